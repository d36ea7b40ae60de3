"""One decode step, cache prefixes halved (S/4, S/2, S: the earlier CPU default) against evenly spaced
(S/8, 2S/8, ..., S: the current one), at several positions.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.cache_prefix_spacing`` (SmolLM2-135M
float32, batch 32, 256-slot cache, every row at the same position; best of 4 alternated rounds).
"""

import jax
import jax.numpy as jnp

import dora_jax.models.decoder as dec
from benchmarks.timing import alternated_times, timed
from dora_jax.config import load_config
from dora_jax.models.weights import load_model

B, S, ROUNDS, POSITIONS = 32, 256, 4, (50, 100, 140, 170, 200)
mc = load_config("smollm2_135m").model
model, _ = load_model(mc, progress=False)
prepared = model.decode_params(fuse=True)
tokens = jnp.zeros((B, 1), jnp.int32)
even = dec.cache_read_lengths


def halved(settings, cache_len):
    return tuple(sorted({max(1, cache_len >> i) for i in range(settings.cache_read_buckets)}))


def make(lengths, n):
    settings = dec.DecodeSettings(cache_read_buckets=n)

    def step(params, pos, cache):
        dec.cache_read_lengths = lengths  # read while tracing only
        try:
            return dec.decode_forward(mc, params, tokens, pos, cache, settings=settings)
        finally:
            dec.cache_read_lengths = even
    return jax.jit(step, donate_argnums=(2,))


variants = {"halved S/4, S/2, S": make(halved, 3), "even S/8 .. S": make(even, 8)}
caches = {name: dec.init_cache(mc, B, S) for name in variants}


def call(name, pos):
    logits, caches[name] = variants[name](prepared, pos, caches[name])
    return logits


for name in variants:
    print(f"{name}: compiled in {timed(lambda: call(name, jnp.full((B, 1), 100, jnp.int32)))[1]:.2f} s", flush=True)
for position in POSITIONS:
    pos = jnp.full((B, 1), position, jnp.int32)
    times = alternated_times({name: lambda name=name: call(name, pos) for name in variants}, ROUNDS)
    print(f"position {position}: " + ", ".join(f"{n} {1e3 * min(t):.1f} ms" for n, t in times.items()), flush=True)
