"""The device programs of the rollout engine (:class:`~dora_jax.rollout.engine.Engine`): prefill, insertion,
decode steps over the page pool, and resizing, as pure functions of arrays (:class:`DecodePrograms`) that the
engine jits; no host state.

Shapes: B slots, T prompt bucket, S a prompt's cache length (prefill), W pages per table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import ModelConfig
from dora_jax.models.decoder import (DecodeSettings, KVCache, decode_forward, fuse_layer_params, head_logits,
                                     init_cache, resolve_attention_impl)
from dora_jax.models.paged import Pool, decode_forward_paged, init_pages, write_prompt_pages
from dora_jax.rollout.engine_api import DecodeState, PreparedParams, PrefixBatch
from dora_jax.rollout.sampling import SamplingParams, row_keys, sample
from dora_jax.sharding import Rules, logical_to_spec, serial_jit


def _pack(tokens, valid, positions, logprobs, versions) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
    return jnp.stack([tokens, valid.astype(jnp.int32), positions, bits, versions], axis=-1)


def fitting_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules, shape: Sequence[int]) -> NamedSharding:
    """``axes`` mapped through ``rules`` onto ``mesh``, each dimension sharded only where its mesh axes divide it
    (a decode state of 1 slot on a data axis of 2 keeps its rows whole and still splits its heads)."""
    spec = logical_to_spec(axes, rules)
    out = []
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(a for a in names if a in mesh.shape)  # rules may name axes this mesh does not have
        out.append((names if len(names) > 1 else names[0]) if names and size % int(
            np.prod([mesh.shape[a] for a in names])) == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*out))


def pool_shardings(mesh: Mesh, rules: Rules, pool: Pool, split_pages: bool = True) -> Pool:
    """The page pool's layout on ``mesh`` (:meth:`PagedKV.axes` of its kind), one sharding per array: kv heads
    over the tensor axes where they divide (whole heads, and whole (key, value) pairs of an interleaved pool);
    pages over the batch axes where they divide and ``split_pages``."""
    axes = tuple(None if a == "batch" and not split_pages else a for a in pool.axes())

    def one(x):
        shape = list(x.shape)
        shape[pool.HEAD_AXIS] //= pool.HEAD_ENTRIES  # what must divide: kv heads, not their entries
        return fitting_sharding(mesh, axes, rules, shape)

    return type(pool)(*(one(x) for x in pool))


@dataclasses.dataclass(frozen=True)
class DecodePrograms:
    """The engine's programs for one architecture served in one dtype (``cfg``) with its serving ``settings``.

    A value: two engines of equal programs share one jitted copy of each (:func:`jitted_programs`).

    Args:
      cfg: the architecture as the engine runs it (weights and compute in the engine's dtype).
      settings: how decode reads the cache (:class:`~dora_jax.models.decoder.DecodeSettings`).
      max_target_length: cache length per slot; a full row's position stays below it.
      shards: the batch shards the slots split into (each with pages of its own).
      page_tokens: tokens per page; ``pool_pages``: pages in the pool, every shard's scratch page included.
      mesh, rules: where the state lives and how its logical axes map to the mesh; ``spans_processes``: whether
        the mesh holds devices of several processes (then every program pins the layouts).
    """

    cfg: ModelConfig
    settings: DecodeSettings
    _: dataclasses.KW_ONLY
    max_target_length: int
    shards: int
    page_tokens: int
    pool_pages: int
    mesh: Mesh | None
    rules: Rules
    spans_processes: bool

    def new_pool(self) -> Pool:
        return init_pages(self.cfg, self.pool_pages, self.page_tokens, impl=resolve_attention_impl(self.settings))

    def zeros(self, b: int) -> DecodeState:
        def z():  # distinct buffers: the state is donated
            return jnp.zeros((b,), jnp.int32)

        return DecodeState(z(), z(), z(), z(), z(), jnp.zeros((b,), bool), SamplingParams.make(b))

    def pin(self, state: DecodeState) -> DecodeState:
        """A decode state in its layout on the mesh (as is without one): the same layout in and out of every
        program, so donation reuses the buffers and warm-up's programs are the ones later calls find."""
        if self.mesh is None:
            return state

        def rows(x):
            return fitting_sharding(self.mesh, ("batch",), self.rules, x.shape)

        shardings = DecodeState(*(rows(x) for x in state[:6]), SamplingParams(*(rows(x) for x in state.sampling)))
        return jax.lax.with_sharding_constraint(state, shardings)

    def pool_layout(self, pool: Pool) -> Pool:
        """The page pool's shardings on the mesh: KV heads over the tensor axes; pages over the batch axes for
        the XLA attention, and for a kernel only where the slots split over them too (docs/rollout.md)."""
        split = self.shards > 1 or resolve_attention_impl(self.settings) == "xla"
        return pool_shardings(self.mesh, self.rules, pool, split_pages=split)

    def pin_pool(self, pool: Pool) -> Pool:
        """The page pool in one layout on the mesh (:meth:`pool_layout`)."""
        if self.mesh is None:
            return pool
        return jax.lax.with_sharding_constraint(pool, self.pool_layout(pool))

    def readable(self, packed: jax.Array) -> jax.Array:
        """Results the host reads, replicated on a mesh spanning processes (each process reads its own copy)."""
        if not self.spans_processes:
            return packed
        return jax.lax.with_sharding_constraint(packed, NamedSharding(self.mesh, PartitionSpec()))

    def prefill_rows(self, params: PreparedParams, tokens_pt, lengths_p, prefix: KVCache | None = None):
        """The model part of :meth:`prefill_batch`: each distinct prompt's cache and last-token logits.

        With ``prefix`` (a shared prefix's cache of n slots), the T tokens are what follows it, at positions
        n .. n + T - 1, attending to it; each row's cache is the prefix's n slots followed by its own T.
        ``lengths_p`` counts the tokens given here."""
        p, t = tokens_pt.shape
        # The prompts' cache is T (or n + T) slots long, not S: insertion writes each row's first slots.
        cache, n = init_cache(self.cfg, p, t), 0
        if prefix is not None:
            n = prefix.v.shape[3]
            rows = lambda x: jnp.broadcast_to(x, x.shape[:1] + (p,) + x.shape[2:])  # noqa: E731
            cache = KVCache(jnp.concatenate([rows(prefix.k), cache.k], axis=4),
                            jnp.concatenate([rows(prefix.v), cache.v], axis=3))
        positions = jnp.broadcast_to(n + jnp.arange(t, dtype=jnp.int32), (p, t))
        x, cache = decode_forward(self.cfg, params.tree, tokens_pt, positions, cache, logits=False,
                                  settings=self.settings)
        last_x = jnp.take_along_axis(x, (lengths_p - 1)[:, None, None], axis=1)  # [P, 1, D]
        return cache, head_logits(self.cfg, params.tree, last_x)[:, 0]  # the head on one row per prompt

    def shared_prefix(self, params: PreparedParams, tokens_n):
        n = tokens_n.shape[0]
        _, cache = decode_forward(self.cfg, params.tree, tokens_n[None], jnp.arange(n, dtype=jnp.int32)[None],
                                  init_cache(self.cfg, 1, n), logits=False, settings=self.settings)
        return cache

    def prefill_batch(self, params: PreparedParams, tokens_pt, lengths_p, prefix: KVCache | None, positions_p,
                      rows_n, valid_n, sample_ids_n, version, seeds_n, sampling_n):
        """:meth:`prefill_rows`, then each request's first token sampled from its prompt's row (``rows_n``) at
        ``positions_p`` (its prompt's whole length): one program per admission. Returns (cache, the
        :class:`PrefixBatch` fields after the cache, packed first-token results)."""
        cache, logits = self.prefill_rows(params, tokens_pt, lengths_p, prefix)
        rest, packed = self.first_tokens(logits, positions_p, rows_n, valid_n, sample_ids_n, version, seeds_n,
                                         sampling_n)
        return cache, rest, packed

    def first_tokens(self, logits_pv, lengths_p, rows_n, valid_n, sample_ids_n, version, seeds_n, sampling_n):
        """The sampling part of :meth:`prefill_batch`."""
        lengths_n = lengths_p[rows_n]
        keys = jax.vmap(lambda s, i, q: row_keys(s, i[None], q[None])[0])(seeds_n, sample_ids_n, lengths_n)
        tok, lp = sample(logits_pv[rows_n], keys, sampling_n)
        versions_n = jnp.full(rows_n.shape, version, jnp.int32)
        rest = (rows_n, tok, lp, lengths_n, sample_ids_n, versions_n, sampling_n, seeds_n)  # PrefixBatch order
        return rest, self.readable(_pack(tok, valid_n, lengths_n, lp, versions_n))

    def write_prompts(self, cache: KVCache, rows_n, pool: Pool, page_nt, row_nt) -> Pool:
        """Writes each inserted request's prompt entries (its cache row ``rows_n[i]``) at (page, row) per token
        (scratch for what it does not write: padding, pages it shares with a request before it). Compiled per
        (distinct prompts, prompt bucket): the request count is fixed per engine."""
        k_rows = cache.k[:, rows_n].swapaxes(3, 4)  # [L, N, K, T, d]
        return self.pin_pool(write_prompt_pages(pool, k_rows, cache.v[:, rows_n], page_nt, row_nt))

    def set_slots(self, batch: PrefixBatch, state: DecodeState, slots_n) -> DecodeState:
        """Sets each inserted request's slot (``batch.cache`` is not read). Slot B (out of range) marks a request
        that is not inserted. Compiled per decode-state capacity."""
        def put(vec, values):
            return vec.at[slots_n].set(values.astype(vec.dtype), mode="drop")

        return self.pin(DecodeState(
            tokens=put(state.tokens, batch.token), positions=put(state.positions, batch.length),
            sample_ids=put(state.sample_ids, batch.sample_id), versions=put(state.versions, batch.version),
            seeds=put(state.seeds, batch.seed), active=put(state.active, jnp.ones(slots_n.shape, bool)),
            sampling=SamplingParams(*(put(a, b) for a, b in zip(state.sampling, batch.sampling)))))

    def decode_step(self, params: PreparedParams, state: DecodeState, pool: Pool, tables, write,
                     filtered: bool | None):
        """One step's model and sampling for every slot: (new pool, sampled tokens, their log-probs, the
        position of each sampled token, held below the cache length). Rows where ``write`` is off write their
        entries to scratch."""
        logits, pool = decode_forward_paged(self.cfg, params.tree, state.tokens, state.positions, pool, tables,
                                            write, settings=self.settings, shards=self.shards,
                                            mesh_rules=None if self.mesh is None else (self.mesh, self.rules))
        nxt = state.positions + 1
        keys = jax.vmap(lambda s, i, p: row_keys(s, i[None], p[None])[0])(state.seeds, state.sample_ids, nxt)
        tokens, logprobs = sample(logits, keys, state.sampling, filtered)
        # A full row stops advancing (the driver finishes it with reason "length" before that matters).
        return self.pin_pool(pool), tokens, logprobs, jnp.minimum(nxt, self.max_target_length - 1)

    def generate_steps(self, params_seq, states_seq, pool, tables_seq, budgets_seq, stops_seq, final_seq,
                             end_after, limit, steps: int, filtered: bool | None):
        """Up to ``steps`` decode steps of several decode states in one ``lax.while_loop``.

        A slot is live in a step while it is active, has produced fewer tokens than its budget and has not
        sampled one of its stop ids; only live slots advance (token, position), report a token and write to
        their pages (the others write to scratch). A slot that samples a stop id is inactive in the returned
        state. A slot is freed when it stops, or when it produces its budget's last token and ``final`` says
        that token ends its request. The loop ends after ``limit`` steps, when no slot is live, or after the
        step at which some state ``g`` with ``end_after[g] > 0`` has had that many slots freed."""
        sizes = [st.tokens.shape[0] for st in states_seq]
        out0 = jnp.zeros((steps, sum(sizes), 5), jnp.int32)
        produced0 = tuple(jnp.zeros((n,), jnp.int32) for n in sizes)

        def live(st, produced, budget):
            return st.active & (produced < budget)

        def cond(carry):
            i, states, _, produced, _, freed = carry
            anyone = jnp.any(jnp.stack([jnp.any(live(st, n, b)) for st, n, b in zip(states, produced, budgets_seq)]))
            return (i < limit) & anyone & ~jnp.any((end_after > 0) & (freed >= end_after))

        def body(carry):
            i, states, pool, produced, out, freed = carry
            new_states, new_produced, rows, frees = [], [], [], []
            for p, st, tables, n, budget, stops, final in zip(params_seq, states, tables_seq, produced, budgets_seq,
                                                              stops_seq, final_seq):
                on = live(st, n, budget)
                pool, tok, lp, nxt = self.decode_step(p, st, pool, tables, on, filtered)
                hit = on & jnp.any(tok[:, None] == stops, axis=1)
                frees.append(jnp.sum(hit | (on & final & (n + 1 == budget)), dtype=jnp.int32))
                new_states.append(st._replace(tokens=jnp.where(on, tok, st.tokens),
                                              positions=jnp.where(on, nxt, st.positions), active=st.active & ~hit))
                new_produced.append(n + on.astype(jnp.int32))
                rows.append(_pack(jnp.where(on, tok, 0), on, nxt, lp, st.versions))
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.concatenate(rows, axis=0), i, axis=0)
            return i + 1, tuple(new_states), pool, tuple(new_produced), out, freed + jnp.stack(frees)

        # A slot whose next token to feed is one of its stop ids has already ended (a request whose first
        # token, sampled at prefill, stops it): it produces nothing.
        states_seq = tuple(st._replace(active=st.active & ~jnp.any(st.tokens[:, None] == stops, axis=1))
                           for st, stops in zip(states_seq, stops_seq))
        carry = (jnp.int32(0), states_seq, pool, produced0, out0, jnp.zeros((len(sizes),), jnp.int32))
        _, states, pool, _, out, _ = jax.lax.while_loop(cond, body, carry)
        return tuple(self.pin(st) for st in states), pool, self.readable(out)

    def resize(self, state: DecodeState, rows, capacity: int) -> DecodeState:
        """Gathers ``rows`` (indices into the old state, -1 = empty) into a state of ``capacity`` slots: the
        slots' pages stay where they are."""
        take = jnp.maximum(rows, 0)

        def g(x, axis=0):
            return jnp.take(x, take, axis=axis)

        keep = rows >= 0
        return self.pin(DecodeState(
            tokens=g(state.tokens),
            positions=g(state.positions), sample_ids=g(state.sample_ids), versions=g(state.versions),
            seeds=g(state.seeds), active=g(state.active) & keep,
            sampling=SamplingParams(*(g(a) for a in state.sampling))))


# The programs an engine jits, each with its jit options: (name, method or function of the programs, options).
_JITTED = (("prefill_batch", "prefill_batch", {}), ("shared_prefix", "shared_prefix", {}),
           ("write_prompts", "write_prompts", {"donate_argnums": (2,)}),
           ("set_slots", "set_slots", {"donate_argnums": (1,)}),
           ("generate_steps", "generate_steps", {"donate_argnums": (1, 2), "static_argnums": (9, 10)}),
           ("resize", "resize", {"static_argnums": (2,)}))


def jitted_programs(progs: DecodePrograms, dtype: str, jit: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """Every program of ``progs`` jitted with ``jit``, by name; engines of equal programs and dtype in one process
    get the same jitted functions."""
    # The class's own methods are part of the key: a method replaced on the class (a test's trace counter) gets
    # functions of its own.
    methods = tuple(getattr(DecodePrograms, m) for _, m, _ in _JITTED)
    try:
        return _jitted(progs, dtype, jit, methods)
    except TypeError:  # an unhashable part (rules given as lists): jitted for this engine alone
        return _jitted.__wrapped__(progs, dtype, jit, methods)


def gather_pages(progs: DecodePrograms, pool: Pool, pages_m) -> Pool:
    """Pool pages ``pages_m`` (pool-wide ids) of every layer, in order: a pool of M pages in ``pool``'s layout."""
    del progs
    return pool.take(pages_m)


def scatter_pages(progs: DecodePrograms, pool: Pool, pages_m, rows: Pool, index_m) -> Pool:
    """``pool`` with pages ``pages_m`` (pool-wide ids; scratch for padding) set to pages ``index_m`` of ``rows``
    (a page of ``rows`` may go to several)."""
    return progs.pin_pool(pool.put(pages_m, rows.take(index_m)))


@functools.lru_cache(maxsize=16)
def page_copy_programs(progs: DecodePrograms) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted (gather, scatter) of whole pages that move requests between engines
    (:meth:`~dora_jax.rollout.engine.Engine.take_rows`, :meth:`~dora_jax.rollout.engine.Engine.put_rows`). Not in
    the warm-up's catalog."""
    return (serial_jit(functools.partial(gather_pages, progs)),
            serial_jit(functools.partial(scatter_pages, progs), donate_argnums=(0,)))


@functools.lru_cache(maxsize=16)
def _jitted(progs: DecodePrograms, dtype: str, jit: Callable[..., Any], methods: tuple) -> dict[str, Callable[..., Any]]:
    out = {name: jit(getattr(progs, method), **options) for name, method, options in _JITTED}
    out["new_pool"] = jit(lambda: progs.pin_pool(progs.new_pool()))
    out["zeros"] = jit(lambda b: progs.pin(progs.zeros(b)), static_argnums=(0,))
    out["fuse_params"] = jit(fuse_layer_params)
    out["cast_params"] = jit(lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree))
    return out
