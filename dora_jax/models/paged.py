"""Decode against a paged KV cache: one pool of fixed-size pages shared by every slot, a page table per slot.

The pool is ``[K, L, N, P, d]`` for keys and for values (:class:`PagedKV`); token ``i`` of a slot sits in page
``tables[b, i // P]`` at row ``i % P`` (of every layer). Layers sit next to the pages so that ``[K, L * N, P, d]``
is a view of the same buffer, in which a paged kernel (reading ``[K, N, P, d]`` and page ids) finds layer ``l``'s
page ``t`` at ``l * N + t`` (docs/rollout.md, 'Paged KV cache'). For the ragged TPU kernel the pool is
:class:`InterleavedKV` ``[L, N, P, 2K, d]``, read the same way. Page 0 (of each shard) is scratch: it belongs to no
slot, takes the writes that must land nowhere, and table entries past a slot's pages point there. On a mesh that
splits the slots over S batch shards, the pages split the same way, tables hold page ids within the slot's shard,
and slot ``b`` of B is in shard ``b // (B / S)``; the pool's layout on a mesh is its owner's to pin (the engine's,
``DecodePrograms.pool_layout``). Entry point: :func:`decode_forward_paged`. See docs/rollout.md,
'How a decode step runs' and 'Paged KV cache'.

Shapes: B slots, H query heads, K kv heads, G = H // K, d head dim, N pages, P tokens per page, W pages per
table, L layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from dora_jax.config import ModelConfig
from dora_jax.kernels.paged_attention import (LIVE_TILE_GROUPS, RAGGED_IMPL, LivePlan, compute_block_pages,
                                              live_block_pages, live_paged_attention, live_plan, live_read_tokens,
                                              live_step_reads, paged_attention, ragged_paged_attention)
from dora_jax.models.decoder import (DecodeSettings, decoder_layers, embed_tokens, head_logits,
                                     resolve_attention_impl)
from dora_jax.sharding import Rules, mesh_axes

SCRATCH_PAGE = 0


class PagedKV(NamedTuple):
    """Every layer's pages, keys and values apart: ``k`` and ``v`` [K, L, N, P, d] (every attention choice but
    ``pallas_tpu_ragged``). A pool of M pages is also how pages travel between engines (:meth:`take`)."""

    k: jax.Array
    v: jax.Array

    # The kv-head axis (of the pool, of :meth:`layer_view`), and the entries each kv head has on it.
    HEAD_AXIS, VIEW_HEAD_AXIS, HEAD_ENTRIES = 0, 0, 1

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

    def take(self, pages_m: jax.Array) -> PagedKV:
        """Pages ``pages_m`` of every layer, in order: a pool of M pages."""
        return PagedKV(self.k[:, :, pages_m], self.v[:, :, pages_m])

    def put(self, pages_m: jax.Array, rows: PagedKV) -> PagedKV:
        """This pool with pages ``pages_m`` set to the M pages of ``rows`` (:meth:`take` of a pool like it)."""
        return PagedKV(*(x.at[:, :, pages_m].set(r.astype(x.dtype)) for x, r in zip(self, rows)))

    def write_tokens(self, k_lbkd, v_lbkd, page_b, row_b, shards: int = 1) -> PagedKV:
        def write(pages, new, page, row):
            # Advanced indices on adjacent axes 2, 3 keep their place: updates are [K, L, B, d].
            return pages.at[:, :, page, row].set(new.transpose(2, 0, 1, 3).astype(pages.dtype))

        if shards == 1:
            return PagedKV(write(self.k, k_lbkd, page_b, row_b), write(self.v, v_lbkd, page_b, row_b))
        per_shard = jax.vmap(write, in_axes=(2, 1, 0, 0), out_axes=2)
        page_s, row_s = _shards(page_b, shards), _shards(row_b, shards)
        return PagedKV(*(per_shard(_shards(x, shards, 2), _shards(new, shards, 1), page_s, row_s).reshape(x.shape)
                         for x, new in ((self.k, k_lbkd), (self.v, v_lbkd))))

    def write_prompts(self, k_lrktd, v_lrktd, page_rt, row_rt) -> PagedKV:
        return PagedKV(*(x.at[:, :, page_rt, row_rt].set(new.transpose(2, 0, 1, 3, 4).astype(x.dtype))
                         for x, new in ((self.k, k_lrktd), (self.v, v_lrktd))))

    def layer_view(self) -> PagedKV:
        """Every layer's pages on one page axis, ``[K, L * N, P, d]`` (a view of the same buffers): layer ``l``'s
        page ``t`` is page ``l * N + t``, in the layout the ``[K, N, P, d]`` kernels read."""
        return PagedKV(*(x.reshape(x.shape[0], -1, *x.shape[3:]) for x in self))

    @staticmethod
    def write_view_token(view: PagedKV, k_bkd, v_bkd, page_b, row_b) -> PagedKV:
        """One token per row into :meth:`layer_view` at (page, row) [B]; indices on adjacent axes 1, 2: updates
        [K, B, d]."""
        return PagedKV(*(x.at[:, page_b, row_b].set(new.swapaxes(0, 1).astype(x.dtype))
                         for x, new in ((view.k, k_bkd), (view.v, v_bkd))))


def interleave_heads(k: jax.Array, v: jax.Array) -> jax.Array:
    """``[..., K, d]`` keys and values as ``[..., 2K, d]``: kv head ``h``'s key at ``2h``, its value at
    ``2h + 1``."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


class InterleavedKV(NamedTuple):
    """Every layer's pages with each kv head's key and value side by side: ``kv`` [L, N, P, 2K, d]
    (:func:`interleave_heads`), the layout ``ragged_paged_attention`` (``pallas_tpu_ragged``) reads, as the view
    ``[L * N, P, 2K, d]``."""

    kv: jax.Array

    # A tensor shard of the 2K axis must hold whole (key, value) pairs: it is split only where K divides.
    HEAD_AXIS, VIEW_HEAD_AXIS, HEAD_ENTRIES = 3, 2, 2

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        return ("layers", "batch", None, "act_kv_heads", None)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def page_tokens(self) -> int:
        return self.kv.shape[2]

    def take(self, pages_m: jax.Array) -> InterleavedKV:
        return InterleavedKV(self.kv[:, pages_m])

    def put(self, pages_m: jax.Array, rows: InterleavedKV) -> InterleavedKV:
        return InterleavedKV(self.kv.at[:, pages_m].set(rows.kv.astype(self.kv.dtype)))

    def write_tokens(self, k_lbkd, v_lbkd, page_b, row_b, shards: int = 1) -> InterleavedKV:
        if shards != 1:
            raise ValueError(f"an interleaved pool takes a decode step's entries per batch shard in the ragged "
                             f"kernel's step (_kernel_per_batch_shard), not here ({shards} batch shards)")
        # Advanced indices on adjacent axes 1, 2: updates [L, B, 2K, d].
        return InterleavedKV(self.kv.at[:, page_b, row_b].set(interleave_heads(k_lbkd, v_lbkd).astype(self.kv.dtype)))

    def write_prompts(self, k_lrktd, v_lrktd, page_rt, row_rt) -> InterleavedKV:
        new = interleave_heads(k_lrktd.swapaxes(2, 3), v_lrktd.swapaxes(2, 3))  # [L, R, T, 2K, d]
        return InterleavedKV(self.kv.at[:, page_rt, row_rt].set(new.astype(self.kv.dtype)))

    def layer_view(self) -> InterleavedKV:
        return InterleavedKV(self.kv.reshape(-1, *self.kv.shape[2:]))

    @staticmethod
    def write_view_token(view: InterleavedKV, k_bkd, v_bkd, page_b, row_b) -> InterleavedKV:
        return InterleavedKV(view.kv.at[page_b, row_b].set(interleave_heads(k_bkd, v_bkd).astype(view.kv.dtype)))


Pool = PagedKV | InterleavedKV


def init_pages(cfg: ModelConfig, num_pages: int, page_tokens: int, dtype: str | None = None,
               impl: str = "xla") -> Pool:
    """A zero pool of ``num_pages`` pages (page 0, scratch, included), laid out for the attention ``impl``."""
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    kv, layers, d = cfg.num_kv_heads, cfg.num_layers, cfg.head_dim
    if impl == RAGGED_IMPL:
        return InterleavedKV(jnp.zeros((layers, num_pages, page_tokens, 2 * kv, d), dt))
    shape = (kv, layers, num_pages, page_tokens, d)
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


def write_pages(pool: Pool, k_lbkd: jax.Array, v_lbkd: jax.Array, page_b: jax.Array, row_b: jax.Array,
                shards: int = 1) -> Pool:
    """Writes one token per row (``k``, ``v`` [L, B, K, d]), every layer, with one scatter per tensor (in place
    when the pool is donated). ``page_b`` are page ids within each row's shard."""
    return pool.write_tokens(k_lbkd, v_lbkd, page_b, row_b, shards)


def write_prompt_pages(pool: Pool, k_lrktd: jax.Array, v_lrktd: jax.Array, page_rt: jax.Array,
                       row_rt: jax.Array) -> Pool:
    """Writes prompts' entries (``k``, ``v`` [L, R, K, T, d]) at (page, row) per token [R, T]."""
    return pool.write_prompts(k_lrktd, v_lrktd, page_rt, row_rt)


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


def attention_step_reads(impl: str, shards: list, table_width: int, page_tokens: int, head_dim: int,
                         interpret: bool = False, apart: bool = False) -> tuple[int, list[int]]:
    """Cached tokens one layer's decode attention reads for batch shards of slots of these lengths (numpy,
    host), by the path ``impl`` takes, and the trips each of its loops takes: the live-reading XLA path's tile
    groups (:func:`~dora_jax.kernels.paged_attention.live_step_reads`; ``apart``: the shards loop on devices of
    their own, :func:`shards_apart`); none for a kernel, which launches once."""
    if impl == "xla":
        return live_step_reads(shards, table_width, page_tokens, apart=apart)
    return sum(attention_read_tokens(impl, x, table_width, page_tokens, head_dim, interpret) for x in shards), []


class ReadCounter:
    """Cached tokens a decode attention path reads (``read``) against the live tokens it has to read (``live``),
    per layer, and the loop trips it takes (``trips``; per loop, ``loop_trips``) over the decode ``steps``,
    counted on the host from each program's results (the benchmarks' ``kv_read_ratio`` and
    ``attention_trips_per_step``)."""

    def __init__(self, impl: str, shards: int, table_width: int, page_tokens: int, head_dim: int,
                 interpret: bool = False, apart: bool = False):
        self.impl, self.shards, self.table_width, self.page_tokens = impl, shards, table_width, page_tokens
        self.head_dim, self.interpret, self.apart = head_dim, interpret, apart
        self.reset()

    def reset(self) -> None:
        """Counts back to zero."""
        self.read = self.live = self.trips = self.steps = 0
        self.loop_trips = [0] * (len(LIVE_TILE_GROUPS) if self.impl == "xla" else 0)
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
                read, trips = attention_step_reads(self.impl, np.split(lengths, self.shards), self.table_width,
                                                   self.page_tokens, self.head_dim, self.interpret, self.apart)
                self.read += read
                self.trips += sum(trips)
                self.loop_trips = [a + b for a, b in zip(self.loop_trips, trips)]
                self.live += int(lengths.sum())
                self.steps += 1
        self.seconds += time.perf_counter() - t0

    @property
    def ratio(self) -> float | None:
        """Tokens read over live tokens (None before any was counted)."""
        return self.read / self.live if self.live else None

    @property
    def trips_per_step(self) -> float | None:
        """Attention loop trips per layer and decode step (None before any step was counted)."""
        return self.trips / self.steps if self.steps else None

    @property
    def loop_trips_per_step(self) -> list[float] | None:
        """:attr:`trips_per_step` per loop of the attention, in program order (None before any step)."""
        return [t / self.steps for t in self.loop_trips] if self.steps else None


def sharded_live_plan(tables_bw: jax.Array, lengths_b: jax.Array, page_tokens: int, shards: int = 1) -> LivePlan:
    """:func:`live_plan` of each batch shard's slots (a leading shard axis when ``shards`` > 1)."""
    if shards == 1:
        return live_plan(tables_bw, lengths_b, page_tokens)
    return jax.vmap(lambda t, n: live_plan(t, n, page_tokens))(_shards(tables_bw, shards), _shards(lengths_b, shards))


def sharded_live_attention(q_bhd, k_pool, v_pool, layer, plan, k_new_bkd, v_new_bkd, *, block_pages: int,
                           shards: int = 1, mesh_rules: tuple[Mesh, Rules] | None = None):
    """:func:`live_paged_attention` with the slots and pages split into ``shards`` (``plan`` from
    :func:`sharded_live_plan`). Where the mesh's batch axes make the shards (``mesh_rules``, the engine's case),
    each device runs its own shard's loops (``shard_map``); otherwise the shards' loops run side by side
    (vmapped), each as long as the slowest (docs/rollout.md, 'Decode attention over pages')."""
    attend = functools.partial(live_paged_attention, block_pages=block_pages)
    if shards == 1:
        return attend(q_bhd, k_pool, v_pool, layer, plan, k_new_bkd, v_new_bkd)
    per_shard = jax.vmap(attend, in_axes=(0, 2, 2, None, 0, 0, 0))
    rows = [_shards(x, shards) for x in (q_bhd, k_new_bkd, v_new_bkd)]
    args = (rows[0], _shards(k_pool, shards, 2), _shards(v_pool, shards, 2), layer, plan, *rows[1:])
    out = _per_batch_shard(per_shard, mesh_rules, shards, args) if mesh_rules is not None else per_shard(*args)
    return out.reshape(q_bhd.shape)


def shards_apart(mesh: Mesh | None, rules: Rules, shards: int) -> bool:
    """Whether :func:`sharded_live_attention` runs each of ``shards`` batch shards' loops on its own devices
    (the mesh's batch axes make exactly those shards) rather than side by side."""
    return mesh is not None and shards > 1 and mesh_axes("batch", mesh, rules)[1] == shards


def _batch_and_head_axes(mesh: Mesh, rules: Rules, kv_heads: int, q_heads: int):
    """The mesh axes (a name, a tuple of names, or None) that split the slots' batch shards, and those that split
    the kv heads (and the query heads alike) where they divide both: what a ``shard_map`` over them takes."""
    batch = mesh_axes("batch", mesh, rules)[0]
    names, n = mesh_axes("act_kv_heads", mesh, rules)
    split = n > 1 and kv_heads % n == 0 and q_heads % n == 0
    return (batch if len(batch) > 1 else batch[0]), ((names if len(names) > 1 else names[0]) if split else None)


def _per_batch_shard(per_shard, mesh_rules: tuple[Mesh, Rules], shards: int, args: tuple):
    """``per_shard(q, k, v, layer, plan, k_new, v_new)`` (shard-leading operands) under ``shard_map`` over the
    mesh's batch axes, and its kv heads over the head axes where they divide them: each device loops over its
    own shard's tiles (docs/rollout.md, 'A step reads only live tokens'). As is where the batch axes are not the
    shards."""
    mesh, rules = mesh_rules
    if not shards_apart(mesh, rules, shards):
        return per_shard(*args)
    b, h = _batch_and_head_axes(mesh, rules, args[1].shape[0], args[0].shape[2])
    rows_spec = PartitionSpec(b, None, h, None)  # [S, B / S, heads, d]
    pool_spec = PartitionSpec(h, None, b, None, None, None)  # [K, L, S, N / S, P, d]
    plan_spec = jax.tree.map(lambda _: PartitionSpec(b), args[4])
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(rows_spec, pool_spec, pool_spec, PartitionSpec(), plan_spec,
                                                         rows_spec, rows_spec),
                         out_specs=rows_spec, check_vma=False)(*args)


def _per_head_shard(call, mesh_rules, head_axis: int, entries: int, q_bhd, pages: tuple, tables_bw, lengths_b):
    """``call(q, *pages, tables, lengths)`` once per shard of the kv heads over the mesh's head axes (query heads
    split alike), through ``shard_map`` (docs/rollout.md, 'Decode attention over pages'). ``pages`` hold each kv
    head's ``entries`` side by side on ``head_axis``. One call where heads are not split: no mesh, one shard, or
    kv heads the axes do not divide."""
    if mesh_rules is None:
        return call(q_bhd, *pages, tables_bw, lengths_b)
    mesh, rules = mesh_rules
    names, n = mesh_axes("act_kv_heads", mesh, rules)
    if n == 1 or (pages[0].shape[head_axis] // entries) % n or q_bhd.shape[1] % n:
        return call(q_bhd, *pages, tables_bw, lengths_b)
    axis = names if len(names) > 1 else names[0]
    page_spec = PartitionSpec(*(axis if i == head_axis else None for i in range(pages[0].ndim)))
    q_spec = PartitionSpec(None, axis, None)
    return jax.shard_map(call, mesh=mesh, in_specs=(q_spec, *(page_spec,) * len(pages), PartitionSpec(),
                                                     PartitionSpec()),
                         out_specs=q_spec, check_vma=False)(q_bhd, *pages, tables_bw, lengths_b)


def _kernel_per_batch_shard(call, mesh_rules: tuple[Mesh, Rules], pool: Pool, q_bhd, k_bkd, v_bkd, layer,
                            page_b, row_b, tables_bw, lengths_b) -> tuple[jax.Array, Pool]:
    """Layer ``layer``'s new entries written at (page, row) and the kernel ``call(q, *view, tables, lengths)``
    over the pool's ``layer_view``, once per device (``shard_map``): each holds one batch shard's slots and pages
    (its tables hold page ids within the shard), and its own kv heads where the tensor axes divide them.
    Returns the attention [B, H, d] and the pool."""
    mesh, rules = mesh_rules
    kinds = type(pool)
    b, h = _batch_and_head_axes(mesh, rules, pool[0].shape[pool.HEAD_AXIS] // pool.HEAD_ENTRIES, q_bhd.shape[1])
    axis = {"batch": b, "act_kv_heads": h}
    pool_spec = PartitionSpec(*(axis.get(a) for a in pool.axes()))
    rows, vec = PartitionSpec(axis["batch"], axis["act_kv_heads"], None), PartitionSpec(axis["batch"])

    def local(q, k, v, i, page, row, tables, lengths, *arrays):
        here = kinds(*arrays)
        m = here.num_pages  # this shard's pages: its tables' ids are within them
        view = kinds.write_view_token(here.layer_view(), k, v, page + i * m, row)
        att = call(q, *view, tables + i * m, lengths)
        return att, *(a.reshape(b.shape) for a, b in zip(view, here))

    att, *arrays = jax.shard_map(
        local, mesh=mesh, in_specs=(rows, rows, rows, PartitionSpec(), vec, vec, PartitionSpec(axis["batch"], None),
                                    vec) + (pool_spec,) * len(pool),
        out_specs=(rows,) + (pool_spec,) * len(pool), check_vma=False)(q_bhd, k_bkd, v_bkd, layer, page_b, row_b,
                                                                      tables_bw, lengths_b, *pool)
    return att, kinds(*arrays)


def decode_forward_paged(cfg: ModelConfig, p: dict, tokens_b: jax.Array, positions_b: jax.Array, pool: Pool,
                         tables_bw: jax.Array, write_b: jax.Array, *, settings: DecodeSettings = DecodeSettings(),
                         shards: int = 1, mesh_rules: tuple[Mesh, Rules] | None = None) -> tuple[jax.Array, Pool]:
    """One new token per row against the pool: float32 logits [B, V] and the pool with the tokens' entries.

    Row ``b``'s token sits at ``positions_b[b]`` and attends to the row's tokens ``0 .. position``; its entries
    are written at that position's page where ``write_b`` is on, else to scratch. ``tables_bw`` must cover
    position ``positions_b[b]`` for every written row (the host appends pages before it dispatches). With
    ``shards`` > 1, page ids are within each row's shard. ``mesh_rules``: the mesh the engine runs on and its
    rules, with which the attention runs per device: per batch shard where the batch axes make the shards
    (required then for a kernel), and per shard of the kv heads."""
    impl = resolve_attention_impl(settings)
    if isinstance(pool, InterleavedKV) != (impl == RAGGED_IMPL):
        raise ValueError(f"attention_impl {impl!r} cannot read a {type(pool).__name__} pool: "
                         "init_pages(..., impl=) lays the pool out for its attention")
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
                                         shards=shards, mesh_rules=mesh_rules)
            return att[:, None], state

        x, _, (k_new, v_new) = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, collect_kv=True)
        pool = write_pages(pool, k_new[:, :, 0], v_new[:, :, 0], page_b, row_b, shards)
    elif shards != 1:
        if mesh_rules is None or not shards_apart(*mesh_rules, shards):
            raise ValueError(f"attention_impl {impl!r} with slots split over {shards} batch shards: a kernel runs "
                             "per batch shard, on a mesh whose batch axes make the shards (mesh_rules); or use "
                             "attention_impl='xla'")
        call = (ragged_paged_attention if impl == RAGGED_IMPL
                else functools.partial(paged_attention, impl=impl, interpret=settings.pallas_interpret))

        def attend(q, k, v, i, pool):
            att, pool = _kernel_per_batch_shard(call, mesh_rules, pool, q[:, 0], k[:, 0], v[:, 0], i, page_b, row_b,
                                                tables_bw, positions_b + 1)
            return att[:, None], pool

        x, pool, _ = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, state=pool)
    else:
        n, view = pool.num_pages, pool.layer_view()
        call = (ragged_paged_attention if impl == RAGGED_IMPL
                else functools.partial(paged_attention, impl=impl, interpret=settings.pallas_interpret))

        def attend(q, k, v, i, view):
            page_i, tables_i = page_b + i * n, tables_bw + i * n  # layer i's pages in the view
            # The kernels read the current token from the pool: write this layer's entry first, so the pool is
            # the layers' carry.
            view = view.write_view_token(view, k[:, 0], v[:, 0], page_i, row_b)
            att = _per_head_shard(call, mesh_rules, view.VIEW_HEAD_AXIS, view.HEAD_ENTRIES, q[:, 0], tuple(view),
                                  tables_i, positions_b + 1)
            return att[:, None], view

        x, view, _ = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, state=view)
        pool = type(pool)(*(a.reshape(b.shape) for a, b in zip(view, pool)))
    return head_logits(cfg, p, x)[:, 0], pool
