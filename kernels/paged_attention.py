"""One-token decode attention over a paged KV cache: one XLA implementation, and JAX's shipped Pallas
paged-attention kernels.

Pool layout (one layer): ``k_pages``, ``v_pages`` are ``[K, N, P, d]`` (kv heads, pages, tokens per page, head
dim). ``tables`` is int32 ``[B, W]``: token ``i`` of slot ``b`` sits at page ``tables[b, i // P]``, row
``i % P``. Slot ``b`` attends to its tokens ``0 .. lengths[b] - 1``; a slot of length 0 gets zeros. Entries of
a table past the slot's length must still be valid page ids (the kernels read whole compute blocks and mask
afterwards). Queries ``q`` are ``[B, H, d]`` with ``H = K * G``; query head ``h`` reads kv head ``h // G``.
Logits are scaled by ``1 / sqrt(d)``, the softmax is float32, the output has ``q``'s dtype.

Implementations (``impl``):

  * ``"xla"``: :func:`live_paged_attention`, the engine's own decode attention. It sorts the slots by length into
    classes (:func:`live_plan`) and reads each class's pages in blocks only up to its longest slot, with an
    online softmax across blocks. It runs anywhere; on the CPU it is the only fast choice. Inside the decode step
    it also takes each row's new key and value and the stacked pool of every layer (docs/rollout.md, 'How a
    decode step runs').
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
``cdiv(length, block)`` blocks and would read past the slot's table otherwise (and the XLA path's
classes would count blocks past it). Both kernels already return
zeros for a row of length 0; the wrapper zeroes those rows anyway, as the contract callers rely on, rather than
depend on an undocumented convention of the kernels.

``"pallas_tpu_ragged"`` (:func:`ragged_paged_attention`) is ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``,
the kernel vLLM and SGLang run on TPU. It reads one pool ``[N, P, 2 * K, d]`` with each kv head's key and value
side by side (the engine lays its pool out that way for it, ``models.paged.InterleavedKV``), takes the softmax
scale itself, and has no interpreter: it runs on a TPU only. As with ``pallas_tpu``, Mosaic's tiling may reject
a small head dim on hardware (serving engines pad it to 128 for this kernel); that is left to its compiler error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The kernel that reads the interleaved pool (models.paged.InterleavedKV); the others read keys and values apart.
RAGGED_IMPL = "pallas_tpu_ragged"
IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", RAGGED_IMPL)

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


# The live-reading XLA path sorts a state's slots by length into classes of equal size (each reads to its own
# longest slot, in blocks of whole pages; each class costs a loop trip per block it reads). A full state reads
# classes of 8 rows in blocks of 128 tokens; the small states a long tail compacts into hold few, long rows, so
# they take classes of fewer rows (less padding next to a long row) and longer blocks (fewer trips for the same
# rounding). At most LIVE_ROW_CLASSES classes.
LIVE_ROW_CLASSES = 32
# Tiles one loop trip reads: whole groups of 16 first, then of 4, then single tiles, so that no trip reads a
# tile the step does not need. Each trip is a round of small kernels (and on a GPU a read of the loop's
# condition by the host), so trips, not tiles, are what a step pays per layer beyond its bytes. Batch shards on
# devices of their own loop apart; batch shards on one device loop side by side (vmapped): each loop takes as
# many trips as the shard that needs most, and a shard past its own tiles reads tiles it then discards
# (live_step_reads counts them).
LIVE_TILE_GROUPS = (16, 4, 1)
# The name scope of each of those loops (followed by its group size) in a compiled program's op names.
LIVE_LOOP_SCOPE = "live_tile_groups_of_"


def live_block_tokens(slots: int) -> int:
    """Tokens per block of the live-reading path for a state (or batch shard) of ``slots`` slots."""
    return 128 if slots >= 128 else 256 if slots >= 32 else 512


def live_class_rows(slots: int) -> int:
    """Rows per length class of the live-reading path for ``slots`` slots: 8 from 128 slots, down to 2."""
    return min(8, max(2, slots // 16))


class LivePlan(NamedTuple):
    """What every layer's live-reading attention shares in one decode step (slots sorted by length, in classes,
    and each class's blocks listed as tiles).

    ``order`` [C * R]: slot ids longest first (padding rows point at slot 0 with length 0); ``lengths`` [C, R];
    ``tiles``: the tiles the step reads; tile ``t < tiles`` is block ``tile_block[t]`` of class ``tile_class[t]``,
    whose rows read pages ``tile_tables[t]`` [R, bp] (at least ``C * nblk`` entries; those past ``tiles`` are
    read only by a batch shard whose loops outlast its own tiles, and discarded)."""

    order: jax.Array
    lengths: jax.Array
    tiles: jax.Array
    tile_class: jax.Array
    tile_block: jax.Array
    tile_tables: jax.Array


def live_block_pages(table_width: int, page_tokens: int, slots: int) -> int:
    """Pages per block of the live-reading path for ``slots`` slots: :func:`live_block_tokens` in whole pages,
    at most the table width."""
    return max(1, min(table_width, live_block_tokens(slots) // page_tokens))


def live_classes(slots: int, row_classes: int = LIVE_ROW_CLASSES) -> int:
    """Length classes for ``slots`` slots: at most ``row_classes``, of :func:`live_class_rows` rows each."""
    return max(1, min(row_classes, slots // live_class_rows(slots)))


def live_plan(tables_bw: jax.Array, lengths_b: jax.Array, page_tokens: int, *,
              row_classes: int = LIVE_ROW_CLASSES) -> LivePlan:
    """Sorts the slots by cached length into classes and counts the page blocks each class must read."""
    b, w = tables_bw.shape
    bp = live_block_pages(w, page_tokens, b)
    nblk = -(-w // bp)
    c = live_classes(b, row_classes)
    r = -(-b // c)
    order = jnp.argsort(-lengths_b, stable=True).astype(jnp.int32)
    order = jnp.pad(order, (0, c * r - b))
    lengths = jnp.pad(lengths_b[order[:b]], (0, c * r - b)).reshape(c, r)
    tables = jnp.pad(tables_bw, ((0, 0), (0, nblk * bp - w)))[order].reshape(c, r, nblk, bp)
    blocks = -(-jnp.max(lengths, axis=1) // (bp * page_tokens))
    ends = jnp.cumsum(blocks)
    # The tiles in order, class by class: worked out once per step here, not in every layer's loop trips (at
    # least a largest group's worth, for the loops' slices to trace).
    tile = jnp.arange(max(c * nblk, LIVE_TILE_GROUPS[0]), dtype=jnp.int32)
    tile_class = jnp.minimum(jnp.sum(tile[:, None] >= ends[None, :], axis=1), c - 1).astype(jnp.int32)
    tile_block = jnp.clip(tile - (ends - blocks)[tile_class], 0, nblk - 1).astype(jnp.int32)
    return LivePlan(order, lengths, ends[-1].astype(jnp.int32), tile_class, tile_block,
                    tables[tile_class, :, tile_block])


def _live_blocks(lengths, table_width: int, page_tokens: int, row_classes: int):
    """Host-side :func:`live_plan` of ``lengths`` (numpy): each class's blocks, rows per class, pages per block."""
    lengths = np.sort(np.asarray(lengths, np.int64))[::-1]
    b = lengths.shape[0]
    bp = live_block_pages(table_width, page_tokens, b)
    c = live_classes(b, row_classes)
    r = -(-b // c)
    padded = np.zeros((c * r,), np.int64)
    padded[:b] = lengths
    return -(-padded.reshape(c, r).max(axis=1) // (bp * page_tokens)), r, bp


def live_read_tokens(lengths, table_width: int, page_tokens: int, *, row_classes: int = LIVE_ROW_CLASSES) -> int:
    """Cached tokens one layer of :func:`live_paged_attention` reads for slots of ``lengths`` (numpy, host):
    what ``kv_read_ratio`` counts for the XLA path."""
    blocks, r, bp = _live_blocks(lengths, table_width, page_tokens, row_classes)
    return int(blocks.sum() * r * bp * page_tokens)


def live_step_reads(shards, table_width: int, page_tokens: int, *, apart: bool = False,
                    row_classes: int = LIVE_ROW_CLASSES) -> tuple[int, list[int]]:
    """Cached tokens one layer of :func:`live_paged_attention` reads for batch shards of slots of these lengths
    (numpy, host; shards of equal slot counts), and the trips each of its loops takes: with one shard,
    :func:`live_read_tokens` and :func:`live_group_trips`. Shards whose loops run ``apart`` (each on its own
    devices) read their own tiles, and a step waits for the shard of most trips (its trips are counted).
    Otherwise their loops run side by side: each loop takes the most trips any shard needs in it, and every
    shard reads a group's tiles on every trip."""
    own = [live_group_trips(x, table_width, page_tokens, row_classes=row_classes) for x in shards]
    trips = max(own, key=sum) if apart else [max(t) for t in zip(*own)]
    _, rows, bp = _live_blocks(shards[0], table_width, page_tokens, row_classes)
    tiles = sum(n * k for t in own for n, k in zip(LIVE_TILE_GROUPS, t)) if apart else \
        len(shards) * sum(n * k for n, k in zip(LIVE_TILE_GROUPS, trips))
    return tiles * rows * bp * page_tokens, trips


def live_group_trips(lengths, table_width: int, page_tokens: int, *, row_classes: int = LIVE_ROW_CLASSES
                     ) -> list[int]:
    """Trips each loop of one layer of :func:`live_paged_attention` takes for slots of ``lengths`` (numpy, host),
    one count per group size of :data:`LIVE_TILE_GROUPS`."""
    tiles = int(_live_blocks(lengths, table_width, page_tokens, row_classes)[0].sum())
    trips = []
    for n in LIVE_TILE_GROUPS:
        trips.append(tiles // n)
        tiles %= n
    return trips


def live_paged_attention(q_bhd: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                         plan: LivePlan, k_new_bkd: jax.Array | None = None, v_new_bkd: jax.Array | None = None,
                         *, block_pages: int) -> jax.Array:
    """The ``"xla"`` implementation: decode attention over the paged pool that reads only each slot class's
    live page blocks, with an online float32 softmax across blocks. [B, H, d] in ``q``'s dtype.

    ``k_pool``, ``v_pool`` are the stacked pool [K, L, N, P, d], read at ``layer`` by the gather itself (no
    copy of the layer). ``plan``: :func:`live_plan` of the tables and lengths (lengths at most ``W * P``);
    ``block_pages``: :func:`live_block_pages`. With ``k_new``, ``v_new`` [B, K, d] each row also attends to
    its own new key and value in the same softmax (what a decode step computes before it writes them); without
    them a row of length 0 gets zeros."""
    b, h, d = q_bhd.shape
    kv, p = k_pool.shape[0], k_pool.shape[3]
    c, r = plan.lengths.shape
    bp = block_pages
    g = h // kv
    f32 = jnp.float32
    scale = 1.0 / math.sqrt(d)
    q = q_bhd.reshape(b, kv, g, d)

    def by_class(x):  # [B, ...] -> [C, R, ...] in the plan's order (padding rows repeat slot 0, length 0)
        return x[plan.order].reshape((c, r) + x.shape[1:])

    q_c = by_class(q)
    if k_new_bkd is None:
        m0 = jnp.full((c, r, kv, g), _MASK_VALUE, f32)
        l0, acc0 = jnp.zeros_like(m0), jnp.zeros((c, r, kv, g, d), f32)
    else:  # the row's own token opens the softmax, so l > 0 for every row
        sn = jnp.sum(q.astype(f32) * k_new_bkd[:, :, None].astype(f32), axis=-1) * scale  # [B, K, G]
        m0 = by_class(sn)
        l0 = jnp.ones_like(m0)
        acc0 = by_class(jnp.broadcast_to(v_new_bkd[:, :, None].astype(f32), (b, kv, g, d)))

    def group(n):
        def body(carry):  # tiles t .. t + n - 1, each (class, block), folded into their classes' softmax
            t, m, l, acc = carry
            cls = jax.lax.dynamic_slice_in_dim(plan.tile_class, t, n)  # [n]
            blk = jax.lax.dynamic_slice_in_dim(plan.tile_block, t, n)
            tab = jax.lax.dynamic_slice_in_dim(plan.tile_tables, t, n)  # [n, R, bp]
            k_b = k_pool[:, layer, tab]  # [K, n, R, bp, P, d]
            v_b = v_pool[:, layer, tab]
            s = jnp.einsum("trkhd,ktrjpd->trkhjp", q_c[cls], k_b, preferred_element_type=f32) * scale
            pos = (blk * bp * p)[:, None, None] + jnp.arange(bp * p, dtype=jnp.int32).reshape(bp, p)  # [n, bp, P]
            valid = (pos[:, None] < plan.lengths[cls][:, :, None, None])[:, :, None, None]  # [n, R, 1, 1, bp, P]
            # Tiles of one class in the group share its new maximum (a scatter-max over the group's tiles).
            m_new = m.at[cls].max(jnp.max(jnp.where(valid, s, _MASK_VALUE), axis=(-2, -1)))
            e = jnp.where(valid, jnp.exp(s - m_new[cls][..., None, None]), 0.0)
            pv = jnp.einsum("trkhjp,ktrjpd->trkhd", e.astype(v_b.dtype), v_b, preferred_element_type=f32)
            alpha = jnp.exp(m - m_new)
            l_new = (l * alpha).at[cls].add(jnp.sum(e, axis=(-2, -1)))
            acc_new = (acc * alpha[..., None]).at[cls].add(pv)
            return t + n, m_new, l_new, acc_new

        return body

    carry = (jnp.int32(0), m0, l0, acc0)
    for n in LIVE_TILE_GROUPS:  # whole groups of the largest size, then the rest in smaller ones: no padding
        with jax.named_scope(f"{LIVE_LOOP_SCOPE}{n}"):  # how the compiled program's kernel count finds its loops
            carry = jax.lax.while_loop(lambda c_, n=n: c_[0] + n <= plan.tiles, group(n), carry)
    _, _, l, acc = carry
    # l is 0 only for a row with no token at all (no new one, length 0): it gets zeros.
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(c * r, kv, g, d)
    # Back to slot order: padding rows (past B) are dropped by the scatter.
    out = jnp.zeros((b, kv, g, d), f32).at[plan.order[:b]].set(out[:b])
    return out.astype(q_bhd.dtype).reshape(b, h, d)


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
    if impl == RAGGED_IMPL:
        return ragged_block_pages(table_width)
    return 0


def paged_attention(q, k_pages, v_pages, tables, lengths, *, impl, interpret=False, pages_per_compute_block=None):
    """Decode attention of ``q`` ``[B, H, d]`` over the paged pool; ``[B, H, d]`` in ``q``'s dtype.

    ``impl`` is one of :data:`IMPLEMENTATIONS` (see the module docstring). ``interpret=True`` runs a Pallas
    kernel in interpret mode (CPU): for ``pallas_gpu`` through the kernel's ``interpret`` flag, for
    ``pallas_tpu`` under ``pltpu.force_tpu_interpret_mode()``. ``pages_per_compute_block`` is the number of
    pages a kernel loads per step; it must divide ``W``; ``None`` picks one. Raises ``ValueError`` naming the
    shapes when they do not fit the chosen kernel.
    """
    if impl not in IMPLEMENTATIONS or impl == RAGGED_IMPL:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS[:-1]} (the interleaved pool of {RAGGED_IMPL!r} "
                         f"goes to ragged_paged_attention); got {impl!r}")
    B, H, d, K, N, P, W, G = _shapes(q, k_pages, v_pages, tables, lengths)
    if impl == "xla":
        plan = live_plan(tables.astype(jnp.int32), jnp.clip(lengths.astype(jnp.int32), 0, W * P), P)
        return live_paged_attention(q, k_pages[:, None], v_pages[:, None], jnp.int32(0), plan,
                                    block_pages=live_block_pages(W, P, B))

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


# The ragged kernel's pages per block where its tuned table has no entry (its own untuned default on TPU v5+):
# pages past a slot's length are loaded in whole blocks, so kv_read_ratio counts in these.
_RAGGED_DEFAULT_BLOCK_PAGES, _RAGGED_DEFAULT_QUERIES = 128, 32


def ragged_block_pages(table_width: int) -> int:
    """Pages the ragged kernel loads per block at its default block sizes (what it reads past a slot's length
    is the rest of its last block); its tuned table is consulted on a TPU only, so counts made elsewhere use the
    untuned default."""
    return min(table_width, _RAGGED_DEFAULT_BLOCK_PAGES)


def _shipped_ragged_kernel():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel

    return kernel


def ragged_paged_attention(q, kv_pages, tables, lengths, *, kernel=None):
    """Decode attention of ``q`` ``[B, H, d]`` (one query per slot) over the interleaved pool ``kv_pages``
    ``[N, P, 2K, d]``, through ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``; ``[B, H, d]`` in
    ``q``'s dtype.

    Slot ``b`` is the kernel's sequence ``b`` with one query token (``cu_q_lens`` = 0, 1, .., B) at the last of
    its ``lengths[b]`` tokens; the kernel's causal mask then lets it see all of them. ``kernel`` replaces the
    shipped kernel with one of the same arguments (its reference ``ref_ragged_paged_attention``, which runs
    anywhere but only outside ``jit``). Rows of length 0 get zeros."""
    if q.ndim != 3 or kv_pages.ndim != 4 or tables.ndim != 2 or lengths.ndim != 1:
        raise ValueError(f"expected q [B, H, d], kv_pages [N, P, 2K, d], tables [B, W], lengths [B]; got "
                         f"q {tuple(q.shape)}, kv_pages {tuple(kv_pages.shape)}, tables {tuple(tables.shape)}, "
                         f"lengths {tuple(lengths.shape)}")
    b, h, d = q.shape
    _, p, kv2, dk = kv_pages.shape
    if kv2 % 2 or h % (kv2 // 2) or dk != d or tables.shape[0] != b or lengths.shape[0] != b:
        raise ValueError(f"q {tuple(q.shape)} and kv_pages {tuple(kv_pages.shape)} (2K heads, keys and values "
                         f"interleaved) do not fit, or tables {tuple(tables.shape)} and lengths "
                         f"{tuple(lengths.shape)} are not one per slot")
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, tables.shape[1] * p)
    kernel = kernel or _shipped_ragged_kernel()
    # The kernel wants each sequence's query within its tokens (q_len <= kv_len): an empty row reads its first
    # table entry (a valid page) and is zeroed below.
    out = kernel(q, kv_pages, jnp.maximum(lengths, 1), tables.astype(jnp.int32), jnp.arange(b + 1, dtype=jnp.int32),
                 jnp.array([b], jnp.int32), sm_scale=1.0 / math.sqrt(d), mask_value=_MASK_VALUE)
    out = jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)
    return out.astype(q.dtype)
