"""Decode attention over the cache in several forms, alone.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.attention_forms [ROUNDS]``. SmolLM2's
attention shapes (30 layers, batch 32, 3 KV heads of 3 queries each, head dim 64, 256-slot cache), float32,
random values; one jitted scan over the layers per form, alternated, best and median of ROUNDS. Checks that
every form gives the first one's result.

- ``stacked, 128``: as the decode step reads it: layer i's first 128 slots sliced out of the stacked
  ``[L, B, K, d, S]`` keys and ``[L, B, K, S, d]`` values (XLA:CPU copies the slices), then two batched dots.
- ``stacked, 128, multiply-reduce``: the same slices consumed by multiply-reduces (the slices fuse in).
- ``stacked, 128, cache first``: keys stored ``[S, d]`` and values ``[d, S]``, so that each dot has the
  cache as its first operand and the queries as the columns of the second.
- ``stacked, 256``: every slot, sliced by layer only.
- ``per-layer, 128`` / ``per-layer, 256``: one cache buffer per layer, picked by a ``lax.switch`` on the
  layer index; 256 reads the buffer in place (no copy at all).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import alternated_times

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
L, B, K, G, D, S, N = 30, 32, 3, 3, 64, 256, 128
rng = np.random.default_rng(0)
k_ds = np.asarray(rng.standard_normal((L, B, K, D, S)), np.float32)
v_sd = np.asarray(rng.standard_normal((L, B, K, S, D)), np.float32)
q0 = jnp.asarray(rng.standard_normal((B, K, G, D)), jnp.float32)
barrier = jax.lax.optimization_barrier


def softmax(s):
    e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)


def dots(q, kc, vc):  # kc [b, k, d, n], vc [b, k, n, d]
    return jnp.einsum("bkgs,bksd->bkgd", softmax(jnp.einsum("bkgd,bkds->bkgs", q, kc) / 8.0), vc)


def reduces(q, kc, vc):
    p = softmax(jnp.sum(q[..., None] * kc[:, :, None], axis=3) / 8.0)
    return jnp.sum(p[..., None] * vc[:, :, None], axis=3)


def cache_first(q, kc, vc):  # kc [b, k, n, d], vc [b, k, d, n]
    st = barrier(jnp.einsum("bknd,bkdg->bkng", kc, barrier(jnp.swapaxes(q, 2, 3)))) / 8.0
    pt = barrier(jnp.swapaxes(softmax(jnp.swapaxes(st, 2, 3)), 2, 3))
    return jnp.swapaxes(barrier(jnp.einsum("bkdn,bkng->bkdg", vc, pt)), 2, 3)


def stacked(attend, n, k_axis=4, v_axis=3):
    def layer(q, kc, vc, i):
        kc = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(kc, i, keepdims=False), 0, n, k_axis - 1)
        vc = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(vc, i, keepdims=False), 0, n, v_axis - 1)
        return attend(q, kc, vc)
    return layer


def per_layer(n):
    def layer(q, ks, vs, i):
        return jax.lax.switch(i, [lambda q, kc=kc, vc=vc: dots(q, kc[..., :n], vc[:, :, :n])
                                  for kc, vc in zip(ks, vs)], q)
    return layer


def scan(layer):  # each layer's output feeds the next query, as in the model
    return jax.jit(lambda q, kc, vc: jax.lax.scan(lambda q, i: (q + 1e-3 * layer(q, kc, vc, i), None), q,
                                                  jnp.arange(L))[0])


swapped = (jnp.asarray(np.swapaxes(k_ds, 3, 4)), jnp.asarray(np.swapaxes(v_sd, 3, 4)))
stacked_cache = (jnp.asarray(k_ds), jnp.asarray(v_sd))
split_cache = (tuple(jnp.asarray(x) for x in k_ds), tuple(jnp.asarray(x) for x in v_sd))
forms = {"stacked, 128": (scan(stacked(dots, N)), stacked_cache),
         "stacked, 128, multiply-reduce": (scan(stacked(reduces, N)), stacked_cache),
         "stacked, 128, cache first": (scan(stacked(cache_first, N, 3, 4)), swapped),
         "stacked, 256": (scan(stacked(dots, S)), stacked_cache),
         "per-layer, 128": (scan(per_layer(N)), split_cache),
         "per-layer, 256": (scan(per_layer(S)), split_cache)}
ref = {}
for name, (fn, cache) in forms.items():
    out = fn(q0, *cache).block_until_ready()
    ref.setdefault(S if "256" in name else N, out)
    err = float(jnp.max(jnp.abs(out - ref[S if "256" in name else N])))
    print(f"{name}: max |difference| from the first form of its length {err:.1e}")
times = alternated_times({name: lambda fn=fn, cache=cache: fn(q0, *cache) for name, (fn, cache) in forms.items()},
                         ROUNDS)
for name, t in times.items():
    print(f"{name}: best {1e3 * min(t):.1f} ms, median {1e3 * float(np.median(t)):.1f} ms (30 layers)")
