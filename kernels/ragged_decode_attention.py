"""Grouped-query decode attention over ragged KV lengths: one query token per slot, reading only the slot's
valid cache positions.

The cache is the engine's layout (:class:`dora_jax.models.decoder.KVCache`, one layer): keys transposed
``[B, K, d, S]``, values ``[B, K, S, d]``. Slot ``b`` attends over positions ``0 .. lengths[b] - 1``; a slot of
length 0 gets zeros. Two Pallas implementations compute the same float32 online softmax:

  * GPU (Triton lowering), split over the cache as in flash-decoding: grid ``(B, K, splits)``, one program per
    slot, kv head and contiguous chunk of ``S / splits`` positions, a ``fori_loop`` over the chunk's KV blocks
    up to the slot's length (blocks past it are never loaded). Each program writes its chunk's unnormalized
    output and softmax statistics; a few element-wise ops merge the chunks exactly. The split count fills the
    GPU: one program per slot and head alone (B * K of them) leaves most multiprocessors idle at decode sizes
    and walks a long cache serially;
  * TPU (Mosaic): grid ``(B, K, S // block_kv)`` with the lengths scalar-prefetched into SMEM; blocks past a
    slot's length are skipped with ``pl.when`` and their index map is clamped to the last valid block, so the
    pipeline issues no new copy for them.

Both can also return the softmax statistics (row max ``m`` and sum of exponentials ``l``), which is how the
decoder merges the cached part with the current token's own key and value exactly.

Shape legend: B slots, K kv heads, G query heads per kv head, d head dim, S cache length, Gp = G padded to a
power of two (Triton tensors need power-of-two shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
HIGHEST = jax.lax.Precision.HIGHEST
IMPLEMENTATIONS = ("gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes.

    Attributes:
      block_kv: cache positions per step. It is reduced to ``gcd(S, block_kv)`` so blocks tile the cache
        exactly (a power of two stays a power of two); on TPU a block that is not a multiple of 128 lanes
        falls back to the whole cache length.
      num_warps: GPU only, Triton warps per program.
      num_stages: GPU only, Triton software-pipelining stages of the KV loop.
      num_splits: GPU only, chunks of the cache handled by separate programs (a power of two). ``None`` picks
        enough for about four programs per multiprocessor (:func:`gpu_num_splits`); either way it is reduced
        until every chunk is a power-of-two multiple of the block.
    """

    block_kv: int = 128
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None

    def __post_init__(self):
        for name in ("block_kv", "num_warps", "num_stages", "num_splits"):
            value = getattr(self, name)
            if name == "num_splits" and value is None:
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{name}: {value!r} must be a positive integer")
        for name in ("block_kv", "num_splits"):
            value = getattr(self, name)
            if value is not None and value & (value - 1):
                raise ValueError(f"BlockSizes.{name}: {value} must be a power of two")

    @classmethod
    def default(cls, implementation: str) -> "BlockSizes":
        """Defaults per implementation: 16 positions and 4 warps on GPU (the best of six tile settings on an
        H100 over batch 8 and 32 and fills 0.1-1.0, docs/performance.md: the per-program [Gp, d, block]
        product stays small enough for registers), 128 lanes on TPU."""
        return cls(block_kv=16) if implementation == "gpu" else cls(block_kv=128)


# ----------------------------------------------------------------------------------------------------------
# Oracle.


def reference_ragged_decode_attention(q_bkgd: jax.Array, k_bkds: jax.Array, v_bksd: jax.Array,
                                      lengths_b: jax.Array, *, return_stats: bool = False):
    """Plain-jnp oracle: the masked softmax over the whole cache, in float32.

    Args:
      q_bkgd: one query per slot, ``[B, K, G, d]``.
      k_bkds: keys ``[B, K, d, S]`` (transposed, as the engine stores them).
      v_bksd: values ``[B, K, S, d]``.
      lengths_b: int ``[B]``, valid positions per slot (``0 <= length <= S``).
      return_stats: also return the row max and sum of exponentials.

    Returns:
      ``[B, K, G, d]`` in ``q``'s dtype (zeros for a slot of length 0); with ``return_stats``, the float32
      output and ``m``, ``l`` ``[B, K, G]`` instead.
    """
    f32 = jnp.float32
    d, s_len = k_bkds.shape[2], k_bkds.shape[3]
    s = jnp.einsum("bkgd,bkds->bkgs", q_bkgd.astype(f32), k_bkds.astype(f32),
                   precision=jax.lax.Precision.HIGHEST) * (1.0 / math.sqrt(d))
    valid = (jnp.arange(s_len)[None, :] < lengths_b[:, None])[:, None, None, :]
    s = jnp.where(valid, s, MASK_VALUE)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l_sum = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bkgs,bksd->bkgd", p, v_bksd.astype(f32), precision=jax.lax.Precision.HIGHEST)
    out = _normalize(acc, l_sum[..., None])
    return (out, m, l_sum) if return_stats else out.astype(q_bkgd.dtype)


def _normalize(acc, l_sum):
    """``acc / l`` with zeros where nothing was attended (``l == 0``)."""
    return jnp.where(l_sum > 0, acc / jnp.where(l_sum > 0, l_sum, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------------------
# GPU: Triton lowering.


def _gpu_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale: float, block_kv: int, chunk: int):
    f32 = jnp.float32
    offset = pl.program_id(2) * chunk  # this program's first cache position
    valid_here = jnp.clip(len_ref[()] - offset, 0, chunk)  # valid positions inside the chunk
    q = q_ref[...].astype(f32)  # [Gp, d]
    gp, d = q.shape

    def body(i, carry):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(i * block_kv, block_kv)
        k = k_ref[:, pl.ds(start, block_kv)].astype(f32)  # [d, block]
        # A multiply-reduce, not a dot: Gp is 1..8 and tl.dot needs 16 rows; decode is bound by the loads.
        s = jnp.sum(q[:, :, None] * k[None, :, :], axis=1) * scale  # [Gp, block]
        valid = (start + jnp.arange(block_kv)) < valid_here
        s = jnp.where(valid[None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, None])  # masked entries underflow to 0: the block has a valid position
        v = v_ref[pl.ds(start, block_kv), :].astype(f32)  # [block, d]
        acc = alpha[:, None] * acc + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return acc, m_new, alpha * l_prev + jnp.sum(p, axis=1)

    init = (jnp.zeros((gp, d), f32), jnp.full((gp,), MASK_VALUE, f32), jnp.zeros((gp,), f32))
    acc, m, l_sum = jax.lax.fori_loop(0, pl.cdiv(valid_here, block_kv), body, init)
    o_ref[...] = acc  # unnormalized: the chunks are merged outside
    m_ref[...] = m
    l_ref[...] = l_sum


def _triton_params(bs: BlockSizes):
    from jax.experimental.pallas import triton as plgpu

    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")  # renamed in 0.6
    return cls(num_warps=bs.num_warps, num_stages=bs.num_stages)


def gpu_num_splits(programs: int, blocks: int) -> int:
    """Splits of the cache that give about four programs per multiprocessor of the default device (at most one
    per block): ``programs`` is ``B * K``, ``blocks`` the cache length over the block."""
    cores = getattr(jax.devices()[0], "core_count", None) or 128  # multiprocessors on a GPU
    want = max(1, -(-4 * cores // max(programs, 1)))
    return min(1 << (want - 1).bit_length(), blocks)


def _split_plan(s_len: int, block: int, requested: int) -> int:
    """The largest power of two ``<= requested`` that cuts ``s_len`` into power-of-two chunks of whole blocks
    (Triton blocks need power-of-two shapes); 1 if none does (one chunk: the whole cache)."""
    n = 1 << (max(requested, 1).bit_length() - 1)
    while n > 1:
        chunk = s_len // n
        if s_len % n == 0 and chunk % block == 0 and chunk & (chunk - 1) == 0:
            return n
        n //= 2
    return 1


def merge_chunks(acc, m, l_sum, axis: int):
    """Exact merge of per-chunk flash-attention partials along ``axis``: unnormalized outputs ``acc`` (one
    more trailing dim than ``m``/``l``), row maxima ``m`` and sums of exponentials ``l``. Returns the
    normalized output and the merged ``m``, ``l``."""
    m_all = jnp.max(m, axis=axis)
    w = jnp.exp(m - jnp.expand_dims(m_all, axis))  # 0 for an empty chunk (its m is MASK_VALUE)
    l_all = jnp.sum(w * l_sum, axis=axis)
    acc_all = jnp.sum(w[..., None] * acc, axis=axis)
    return _normalize(acc_all, l_all[..., None]), m_all, l_all


def _gpu_call(q_bkgd, k_bkds, v_bksd, lengths_b, bs: BlockSizes, interpret: bool):
    b, kv, g, d = q_bkgd.shape
    s_len = k_bkds.shape[3]
    if d & (d - 1):
        raise ValueError(f"ragged_decode_attention (gpu): head dim {d} must be a power of two for Triton")
    block = math.gcd(s_len, bs.block_kv)
    splits = _split_plan(s_len, block, bs.num_splits or gpu_num_splits(b * kv, s_len // block))
    chunk = s_len // splits
    gp = 1 << (g - 1).bit_length()
    if gp != g:  # zero query rows, sliced off below
        q_bkgd = jnp.pad(q_bkgd, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    f32 = jnp.float32
    acc, m, l_sum = pl.pallas_call(
        functools.partial(_gpu_kernel, scale=1.0 / math.sqrt(d), block_kv=block, chunk=chunk),
        grid=(b, kv, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, h, c: (i,)),
            pl.BlockSpec((None, None, gp, d), lambda i, h, c: (i, h, 0, 0)),
            pl.BlockSpec((None, None, d, chunk), lambda i, h, c: (i, h, 0, c)),
            pl.BlockSpec((None, None, chunk, d), lambda i, h, c: (i, h, c, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, h, c: (i, h, c, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, kv, splits, gp, d), f32), jax.ShapeDtypeStruct((b, kv, splits, gp), f32),
                   jax.ShapeDtypeStruct((b, kv, splits, gp), f32)],
        compiler_params=None if interpret else _triton_params(bs),
        interpret=interpret,
        name="ragged_decode_attention_gpu",
    )(lengths_b, q_bkgd, k_bkds, v_bksd)
    out, m, l_sum = merge_chunks(acc, m, l_sum, axis=2)
    return out[:, :, :g], m[:, :, :g], l_sum[:, :, :g]


# ----------------------------------------------------------------------------------------------------------
# TPU: Mosaic.


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_sc, m_sc, l_sc, *, scale: float,
                block_kv: int):
    f32 = jnp.float32
    i, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[i]

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, f32)
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, f32)
        l_sc[...] = jnp.zeros(l_sc.shape, f32)

    @pl.when(j * block_kv < length)
    def _step():
        q = q_ref[...].astype(f32)  # [G, d]
        # HIGHEST: float32 dots stay float32 (TPU and the GPU interpreter would otherwise round to bf16 / TF32).
        s = jnp.dot(q, k_ref[...].astype(f32), preferred_element_type=f32, precision=HIGHEST) * scale  # [G, block]
        pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(pos < length, s, MASK_VALUE)
        m_prev = m_sc[...]  # [G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p, v_ref[...].astype(f32), preferred_element_type=f32,
                                                    precision=HIGHEST)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = _normalize(acc_sc[...], l_sc[...])
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]


def _tpu_call(q_bkgd, k_bkds, v_bksd, lengths_b, bs: BlockSizes, interpret: bool):
    from jax.experimental.pallas import tpu as pltpu

    b, kv, g, d = q_bkgd.shape
    s_len = k_bkds.shape[3]
    block = math.gcd(s_len, bs.block_kv)
    if block % 128 and block != s_len:  # keys put positions on lanes: 128-multiples or the whole length
        block = s_len
    f32 = jnp.float32

    def kv_block(i, j, len_ref):
        # Blocks past the length map to the last valid one: same block index, so no new copy is issued.
        return jnp.minimum(j, jnp.maximum(pl.cdiv(len_ref[i], block) - 1, 0))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kv, s_len // block),
        in_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, h, j, len_ref: (i, h, 0, 0)),
            pl.BlockSpec((None, None, d, block), lambda i, h, j, len_ref: (i, h, 0, kv_block(i, j, len_ref))),
            pl.BlockSpec((None, None, block, d), lambda i, h, j, len_ref: (i, h, kv_block(i, j, len_ref), 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, h, j, len_ref: (i, h, 0, 0)),
            pl.BlockSpec((None, None, g, 1), lambda i, h, j, len_ref: (i, h, 0, 0)),
            pl.BlockSpec((None, None, g, 1), lambda i, h, j, len_ref: (i, h, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((g, d), f32), pltpu.VMEM((g, 1), f32), pltpu.VMEM((g, 1), f32)],
    )
    params_cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")  # renamed in 0.6
    out, m, l_sum = pl.pallas_call(
        functools.partial(_tpu_kernel, scale=1.0 / math.sqrt(d), block_kv=block),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, kv, g, d), f32), jax.ShapeDtypeStruct((b, kv, g, 1), f32),
                   jax.ShapeDtypeStruct((b, kv, g, 1), f32)],
        compiler_params=params_cls(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_decode_attention_tpu",
    )(lengths_b, q_bkgd, k_bkds, v_bksd)
    return out, m[..., 0], l_sum[..., 0]


# ----------------------------------------------------------------------------------------------------------
# Public wrapper.


def default_implementation() -> str | None:
    """``"gpu"`` or ``"tpu"`` for the default backend, ``None`` on CPU (no compiled kernel there)."""
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if backend == "tpu" else None


def ragged_decode_attention(q_bkgd: jax.Array, k_bkds: jax.Array, v_bksd: jax.Array, lengths_b: jax.Array, *,
                            implementation: str | None = None, block_sizes: BlockSizes | None = None,
                            interpret: bool = False, return_stats: bool = False):
    """GQA decode attention of one query per slot over the slot's first ``lengths[b]`` cache positions.

    Args:
      q_bkgd: ``[B, K, G, d]``.
      k_bkds: keys ``[B, K, d, S]`` (one layer of the engine's cache).
      v_bksd: values ``[B, K, S, d]``.
      lengths_b: int ``[B]`` in ``[0, S]``; 0 gives zeros.
      implementation: ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic); default: the backend's. On CPU it must be
        given or ``interpret`` set (then the GPU variant runs in the Pallas interpreter).
      block_sizes: tiles; default :meth:`BlockSizes.default`.
      interpret: run in the Pallas interpreter (any backend, slow; for tests).
      return_stats: return ``(float32 out, m, l)`` with ``m``, ``l`` ``[B, K, G]`` the row max of the scaled
        scores and the sum of ``exp(score - m)``, so a caller can merge more keys exactly.

    Returns:
      ``[B, K, G, d]`` in ``q``'s dtype, or the triple above.
    """
    if q_bkgd.ndim != 4 or k_bkds.ndim != 4 or v_bksd.ndim != 4 or lengths_b.ndim != 1:
        raise ValueError(f"ragged_decode_attention: expected q [B, K, G, d], k [B, K, d, S], v [B, K, S, d], "
                         f"lengths [B]; got {q_bkgd.shape}, {k_bkds.shape}, {v_bksd.shape}, {lengths_b.shape}")
    b, kv, _, d = q_bkgd.shape
    s_len = v_bksd.shape[2]
    if k_bkds.shape != (b, kv, d, s_len) or v_bksd.shape != (b, kv, s_len, d) or lengths_b.shape != (b,):
        raise ValueError(f"ragged_decode_attention: shapes do not agree: q {q_bkgd.shape} (B, K, G, d), k "
                         f"{k_bkds.shape} (B, K, d, S), v {v_bksd.shape} (B, K, S, d), lengths {lengths_b.shape}")
    impl = implementation or default_implementation() or ("gpu" if interpret else None)
    if impl is None:
        raise ValueError("ragged_decode_attention: no compiled kernel on CPU; pass interpret=True or use "
                         "reference_ragged_decode_attention")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"ragged_decode_attention: implementation {impl!r}; allowed: {IMPLEMENTATIONS}")
    bs = block_sizes or BlockSizes.default(impl)
    call = _gpu_call if impl == "gpu" else _tpu_call
    out, m, l_sum = call(q_bkgd, k_bkds, v_bksd, lengths_b.astype(jnp.int32), bs, interpret)
    return (out, m, l_sum) if return_stats else out.astype(q_bkgd.dtype)
