"""Decode against a paged KV cache: one pool of fixed-size pages shared by every slot, a page table per slot.

The pool is ``[L, K, N, P, d]`` for keys and for values; token ``i`` of a slot sits in page ``tables[b, i // P]``
at row ``i % P``. Page 0 (of each shard) is scratch: it belongs to no slot, takes the writes that must land
nowhere, and table entries past a slot's pages point there. On a mesh that splits the slots over S batch shards,
the pages split the same way, tables hold page ids within the slot's shard, and slot ``b`` of B is in shard
``b // (B / S)``. Entry point: :func:`decode_forward_paged`. See docs/rollout.md, 'How a decode step runs' and
'Paged KV cache'.

Shapes: B slots, H query heads, K kv heads, G = H // K, d head dim, N pages, P tokens per page, W pages per
table, L layers.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.models.decoder import (_MASK_VALUE, DecodeSettings, embed_tokens, finish_block, head_logits,
                                     qkv_projection, resolve_attention_impl)
from dora_jax.sharding import constrain

SCRATCH_PAGE = 0


class PagedKV(NamedTuple):
    """Every layer's pages: ``k`` and ``v`` [L, K, N, P, d]."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        # Pages split over the batch axes as the slots do (memory per device falls with the batch shards; a
        # slot holds pages of its own shard only), heads over the tensor axes.
        return ("layers", "act_kv_heads", "batch", None, None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_tokens(self) -> int:
        return self.k.shape[3]


def init_pages(cfg: ModelConfig, num_pages: int, page_tokens: int, dtype: str | None = None) -> PagedKV:
    """A zero pool of ``num_pages`` pages (page 0, scratch, included)."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_tokens, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    return PagedKV(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def token_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of one token's keys and values over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype or cfg.compute_dtype).itemsize


def slot_pages(tables_bw: jax.Array, positions_b: jax.Array, page_tokens: int, write_b: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Where each row's token at ``positions_b`` goes: (page, row in page); scratch where ``write_b`` is off."""
    page = jnp.take_along_axis(tables_bw, (positions_b // page_tokens)[:, None], axis=1)[:, 0]
    return jnp.where(write_b, page, SCRATCH_PAGE), jnp.where(write_b, positions_b % page_tokens, 0)


def _shards(x: jax.Array, shards: int, axis: int = 0) -> jax.Array:
    """Splits ``axis`` into (shards, size / shards)."""
    return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])


def write_pages(pool: PagedKV, k_lbkd: jax.Array, v_lbkd: jax.Array, page_b: jax.Array, row_b: jax.Array,
                shards: int = 1) -> PagedKV:
    """Writes one token per row, every layer, with one scatter per tensor (in place when the pool is donated).
    ``page_b`` are page ids within each row's shard."""
    def write(pages, new, page, row):
        # Advanced indices on adjacent axes 2, 3 keep their place: updates are [L, K, B, d].
        return pages.at[:, :, page, row].set(new.transpose(0, 2, 1, 3).astype(pages.dtype))

    if shards == 1:
        k, v = write(pool.k, k_lbkd, page_b, row_b), write(pool.v, v_lbkd, page_b, row_b)
    else:
        per_shard = jax.vmap(write, in_axes=(2, 1, 0, 0), out_axes=2)
        page_s, row_s = _shards(page_b, shards), _shards(row_b, shards)
        k, v = (per_shard(_shards(x, shards, 2), _shards(new, shards, 1), page_s, row_s).reshape(x.shape)
                for x, new in ((pool.k, k_lbkd), (pool.v, v_lbkd)))
    return PagedKV(constrain(k, PagedKV.axes()), constrain(v, PagedKV.axes()))


def write_prompt_pages(pool: PagedKV, k_lrktd: jax.Array, v_lrktd: jax.Array, page_rt: jax.Array,
                       row_rt: jax.Array) -> PagedKV:
    """Writes prompts' entries (``k``, ``v`` [L, R, K, T, d]) at (page, row) per token [R, T]."""
    k = pool.k.at[:, :, page_rt, row_rt].set(k_lrktd.transpose(0, 2, 1, 3, 4).astype(pool.k.dtype))
    v = pool.v.at[:, :, page_rt, row_rt].set(v_lrktd.transpose(0, 2, 1, 3, 4).astype(pool.v.dtype))
    return PagedKV(constrain(k, PagedKV.axes()), constrain(v, PagedKV.axes()))


# The live-reading XLA path sorts a state's slots by length into classes of equal size (each reads to its own
# longest slot, in blocks of whole pages; each class costs a loop trip per block it reads). A full state reads
# classes of 8 rows in blocks of 128 tokens; the small states a long tail compacts into hold few, long rows, so
# they take classes of fewer rows (less padding next to a long row) and longer blocks (fewer trips for the same
# rounding). At most LIVE_ROW_CLASSES classes.
LIVE_ROW_CLASSES = 32


def live_block_tokens(slots: int) -> int:
    """Tokens per block of the live-reading path for a state (or batch shard) of ``slots`` slots."""
    return 128 if slots >= 128 else 256 if slots >= 32 else 512


def live_class_rows(slots: int) -> int:
    """Rows per length class of the live-reading path for ``slots`` slots: 8 from 128 slots, down to 2."""
    return min(8, max(2, slots // 16))


class LivePlan(NamedTuple):
    """What every layer's live-reading attention shares in one decode step (slots sorted by length, in classes).

    ``order`` [C * R]: slot ids longest first (padding rows point at slot 0 with length 0); ``tables`` [C, R,
    nblk * bp]; ``lengths`` [C, R]; ``blocks`` [C]: the blocks each class reads; ``starts`` [C]: its first tile;
    ``tiles``: the tiles of the step (sum of ``blocks``)."""

    order: jax.Array
    tables: jax.Array
    lengths: jax.Array
    blocks: jax.Array
    starts: jax.Array
    tiles: jax.Array


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
    tables = jnp.pad(tables_bw, ((0, 0), (0, nblk * bp - w)))[order].reshape(c, r, nblk * bp)
    blocks = -(-jnp.max(lengths, axis=1) // (bp * page_tokens))
    ends = jnp.cumsum(blocks)
    return LivePlan(order, tables, lengths, blocks.astype(jnp.int32), (ends - blocks).astype(jnp.int32),
                    ends[-1].astype(jnp.int32))


def live_read_tokens(lengths, table_width: int, page_tokens: int, *, row_classes: int = LIVE_ROW_CLASSES) -> int:
    """Cached tokens one layer of :func:`live_paged_attention` reads for slots of ``lengths`` (numpy, host):
    what ``kv_read_ratio`` counts for the XLA path."""
    import numpy as np

    lengths = np.sort(np.asarray(lengths, np.int64))[::-1]
    b = lengths.shape[0]
    bp = live_block_pages(table_width, page_tokens, b)
    c = live_classes(b, row_classes)
    r = -(-b // c)
    padded = np.zeros((c * r,), np.int64)
    padded[:b] = lengths
    blocks = -(-padded.reshape(c, r).max(axis=1) // (bp * page_tokens))
    return int(blocks.sum() * r * bp * page_tokens)


def attention_read_tokens(impl: str, lengths, table_width: int, page_tokens: int, head_dim: int,
                          interpret: bool = False) -> int:
    """Cached tokens one layer's decode attention reads for slots of ``lengths`` (numpy, host), by the path
    ``impl`` takes (``kv_read_ratio`` is this over the live tokens)."""
    import numpy as np

    if impl == "xla":
        return live_read_tokens(lengths, table_width, page_tokens)
    from dora_jax.kernels.paged_attention import compute_block_pages

    block = compute_block_pages(impl, table_width, page_tokens, head_dim, interpret) * page_tokens
    lengths = np.asarray(lengths, np.int64)
    return int((-(-lengths // block) * block).sum())


class ReadCounter:
    """Cached tokens a decode attention path reads (``read``) against the live tokens it has to read (``live``),
    per layer, counted on the host from each program's results (the benchmarks' ``kv_read_ratio``)."""

    def __init__(self, impl: str, shards: int, table_width: int, page_tokens: int, head_dim: int,
                 interpret: bool = False):
        self.impl, self.shards, self.table_width, self.page_tokens = impl, shards, table_width, page_tokens
        self.head_dim, self.interpret = head_dim, interpret
        self.read = self.live = 0
        self.seconds = 0.0  # host time the counting took (benchmarks take it off what they time)

    def add(self, starts: list, produced) -> None:
        """One program: per decode state, each slot's cached tokens before it (``starts``), and the tokens each
        slot produced (``produced``, every state's slots in order). At each step every producing row reads its
        cached tokens."""
        import time

        import numpy as np

        t0, row = time.perf_counter(), 0
        for start in starts:
            n = produced[row:row + start.shape[0]]
            row += start.shape[0]
            for s in range(int(n.max(initial=0))):
                lengths = np.where(n > s, start + s, 0)
                for shard in np.split(lengths, self.shards):  # each shard's slots are planned apart
                    self.read += attention_read_tokens(self.impl, shard, self.table_width, self.page_tokens,
                                                       self.head_dim, self.interpret)
                self.live += int(lengths.sum())
        self.seconds += time.perf_counter() - t0

    @property
    def ratio(self) -> float | None:
        """Tokens read over live tokens (None before any was counted)."""
        return self.read / self.live if self.live else None


def live_paged_attention(q_bhd: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                         plan: LivePlan, k_new_bkd: jax.Array, v_new_bkd: jax.Array, *, block_pages: int
                         ) -> jax.Array:
    """Decode attention over the paged pool with each row's own new key and value (the computation of
    ``dora_jax.kernels.paged_attention.reference_paged_attention`` with ``k_new``, ``v_new``), reading only each
    slot class's live page blocks.

    ``k_pool``, ``v_pool`` are the stacked pool [L, K, N, P, d], read at ``layer`` by the gather itself.
    ``plan``: :func:`live_plan`; ``block_pages``: :func:`live_block_pages`. Returns [B, H, d]."""
    b, h, d = q_bhd.shape
    kv, p = k_pool.shape[1], k_pool.shape[3]
    c, r, _ = plan.tables.shape
    bp = block_pages
    g = h // kv
    f32 = jnp.float32
    scale = 1.0 / math.sqrt(d)
    q = q_bhd.reshape(b, kv, g, d)
    sn = jnp.sum(q.astype(f32) * k_new_bkd[:, :, None].astype(f32), axis=-1) * scale  # [B, K, G]

    def by_class(x):  # [B, ...] -> [C, R, ...] in the plan's order (padding rows repeat slot 0, length 0)
        return x[plan.order].reshape((c, r) + x.shape[1:])

    q_c = by_class(q)
    m0 = by_class(sn)
    l0 = jnp.ones_like(m0)
    acc0 = by_class(jnp.broadcast_to(v_new_bkd[:, :, None].astype(f32), (b, kv, g, d)))

    def body(carry):
        t, m, l, acc = carry
        cls = jnp.sum(t >= plan.starts + plan.blocks).astype(jnp.int32)  # the class whose tiles hold t
        blk = t - plan.starts[cls]
        tab = jax.lax.dynamic_slice_in_dim(plan.tables[cls], blk * bp, bp, axis=1)  # [R, bp]
        k_b = k_pool[layer, :, tab]  # [R, bp, K, P, d]
        v_b = v_pool[layer, :, tab]
        s = jnp.einsum("rkgd,rjkpd->rkgjp", q_c[cls], k_b, preferred_element_type=f32) * scale
        pos = blk * bp * p + jnp.arange(bp * p, dtype=jnp.int32).reshape(bp, p)
        valid = (pos[None] < plan.lengths[cls][:, None, None])[:, None, None]  # [R, 1, 1, bp, P]
        m_old, l_old, acc_old = m[cls], l[cls], acc[cls]
        m_new = jnp.maximum(m_old, jnp.max(jnp.where(valid, s, _MASK_VALUE), axis=(-2, -1)))
        e = jnp.where(valid, jnp.exp(s - m_new[..., None, None]), 0.0)
        alpha = jnp.exp(m_old - m_new)
        l_new = l_old * alpha + jnp.sum(e, axis=(-2, -1))
        pv = jnp.einsum("rkgjp,rjkpd->rkgd", e.astype(v_b.dtype), v_b, preferred_element_type=f32)
        acc_new = acc_old * alpha[..., None] + pv
        return t + 1, m.at[cls].set(m_new), l.at[cls].set(l_new), acc.at[cls].set(acc_new)

    _, _, l, acc = jax.lax.while_loop(lambda carry: carry[0] < plan.tiles, body, (jnp.int32(0), m0, l0, acc0))
    out = (acc / l[..., None]).reshape(c * r, kv, g, d)
    # Back to slot order: padding rows (past B) are dropped by the scatter.
    out = jnp.zeros((b, kv, g, d), f32).at[plan.order[:b]].set(out[:b])
    return out.astype(q_bhd.dtype).reshape(b, h, d)


def sharded_live_plan(tables_bw: jax.Array, lengths_b: jax.Array, page_tokens: int, shards: int = 1) -> LivePlan:
    """:func:`live_plan` of each batch shard's slots (a leading shard axis when ``shards`` > 1)."""
    if shards == 1:
        return live_plan(tables_bw, lengths_b, page_tokens)
    return jax.vmap(lambda t, n: live_plan(t, n, page_tokens))(_shards(tables_bw, shards), _shards(lengths_b, shards))


def sharded_live_attention(q_bhd, k_pool, v_pool, layer, plan, k_new_bkd, v_new_bkd, *, block_pages: int,
                           shards: int = 1):
    """:func:`live_paged_attention` with the slots and pages split into ``shards`` (``plan`` from
    :func:`sharded_live_plan`)."""
    attend = functools.partial(live_paged_attention, block_pages=block_pages)
    if shards == 1:
        return attend(q_bhd, k_pool, v_pool, layer, plan, k_new_bkd, v_new_bkd)
    per_shard = jax.vmap(attend, in_axes=(0, 2, 2, None, 0, 0, 0))
    rows = [_shards(x, shards) for x in (q_bhd, k_new_bkd, v_new_bkd)]
    out = per_shard(rows[0], _shards(k_pool, shards, 2), _shards(v_pool, shards, 2), layer, plan, *rows[1:])
    return out.reshape(q_bhd.shape)


def decode_forward_paged(cfg: ModelConfig, p: dict, tokens_b: jax.Array, positions_b: jax.Array, pool: PagedKV,
                         tables_bw: jax.Array, write_b: jax.Array, *, settings: DecodeSettings = DecodeSettings(),
                         shards: int = 1) -> tuple[jax.Array, PagedKV]:
    """One new token per row against the pool: float32 logits [B, V] and the pool with the tokens' entries.

    Row ``b``'s token sits at ``positions_b[b]`` and attends to the row's tokens ``0 .. position``; its entries
    are written at that position's page where ``write_b`` is on, else to scratch. ``tables_bw`` must cover
    position ``positions_b[b]`` for every written row (the host appends pages before it dispatches). With
    ``shards`` > 1 (the xla path), page ids are within each row's shard."""
    impl = resolve_attention_impl(settings)
    page_b, row_b = slot_pages(tables_bw, positions_b, pool.page_tokens, write_b)
    x0 = embed_tokens(cfg, p["embed"], tokens_b[:, None])
    layers = jnp.arange(pool.k.shape[0], dtype=jnp.int32)
    if impl == "xla":
        # Slots sorted by length once per step; every layer reads only its classes' live page blocks.
        # Rows that do not produce this step read nothing (their output is dropped).
        plan = sharded_live_plan(tables_bw, jnp.where(write_b, positions_b, 0), pool.page_tokens, shards)
        bp = live_block_pages(tables_bw.shape[1], pool.page_tokens, tables_bw.shape[0] // shards)

        def block(x, layer):
            lp, i = layer
            # The pool is closed over, not carried: layers only read it (the gather indexes the layer itself),
            # and it is written once after them.
            q, k, v = qkv_projection(cfg, lp, x, positions_b[:, None])
            att = sharded_live_attention(q[:, 0], pool.k, pool.v, i, plan, k[:, 0], v[:, 0], block_pages=bp,
                                         shards=shards)
            return finish_block(cfg, lp, x, att[:, None]), (k[:, 0], v[:, 0])

        x, (k_new, v_new) = jax.lax.scan(block, x0, (p["layers"], layers))
        pool = write_pages(pool, k_new, v_new, page_b, row_b, shards)
    else:
        if shards != 1:
            raise ValueError(f"attention_impl {impl!r} reads one pool: slots split over {shards} batch shards "
                             "need attention_impl='xla'")
        from dora_jax.kernels.paged_attention import paged_attention

        def block(carry, layer):
            x, pk, pv = carry
            lp, i = layer
            q, k, v = qkv_projection(cfg, lp, x, positions_b[:, None])
            # The kernels read the current token from the pool: write this layer's entry first.
            pk = pk.at[i, :, page_b, row_b].set(k[:, 0].astype(pk.dtype))  # indices apart: updates [B, K, d]
            pv = pv.at[i, :, page_b, row_b].set(v[:, 0].astype(pv.dtype))
            att = paged_attention(q[:, 0], pk[i], pv[i], tables_bw, positions_b + 1, impl=impl,
                                  interpret=settings.pallas_interpret)
            return (finish_block(cfg, lp, x, att[:, None]), pk, pv), None

        (x, pk, pv), _ = jax.lax.scan(block, (x0, pool.k, pool.v), (p["layers"], layers))
        pool = PagedKV(constrain(pk, PagedKV.axes()), constrain(pv, PagedKV.axes()))
    return head_logits(cfg, p, x)[:, 0], pool
