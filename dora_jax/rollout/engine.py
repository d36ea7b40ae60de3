"""The rollout engine, :class:`Engine`: a host wrapper over the device programs (:mod:`dora_jax.rollout.programs`)
and one page book (:mod:`dora_jax.rollout.page_book`), with the batched calls ``prefill_batch``,
``insert_batch``, ``generate_steps``, ``free_slots``, ``resize``; names follow JetStream's Engine API. See
docs/rollout.md.

Shapes: B slots, T prompt bucket, S a prompt's cache length (prefill), W pages per table.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dora_jax.compiles import Programs
from dora_jax.config import ATTENTION_IMPLS, DEFAULT_RULES, MAX_DECODE_STEPS, ROLLOUT_DTYPES
from dora_jax.kernels.paged_attention import RAGGED_IMPL
from dora_jax.models.decoder import FUSED_INPUTS, Decoder, DecodeSettings, resolve_attention_impl
from dora_jax.models.paged import Pool, ReadCounter, shards_apart, token_bytes
from dora_jax.rollout.engine_api import (DecodeState, EngineError, KVRows, PreparedParams, PrefixBatch,
                                         RequestSampling, ResultSteps, ResultTokens, SharedPrefix, stop_table)
from dora_jax.rollout import kv_transfer
from dora_jax.rollout.page_book import PageBook, StateRecords
from dora_jax.rollout.pages import DEFAULT_PAGE_TOKENS, PageError, bucket, pages_for
from dora_jax.rollout.programs import DecodePrograms, jitted_programs
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.sharding import Rules, mesh_axes, serial_jit


def _check_settings(dtype: str, settings: DecodeSettings) -> None:
    """Refuses serving settings the engine does not know, naming the setting, its value and what is allowed."""
    for name, value, allowed in (("dtype", dtype, ROLLOUT_DTYPES),
                                 ("attention_impl", settings.attention_impl, ATTENTION_IMPLS)):
        if value not in allowed:
            raise EngineError(f"{name} {value!r}: allowed {', '.join(map(repr, allowed))}")
    impl = settings.attention_impl
    platform = {"pallas_gpu": "gpu", "pallas_tpu": "tpu", RAGGED_IMPL: "tpu"}.get(impl)
    if impl == RAGGED_IMPL and jax.default_backend() != platform:
        raise EngineError(f"attention_impl {impl!r} runs on TPU only (JAX's ragged kernel has no interpreter), and "
                          f"this backend is {jax.default_backend()!r}: use 'xla'")
    if platform and not settings.pallas_interpret and jax.default_backend() != platform:
        raise EngineError(f"attention_impl {impl!r} runs on {platform.upper()} only, and this backend is "
                          f"{jax.default_backend()!r}: use 'xla' (or pallas_interpret=True to run the kernel in "
                          "the Pallas interpreter)")
    steps = settings.decode_steps
    if steps != "auto" and not (isinstance(steps, (int, np.integer)) and 1 <= steps <= MAX_DECODE_STEPS):
        raise EngineError(f"decode_steps {steps!r}: allowed 'auto' or 1 .. {MAX_DECODE_STEPS}")


# rollout.decode_steps "auto". The same on every backend: on an accelerator a step is short next to the host's
# share of it (dispatch, result transfer, booking), and on CPU the programs of 8 steps measured no slower
# than one step each (docs/performance.md).
AUTO_DECODE_STEPS = 8


def resolve_decode_steps(settings: DecodeSettings) -> int:
    """``settings.decode_steps`` with ``"auto"`` resolved (:data:`AUTO_DECODE_STEPS`)."""
    return AUTO_DECODE_STEPS if settings.decode_steps == "auto" else int(settings.decode_steps)


def mesh_processes(mesh: Mesh | None) -> tuple[int, ...]:
    """The processes whose devices ``mesh`` holds, in order (this process alone without a mesh)."""
    if mesh is None:
        return (jax.process_index(),)
    return tuple(sorted({d.process_index for d in mesh.devices.flat}))


def batch_shards(mesh: Mesh | None, rules: Rules, slots: int) -> int:
    """How many shards the mesh's batch axes split ``slots`` decode slots into (1 where they do not divide)."""
    if mesh is None:
        return 1
    n = mesh_axes("batch", mesh, rules)[1]
    return n if n > 1 and slots % n == 0 else 1


def prompt_rows(distinct: int, slots: int) -> int:
    """Rows of a prefill program for ``distinct`` prompts on an engine of ``slots`` slots: a power of four, at
    most the slots' power of two (docs/rollout.md, 'Warm-up')."""
    rows = 1
    while rows < distinct:
        rows *= 4
    return min(rows, bucket(slots, minimum=1))


def _step_arguments(states_seq, steps, budgets, stop_ids, final, end_after, limit):
    """:meth:`Engine.generate_steps`'s per-state arguments, checked, as its program takes them: (limit, budgets,
    stop tables of one width, final flags, end_after)."""
    if not states_seq or len(budgets) != len(states_seq) or len(stop_ids) != len(states_seq):
        raise EngineError(f"generate_steps: {len(budgets)} budgets and {len(stop_ids)} stop-id lists for "
                          f"{len(states_seq)} decode states")
    if not (isinstance(steps, (int, np.integer)) and steps >= 1):
        raise EngineError(f"generate_steps: steps must be an integer >= 1, got {steps!r}")
    limit = steps if limit is None else limit
    if not 0 <= limit <= steps:
        raise EngineError(f"generate_steps: limit {limit!r} must be in [0, steps = {steps}]")
    final = [np.zeros((st.tokens.shape[0],), bool) for st in states_seq] if final is None else final
    end_after = np.zeros((len(states_seq),), np.int32) if end_after is None else np.asarray(end_after, np.int32)
    if len(final) != len(states_seq) or end_after.shape != (len(states_seq),):
        raise EngineError(f"generate_steps: {len(final)} final flags and {end_after.size} end_after counts for "
                          f"{len(states_seq)} decode states")
    budget_arrays, stop_arrays, final_arrays = [], [], []
    for st, budget, stops, ends in zip(states_seq, budgets, stop_ids, final):
        b = st.tokens.shape[0]
        budget = np.asarray(budget, np.int32).reshape(-1)
        ends = np.asarray(ends, bool).reshape(-1)
        if budget.shape[0] != b or len(stops) != b or ends.shape[0] != b:
            raise EngineError(f"generate_steps: a decode state of {b} slots got {budget.shape[0]} budgets, "
                              f"{len(stops)} stop-id lists and {ends.shape[0]} final flags")
        budget_arrays.append(budget)
        stop_arrays.append(stops if isinstance(stops, np.ndarray) and stops.ndim == 2 else stop_table(stops))
        final_arrays.append(ends)
    width = max(x.shape[1] for x in stop_arrays)  # one width for all states: one program per mix
    stop_arrays = [x if x.shape[1] == width else np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=-1)
                   for x in stop_arrays]
    return limit, budget_arrays, stop_arrays, final_arrays, end_after


def _prompt_arrays(engine: "Engine", prompts, sample_ids, samplings, shared_prefix, version):
    """:meth:`Engine.prefill_batch`'s requests, checked, as its program's host arguments: ((tokens [P, T], lengths
    [P], each request's prompt row, valid, sample ids, seeds, sampling), the shared prefix's length)."""
    n, request_rows, longest = len(prompts), engine.request_rows, engine.max_prefill_length
    if n == 0 or len(sample_ids) != n or len(samplings) != n:
        raise EngineError(f"prefill_batch: {n} prompts, {len(sample_ids)} sample ids, {len(samplings)} sampling "
                          "settings; need as many of each, at least one")
    if n > request_rows:
        raise EngineError(f"prefill_batch: {n} requests; one program takes at most {request_rows} (the engine's "
                          "slots)")
    if shared_prefix is not None and shared_prefix.version != version:
        raise EngineError(f"prefill_batch: the shared prefix was prefilled by policy version "
                          f"{shared_prefix.version}, the requests are of version {version}")
    distinct: dict[tuple[int, ...], int] = {}
    rows = np.zeros((request_rows,), np.int32)
    for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
        sampling.validate()
        key = tuple(int(x) for x in prompt)
        if not 0 < len(key) <= longest:
            raise EngineError(f"prefill_batch: request {i} (sample {sample_ids[i]}): prompt of {len(key)} tokens; "
                              f"allowed 1..{longest}")
        if shared_prefix is not None and not shared_prefix.covers(key):
            raise EngineError(f"prefill_batch: request {i} (sample {sample_ids[i]}): the prompt does not continue "
                              f"the shared prefix ({len(shared_prefix.tokens)} tokens)")
        rows[i] = distinct.setdefault(key, len(distinct))
    skip = 0 if shared_prefix is None else len(shared_prefix.tokens)
    # The bucket of the tokens prefilled here, cut to what the cache holds after the prefix (a prompt is shorter
    # than max_target_length, so its tokens always fit).
    t = min(bucket(max(len(k) for k in distinct) - skip), engine.max_target_length - skip)
    tokens = np.zeros((prompt_rows(len(distinct), engine.max_concurrent_decodes), t), np.int32)
    lengths = np.ones((tokens.shape[0],), np.int32)  # padding rows: one token, never read
    for key, r in distinct.items():
        tokens[r, :len(key) - skip] = key[skip:]
        lengths[r] = len(key) - skip

    def col(values, dtype, pad):
        out = np.full((request_rows,), pad, dtype)
        out[:n] = values
        return out

    sp = SamplingParams(col([s.temperature for s in samplings], np.float32, 0.0),
                        col([s.top_k for s in samplings], np.int32, 0),
                        col([s.top_p for s in samplings], np.float32, 1.0))
    return (tokens, lengths, rows, col(True, bool, False), col(sample_ids, np.int32, 0),
            col([s.seed for s in samplings], np.int32, 0), sp), skip


def _insert_slots(engine: "Engine", batch: PrefixBatch, b: int, slots, limits) -> tuple[np.ndarray, list[int]]:
    """:meth:`Engine.insert_batch`'s slots and limits, checked: (each request's slot, ``b`` for none; limits)."""
    nb = batch.rows.shape[0]
    if len(slots) > nb:
        raise EngineError(f"insert_batch: {len(slots)} slots for a batch of {nb} requests")
    if batch.host is None:
        raise EngineError("insert_batch: the batch has no host lengths; pass what Engine.prefill_batch returned")
    lengths, target = batch.host[0], engine.max_target_length
    limits = [target] * len(slots) if limits is None else list(limits)
    if len(limits) < len(slots):
        raise EngineError(f"insert_batch: {len(limits)} limits for {len(slots)} slots")
    idx = np.full((nb,), b, np.int32)  # b: dropped
    for i, slot in enumerate(slots):
        if slot is None:
            continue
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < b):
            raise EngineError(f"slot {slot!r} does not exist (decode state has slots 0..{b - 1})")
        if not lengths[i] <= limits[i] <= target:
            raise EngineError(f"insert_batch: request {i}: limit {limits[i]} must be in [its prompt's {lengths[i]} "
                              f"tokens, max_target_length {target}]")
        idx[i] = slot
    taken = [s for s in slots if s is not None]
    if len(set(taken)) != len(taken):
        raise EngineError(f"insert_batch: slots {list(slots)} repeat a slot")
    return idx, limits


class _Retired:
    """Device arrays whose last use is a program still in flight, kept until a later decode program's results
    are read (dropping the last reference to an array in use blocks the host on XLA:CPU)."""

    def __init__(self):
        self._arrays: collections.deque[tuple[int, Any]] = collections.deque()
        self.decodes = 0

    def keep(self, x: Any) -> None:
        self._arrays.append((self.decodes, x))

    def drop_before(self, decode: int) -> None:
        while self._arrays and self._arrays[0][0] < decode:
            self._arrays.popleft()

    def next_decode(self) -> int:
        """Counts a decode program about to be dispatched and drops what the one two before it consumed: a driver
        has read that one by now (one program in flight, two with overlap)."""
        self.decodes += 1
        self.drop_before(self.decodes - 2)
        return self.decodes


def _page_tokens(page_tokens: Any) -> int:
    if not (isinstance(page_tokens, (int, np.integer)) and page_tokens >= 1):
        raise EngineError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
    return int(page_tokens)


def _check_sizes(engine: "Engine") -> None:
    """Refuses an engine whose sizes do not fit together, naming them."""
    if jax.process_index() not in engine.processes:
        raise EngineError(f"the engine's mesh holds devices of processes {list(engine.processes)} only, none of this "
                          f"process ({jax.process_index()}): build each process's engine on a mesh of its own "
                          "devices, or one mesh every process of it builds the engine on")
    slots, target = engine.max_concurrent_decodes, engine.max_target_length
    if engine.max_prefill_length >= target:
        raise EngineError(f"max_prefill_length ({engine.max_prefill_length}) must be < max_target_length ({target})")
    if target > engine.cfg.max_seq_len:
        raise EngineError(f"max_target_length ({target}) exceeds model.max_seq_len ({engine.cfg.max_seq_len})")
    if not (isinstance(engine.num_pages, (int, np.integer)) and engine.num_pages >= slots):
        raise EngineError(f"a pool of {engine.num_pages!r} pages cannot hold one page per slot ({slots} slots of "
                          f"{engine.page_tokens}-token pages): give it at least {slots} pages")


class Engine:
    """A continuous-batching decode engine for one :class:`~dora_jax.models.decoder.Decoder` architecture;
    ``params`` is passed to each call, so one set of programs serves every policy version.

    Args:
      model: a model of the architecture (its own params are ``self.params``).
      max_concurrent_decodes: slots of a decode state (:meth:`init_decode_state` may ask for fewer).
      max_prefill_length: the longest prompt; max_target_length: prompt + generated tokens per slot.
      mesh: where params and the decode state live; rules: the logical axis rules that lay them out.
      dtype: the dtype weights are held and decode computes in (KV cache included); ``"auto"``: the model's
        ``compute_dtype``. settings: how decode reads the cache and how many steps a program runs.
      page_tokens: tokens per KV page; num_pages: pages in the pool (:attr:`pool`; default: every slot at its
        longest).

    Over several processes every process makes the same calls.
    """

    def __init__(self, model: Decoder, *, max_concurrent_decodes: int = 8, max_prefill_length: int = 256,
                 max_target_length: int = 512, mesh: Mesh | None = None, dtype: str = "auto",
                 settings: DecodeSettings = DecodeSettings(), rules: Rules = DEFAULT_RULES,
                 page_tokens: int = DEFAULT_PAGE_TOKENS, num_pages: int | None = None):
        _check_settings(dtype, settings)
        self.processes = mesh_processes(mesh)
        self.spans_processes = len(self.processes) > 1  # a trace-time switch: one process's programs stay as they are
        self.rules, self.settings, self._mesh = tuple(rules), settings, mesh
        self.dtype = model.cfg.compute_dtype if dtype == "auto" else dtype
        # The architecture as the engine runs it: weights held and decode computed in the engine's dtype.
        self.cfg = dataclasses.replace(model.cfg, param_dtype=self.dtype, compute_dtype=self.dtype)
        self.graphdef, self.params = nnx.split(model)
        self._prepared: PreparedParams | None = None
        self._max_concurrent_decodes, self._max_prefill_length = max_concurrent_decodes, max_prefill_length
        self.max_target_length = max_target_length
        self.page_tokens = _page_tokens(page_tokens)
        self.table_width = pages_for(max_target_length, self.page_tokens)  # the most pages one slot holds
        self.num_pages = max_concurrent_decodes * self.table_width if num_pages is None else num_pages
        # Slots split over the mesh's batch shards hold pages of their own shard (dora_jax.models.paged).
        self.shards = batch_shards(mesh, self.rules, max_concurrent_decodes)
        _check_sizes(self)
        self.num_pages = int(self.num_pages)
        # Which pages each request holds, when a slot may grow, what the device reads.
        self.book = PageBook(self.num_pages, self.page_tokens, self.shards, self.table_width)
        self.shard_pages = self.book.shard_pages  # device pages per shard, scratch included
        self.records = StateRecords(self.book)
        self._pool: Pool | None = None
        self.token_bytes = token_bytes(self.cfg)  # one token's keys and values, every layer
        self.programs = DecodePrograms(self.cfg, settings, max_target_length=max_target_length, shards=self.shards,
                                       page_tokens=self.page_tokens, pool_pages=self.shards * self.shard_pages,
                                       mesh=mesh, rules=self.rules, spans_processes=self.spans_processes)
        self._jit_programs(self.programs)
        # Requests of one prefill program, fixed per engine: the programs after it vary only in prompt shape.
        self.request_rows = bucket(max_concurrent_decodes, minimum=1)
        # Attention reads counted on the host from each program's results (benchmarks' kv_read_ratio) while
        # ``count_reads`` is set: off by default, as it costs host time per dispatch.
        self.count_reads = False
        self.reads = ReadCounter(resolve_attention_impl(settings), self.shards, self.table_width, self.page_tokens,
                                 self.cfg.head_dim, settings.pallas_interpret,
                                 apart=shards_apart(mesh, self.rules, self.shards))
        self._retired = _Retired()

    def _jit_programs(self, progs: DecodePrograms) -> None:
        """Jits every program under its name (:attr:`compiled`); engines of equal programs in one process share
        them."""
        self.compiled = Programs("rollout engine", serial_jit)
        # By name, for the calls kept outside this class too (kv_transfer).
        self.fns = fns = {n: self.compiled.add(n, f) for n, f in jitted_programs(progs, self.dtype, serial_jit).items()}
        self._prefill_batch_jit, self._shared_prefix_jit = fns["prefill_batch"], fns["shared_prefix"]
        self._write_prompts_jit, self._set_slots_jit = fns["write_prompts"], fns["set_slots"]
        self._generate_steps_jit, self._pool_jit, self._resize_jit = fns["generate_steps"], fns["new_pool"], fns["resize"]
        self._zeros_jit, self._fuse_jit, self._cast_jit = fns["zeros"], fns["fuse_params"], fns["cast_params"]

    @property
    def max_concurrent_decodes(self) -> int:
        return self._max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    def prepare_params(self, params: Any = None) -> PreparedParams:
        """One policy version's weights in the engine's dtype and decode layout (q|k|v and gate|up fused), made
        once per version. ``params``: an ``nnx.State`` of this architecture, already prepared params (returned
        as they are), or ``None`` for the engine's own. Unfused weights already in the engine's dtype are shared."""
        if isinstance(params, PreparedParams):
            return params
        if params is None:
            if self._prepared is None:
                self._prepared = self.prepare_params(self.params)
            return self._prepared
        tree = nnx.merge(self.graphdef, params).decode_params(fuse=False)
        if any(x.dtype != self.dtype for x in jax.tree.leaves(tree)):  # one program casts the whole version
            tree = self._cast_jit(tree)
        layers = dict(tree["layers"])
        # One program for the whole fusion, not one eager concatenate per weight.
        fused = self._fuse_jit({n: layers.pop(n) for n in FUSED_INPUTS if n in layers})
        return PreparedParams({**tree, "layers": {**layers, **fused}})

    def init_decode_state(self, capacity: int | None = None) -> DecodeState:
        b = capacity or self._max_concurrent_decodes
        if b % self.shards:
            raise EngineError(f"a decode state of {b} slots does not split over the {self.shards} batch shards")
        return self.records.track(self._zeros_jit(b))

    def prefill_shared_prefix(self, *, params: Any = None, tokens: Sequence[int], version: int = 0) -> SharedPrefix:
        """Prefills ``tokens``, the head many prompts share (1 .. ``max_prefill_length - 1`` of them), once for
        policy ``version`` (``params``), for :meth:`prefill_batch` of that version to continue."""
        key = tuple(int(x) for x in tokens)
        if not 0 < len(key) < self._max_prefill_length:
            raise EngineError(f"shared prefix of {len(key)} tokens; allowed 1..{self._max_prefill_length - 1} "
                              f"(max_prefill_length {self._max_prefill_length}, and a prompt must continue it)")
        cache = self._shared_prefix_jit(self.prepare_params(params), np.asarray(key, np.int32))
        return SharedPrefix(key, cache, int(version))

    def prefill_batch(self, *, params: Any = None, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int],
                      version: int = 0, samplings: Sequence[RequestSampling],
                      shared_prefix: SharedPrefix | None = None) -> tuple[PrefixBatch, ResultTokens]:
        """Prefills several requests of one policy version in one program and samples each one's first token
        (result row ``i`` is request ``i``'s) from its own ``(seed, sample_id, position)`` stream.

        Requests with equal prompts share one cache row. ``params``: prepared params (``None``: the engine's
        own); ``samplings``: one per request; ``shared_prefix``: this version's :meth:`prefill_shared_prefix`,
        which every prompt continues (only the tokens after it are prefilled).
        """
        args, skip = _prompt_arrays(self, prompts, sample_ids, samplings, shared_prefix, version)
        tokens, lengths, rows, valid, ids, seeds, sampling = args
        cache, rest, packed = self._prefill_batch_jit(
            self.prepare_params(params), tokens, lengths, None if shared_prefix is None else shared_prefix.cache,
            lengths + skip, rows, valid, ids, np.int32(version), seeds, sampling)
        self._retired.keep(packed)
        host_lengths = np.array([len(p) for p in prompts], np.int32)
        return (PrefixBatch(cache, *rest, host=(host_lengths, rows[:len(prompts)].copy(), shared_prefix)),
                ResultTokens(packed))

    def insert_batch(self, batch: PrefixBatch, decode_state: DecodeState, slots: Sequence[int | None],
                     limits: Sequence[int] | None = None) -> DecodeState:
        """Places request ``i`` of a :meth:`prefill_batch` result into ``slots[i]`` of the decode state (donated),
        ending what the slot held; ``None`` (or a missing entry) skips the request. Each request may grow to
        ``limits[i]`` tokens (default ``max_target_length``). Raises :class:`EngineError` for a bad slot, or a
        pool without room for them all now (nothing is inserted; see :meth:`admissible`)."""
        b, nb = decode_state.tokens.shape[0], batch.rows.shape[0]
        idx, limits = _insert_slots(self, batch, b, slots, limits)
        rec = self.rows_of(decode_state)
        shards = [None if slot is None else self.row_shard(b, slot) for slot in slots]
        try:
            page_nt, row_nt = self.records.admit(rec, batch.host, slots, shards, limits, nb, batch.cache.v.shape[3])
        except PageError as e:
            raise EngineError(str(e)) from None
        self._retired.keep(batch._replace(host=None))  # its arrays only: the host part holds the head
        self._pool = self._write_prompts_jit(batch.cache, batch.rows, self.pool, page_nt, row_nt)
        state = self._set_slots_jit(batch._replace(cache=None, host=None), decode_state, idx)
        return self.records.handoff(decode_state, state)

    def generate_steps(self, params_seq: Sequence[Any], states_seq: Sequence[DecodeState], *, steps: int,
                       budgets: Sequence[Any], stop_ids: Sequence[Sequence[Sequence[int]]],
                       final: Sequence[Any] | None = None, end_after: Sequence[int] | None = None,
                       limit: int | None = None, filtered: bool | None = None
                       ) -> tuple[tuple[DecodeState, ...], ResultSteps]:
        """Up to ``steps`` decode steps of several decode states (one policy version each) in one program: one
        dispatch and one result transfer. States are donated; results are stacked in the order given.

        A slot produces tokens until it samples one of its stop ids (it is then inactive in the returned state)
        or has produced its budget (smaller when the page pool cannot serve it safely now).

        Args:
          params_seq: one :meth:`prepare_params` output per state.
          steps: the most steps (compiled in: one program per value).
          budgets: per state, int [B]: the most tokens each slot may produce (0: none).
          stop_ids: per state, each slot's stop ids, or their :func:`~dora_jax.rollout.engine_api.stop_table`.
          final: per state, bool [B]: producing the budget's last token frees the slot (default: never).
          end_after: per state, end after the step at which this many of its slots have been freed (0: never).
          limit: run at most this many steps (<= ``steps``; default ``steps``).
          filtered: ``False`` promises no slot uses top-k / top-p, ``True`` always filters, ``None`` decides on
            the device; the tokens are the same under every choice that keeps the promise.
        """
        if len(params_seq) != len(states_seq):
            raise EngineError(f"generate_steps: {len(params_seq)} params for {len(states_seq)} decode states")
        limit, budget_arrays, stop_arrays, final_arrays, end_after = _step_arguments(
            states_seq, steps, budgets, stop_ids, final, end_after, limit)
        recs = [self.rows_of(st) for st in states_seq]
        # Pages for every token a slot may produce; a slot the pool cannot serve safely gets a smaller budget
        # (what its pages cover), and its final flag only if it keeps its whole budget.
        starts = [self.book.dispatched(rec.ids) for rec in recs] if self.count_reads else None
        granted = self.book.dispatch([rec.ids for rec in recs], [np.minimum(b, limit) for b in budget_arrays])
        final_arrays = [f & (g == np.minimum(b, limit)) for f, g, b in zip(final_arrays, granted, budget_arrays)]
        budget_arrays = [g.astype(np.int32) for g in granted]
        decode = self._retired.next_decode()
        states, self._pool, data = self._generate_steps_jit(
            tuple(self.prepare_params(p) for p in params_seq), tuple(states_seq), self.pool,
            tuple(self.book.tables([rec.ids for rec in recs])),
            tuple(budget_arrays), tuple(stop_arrays), tuple(final_arrays), end_after, np.int32(limit), int(steps),
            filtered)
        # What each row was granted, to take back what the program did not write once its results are read.
        ids = np.concatenate([rec.ids for rec in recs])
        rows = np.flatnonzero(ids)
        booked = ids[rows], self.book.serials(ids[rows]), np.concatenate(budget_arrays)[rows]

        def on_read(d):
            produced = d[..., 1].sum(axis=0)
            self._retired.drop_before(decode)
            self.book.settle(*booked, produced[rows])
            if starts is not None:
                self.reads.add(starts, produced)

        return tuple(self.records.handoff(a, b) for a, b in zip(states_seq, states)), ResultSteps(data, on_read,
                                                                                            granted=budget_arrays)

    def free_slots(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Marks ``slots`` empty and returns their pages to the pool (host work only)."""
        rec = self.rows_of(decode_state)
        for slot in slots:
            self.records.release(rec, slot)
        return decode_state

    def resize(self, decode_state: DecodeState, rows: list[int], capacity: int) -> DecodeState:
        """Compacts or grows a decode state: new slot ``i`` holds old slot ``rows[i]`` (-1 or missing: empty).
        A slot left out ends its request. Pages stay where they are: only the slots' rows move."""
        if capacity % self.shards:
            raise EngineError(f"resize: {capacity} slots do not split over the {self.shards} batch shards")
        idx = np.full((capacity,), -1, np.int32)
        idx[:len(rows)] = rows
        rec, old = self.rows_of(decode_state), decode_state.tokens.shape[0]
        try:
            moved = self.records.regather(rec, idx, [self.row_shard(old, r) for r in range(old)],
                                          [self.row_shard(capacity, i) for i in range(capacity)])
        except PageError as e:
            raise EngineError(f"resize: {e}") from None
        state = self.records.handoff(decode_state, self._resize_jit(decode_state, idx, capacity))
        rec.ids = moved
        return state

    # -- moving requests between engines (dora_jax.rollout.kv_transfer) ----------------------------------------

    def take_rows(self, decode_state: DecodeState, slots: Sequence[int]) -> KVRows:
        """:func:`~dora_jax.rollout.kv_transfer.take_rows` of this engine."""
        return kv_transfer.take_rows(self, decode_state, slots)

    def written_heads(self, decode_state: DecodeState, slots: Sequence[int], written: Sequence[int]
                      ) -> list[tuple[int, ...]]:
        """:func:`~dora_jax.rollout.kv_transfer.written_heads` of this engine."""
        return kv_transfer.written_heads(self, decode_state, slots, written)

    def put_rows(self, decode_state: DecodeState, rows: KVRows, slots: Sequence[int],
                 limits: Sequence[int]) -> DecodeState:
        """:func:`~dora_jax.rollout.kv_transfer.put_rows` of this engine."""
        return kv_transfer.put_rows(self, decode_state, rows, slots, limits)

    # -- the page pool --------------------------------------------------------------------------------------

    @property
    def pool(self) -> Pool:
        """The KV cache of every decode state: ``num_pages`` pages and the scratch page (made at first use)."""
        if self._pool is None:
            self._pool = self._pool_jit() if self.mesh is not None else self.programs.new_pool()
        return self._pool

    @pool.setter
    def pool(self, pool: Pool) -> None:
        self._pool = pool

    def pool_shape(self) -> Pool:
        """The pool's shapes and dtypes, without making it."""
        return jax.eval_shape(self.programs.new_pool)

    def shard_pages_available(self, shard: int) -> int:
        return self.book.shard_free(shard)

    @property
    def pages_held(self) -> int:
        """Pages live requests and shared prefixes hold now (shared pages once)."""
        return self.book.held_pages

    def row_shard(self, capacity: int, row: int) -> int:
        """The batch shard of slot ``row`` in a decode state of ``capacity`` slots."""
        return row * self.shards // capacity

    def page_table(self, decode_state: DecodeState, slot: int) -> list[int]:
        """The pages of the request ``slot`` of ``decode_state`` holds, in order (empty for an empty slot)."""
        return self.book.table(self.rows_of(decode_state).ids[slot])

    def pages_needed(self, limit: int) -> int:
        """Pages a request of up to ``limit`` tokens holds at its longest (sharing with its group aside)."""
        return pages_for(limit, self.page_tokens)

    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int] | None:
        """:meth:`~dora_jax.rollout.page_book.PageBook.admissible`: the batch shard each request of (prompt
        tokens, limit) would go to if admitted now together, or ``None`` when they do not all fit safely now."""
        return self.book.admissible(requests)

    def admissible_moved(self, requests: Sequence[tuple[int, int, tuple[int, ...]]],
                         shards: Sequence[int] | None = None) -> list[int] | None:
        """:meth:`admissible` of requests moved in from another engine, each (written tokens, limit, head),
        ``head`` the pool ids of the full pages it has written there (:meth:`written_heads`), landing in batch
        shards ``shards`` (default: all in shard 0 on an engine of one shard). Rows of one shard whose heads start
        alike share those pages again where they land (:meth:`put_rows`) and are counted once: the rows are
        admitted in order to a copy of the page book. Without ``shards`` on an engine of several, they are
        counted apart, each in the shard with most free pages."""
        if shards is None and self.shards > 1:
            return self.book.admissible([r[:2] for r in requests])
        shards = [0] * len(requests) if shards is None else [int(k) for k in shards]
        book, refs = copy.deepcopy(self.book), []
        heads = [r[2] for r in requests]
        try:
            for i, (written, limit, _) in enumerate(requests):
                fork, shared = kv_transfer.best_fork(heads, shards, i)
                refs.append(book.admit(shards[i], int(written), int(limit), fork=None if fork is None else refs[fork],
                                       fork_tokens=shared * self.page_tokens))
        except PageError:
            return None
        return shards

    def rows_of(self, state: DecodeState):
        """The page book's record of ``state``'s rows (:class:`~dora_jax.rollout.page_book.StateRecords`)."""
        try:
            return self.records.of(state)
        except PageError as e:
            raise EngineError(str(e)) from None
