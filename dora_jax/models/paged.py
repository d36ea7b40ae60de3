"""Decode against a paged KV cache: one pool of fixed-size pages shared by every slot, a page table per slot.

The pool is ``[K, L, N, P, d]`` for keys and for values; token ``i`` of a slot sits in page ``tables[b, i // P]``
at row ``i % P`` (of every layer). Layers sit next to the pages so that ``[K, L * N, P, d]`` is a view of the
same buffer: a paged kernel, which reads ``[K, N, P, d]`` and page ids, reads layer ``l`` in place through page
ids offset by ``l * N``; handing it a layer slice of an ``[L, ...]`` pool would make XLA copy that layer's
pages before every call (a custom call takes whole buffers). Page 0 (of each shard) is scratch: it belongs to no slot, takes the writes that must land
nowhere, and table entries past a slot's pages point there. On a mesh that splits the slots over S batch shards,
the pages split the same way, tables hold page ids within the slot's shard, and slot ``b`` of B is in shard
``b // (B / S)``. Entry point: :func:`decode_forward_paged`. See docs/rollout.md, 'How a decode step runs' and
'Paged KV cache'.

Shapes: B slots, H query heads, K kv heads, G = H // K, d head dim, N pages, P tokens per page, W pages per
table, L layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.kernels.paged_attention import (LivePlan, compute_block_pages, live_block_pages, live_paged_attention,
                                              live_plan, live_read_tokens, paged_attention)
from dora_jax.models.decoder import (DecodeSettings, decoder_layers, embed_tokens, head_logits,
                                     resolve_attention_impl)
from dora_jax.sharding import constrain

SCRATCH_PAGE = 0


class PagedKV(NamedTuple):
    """Every layer's pages: ``k`` and ``v`` [K, L, N, P, d]."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        # Pages split over the batch axes as the slots do (memory per device falls with the batch shards; a
        # slot holds pages of its own shard only), heads over the tensor axes.
        return ("act_kv_heads", "layers", "batch", None, None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_tokens(self) -> int:
        return self.k.shape[3]


def init_pages(cfg: ModelConfig, num_pages: int, page_tokens: int, dtype: str | None = None) -> PagedKV:
    """A zero pool of ``num_pages`` pages (page 0, scratch, included)."""
    shape = (cfg.num_kv_heads, cfg.num_layers, num_pages, page_tokens, cfg.head_dim)
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
        # Advanced indices on adjacent axes 2, 3 keep their place: updates are [K, L, B, d].
        return pages.at[:, :, page, row].set(new.transpose(2, 0, 1, 3).astype(pages.dtype))

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
    k = pool.k.at[:, :, page_rt, row_rt].set(k_lrktd.transpose(2, 0, 1, 3, 4).astype(pool.k.dtype))
    v = pool.v.at[:, :, page_rt, row_rt].set(v_lrktd.transpose(2, 0, 1, 3, 4).astype(pool.v.dtype))
    return PagedKV(constrain(k, PagedKV.axes()), constrain(v, PagedKV.axes()))


def attention_read_tokens(impl: str, lengths, table_width: int, page_tokens: int, head_dim: int,
                          interpret: bool = False) -> int:
    """Cached tokens one layer's decode attention reads for slots of ``lengths`` (numpy, host), by the path
    ``impl`` takes (``kv_read_ratio`` is this over the live tokens)."""
    import numpy as np

    if impl == "xla":
        return live_read_tokens(lengths, table_width, page_tokens)
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
    x0, positions_bt = embed_tokens(cfg, p["embed"], tokens_b[:, None]), positions_b[:, None]
    if impl == "xla":
        # Slots sorted by length once per step; every layer reads only its classes' live page blocks.
        # Rows that do not produce this step read nothing (their output is dropped).
        plan = sharded_live_plan(tables_bw, jnp.where(write_b, positions_b, 0), pool.page_tokens, shards)
        bp = live_block_pages(tables_bw.shape[1], pool.page_tokens, tables_bw.shape[0] // shards)

        def attend(q, k, v, i, state):
            # The pool is closed over, not carried: layers only read it (the gather indexes the layer itself),
            # and it is written once after them.
            att = sharded_live_attention(q[:, 0], pool.k, pool.v, i, plan, k[:, 0], v[:, 0], block_pages=bp,
                                         shards=shards)
            return att[:, None], state

        x, _, (k_new, v_new) = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, collect_kv=True)
        pool = write_pages(pool, k_new[:, :, 0], v_new[:, :, 0], page_b, row_b, shards)
    else:
        if shards != 1:
            raise ValueError(f"attention_impl {impl!r} reads one pool: slots split over {shards} batch shards "
                             "need attention_impl='xla'")

        n = pool.num_pages
        # Every layer's pages as one page axis (a view): layer i's page t is page i * N + t.
        flat = tuple(a.reshape(a.shape[0], -1, *a.shape[3:]) for a in pool)

        def attend(q, k, v, i, pages):
            pk, pv = pages
            page_i = page_b + i * n
            # The kernels read the current token from the pool: write this layer's entry first, so the pool is
            # the layers' carry. Indices on adjacent axes 1, 2: updates [K, B, d].
            pk = pk.at[:, page_i, row_b].set(k[:, 0].swapaxes(0, 1).astype(pk.dtype))
            pv = pv.at[:, page_i, row_b].set(v[:, 0].swapaxes(0, 1).astype(pv.dtype))
            att = paged_attention(q[:, 0], pk, pv, tables_bw + i * n, positions_b + 1, impl=impl,
                                  interpret=settings.pallas_interpret)
            return att[:, None], (pk, pv)

        x, flat, _ = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, state=flat)
        pool = PagedKV(*(constrain(a.reshape(pool.k.shape), PagedKV.axes()) for a in flat))
    return head_logits(cfg, p, x)[:, 0], pool
