"""``dora-jax bench kernel``: the ragged decode-attention kernel against the XLA path; and ``dora-jax bench
kernel-sweep``, the GPU kernel's tile settings against XLA (how ``BlockSizes.default`` was chosen).

The XLA path is :func:`~dora_jax.kernels.ragged_decode_attention.reference_ragged_decode_attention` under
``jit``: the masked softmax over every cache slot, which is what the decoder's ``xla`` attention does. Achieved
bandwidth counts the bytes each side must read (the kernel: each slot's valid keys and values; XLA: the whole
cache) and is compared with a measured device-to-device copy bandwidth.

On CPU no compiled kernel exists: the kernel side runs in the Pallas interpreter, whose times measure the
interpreter, not the kernel; the output says so.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import device
from benchmarks.timing import median_of
from dora_jax.kernels.ragged_decode_attention import (BlockSizes, default_implementation, ragged_decode_attention,
                                                      reference_ragged_decode_attention)

# The sweep's (block_kv, num_warps, num_splits) settings.
SWEEP_SETTINGS = ((64, 4, None), (32, 8, None), (32, 4, None), (32, 8, 16), (64, 8, None), (16, 4, None))


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of an ``nbytes`` buffer, median of ``repeats``)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # not a no-op: XLA must read and write every element
    return 2 * x.nbytes / median_of(lambda: copy(x), repeats=repeats)


def bench_kernel(*, batches: tuple[int, ...] = (8, 32), fills: tuple[float, ...] = (0.1, 0.5, 1.0),
                 cache_length: int | None = None, kv_heads: int = 8, group: int = 4, head_dim: int = 128,
                 dtype: str = "bfloat16", repeats: int = 10, block_sizes: BlockSizes | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """Times the kernel and the XLA path over batch sizes and cache fill levels.

    Args:
      batches: slots per call.
      fills: mean valid length as a fraction of the cache length (lengths uniform in ``[0, 2 * fill * S]``,
        clipped to ``S``, so rows are ragged).
      cache_length: ``S``; default 4096 on an accelerator, 256 on CPU.
      kv_heads, group, head_dim: ``K``, ``G``, ``d``.
      dtype: cache and query dtype.
      repeats: timed calls per point (the median is reported).
      block_sizes: kernel tiles (default per implementation).
      seed: lengths and data.

    Returns:
      A JSON-ready dict: the device, the copy bandwidth, and per point the times, bytes read and achieved
      bandwidth of both sides (fractions of the copy bandwidth), and the speedup.
    """
    impl = default_implementation()
    interpret = impl is None
    s_len = cache_length or (256 if interpret else 4096)
    if interpret:
        batches = tuple(min(b, 4) for b in batches)
        repeats = min(repeats, 2)
    dt = jnp.dtype(dtype)
    item = dt.itemsize
    copy_bw = copy_bandwidth(16 << 20 if interpret else 1 << 30)  # a large buffer: launch cost must not count
    kernel = jax.jit(functools.partial(ragged_decode_attention, implementation=impl or "gpu", interpret=interpret,
                                       block_sizes=block_sizes))
    xla = jax.jit(reference_ragged_decode_attention)
    rng = np.random.default_rng(seed)
    points = []
    for b in batches:
        q = jnp.asarray(rng.normal(size=(b, kv_heads, group, head_dim)), dt)
        k = jnp.asarray(rng.normal(size=(b, kv_heads, head_dim, s_len)), dt)
        v = jnp.asarray(rng.normal(size=(b, kv_heads, s_len, head_dim)), dt)
        for fill in fills:
            lengths = np.clip(rng.integers(0, int(2 * fill * s_len) + 1, b), 0, s_len)
            lengths_j = jnp.asarray(lengths, jnp.int32)
            t_kernel = median_of(lambda: kernel(q, k, v, lengths_j), repeats=repeats)
            t_xla = median_of(lambda: xla(q, k, v, lengths_j), repeats=repeats)
            qo_bytes = 2 * q.size * item
            kernel_bytes = int(lengths.sum()) * kv_heads * head_dim * 2 * item + qo_bytes
            xla_bytes = k.nbytes + v.nbytes + qo_bytes
            points.append({
                "batch": b, "fill": fill, "mean_length": float(lengths.mean()),
                "kernel_ms": 1e3 * t_kernel, "xla_ms": 1e3 * t_xla, "speedup": t_xla / t_kernel,
                "kernel_bytes": kernel_bytes, "xla_bytes": xla_bytes,
                "kernel_gbps": kernel_bytes / t_kernel / 1e9, "xla_gbps": xla_bytes / t_xla / 1e9,
                "kernel_frac_of_copy": kernel_bytes / t_kernel / copy_bw,
                "xla_frac_of_copy": xla_bytes / t_xla / copy_bw,
            })
    note = (f"compiled {impl} kernel" if not interpret else
            "CPU: no compiled kernel; the kernel side ran in the Pallas interpreter (its times measure the "
            "interpreter, not the kernel), only the XLA side is a real measurement")
    return {"device": device(), "backend": jax.default_backend(), "kernel": note,
            "shape": {"cache_length": s_len, "kv_heads": kv_heads, "group": group, "head_dim": head_dim,
                      "dtype": dt.name},
            "copy_gbps": copy_bw / 1e9, "points": points}


def sweep_kernel_tiles(repeats: int = 50, seed: int = 1) -> dict[str, Any]:
    """The GPU kernel at each of :data:`SWEEP_SETTINGS` against XLA, printed as it goes.

    bf16 cache of 4096 slots, 8 kv heads, 4 query heads per kv head, head dim 128; batch 32 and 8; fills 0.1,
    0.5, 1.0 (lengths uniform in ``[0, 2 x fill x 4096]``); median of ``repeats`` calls each, XLA timed once per
    point and again beside every setting (the smaller kept).

    Args:
      repeats: timed calls per measurement.
      seed: lengths and data.

    Returns:
      ``rows``: per point and setting ``b``, ``fill``, ``block``, ``warps``, ``splits``, ``ms`` and ``xla_ms``.

    Raises:
      SystemExit: on a backend other than GPU (the Triton kernel compiles only there).
    """
    if jax.default_backend() != "gpu":
        raise SystemExit("dora-jax bench kernel-sweep: needs a GPU backend (the Triton kernel does not compile on "
                         "CPU)")
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
            t_x = median_of(lambda: xla(q, k, v, lengths), repeats=repeats)
            for block, warps, splits in SWEEP_SETTINGS:
                bs = BlockSizes(block_kv=block, num_warps=warps, num_splits=splits)
                f = jax.jit(functools.partial(ragged_decode_attention, implementation="gpu", block_sizes=bs))
                t = median_of(lambda: f(q, k, v, lengths), repeats=repeats)
                t_x = min(t_x, median_of(lambda: xla(q, k, v, lengths), repeats=repeats))
                rows.append(dict(b=b, fill=fill, block=block, warps=warps, splits=splits, ms=1e3 * t,
                                 xla_ms=1e3 * t_x))
                print(f"B={b} fill={fill} block={block} warps={warps} splits={splits}  {1e3 * t:.3f} ms  "
                      f"xla {1e3 * t_x:.3f} ms  x{t_x / t:.2f}", flush=True)
    return {"backend": jax.default_backend(), "repeats": repeats, "rows": rows}
