"""Tile-size sweep of the GPU ragged decode-attention kernel against XLA (how ``BlockSizes.default`` was chosen).

    python -m dora_jax.kernels.sweep --json OUT.json

bf16 cache of 4096 slots, 8 kv heads, 4 query heads per kv head, head dim 128; batch 32 and 8; fills 0.1, 0.5,
1.0 (lengths uniform in [0, 2 x fill x 4096]); six (block, warps, splits) settings; median of 50 calls each,
XLA timed twice per point (the smaller kept). Needs a GPU backend.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.kernels.bench import _time
from dora_jax.kernels.ragged_decode_attention import (BlockSizes, ragged_decode_attention,
                                                      reference_ragged_decode_attention)

SETTINGS = ((64, 4, None), (32, 8, None), (32, 4, None), (32, 8, 16), (64, 8, None), (16, 4, None))


def sweep(repeats: int = 50, seed: int = 1) -> list[dict]:
    if jax.default_backend() != "gpu":
        raise SystemExit("dora_jax.kernels.sweep: needs a GPU backend (the Triton kernel does not compile on CPU)")
    rng = np.random.default_rng(seed)
    s_len, kv, g, d = 4096, 8, 4, 128
    rows = []
    xla = jax.jit(reference_ragged_decode_attention)
    for b in (32, 8):
        q = jnp.asarray(rng.normal(size=(b, kv, g, d)), jnp.bfloat16)
        k = jnp.asarray(rng.normal(size=(b, kv, d, s_len)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(b, kv, s_len, d)), jnp.bfloat16)
        for fill in (0.1, 0.5, 1.0):
            lengths = jnp.asarray(np.clip(rng.integers(0, int(2 * fill * s_len) + 1, b), 0, s_len), jnp.int32)
            t_x = _time(xla, q, k, v, lengths, repeats=repeats)
            for block, warps, splits in SETTINGS:
                bs = BlockSizes(block_kv=block, num_warps=warps, num_splits=splits)
                f = jax.jit(functools.partial(ragged_decode_attention, implementation="gpu", block_sizes=bs))
                t = _time(f, q, k, v, lengths, repeats=repeats)
                t_x = min(t_x, _time(xla, q, k, v, lengths, repeats=repeats))
                rows.append(dict(b=b, fill=fill, block=block, warps=warps, splits=splits, ms=1e3 * t,
                                 xla_ms=1e3 * t_x))
                print(f"B={b} fill={fill} block={block} warps={warps} splits={splits}  {1e3 * t:.3f} ms  "
                      f"xla {1e3 * t_x:.3f} ms  x{t_x / t:.2f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    rows = sweep()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
