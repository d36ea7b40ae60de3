"""``dora-jax bench kernel``: the shipped paged decode-attention kernel against the XLA reference over a page
pool; and ``dora-jax bench kernel-sweep``, the GPU kernel's ``pages_per_compute_block`` against XLA.

Both sides are :func:`~dora_jax.kernels.paged_attention.paged_attention` under ``jit``: the kernel is
``pallas_tpu`` on a TPU and ``pallas_gpu`` elsewhere, the XLA side ``impl="xla"`` (the engine's live-reading
attention for one layer: slots sorted by length into classes, each class's pages read in blocks up to its
longest slot). The pool is laid out as the engine's: page 0 scratch, each slot's pages scattered over the pool,
table entries past a slot's pages pointing at scratch. Achieved bandwidth counts the bytes each side must read
(the kernel: each slot's pages up to its length; XLA: the blocks its classes read,
:func:`~dora_jax.kernels.paged_attention.live_read_tokens`), plus the queries read and the output written, and
is compared with a measured device-to-device copy bandwidth.

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
from dora_jax.kernels.paged_attention import gpu_blocks, live_read_tokens, paged_attention
from dora_jax.models.paged import SCRATCH_PAGE

# The sweep's pages per compute block, on 16-token pages: 16 to 256 tokens per block (the Triton lowering needs
# at least 16).
SWEEP_PAGES_PER_BLOCK = (1, 2, 4, 8, 16)


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of an ``nbytes`` buffer, median of ``repeats``)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # not a no-op: XLA must read and write every element
    return 2 * x.nbytes / median_of(lambda: copy(x), repeats=repeats)


def kernel_implementation() -> tuple[str, bool]:
    """``(impl, interpret)``: the compiled kernel of this backend, or the GPU kernel interpreted on a CPU."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu", False
    return "pallas_gpu", backend != "gpu"


def pool_case(rng: np.random.Generator, batch: int, kv_heads: int, group: int, head_dim: int, page_tokens: int,
              table_pages: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[B, H, d]`` and a pool of ``1 + batch * table_pages`` pages (page 0 scratch), K and V."""
    shape = (kv_heads, 1 + batch * table_pages, page_tokens, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim), np.float32), dtype)
    return q, k, v


def page_tables(rng: np.random.Generator, lengths: np.ndarray, page_tokens: int, table_pages: int) -> jax.Array:
    """Each slot's table as the engine holds it: its own pages up to its length, scratch after."""
    batch = len(lengths)
    # Scattered pages: a slot's consecutive tokens do not sit in consecutive pages of a pool that has served
    # many requests.
    tables = (1 + rng.permutation(batch * table_pages)).reshape(batch, table_pages).astype(np.int32)
    for b, n in enumerate(lengths):
        tables[b, -(-int(n) // page_tokens):] = SCRATCH_PAGE
    return jnp.asarray(tables)


def ragged_lengths(rng: np.random.Generator, batch: int, fill: float, tokens: int) -> np.ndarray:
    """Lengths uniform in ``[0, 2 * fill * tokens]``, clipped to ``tokens``: ragged rows of mean about ``fill``."""
    return np.clip(rng.integers(0, int(2 * fill * tokens) + 1, batch), 0, tokens).astype(np.int32)


def bench_kernel(*, batches: tuple[int, ...] = (8, 32), fills: tuple[float, ...] = (0.1, 0.5, 1.0),
                 cache_length: int | None = None, page_tokens: int = 16, kv_heads: int = 8, group: int = 4,
                 head_dim: int = 128, dtype: str = "bfloat16", repeats: int = 10,
                 pages_per_compute_block: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Times the paged kernel and the XLA reference over batch sizes and fill levels.

    Args:
      batches: slots per call.
      fills: mean length as a fraction of the tokens per slot (:func:`ragged_lengths`).
      cache_length: tokens per slot, ``W * P`` (rounded up to whole pages); default 4096 on an accelerator, 256
        on CPU.
      page_tokens: ``P``.
      kv_heads, group, head_dim: ``K``, ``G``, ``d``.
      dtype: pool and query dtype.
      repeats: timed calls per point (the median is reported).
      pages_per_compute_block: the kernel's pages per step (default: the wrapper's choice).
      seed: lengths, tables and data.

    Returns:
      A JSON-ready dict: the device, the kernel (and whether it was interpreted), the copy bandwidth, and per
      point the lengths, times, bytes read and achieved bandwidth of both sides (fractions of the copy
      bandwidth), the speedup and the largest difference of the outputs relative to XLA's largest value.
    """
    impl, interpret = kernel_implementation()
    tokens = cache_length or (256 if interpret else 4096)
    table_pages = -(-tokens // page_tokens)
    tokens = table_pages * page_tokens
    if interpret:
        batches = tuple(dict.fromkeys(min(b, 4) for b in batches))  # the interpreter is slow
        repeats = min(repeats, 2)
    dt = jnp.dtype(dtype)
    item = dt.itemsize
    copy_bw = copy_bandwidth(16 << 20 if interpret else 1 << 30)  # a large buffer: launch cost must not count
    kernel = jax.jit(functools.partial(paged_attention, impl=impl, interpret=interpret,
                                       pages_per_compute_block=pages_per_compute_block))
    xla = jax.jit(functools.partial(paged_attention, impl="xla"))
    rng = np.random.default_rng(seed)
    page_bytes = page_tokens * kv_heads * head_dim * item  # one page of K (or of V), every kv head
    points = []
    for b in batches:
        q, k, v = pool_case(rng, b, kv_heads, group, head_dim, page_tokens, table_pages, dt)
        for fill in fills:
            lengths = ragged_lengths(rng, b, fill, tokens)
            tables, lengths_j = page_tables(rng, lengths, page_tokens, table_pages), jnp.asarray(lengths)
            t_kernel = median_of(lambda: kernel(q, k, v, tables, lengths_j), repeats=repeats)
            t_xla = median_of(lambda: xla(q, k, v, tables, lengths_j), repeats=repeats)
            want = np.asarray(xla(q, k, v, tables, lengths_j), np.float32)
            got = np.asarray(kernel(q, k, v, tables, lengths_j), np.float32)
            qo_bytes = 2 * q.size * item
            kernel_bytes = 2 * int((-(-lengths // page_tokens)).sum()) * page_bytes + qo_bytes
            xla_bytes = 2 * live_read_tokens(lengths, table_pages, page_tokens) * (page_bytes // page_tokens) + qo_bytes
            points.append({
                "batch": b, "fill": fill, "lengths": lengths.tolist(), "mean_length": float(lengths.mean()),
                "kernel_ms": 1e3 * t_kernel, "xla_ms": 1e3 * t_xla, "speedup": t_xla / t_kernel,
                "kernel_bytes": kernel_bytes, "xla_bytes": xla_bytes,
                "kernel_gbps": kernel_bytes / t_kernel / 1e9, "xla_gbps": xla_bytes / t_xla / 1e9,
                "kernel_frac_of_copy": kernel_bytes / t_kernel / copy_bw,
                "xla_frac_of_copy": xla_bytes / t_xla / copy_bw,
                "max_rel_diff": float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)),
            })
    note = (f"compiled {impl} kernel" if not interpret else
            "CPU: no compiled kernel; the kernel side ran in the Pallas interpreter (its times measure the "
            "interpreter, not the kernel), only the XLA side is a real measurement")
    return {"device": device(), "backend": jax.default_backend(), "kernel": note, "impl": impl,
            "shape": {"tokens_per_slot": tokens, "page_tokens": page_tokens, "table_pages": table_pages,
                      "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "dtype": dt.name,
                      "pages_per_compute_block": pages_per_compute_block},
            "copy_gbps": copy_bw / 1e9, "points": points}


def sweep_kernel_tiles(repeats: int = 50, seed: int = 1) -> dict[str, Any]:
    """The GPU kernel at each of :data:`SWEEP_PAGES_PER_BLOCK` against XLA, printed as it goes.

    bf16 pool of 16-token pages, 4096 tokens per slot (256 pages), 8 kv heads, 4 query heads per kv head, head
    dim 128; batch 32 and 8; fills 0.1, 0.5, 1.0 (:func:`ragged_lengths`); median of ``repeats`` calls each, XLA
    timed once per point and again beside every setting (the smaller kept).

    Args:
      repeats: timed calls per measurement.
      seed: lengths, tables and data.

    Returns:
      ``rows``: per point and setting ``b``, ``fill``, ``pages_per_compute_block``, ``block_tokens``,
      ``k_splits`` (the partitions per slot the wrapper derives from it), ``ms`` and ``xla_ms``.

    Raises:
      SystemExit: on a backend other than GPU (the Triton kernel compiles only there).
    """
    if jax.default_backend() != "gpu":
        raise SystemExit("dora-jax bench kernel-sweep: needs a GPU backend (the Triton kernel does not compile on "
                         "CPU)")
    rng = np.random.default_rng(seed)
    page_tokens, table_pages, kv, g, d = 16, 256, 8, 4, 128
    rows = []
    xla = jax.jit(functools.partial(paged_attention, impl="xla"))
    for b in (32, 8):
        q, k, v = pool_case(rng, b, kv, g, d, page_tokens, table_pages, jnp.dtype(jnp.bfloat16))
        for fill in (0.1, 0.5, 1.0):
            lengths = ragged_lengths(rng, b, fill, page_tokens * table_pages)
            args = (q, k, v, page_tables(rng, lengths, page_tokens, table_pages), jnp.asarray(lengths))
            t_x = median_of(lambda: xla(*args), repeats=repeats)
            for ppcb in SWEEP_PAGES_PER_BLOCK:
                _, k_splits = gpu_blocks(table_pages, page_tokens, d, ppcb, False, "sweep")
                f = jax.jit(functools.partial(paged_attention, impl="pallas_gpu", pages_per_compute_block=ppcb))
                t = median_of(lambda: f(*args), repeats=repeats)
                t_x = min(t_x, median_of(lambda: xla(*args), repeats=repeats))
                rows.append(dict(b=b, fill=fill, pages_per_compute_block=ppcb, block_tokens=ppcb * page_tokens,
                                 k_splits=k_splits, ms=1e3 * t, xla_ms=1e3 * t_x))
                print(f"B={b} fill={fill} pages/block={ppcb} ({ppcb * page_tokens} tokens) k_splits={k_splits}  "
                      f"{1e3 * t:.3f} ms  xla {1e3 * t_x:.3f} ms  x{t_x / t:.2f}", flush=True)
    return {"backend": jax.default_backend(), "repeats": repeats, "rows": rows}
