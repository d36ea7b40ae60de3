"""``dora-jax bench decode``: where one decode step's time goes; and one step in several forms side by side, for
the experiments."""

from __future__ import annotations

from typing import Any

import jax

from benchmarks.rates import measure_matmul_chain
from benchmarks.record import machine
from benchmarks.timing import alternated_times, best_of


def bench_decode(config: str = "smollm2_135m", batch: int = 32, cache_length: int = 256,
                 repeats: int = 5, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Where one decode step's time goes: the full step against ``cache_length`` tokens of pages per row, the same forward
    without a cache (layers + head only), sampling alone, and the step's weight matmuls alone; best of
    ``repeats`` after compiling.

    Args:
      config: a shipped preset or YAML file.
      batch: rows of the step.
      cache_length: cache slots per row; every row decodes at position ``cache_length // 2``.
      repeats: timed calls of each part.
      overrides: ``key=value`` config overrides.

    Returns:
      ``decode_step_ms``, ``layers_and_head_ms``, ``kv_cache_part_ms``, ``sampling_ms``,
      ``sampling_runtime_choice_ms``, the ``matmul_only_*`` figures and ``machine``.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dora_jax.config import load_config
    from dora_jax.models.decoder import DecodeSettings, resolve_attention_impl
    from dora_jax.models.paged import decode_forward_paged, init_pages
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.sampling import SamplingParams, row_keys, sample

    cfg = load_config(config, overrides)
    model, _ = load_model(cfg.model, progress=False)
    graphdef, params = nnx.split(model)

    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch,), cache_length // 2, jnp.int32)
    # As in the engine: the page pool, each row's table of its own pages (cache_length tokens), page 0 scratch.
    page = cfg.rollout.page_tokens
    width = -(-cache_length // page)
    settings = DecodeSettings.of(cfg.rollout)
    caches = [init_pages(cfg.model, batch * width + 1, page, impl=resolve_attention_impl(settings))]
    tables = jnp.asarray(1 + np.arange(batch * width, dtype=np.int32).reshape(batch, width))
    write = jnp.ones((batch,), bool)
    # As in the engine: fused params prepared once, the pool donated and threaded from step to step.
    prepared = model.decode_params(fuse=True)
    step = jax.jit(lambda p, t, pos, c: decode_forward_paged(cfg.model, p, t[:, 0], pos, c, tables, write,
                                                             settings=settings), donate_argnums=(3,))
    dense = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, cfg.model.vocab_size)), jnp.float32)
    keys = row_keys(0, jnp.arange(batch), jnp.zeros(batch, jnp.int32))

    def one_step():
        out, caches[0] = step(prepared, tokens, positions, caches[0])
        return out

    full_s = best_of(one_step, repeats=repeats)
    dense_s = best_of(lambda: dense(params, tokens), repeats=repeats)
    sp = SamplingParams.make(batch, 1.0)
    # The variant the driver runs when no request uses top-k / top-p, and the run-time choice (a lax.cond).
    sample_fixed, sample_cond = jax.jit(sample, static_argnums=3), jax.jit(sample)
    sample_s = best_of(lambda: sample_fixed(logits, keys, sp, False), repeats=repeats)
    sample_cond_s = best_of(lambda: sample_cond(logits, keys, sp), repeats=repeats)
    return {"config": config, "batch": batch, "cache_length": cache_length, "decode_step_ms": 1e3 * full_s,
            "layers_and_head_ms": 1e3 * dense_s, "kv_cache_part_ms": 1e3 * (full_s - dense_s),
            "sampling_ms": 1e3 * sample_s, "sampling_runtime_choice_ms": 1e3 * sample_cond_s,
            **measure_matmul_chain(cfg.model, batch), "machine": machine()}


def time_decode_steps(variants: dict[str, tuple[Any, Any]], model_cfg, batch: int, cache_len: int, position: int,
                      rounds: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Alternated timings of one decode step in several variants, for comparing forms of the step side by side.

    Every row decodes token 0 at ``position`` into a cache of its own per variant. Two untimed rounds compile
    (a fresh cache, then one the step returned); then ``rounds`` timed rounds, each calling every variant once
    in turn.

    Args:
      variants: name -> ``(step, params)`` with ``step(params, tokens [B, 1], positions [B, 1], cache) ->
        (out, cache)`` jitted with the cache donated.
      model_cfg: the model's ``ModelConfig`` (the cache's shapes).
      batch: rows.
      cache_len: cache slots per row.
      position: the position every row decodes at.
      rounds: timed rounds.

    Returns:
      ``(seconds per variant, each variant's last output as numpy)``.
    """
    import jax.numpy as jnp
    import numpy as np

    from dora_jax.models.decoder import init_cache

    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), position, jnp.int32)
    caches = {k: init_cache(model_cfg, batch, cache_len) for k in variants}
    outs: dict[str, Any] = {}

    def call(k, step, params):
        outs[k], caches[k] = step(params, tokens, positions, caches[k])
        return outs[k]

    times = alternated_times({k: lambda k=k, v=v: call(k, *v) for k, v in variants.items()}, rounds, warmup=2)
    return times, {k: np.asarray(v) for k, v in outs.items()}
