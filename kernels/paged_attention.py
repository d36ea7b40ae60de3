"""One-token decode attention over a paged KV cache, through JAX's shipped Pallas paged-attention kernels.

Pool layout (one layer): ``k_pages``, ``v_pages`` are ``[K, N, P, d]`` (kv heads, pages, tokens per page, head
dim). ``tables`` is int32 ``[B, W]``: token ``i`` of slot ``b`` sits at page ``tables[b, i // P]``, row
``i % P``. Slot ``b`` attends to its tokens ``0 .. lengths[b] - 1``; a slot of length 0 gets zeros. Entries of
a table past the slot's length must still be valid page ids (the kernels read whole compute blocks and mask
afterwards). Queries ``q`` are ``[B, H, d]`` with ``H = K * G``; query head ``h`` reads kv head ``h // G``.
Logits are scaled by ``1 / sqrt(d)``, the softmax is float32, the output has ``q``'s dtype.

Implementations (``impl``):

  * ``"xla"``: :func:`reference_paged_attention`, a gather of each slot's pages and a masked softmax. It runs
    anywhere and is the oracle for the others; on the CPU it is the only fast choice. It reads all ``W * P``
    positions of every slot whatever its length, so on an accelerator it wastes bandwidth on short slots.
  * ``"pallas_gpu"``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (Triton lowering), flash-decoding:
    the ``W`` pages are cut into ``k_splits`` partitions run in parallel and merged exactly, and each partition
    stops at the slot's length. Query heads of one kv head are processed together in a block of 16 rows
    (``G`` is padded up to it, so ``G <= 16`` costs one block). The Triton lowering needs power-of-two tensor
    sizes and dot operands of at least 16 per side, so on the GPU ``P``, ``d`` and ``pages_per_compute_block``
    must be powers of two with ``d >= 16`` and ``pages_per_compute_block * P >= 16``; these are only checked
    when ``interpret=False``. The kernel's dots run in the pool's dtype (``q`` is cast to it) at default
    precision, which Triton runs as TF32 for float32 (about 1e-3 relative on the logits); with a bf16 pool the
    probabilities are rounded to bf16 before the value product.
  * ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` (Mosaic). Lengths and tables are
    scalar-prefetched; pages are DMA'd into VMEM ``pages_per_compute_block`` at a time, double-buffered, only
    up to the slot's length, and zero-length slots are skipped. The kernel always rounds K and V to bf16 after
    loading them (it shares its load path with int8 dequantisation), so a float32 pool gets bf16 K/V accuracy.
    On hardware Mosaic's tiling rules may reject small or unaligned ``d`` and ``P``; those are left to its
    compiler errors, since they depend on the chip and dtype. Interpret mode accepts any sizes.

Neither kernel takes a softmax scale, so ``q`` is multiplied by ``1 / sqrt(d)`` before the call (in float32
for the TPU kernel, which computes in float32; in the pool's dtype for the GPU kernel, which for bf16 adds one
rounding unless ``d`` is a power of four). Lengths are clipped to ``[0, W * P]``: the TPU kernel walks
``cdiv(length, block)`` blocks and would read past the slot's table otherwise. Both kernels already return
zeros for a row of length 0; the wrapper zeroes those rows anyway, as the contract callers rely on, rather than
depend on an undocumented convention of the kernels.

``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` is not offered: it reads one pool
``[N, P, 2 * K, d]`` with K and V interleaved along the head axis, so using it on this layout would mean
building that array from ``k_pages`` and ``v_pages`` (a copy of the whole pool) on every call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")

# Finite, so that an all-masked row softmaxes to a uniform row instead of NaN; it is zeroed afterwards.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Rows of query heads per kv head the GPU kernel processes together; it requires a multiple of 16.
_GPU_BLOCK_H = 16
# Upper bound on the GPU kernel's partitions per slot (the shipped default): enough to fill the GPU at decode
# batch sizes, while each partition still amortises its output write and the merge.
_GPU_MAX_K_SPLITS = 16
# Tokens per compute block aimed for by default: large enough to keep the matrix units busy, small enough that
# a short slot does not load many masked positions.
_GPU_BLOCK_TOKENS = 128
_TPU_BLOCK_TOKENS = 256


def _shapes(q, k_pages, v_pages, tables, lengths):
    """Checks the operands against the pool layout; returns ``(B, H, d, K, N, P, W, G)``."""
    described = (
        f"q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages {tuple(v_pages.shape)}, "
        f"tables {tuple(tables.shape)}, lengths {tuple(lengths.shape)}"
    )
    if q.ndim != 3 or k_pages.ndim != 4 or tables.ndim != 2 or lengths.ndim != 1:
        raise ValueError(f"expected q [B, H, d], pages [K, N, P, d], tables [B, W], lengths [B]; got {described}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape; got {described}")
    B, H, d = q.shape
    K, N, P, dk = k_pages.shape
    W = tables.shape[1]
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the pages ({dk}) differ; got {described}")
    if tables.shape[0] != B or lengths.shape[0] != B:
        raise ValueError(f"q, tables and lengths must share the slot count B={B}; got {described}")
    if H % K:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}; got {described}")
    if W < 1 or N < 1 or P < 1:
        raise ValueError(f"tables need at least one column and the pool at least one page; got {described}")
    return B, H, d, K, N, P, W, H // K


def reference_paged_attention(q, k_pages, v_pages, tables, lengths, k_new=None, v_new=None):
    """Decode attention by gathering each slot's pages to the table's width and a masked float32 softmax: the
    oracle of the kernels and of the rollout's live-reading XLA path. With ``k_new``, ``v_new`` (``[B, K, d]``)
    each row also attends to its own new key and value, in the same softmax (what a decode step computes before
    it writes them). ``[B, H, d]`` in ``q``'s dtype."""
    B, H, d, K, N, P, W, G = _shapes(q, k_pages, v_pages, tables, lengths)
    tables = tables.astype(jnp.int32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, W * P)
    # [K, B, W, P, d] -> [K, B, S, d]: the slot's tokens in order, S = W * P.
    k = k_pages[:, tables].reshape(K, B, W * P, d)
    v = v_pages[:, tables].reshape(K, B, W * P, d)
    qg = q.reshape(B, K, G, d)
    scale = 1.0 / math.sqrt(d)
    # The products accumulate in float32 without upcasting the gathered cache, which is the large operand.
    logits = jnp.einsum("bkgd,kbsd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(W * P, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, S]
    logits = jnp.where(valid[:, None, None, :], logits, _MASK_VALUE)
    if k_new is not None:
        own = jnp.einsum("bkgd,bkd->bkg", qg, k_new, preferred_element_type=jnp.float32) * scale
        probs = jax.nn.softmax(jnp.concatenate([logits, own[..., None]], axis=-1), axis=-1)
        out = jnp.einsum("bkgs,kbsd->bkgd", probs[..., :-1], v, preferred_element_type=jnp.float32)
        out = out + probs[..., -1:] * v_new[:, :, None].astype(jnp.float32)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bkgs,kbsd->bkgd", probs, v, preferred_element_type=jnp.float32)
        out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(B, H, d).astype(q.dtype)


def _divisors(n):
    return [c for c in range(1, n + 1) if n % c == 0]


def _is_pow2(n):
    return n > 0 and n & (n - 1) == 0


def gpu_blocks(W, P, d, pages_per_compute_block, interpret, described):
    """Picks ``(pages_per_compute_block, k_splits)`` for the GPU kernel, which needs ``k_splits`` to divide ``W``
    and the compute block to divide each partition's ``W / k_splits`` pages."""
    hardware = not interpret
    if hardware and not (_is_pow2(P) and _is_pow2(d) and d >= 16):
        raise ValueError(
            f"pallas_gpu on the GPU needs a power-of-two page size and head dim >= 16 (Triton tensor sizes); "
            f"got P={P}, d={d} ({described})"
        )

    def allowed(c):
        return not hardware or (_is_pow2(c) and c * P >= 16)

    if pages_per_compute_block is None:
        candidates = [c for c in _divisors(W) if allowed(c)]
        if not candidates:
            raise ValueError(
                f"pallas_gpu finds no pages_per_compute_block dividing W={W} with a power-of-two block of at "
                f"least 16 tokens for P={P} ({described})"
            )
        fitting = [c for c in candidates if c * P <= _GPU_BLOCK_TOKENS]
        ppcb = max(fitting) if fitting else min(candidates)
    else:
        ppcb = int(pages_per_compute_block)
        if ppcb < 1 or W % ppcb:
            raise ValueError(f"pages_per_compute_block={ppcb} must divide the table width W={W} ({described})")
        if not allowed(ppcb):
            raise ValueError(
                f"pallas_gpu on the GPU needs pages_per_compute_block a power of two with "
                f"pages_per_compute_block * P >= 16; got {ppcb} with P={P} ({described})"
            )
    k_splits = max(s for s in _divisors(W // ppcb) if s <= _GPU_MAX_K_SPLITS)
    return ppcb, k_splits


def _tpu_block(W, P, pages_per_compute_block, described):
    if pages_per_compute_block is None:
        return max(c for c in _divisors(W) if c == 1 or c * P <= _TPU_BLOCK_TOKENS)
    ppcb = int(pages_per_compute_block)
    if ppcb < 1 or W % ppcb:
        raise ValueError(f"pages_per_compute_block={ppcb} must divide the table width W={W} ({described})")
    return ppcb


def compute_block_pages(impl, table_width, page_tokens, head_dim, interpret=False):
    """The pages a kernel of ``impl`` loads per compute block at its default choice (what it reads past a slot's
    length is the rest of that block); 0 for ``"xla"``, which has no such block."""
    described = f"table width {table_width}, page tokens {page_tokens}, head dim {head_dim}"
    if impl == "pallas_gpu":
        return gpu_blocks(table_width, page_tokens, head_dim, None, interpret, described)[0]
    if impl == "pallas_tpu":
        return _tpu_block(table_width, page_tokens, None, described)
    return 0


def paged_attention(q, k_pages, v_pages, tables, lengths, *, impl, interpret=False, pages_per_compute_block=None):
    """Decode attention of ``q`` ``[B, H, d]`` over the paged pool; ``[B, H, d]`` in ``q``'s dtype.

    ``impl`` is one of :data:`IMPLEMENTATIONS` (see the module docstring). ``interpret=True`` runs a Pallas
    kernel in interpret mode (CPU): for ``pallas_gpu`` through the kernel's ``interpret`` flag, for
    ``pallas_tpu`` under ``pltpu.force_tpu_interpret_mode()``. ``pages_per_compute_block`` is the number of
    pages a kernel loads per step; it must divide ``W``; ``None`` picks one. Raises ``ValueError`` naming the
    shapes when they do not fit the chosen kernel.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}; got {impl!r}")
    B, H, d, K, N, P, W, G = _shapes(q, k_pages, v_pages, tables, lengths)
    if impl == "xla":
        return reference_paged_attention(q, k_pages, v_pages, tables, lengths)

    described = (
        f"q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, tables {tuple(tables.shape)}, "
        f"lengths {tuple(lengths.shape)}"
    )
    tables = tables.astype(jnp.int32)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, W * P)
    q_scaled = q.astype(jnp.float32) * (1.0 / math.sqrt(d))

    if impl == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

        ppcb, k_splits = gpu_blocks(W, P, d, pages_per_compute_block, interpret, described)
        out = gpu_paged.paged_attention(
            # The kernel's dot takes both operands in one dtype.
            q_scaled.astype(k_pages.dtype),
            k_pages,
            v_pages,
            tables,
            lengths,
            block_h=_GPU_BLOCK_H,
            pages_per_compute_block=ppcb,
            k_splits=k_splits,
            interpret=interpret,
            mask_value=_MASK_VALUE,
        )
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

        ppcb = _tpu_block(W, P, pages_per_compute_block, described)

        def call():
            # float32 q: the kernel computes in float32 anyway, so the scaled q is not rounded again.
            return tpu_paged(
                q_scaled, k_pages, v_pages, lengths, tables, pages_per_compute_block=ppcb, mask_value=_MASK_VALUE
            )

        if interpret:
            with pltpu.force_tpu_interpret_mode():
                out = call()
        else:
            out = call()

    out = jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)
    return out.astype(q.dtype)
