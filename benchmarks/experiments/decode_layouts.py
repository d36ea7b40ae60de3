"""Decode-step layouts measured against the scanned step.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.decode_layouts`` (SmolLM2-135M float32,
batch 32, 256-slot cache; minutes on a 2-core CPU). Prints the best step time of each variant at each
position, alternated round by round, and checks that every variant gives the scanned step's logits.

- ``scan read N``: ``decode_forward`` as shipped, its cache read cut to N slots (``rollout.cache_read_buckets``).
- ``scan reduce read N``: the same with attention over the cache as a fused multiply-reduce instead of dots.
- ``unrolled buffers read N``: one weight and one cache buffer per layer, the layers unrolled, the cache only
  read by the step and written by a second donated program.
- ``unrolled weights``: one weight buffer per layer, the layers unrolled, the stacked cache read in bucketed
  slices and written by one scatter after all layers, as the scanned step does.
"""

import functools
import math
import sys

import jax
import jax.numpy as jnp

import dora_jax.models.decoder as dec
from benchmarks.timing import alternated_times, timed
from dora_jax.config import load_config
from dora_jax.models.weights import load_model

B, S, ROUNDS = 32, 256, 4
POSITIONS = tuple(int(p) for p in sys.argv[1:]) or (128,)
mc = load_config("smollm2_135m").model
model, _ = load_model(mc, progress=False)
prepared = model.decode_params(fuse=True)
layers = [jax.tree.map(lambda a, i=i: a[i], prepared["layers"]) for i in range(mc.num_layers)]
rest = {k: v for k, v in prepared.items() if k != "layers"}
tokens = jnp.zeros((B, 1), jnp.int32)
dot_attention = dec.attention_with_cache


def reduce_attention(q_bthd, k_bkds, v_bksd, k_new_btkd, v_new_btkd, mask_cache_bts, mask_new_btt):
    """``attention_with_cache`` for one token per row, as multiply-reduces (no dot reads the cache)."""
    b, _, h, d = q_bthd.shape
    kv = k_bkds.shape[1]
    q = q_bthd.reshape(b, kv, h // kv, d)
    sc = jnp.sum(q[..., None] * k_bkds[:, :, None], axis=3) / math.sqrt(d)                  # [b, k, g, s]
    sn = jnp.sum(q * k_new_btkd[:, 0][:, :, None], axis=-1, keepdims=True) / math.sqrt(d)   # [b, k, g, 1]
    sc = jnp.where(mask_cache_bts[:, 0][:, None, None], sc, dec._MASK_VALUE)
    sn = jnp.where(mask_new_btt[:, 0][:, None, None], sn, dec._MASK_VALUE)
    m = jnp.maximum(jnp.max(sc, -1, keepdims=True), sn)
    ec, en = jnp.exp(sc - m), jnp.exp(sn - m)
    den = jnp.sum(ec, -1, keepdims=True) + en
    out = jnp.sum((ec / den)[..., None] * v_bksd[:, :, None], axis=3) + (en / den) * v_new_btkd[:, 0][:, :, None]
    return out.reshape(b, 1, h, d)


# Every step takes the weights as arguments (closed over, XLA would fold them as constants).
def scanned(buckets, attention):
    settings = dec.DecodeSettings(cache_read_buckets=buckets)

    def step(params, pos, cache):
        dec.attention_with_cache = attention  # read while tracing only
        try:
            return dec.decode_forward(mc, params, tokens, pos, cache, settings=settings)
        finally:
            dec.attention_with_cache = dot_attention
    return functools.partial(jax.jit(step, donate_argnums=(2,)), prepared), lambda: dec.init_cache(mc, B, S)


def masks(pos, n):
    slots = jnp.arange(S)
    written = jnp.any(slots[None, None, :] == pos[:, :, None], axis=1)
    mask_cache = (slots[None, None, :] <= pos[:, :, None]) & ~written[:, None, :]
    return mask_cache[..., :n], pos[:, None, :] <= pos[:, :, None]


def unrolled_buffers(n):
    @jax.jit
    def read(rest, layers, pos, ks, vs):
        mask_c, mask_n = masks(pos, n)
        x, k_new, v_new = dec.embed_tokens(mc, rest["embed"], tokens), [], []
        for lp, kc, vc in zip(layers, ks, vs):
            q, k, v = dec.qkv_projection(mc, lp, x, pos)
            x = dec.finish_block(mc, lp, x, dot_attention(q, kc[..., :n], vc[:, :, :n], k, v, mask_c, mask_n))
            k_new.append(k[:, 0])
            v_new.append(v[:, 0])
        return dec.head_logits(mc, rest, x), k_new, v_new

    @jax.jit(donate_argnums=(1, 2))
    def write(pos, ks, vs, k_new, v_new):
        rows, p = jnp.arange(B), pos[:, 0]
        return ([c.at[rows, :, :, p].set(k) for c, k in zip(ks, k_new)],
                [c.at[rows, :, p, :].set(v) for c, v in zip(vs, v_new)])

    def step(pos, cache):
        logits, k_new, v_new = read(rest, layers, pos, *cache)
        return logits, write(pos, *cache, k_new, v_new)
    return step, lambda: (list(dec.init_cache(mc, B, S).k), list(dec.init_cache(mc, B, S).v))


def unrolled_weights():
    reads = dec.cache_read_lengths(dec.DecodeSettings(), S)

    def step(rest, layers, pos, cache):
        branch = jnp.sum(jnp.asarray(reads[:-1]) < jnp.max(pos))
        x, k_new, v_new = dec.embed_tokens(mc, rest["embed"], tokens), [], []
        for i, lp in enumerate(layers):
            q, k, v = dec.qkv_projection(mc, lp, x, pos)
            attend = [lambda q, k, v, n=n: dot_attention(q, cache.k[i, ..., :n], cache.v[i, :, :, :n], k, v,
                                                         *masks(pos, n)) for n in reads]
            x = dec.finish_block(mc, lp, x, jax.lax.switch(branch, attend, q, k, v))
            k_new.append(k)
            v_new.append(v)
        return dec.head_logits(mc, rest, x), dec.write_cache(cache, jnp.stack(k_new), jnp.stack(v_new), pos)
    return functools.partial(jax.jit(step, donate_argnums=(3,)), rest, layers), lambda: dec.init_cache(mc, B, S)


# "read 128": the first 128 slots while every row's position is <= 128 (the cache prefixes 128 and 256 for
# the scanned step; the unrolled-buffers variant with a fixed 128 is skipped at later positions).
variants = {"scan read 128": scanned(2, dot_attention), "scan read 256": scanned(1, dot_attention),
            "scan reduce read 128": scanned(2, reduce_attention), "scan reduce read 256": scanned(1, reduce_attention),
            "unrolled buffers read 128": unrolled_buffers(128), "unrolled buffers read 256": unrolled_buffers(S),
            "unrolled weights": unrolled_weights()}
caches = {name: fresh() for name, (_, fresh) in variants.items()}


def call(name, pos):  # waits on the cache too: the unrolled buffers' second program writes it
    logits, caches[name] = variants[name][0](pos, caches[name])
    return logits, caches[name]


for name in variants:
    print(f"{name}: compiled in {timed(lambda: call(name, jnp.full((B, 1), 100, jnp.int32)))[1]:.1f} s", flush=True)
for position in POSITIONS:
    pos = jnp.full((B, 1), position, jnp.int32)
    names = [n for n in variants if not (n == "unrolled buffers read 128" and position > 128)]
    times = alternated_times({name: lambda name=name: call(name, pos) for name in names}, ROUNDS)
    print(f"position {position}: " + ", ".join(f"{n} {1e3 * min(t):.1f} ms" for n, t in times.items()), flush=True)

# Same logits as the scanned step, from the same random cache (the read must cover the position).
pos = jnp.full((B, 1), 120, jnp.int32)
k = jax.random.normal(jax.random.key(0), (mc.num_layers, B, mc.num_kv_heads, mc.head_dim, S))
v = jax.random.normal(jax.random.key(1), (mc.num_layers, B, mc.num_kv_heads, S, mc.head_dim))
ref = variants["scan read 256"][0](pos, dec.KVCache(k + 0, v + 0))[0]
for name, (step, _) in variants.items():
    cache = (list(k), list(v)) if name.startswith("unrolled buffers") else dec.KVCache(k + 0, v + 0)
    err = float(jnp.max(jnp.abs(step(pos, cache)[0] - ref)) / jnp.max(jnp.abs(ref)))
    print(f"{name}: max |logits - scanned| / max |logits| = {err:.1e}")
