"""One-call generation for a batch of prompts, on the rollout engine (the demo, ``dora-jax generate``, tests).

There is one decode path in dora_jax: :class:`~dora_jax.rollout.engine.Engine` driven by
:class:`~dora_jax.rollout.driver.RolloutDriver`. This module only sizes an engine for a batch and submits it.
"""

from __future__ import annotations

import time
from typing import Sequence

from dora_jax.models.decoder import Decoder, DecodeSettings
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling, bucket
from dora_jax.rollout.samples import Request, Trajectory


def engine_for(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, dtype: str = "auto",
               settings: DecodeSettings = DecodeSettings()) -> Engine:
    """An engine with one slot per prompt and room for the longest prompt plus ``max_new_tokens``, decoding in
    ``dtype`` with ``settings`` (the :class:`~dora_jax.rollout.engine.Engine` arguments of those names)."""
    longest = max(len(p) for p in prompts)
    target = min(bucket(longest + max_new_tokens), model.cfg.max_seq_len)
    return Engine(model, max_concurrent_decodes=len(prompts), max_prefill_length=min(bucket(longest), target - 1),
                  max_target_length=target, dtype=dtype, settings=settings)


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int] = (),
             sampling: RequestSampling = RequestSampling(temperature=0.0), engine: Engine | None = None
             ) -> tuple[list[Trajectory], dict[str, float]]:
    """Generates for every prompt (sample ids 0..n-1, policy version 0).

    Returns:
      ``(trajectories in prompt order, {"wall_s", "new_tokens", "tokens_per_s"})``.
    """
    engine = engine or engine_for(model, prompts, max_new_tokens)
    driver = RolloutDriver(engine, eos_ids=eos_ids)
    driver.add_version(0, engine.params)
    t0 = time.perf_counter()
    out = sorted(driver.run(Request(i, tuple(p), max_new_tokens=max_new_tokens, sampling=sampling)
                            for i, p in enumerate(prompts)), key=lambda t: t.sample_id)
    wall = time.perf_counter() - t0
    n = sum(len(t.tokens) for t in out)
    return out, {"wall_s": wall, "new_tokens": float(n), "tokens_per_s": n / max(wall, 1e-9)}
