"""``dora-jax bench prefill``: ``Engine.prefill_batch`` alone, by prompts per program."""

from __future__ import annotations

from typing import Any

import jax

from benchmarks.record import machine
from benchmarks.timing import best_of


def bench_prefill(config: str = "smollm2_135m", prompt_len: int = 41, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                  repeats: int = 3, seed: int = 0, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Seconds per ``prefill_batch`` program and per prompt, to see what one program for several prompts buys.

    Args:
      config: a shipped preset or YAML file.
      prompt_len: tokens per prompt (distinct random prompts).
      batches: prompts per program, one point each.
      repeats: timed calls per point (best kept, after a compiling call); first tokens read back each call.
      seed: prompts and sampling.
      overrides: ``key=value`` config overrides.

    Returns:
      ``runs``: per point ``prompts``, ``s`` and ``s_per_prompt``; and ``machine``.
    """
    import numpy as np
    from flax import nnx
    from tqdm.auto import tqdm

    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model
    from dora_jax.models.decoder import DecodeSettings
    from dora_jax.rollout.engine import Engine, RequestSampling

    cfg = load_config(config, overrides)
    model, _ = load_model(cfg.model, progress=False)
    eng = Engine(model, max_concurrent_decodes=max(batches), max_prefill_length=prompt_len,
                 max_target_length=2 * (1 << (prompt_len - 1).bit_length()), dtype=cfg.rollout.dtype,
                 settings=DecodeSettings.of(cfg.rollout))
    params = eng.prepare_params(nnx.state(model))
    rng = np.random.default_rng(seed)
    sampling = RequestSampling(temperature=1.0, seed=seed)
    out: dict[str, Any] = {"config": config, "prompt_len": prompt_len, "runs": []}
    for n in tqdm(batches, desc="bench prefill", unit="batch"):
        prompts = [tuple(rng.integers(1, cfg.model.vocab_size, prompt_len).tolist()) for _ in range(n)]

        def once():
            batch, first = eng.prefill_batch(params=params, prompts=prompts, sample_ids=list(range(n)),
                                             samplings=[sampling] * n)
            first.to_host().columns()
            jax.block_until_ready(batch)

        s = best_of(once, repeats=repeats)
        out["runs"].append({"prompts": n, "s": s, "s_per_prompt": s / n})
    out["machine"] = machine()
    return out
