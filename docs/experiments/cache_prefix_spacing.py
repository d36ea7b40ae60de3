"""One decode step, cache prefixes halved (S/4, S/2, S: the earlier CPU default) against evenly spaced
(S/8, 2S/8, ..., S: the current one), at several positions (docs/benchmarks.md, "cache prefixes evenly spaced").

Run from the repository root: ``.venv/bin/python docs/experiments/cache_prefix_spacing.py`` (SmolLM2-135M
float32, batch 32, 256-slot cache, every row at the same position; best of 4 alternated rounds).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

import dora_jax.models.decoder as dec
from dora_jax.config import load_config
from dora_jax.models.weights import load_model

B, S, ROUNDS, POSITIONS = 32, 256, 4, (50, 100, 140, 170, 200)
mc = load_config("smollm2_135m").model
model, _ = load_model(mc, progress=False)
prepared = model.decode_params(fuse=True)
tokens = jnp.zeros((B, 1), jnp.int32)
even = dec.cache_read_lengths


def halved(cfg, cache_len):
    return tuple(sorted({max(1, cache_len >> i) for i in range(cfg.cache_read_buckets)}))


def make(lengths, n):
    cfg = dataclasses.replace(mc, cache_read_buckets=n)

    def step(params, pos, cache):
        dec.cache_read_lengths = lengths  # read while tracing only
        try:
            return dec.decode_forward(cfg, params, tokens, pos, cache)
        finally:
            dec.cache_read_lengths = even
    return jax.jit(step, donate_argnums=(2,))


variants = {"halved S/4, S/2, S": make(halved, 3), "even S/8 .. S": make(even, 8)}
caches = {}
for name, step in variants.items():
    t0 = time.perf_counter()
    logits, caches[name] = step(prepared, jnp.full((B, 1), 100, jnp.int32), dec.init_cache(mc, B, S))
    jax.block_until_ready(logits)
    print(f"{name}: compiled in {time.perf_counter() - t0:.2f} s", flush=True)
for position in POSITIONS:
    pos = jnp.full((B, 1), position, jnp.int32)
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(ROUNDS):
        for name, step in variants.items():
            t0 = time.perf_counter()
            logits, caches[name] = step(prepared, pos, caches[name])
            jax.block_until_ready(logits)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"position {position}: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in best.items()), flush=True)
