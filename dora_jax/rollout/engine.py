"""A continuous-batching decode engine with JetStream's Engine API, extended for RL rollout.

Method names and meaning follow ``jetstream.engine.engine_api.Engine`` (google-jetstream 0.2.2):
``prefill``, ``insert``, ``generate``, ``init_decode_state``, ``max_concurrent_decodes``,
``max_prefill_length``, ``mesh``, and results packed in one array per step (``ResultTokens``) so that one
device-to-host copy serves every slot (``get_result_at_slot``).

Extensions: the log-prob of every sampled token, a policy version per slot, per-request sampling settings
(greedy / temperature / top-k / top-p) and sampling randomness from ``(seed, sample_id, position)`` only.

One engine serves one model architecture; ``params`` is passed to each call, so the same compiled functions
run any policy version of that architecture. The engine is configured by its serving settings, not by the
architecture's: the dtype it holds weights and computes in, and how decode reads the cache and lays out the
weights (:class:`~dora_jax.models.decoder.DecodeSettings`; a config's ``rollout`` section). Pass params
through :meth:`Engine.prepare_params` once per version (JetStream's ``load_params``): it casts them to the
engine's dtype and fuses q|k|v and gate|up into one weight each so a step runs fewer, larger matmuls; a raw
``nnx.State`` is accepted too and prepared on every call. Every program is jitted once per shape, from a fixed
catalog (:meth:`Engine.program_catalog`: decode per versions stepped together, capacity and sampling variant;
page tables are always full width; prefill per distinct-prompt rows and prompt bucket) that
:meth:`Engine.warmup` compiles ahead of time; a compile after it is logged with its shape.

The KV cache is one page pool per engine (:attr:`Engine.pool`, :mod:`dora_jax.models.paged`), shared by every
decode state; which pages each slot holds, and when it may take more, is the engine's host-side book
(:mod:`dora_jax.rollout.page_book`). The programs it jits (prefill, insertion, decode steps, resizing) are pure
functions of arrays in :mod:`dora_jax.rollout.programs`; this module is their host side.

Shape legend: B slots, T prompt bucket, S a prompt's cache length (prefill), W pages per table.
"""

from __future__ import annotations

import concurrent.futures
import collections
import dataclasses
import os
import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dora_jax.compiles import Programs
from dora_jax.config import ATTENTION_IMPLS, DEFAULT_RULES, MAX_DECODE_STEPS, ROLLOUT_DTYPES
from dora_jax.models.decoder import FUSED_INPUTS, Decoder, DecodeSettings, fuse_layer_params, resolve_attention_impl
from dora_jax.models.paged import PagedKV, attention_read_tokens, token_bytes
from dora_jax.rollout.engine_api import (DecodeState, EngineError, PreparedParams, Prefix, PrefixBatch,
                                         RequestSampling, ResultSteps, ResultTokens, SharedPrefix, stop_table)
from dora_jax.rollout.page_book import PageBook
from dora_jax.rollout.pages import DEFAULT_PAGE_TOKENS, PageError, bucket, pages_for
from dora_jax.rollout.pages import HeldPages
from dora_jax.rollout.programs import DecodePrograms
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.sharding import Rules, logical_to_spec, serial_jit


def _check_settings(dtype: str, settings: DecodeSettings) -> None:
    """Refuses serving settings the engine does not know, naming the setting, its value and what is allowed."""
    for name, value, allowed in (("dtype", dtype, ROLLOUT_DTYPES),
                                 ("attention_impl", settings.attention_impl, ATTENTION_IMPLS)):
        if value not in allowed:
            raise EngineError(f"{name} {value!r}: allowed {', '.join(map(repr, allowed))}")
    impl = settings.attention_impl
    platform = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(impl)
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
    entry = logical_to_spec(("batch",), rules)[0]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    n = int(np.prod([mesh.shape[a] for a in names if a in mesh.shape]))
    return n if n > 1 and slots % n == 0 else 1


def prompt_rows(distinct: int, slots: int) -> int:
    """Rows of a prefill program for ``distinct`` prompts on an engine of ``slots`` slots: a power of four
    (prefill is a small share of a rollout's time, and every row count is a program compiled at warm-up), at
    most the slots' power of two."""
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


class _Rows:
    """The host side of one decode state: the page book's record of the request each row holds (0: empty)."""

    __slots__ = ("ids",)

    def __init__(self, n: int):
        self.ids = np.zeros((n,), np.int64)


class Engine:
    """JetStream-style engine over a :class:`~dora_jax.models.decoder.Decoder` architecture.

    Args:
      model: a model of the architecture to serve (its own params are ``self.params``; other versions of the
        same architecture can be passed to every call).
      max_concurrent_decodes: slots in a decode state made by :meth:`init_decode_state` (other capacities
        can be asked for: see ``capacity``).
      max_prefill_length: the longest prompt accepted.
      max_target_length: cache length per slot: prompt + generated tokens.
      mesh: the mesh params live on (reported through ``self.mesh``).
      dtype: the dtype the engine holds a version's weights in (:meth:`prepare_params` casts them once per
        version) and computes decode in, its KV cache included: ``"float32"``, ``"bfloat16"``, ``"float16"``,
        or ``"auto"``, the model's ``compute_dtype`` (``rollout.dtype``; why that default: its docstring in
        :class:`~dora_jax.config.RolloutConfig`). Resolved in ``self.dtype``.
      settings: how decode reads the cache and how many steps a program runs (``rollout.attention_impl``,
        ``pallas_interpret``, ``decode_steps``).
      rules: the logical axis rules (``mesh.logical_axis_rules``) that lay out the decode state when ``mesh``
        spans several processes.
      page_tokens: tokens per page of the KV cache (``rollout.page_tokens``).
      num_pages: pages in the pool (``rollout.kv_pages``); default: every slot at ``max_target_length``.

    The KV cache is one pool of pages for every decode state of the engine (:attr:`pool`); a slot holds the
    pages its tokens fill, taken as it grows (:mod:`dora_jax.rollout.pages` decides which, on the host). A
    request is inserted, and a slot given pages before a program, only while every live request could still
    reach its limit (:func:`~dora_jax.rollout.pages.safe_to_grow`): a slot the pool cannot serve safely runs
    fewer tokens, or waits; nothing is evicted and some slot always progresses. A request that does not fit now
    is refused at insertion, and the driver admits only what fits (:meth:`admissible`). Requests inserted together with the same prompt
    (a GRPO group) share its full pages read-only. A decode state's host record (which pages each row holds)
    passes from the state given to a call to the state it returns; a state dropped without being passed on
    returns its pages when it is garbage collected.

    A ``mesh`` over the devices of several processes (multi-controller ``jax.distributed``) makes one engine
    of all of them (:attr:`spans_processes`): every process runs the same calls with the same host values, the
    decode state is a global array laid out by ``rules`` (KV heads over the tensor axis, rows over the batch
    axes, where they divide), and every result the host reads is replicated on every device, so each process
    reads it from its own. On one process the programs are the same as without this.
    """

    def __init__(self, model: Decoder, *, max_concurrent_decodes: int = 8, max_prefill_length: int = 256,
                 max_target_length: int = 512, mesh: Mesh | None = None, dtype: str = "auto",
                 settings: DecodeSettings = DecodeSettings(), rules: Rules = DEFAULT_RULES,
                 page_tokens: int = DEFAULT_PAGE_TOKENS, num_pages: int | None = None):
        _check_settings(dtype, settings)
        self.processes = mesh_processes(mesh)
        if jax.process_index() not in self.processes:
            raise EngineError(f"the engine's mesh holds devices of processes {list(self.processes)} only, none of "
                              f"this process ({jax.process_index()}): build each process's engine on a mesh of its "
                              "own devices, or one mesh every process of it builds the engine on")
        # Several processes decode as one engine: a trace-time switch, so one process's programs do not change.
        self.spans_processes = len(self.processes) > 1
        self.rules = tuple(rules)
        self.dtype = model.cfg.compute_dtype if dtype == "auto" else dtype
        # The architecture as the engine runs it: weights held and decode computed in the engine's dtype.
        cfg = dataclasses.replace(model.cfg, param_dtype=self.dtype, compute_dtype=self.dtype)
        self.settings = settings
        if max_prefill_length >= max_target_length:
            raise EngineError(f"max_prefill_length ({max_prefill_length}) must be < max_target_length "
                              f"({max_target_length})")
        if max_target_length > cfg.max_seq_len:
            raise EngineError(f"max_target_length ({max_target_length}) exceeds model.max_seq_len ({cfg.max_seq_len})")
        self.cfg = cfg
        self.graphdef, self.params = nnx.split(model)
        self._max_concurrent_decodes = max_concurrent_decodes
        self._max_prefill_length = max_prefill_length
        self.max_target_length = max_target_length
        self._mesh = mesh
        self._prepared: PreparedParams | None = None
        if not (isinstance(page_tokens, (int, np.integer)) and page_tokens >= 1):
            raise EngineError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
        self.page_tokens = int(page_tokens)
        self.table_width = pages_for(max_target_length, self.page_tokens)  # the most pages one slot holds
        self.num_pages = max_concurrent_decodes * self.table_width if num_pages is None else num_pages
        if not (isinstance(self.num_pages, (int, np.integer)) and self.num_pages >= max_concurrent_decodes):
            raise EngineError(f"a pool of {self.num_pages!r} pages cannot hold one page per slot "
                              f"({max_concurrent_decodes} slots of {self.page_tokens}-token pages): give it at "
                              f"least {max_concurrent_decodes} pages")
        self.num_pages = int(self.num_pages)
        # Slots split over the mesh's batch shards hold pages of their own shard (dora_jax.models.paged): one
        # allocator per shard, each with its scratch page. Allocator slots: one per possible live request.
        self.shards = batch_shards(mesh, self.rules, max_concurrent_decodes)
        if self.shards > 1 and resolve_attention_impl(settings) != "xla":
            raise EngineError(f"attention_impl {settings.attention_impl!r} reads one pool, but the mesh splits the "
                              f"slots over {self.shards} batch shards: use attention_impl='xla' there")
        # Which pages each request holds, when a slot may grow, what the device reads (dora_jax.rollout.page_book).
        self.book = PageBook(self.num_pages, self.page_tokens, self.shards, self.table_width)
        self.shard_pages = self.book.shard_pages  # device pages per shard, scratch included
        self._records: dict[int, tuple[_Rows, weakref.finalize]] = {}
        # Each shared prefix's full pages held per batch shard, while the prefix lives.
        self._heads: weakref.WeakKeyDictionary[SharedPrefix, dict[int, HeldPages]] = weakref.WeakKeyDictionary()
        self._pool: PagedKV | None = None
        self.token_bytes = token_bytes(cfg)  # one token's keys and values, every layer
        self.programs = DecodePrograms(cfg, settings, max_target_length=max_target_length, shards=self.shards,
                                       page_tokens=self.page_tokens, pool_pages=self.shards * self.shard_pages,
                                       mesh=mesh, rules=self.rules, spans_processes=self.spans_processes)
        self._jit_programs(self.programs)
        # Requests of one prefill program: fixed per engine (padding rows are never inserted), so the programs
        # after the model's prefill are compiled per distinct-prompt count and prompt bucket only.
        self.request_rows = bucket(max_concurrent_decodes, minimum=1)
        # Attention reads per decode step, counted on the host from each program's results when asked
        # (benchmarks: kv_read_ratio); off by default, as it costs host time per dispatch.
        self.count_reads = False
        self.kv_read_tokens = self.kv_live_tokens = 0
        self.count_reads_s = 0.0  # host time the counting took (benchmarks take it off what they time)
        # Device arrays whose last use is a program still in flight (a prefill's first tokens and batch), each with the
        # number of decode programs dispatched before it: dropped once a later decode program's results are
        # read. Dropping the last reference to an array in use blocks the host on some backends (XLA:CPU), and
        # the decode program that follows depends on every one of them.
        self._retired: collections.deque[tuple[int, Any]] = collections.deque()
        self._decodes = 0

    def _jit_programs(self, progs: DecodePrograms) -> None:
        """Jits every program under its name (:attr:`compiled`), so warm-up compiles them all and a later compile
        is logged with its shape."""
        self.compiled = Programs("rollout engine", serial_jit)
        jit = self.compiled.jit
        self._prefill_jit = jit("prefill", progs.prefill)
        self._prefill_batch_jit = jit("prefill_batch", progs.prefill_batch)
        self._shared_prefix_jit = jit("shared_prefix", progs.shared_prefix)
        self._write_prompts_jit = jit("write_prompts", progs.write_prompts, donate_argnums=(2,))
        self._set_slots_jit = jit("set_slots", progs.set_slots, donate_argnums=(1,))
        self._generate_jit = jit("generate", progs.generate, donate_argnums=(1, 2), static_argnums=(5,))
        self._generate_many_jit = jit("generate_many", progs.generate_many, donate_argnums=(1, 2),
                                      static_argnums=(5,))
        self._generate_steps_jit = jit("generate_steps", progs.generate_steps, donate_argnums=(1, 2),
                                       static_argnums=(9, 10))
        self._pool_jit = jit("new_pool", lambda: progs.pin_pool(progs.new_pool()))
        self._resize_jit = jit("resize", progs.resize, static_argnums=(2,))
        self._zeros_jit = jit("zeros", lambda b: progs.pin(progs.zeros(b)), static_argnums=(0,))
        self._fuse_jit = jit("fuse_params", fuse_layer_params)
        self._cast_jit = jit("cast_params", lambda tree: jax.tree.map(lambda x: x.astype(self.dtype), tree))

    # -- JetStream API properties --------------------------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self._max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    # -- JetStream API ---------------------------------------------------------------------------------------

    def prepare_params(self, params: Any) -> PreparedParams:
        """One policy version's weights in the engine's dtype and decode layout (q|k|v and gate|up fused), made
        once per version.

        Args:
          params: an ``nnx.State`` of this engine's architecture (or already prepared params, returned as is).

        Returns:
          :class:`PreparedParams` to pass to :meth:`prefill` and :meth:`generate` (the driver keeps one per
          version). Unfused weights already in the engine's dtype are shared with ``params``, not copied.
        """
        if isinstance(params, PreparedParams):
            return params
        tree = nnx.merge(self.graphdef, params).decode_params(fuse=False)
        if any(x.dtype != self.dtype for x in jax.tree.leaves(tree)):  # one program casts the whole version
            tree = self._cast_jit(tree)
        layers = dict(tree["layers"])
        # One program for the whole fusion, not one eager concatenate per weight.
        fused = self._fuse_jit({n: layers.pop(n) for n in FUSED_INPUTS if n in layers})
        return PreparedParams({**tree, "layers": {**layers, **fused}})

    def load_params(self, params: Any) -> PreparedParams:
        """JetStream's name for :meth:`prepare_params`."""
        return self.prepare_params(params)

    def _prepared_params(self, params: Any) -> PreparedParams:
        if params is None:
            if self._prepared is None:
                self._prepared = self.prepare_params(self.params)
            return self._prepared
        return self.prepare_params(params)

    def init_decode_state(self, capacity: int | None = None) -> DecodeState:
        b = capacity or self._max_concurrent_decodes
        if b % self.shards:
            raise EngineError(f"a decode state of {b} slots does not split over the {self.shards} batch shards")
        return self._track(self._zeros_jit(b), _Rows(b))

    def prefill(self, *, params: Any = None, existing_prefix: SharedPrefix | None = None, padded_tokens: Any,
                true_length: int, sample_id: int = 0, version: int = 0,
                sampling: RequestSampling = RequestSampling()) -> tuple[Prefix, ResultTokens]:
        """Prefills one prompt (right-padded to a power-of-two bucket) and samples its first token.

        ``existing_prefix`` (a :class:`SharedPrefix` of this version, as JetStream's argument of that name):
        ``padded_tokens[:true_length]`` are the tokens after it, and the request is the whole sequence (its first
        token sits at position ``len(prefix) + true_length``)."""
        padded = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 0 < true_length <= padded.shape[0]:
            raise EngineError(f"true_length {true_length} must be in [1, {padded.shape[0]}] (the padded length)")
        if existing_prefix is not None:
            if not isinstance(existing_prefix, SharedPrefix):
                raise EngineError(f"existing_prefix must be a SharedPrefix (Engine.prefill_shared_prefix), got "
                                  f"{type(existing_prefix).__name__}")
            return self._prefill_after(params, existing_prefix, padded[:true_length], sample_id, version, sampling)
        sampling.validate()
        if true_length > self._max_prefill_length:
            raise EngineError(f"prompt of {true_length} tokens exceeds max_prefill_length ({self._max_prefill_length})")
        t = min(bucket(true_length), self.max_target_length)
        tokens = np.zeros((t,), np.int32)
        tokens[:true_length] = padded[:true_length]
        # Host (numpy) arguments: jit moves them with the call, with no eager dispatch per argument.
        sp = SamplingParams(np.full((1,), sampling.temperature, np.float32), np.full((1,), sampling.top_k, np.int32),
                            np.full((1,), sampling.top_p, np.float32))
        prefix, packed = self._prefill_jit(self._prepared_params(params), tokens, np.int32(true_length),
                                                  np.int32(sample_id), np.int32(version), np.int32(sampling.seed),
                                                  sp)
        return prefix._replace(host_length=int(true_length)), ResultTokens(packed)

    def _prefill_after(self, params, shared: SharedPrefix, tokens: np.ndarray, sample_id, version,
                       sampling) -> tuple[Prefix, ResultTokens]:
        """:meth:`prefill` of ``tokens`` after an existing prefix: :meth:`prefill_batch` of one request, as a
        :class:`Prefix`."""
        batch, first = self.prefill_batch(params=params, prompts=[shared.tokens + tuple(tokens.tolist())],
                                          sample_ids=[sample_id], version=version, samplings=[sampling],
                                          shared_prefix=shared)
        row = jax.tree.map(lambda x: x[0], (batch.token, batch.logprob, batch.length, batch.sample_id, batch.version,
                                            batch.seed))
        prefix = Prefix(batch.cache, row[0], row[1], row[2], row[3], row[4],
                        SamplingParams(*(x[:1] for x in batch.sampling)), row[5], int(batch.host[0][0]), shared)
        return prefix, ResultTokens(first.data[:1])

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Places a prefilled request into ``slot`` of the decode state (donated), replacing what the slot held.

        The request may grow to ``max_target_length`` tokens, which the pool's safety check counts (use
        :meth:`insert_batch` with ``limits`` for a smaller limit)."""
        if prefix.host_length is None:
            raise EngineError("insert: the prefix has no host length; pass what Engine.prefill returned")
        batch = PrefixBatch(prefix.cache, np.zeros((1,), np.int32),
                            *(jnp.reshape(x, (1,)) for x in (prefix.token, prefix.logprob, prefix.length,
                                                              prefix.sample_id, prefix.version)),
                            prefix.sampling, jnp.reshape(prefix.seed, (1,)),
                            (np.array([prefix.host_length], np.int32), np.zeros((1,), np.int32), prefix.head))
        return self.insert_batch(batch, decode_state, [slot])

    def prefill_shared_prefix(self, *, params: Any = None, tokens: Sequence[int], version: int = 0) -> SharedPrefix:
        """Prefills ``tokens`` once for the policy version of ``params``, for :meth:`prefill_batch` to continue
        (one compiled program per prefix length: a run has one prefix).

        Args:
          params: :meth:`prepare_params` output (``None``: the engine's own params).
          tokens: the shared head of the prompts (1 .. ``max_prefill_length - 1`` tokens: a prompt continues it).
          version: the policy version of ``params``; :meth:`prefill_batch` refuses the prefix for another one.
        """
        key = tuple(int(x) for x in tokens)
        if not 0 < len(key) < self._max_prefill_length:
            raise EngineError(f"shared prefix of {len(key)} tokens; allowed 1..{self._max_prefill_length - 1} "
                              f"(max_prefill_length {self._max_prefill_length}, and a prompt must continue it)")
        cache = self._shared_prefix_jit(self._prepared_params(params), np.asarray(key, np.int32))
        return SharedPrefix(key, cache, int(version))

    def prefill_batch(self, *, params: Any = None, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int],
                      version: int = 0, samplings: Sequence[RequestSampling],
                      shared_prefix: SharedPrefix | None = None) -> tuple[PrefixBatch, ResultTokens]:
        """Prefills several requests of one policy version in one program and samples each one's first token.

        Requests with equal prompts share one cache row: a prompt is prefilled once however many samples are
        drawn from it (a GRPO group). Each request's first token is drawn from its own ``(seed, sample_id,
        position)`` stream, exactly as :meth:`prefill` draws it. Shapes are bucketed to powers of two (the
        number of distinct prompts, the number of requests and the prompt length), so compilation stays
        bounded. Result row ``i`` of the returned :class:`ResultTokens` is request ``i``'s first token.

        Args:
          params: :meth:`prepare_params` output (``None``: the engine's own params).
          prompts: token ids of each request (1..``max_prefill_length`` tokens each).
          sample_ids: one per request.
          version: the policy version of ``params``, recorded on every request.
          samplings: one per request (validated here).
          shared_prefix: :meth:`prefill_shared_prefix` output for this version, which every prompt continues:
            only each prompt's tokens after it are prefilled (bucketed on their count), attending to its cache.
            The same computation as a whole-prompt prefill, up to float rounding.
        """
        n = len(prompts)
        if n == 0 or len(sample_ids) != n or len(samplings) != n:
            raise EngineError(f"prefill_batch: {n} prompts, {len(sample_ids)} sample ids, {len(samplings)} "
                              "sampling settings; need as many of each, at least one")
        if n > self.request_rows:
            raise EngineError(f"prefill_batch: {n} requests; one program takes at most {self.request_rows} "
                              "(the engine's slots)")
        distinct: dict[tuple[int, ...], int] = {}
        rows = np.zeros((self.request_rows,), np.int32)
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            sampling.validate()
            key = tuple(int(x) for x in prompt)
            if not 0 < len(key) <= self._max_prefill_length:
                raise EngineError(f"prefill_batch: request {i} (sample {sample_ids[i]}): prompt of {len(key)} "
                                  f"tokens; allowed 1..{self._max_prefill_length}")
            if shared_prefix is not None and not shared_prefix.covers(key):
                raise EngineError(f"prefill_batch: request {i} (sample {sample_ids[i]}): the prompt does not "
                                  f"continue the shared prefix ({len(shared_prefix.tokens)} tokens)")
            rows[i] = distinct.setdefault(key, len(distinct))
        skip = 0 if shared_prefix is None else len(shared_prefix.tokens)
        if shared_prefix is not None and shared_prefix.version != version:
            raise EngineError(f"prefill_batch: the shared prefix was prefilled by policy version "
                              f"{shared_prefix.version}, the requests are of version {version}")
        # The bucket of the tokens prefilled here, cut to what the cache holds after the prefix (a prompt is
        # shorter than max_target_length, so its tokens always fit).
        t = min(bucket(max(len(k) for k in distinct) - skip), self.max_target_length - skip)
        tokens = np.zeros((self.prompt_rows(len(distinct)), t), np.int32)
        lengths = np.ones((tokens.shape[0],), np.int32)  # padding rows: one token, never read
        for key, r in distinct.items():
            tokens[r, :len(key) - skip] = key[skip:]
            lengths[r] = len(key) - skip
        nb = rows.shape[0]

        def col(values, dtype, pad):
            out = np.full((nb,), pad, dtype)
            out[:n] = values
            return out

        valid = col(True, bool, False)
        sp = SamplingParams(col([s.temperature for s in samplings], np.float32, 0.0),
                            col([s.top_k for s in samplings], np.int32, 0),
                            col([s.top_p for s in samplings], np.float32, 1.0))
        ids, seeds = col(sample_ids, np.int32, 0), col([s.seed for s in samplings], np.int32, 0)
        cache, rest, packed = self._prefill_batch_jit(
            self._prepared_params(params), tokens, lengths, None if shared_prefix is None else shared_prefix.cache,
            lengths + skip, rows, valid, ids, np.int32(version), seeds, sp)
        self._retire(packed)
        host_lengths = np.array([len(p) for p in prompts], np.int32)
        return PrefixBatch(cache, *rest, host=(host_lengths, rows[:n].copy(), shared_prefix)), ResultTokens(packed)

    def insert_batch(self, batch: PrefixBatch, decode_state: DecodeState, slots: Sequence[int | None],
                     limits: Sequence[int] | None = None) -> DecodeState:
        """Places request ``i`` of a :meth:`prefill_batch` result into ``slots[i]`` of the decode state
        (donated), replacing what the slot held; ``None`` (or a missing entry) skips the request, e.g. one that
        finished at its first token.

        Each request takes pages for its prompt and may grow to ``limits[i]`` tokens (its prompt plus
        the most tokens it may produce; default ``max_target_length``). Requests with the same prompt share
        its full pages: only the first of them writes them. Requests prefilled after a :class:`SharedPrefix`
        share its full pages in their batch shard, held from the first such insertion until the prefix is
        garbage collected (where the pool cannot give them safely then, the requests write their own).

        Raises:
          EngineError: a bad slot, or a pool without room for the requests now (nothing is inserted then; the
            driver admits only what :meth:`pages_needed` says fits).
        """
        b = decode_state.tokens.shape[0]
        nb = batch.rows.shape[0]
        if len(slots) > nb:
            raise EngineError(f"insert_batch: {len(slots)} slots for a batch of {nb} requests")
        if batch.host is None:
            raise EngineError("insert_batch: the batch has no host lengths; pass what Engine.prefill_batch returned")
        lengths, prompt_rows, head = batch.host
        limits = [self.max_target_length] * len(slots) if limits is None else list(limits)
        if len(limits) < len(slots):
            raise EngineError(f"insert_batch: {len(limits)} limits for {len(slots)} slots")
        idx = np.full((nb,), b, np.int32)  # b: dropped
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            if not (isinstance(slot, (int, np.integer)) and 0 <= slot < b):
                raise EngineError(f"slot {slot!r} does not exist (decode state has slots 0..{b - 1})")
            if not lengths[i] <= limits[i] <= self.max_target_length:
                raise EngineError(f"insert_batch: request {i}: limit {limits[i]} must be in [its prompt's "
                                  f"{lengths[i]} tokens, max_target_length {self.max_target_length}]")
            idx[i] = slot
        taken = [s for s in slots if s is not None]
        if len(set(taken)) != len(taken):
            raise EngineError(f"insert_batch: slots {list(slots)} repeat a slot")
        rec = self._record(decode_state)
        for slot in taken:  # a slot's previous request ends here (JetStream's insert overwrites)
            self._release_row(rec, slot)
        p, t = self.page_tokens, batch.cache.v.shape[3]
        page_nt, row_nt = np.zeros((nb, t), np.int32), np.zeros((nb, t), np.int32)  # scratch
        first: dict[tuple[int, int], tuple[int, int]] = {}  # (cache row, shard) -> the request writing its pages
        held, fresh = self._hold_head(head, b, slots, lengths, limits)
        unwritten = set(fresh)
        done: list[int] = []
        try:
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                shard = self.row_shard(b, slot)
                n, src, pre = int(lengths[i]), first.get((int(prompt_rows[i]), shard)), held.get(shard)
                shared = (n // p) * p if src is not None else 0
                ref = self.book.admit(shard, n, int(limits[i]), fork=src if shared else None, fork_tokens=shared,
                                      prefix=pre)
                done.append(slot)
                rec.ids[slot] = ref
                first.setdefault((int(prompt_rows[i]), shard), ref)
                # The head's pages are written once, by the first request holding them: its cache row holds the
                # head first, so its positions 0 .. head - 1 are the head's.
                start = max(shared, 0 if pre is None or shard in unwritten else pre.tokens)
                unwritten.discard(shard)
                page_nt[i, start:n], row_nt[i, start:n] = self.book.prompt_pages(ref, start, n)
        except PageError as e:
            for slot in done:
                self._release_row(rec, slot)
            self.book.release_prefixes({k: held.pop(k) for k in fresh})  # never written: the scatter did not run
            raise EngineError(str(e)) from None
        self._retire(batch._replace(host=None))  # its arrays only: the host part holds the head
        self._pool = self._write_prompts_jit(batch.cache, batch.rows, self.pool, page_nt, row_nt)
        state = self._set_slots_jit(batch._replace(cache=None, host=None), decode_state, idx)
        return self._handoff(decode_state, state)

    def _hold_head(self, head: SharedPrefix | None, b: int, slots: Sequence[int | None], lengths, limits
                   ) -> tuple[dict[int, HeldPages], set[int]]:
        """The pages holding ``head``'s full pages in each batch shard that ``slots`` insert into (taken now in a
        shard without them, where it can give them safely with these requests), and the shards where they were
        taken now: this insertion writes them. Only full pages are shared, so no page is ever copied; the pool
        gets them back once ``head`` is garbage collected and no slot references them."""
        full = 0 if head is None else len(head.tokens) // self.page_tokens * self.page_tokens
        if not full:
            return {}, set()
        held = self._heads.get(head)
        if held is None:
            held = self._heads[head] = {}
            weakref.finalize(head, self.book.release_prefixes, held).atexit = False
        wanted: dict[int, list[tuple[int, int]]] = {}
        for i, slot in enumerate(slots):
            if slot is not None:
                wanted.setdefault(self.row_shard(b, slot), []).append((int(lengths[i]), int(limits[i])))
        fresh = set()
        for shard in wanted.keys() - held.keys():
            pages = self.book.hold_prefix(shard, full, wanted[shard])
            if pages is not None:
                held[shard] = pages
                fresh.add(shard)
        return held, fresh

    def generate(self, params: Any, decode_state: DecodeState, *, filtered: bool | None = None
                 ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot; inactive slots come back with ``valid == 0``.

        Args:
          params: :meth:`prepare_params` output (or a raw ``nnx.State``, prepared on the spot; ``None``: the
            engine's own params).
          decode_state: donated.
          filtered: ``False`` promises that no slot uses top-k / top-p (the vocabulary sort is compiled out),
            ``True`` always filters, ``None`` decides on device. Tokens and log-probs are the same under every
            choice that keeps the promise (see :func:`~dora_jax.rollout.sampling.sample`); the driver picks
            from its requests' settings with :func:`~dora_jax.rollout.sampling.needs_filter`.
        """
        rec = self._record(decode_state)
        step = self.book.dispatch([rec.ids], [rec.ids > 0])[0] > 0
        self._next_decode()
        state, self._pool, data = self._generate_jit(self._prepared_params(params), decode_state, self.pool,
                                                     self.book.tables([rec.ids])[0], step, filtered)
        return self._handoff(decode_state, state), ResultTokens(data)

    def generate_many(self, params_seq: Sequence[Any], states_seq: Sequence[DecodeState], *,
                      filtered: bool | None = None) -> tuple[tuple[DecodeState, ...], ResultTokens]:
        """One decode step of several decode states, each with its own params (one policy version each), in
        one program: one dispatch and one result transfer for all of them.

        The same computation per state as :meth:`generate` (rows never mix versions); the results are stacked
        in the order given (rows of ``states_seq[0]`` first). States are donated. One program is compiled per
        sequence of capacities: callers keep capacities to powers of two and may order states by capacity.
        """
        if len(params_seq) != len(states_seq) or not states_seq:
            raise EngineError(f"generate_many: {len(params_seq)} params for {len(states_seq)} decode states")
        recs = [self._record(st) for st in states_seq]
        steps = self.book.dispatch([rec.ids for rec in recs], [rec.ids > 0 for rec in recs])
        self._next_decode()
        states, self._pool, data = self._generate_many_jit(tuple(self._prepared_params(p) for p in params_seq),
                                                           tuple(states_seq), self.pool,
                                                           tuple(self.book.tables([rec.ids for rec in recs])),
                                                           tuple(x > 0 for x in steps), filtered)
        return tuple(self._handoff(a, b) for a, b in zip(states_seq, states)), ResultTokens(data)

    def generate_steps(self, params_seq: Sequence[Any], states_seq: Sequence[DecodeState], *, steps: int,
                       budgets: Sequence[Any], stop_ids: Sequence[Sequence[Sequence[int]]],
                       final: Sequence[Any] | None = None, end_after: Sequence[int] | None = None,
                       limit: int | None = None, filtered: bool | None = None
                       ) -> tuple[tuple[DecodeState, ...], ResultSteps]:
        """Several decode steps of several decode states (one policy version each) in one program, stopping
        each slot on the device: one dispatch and one result transfer for up to ``steps`` tokens per slot.

        Each step is the computation of :meth:`generate` (same tokens, log-probs and sampling streams); a
        slot produces tokens until it samples one of its stop ids (the token is reported, and the slot is
        marked inactive in the returned state) or has produced its budget; a slot whose next token to feed is
        a stop id produces none. States are donated; results are stacked in the order given (rows of
        ``states_seq[0]`` first).

        Args:
          params_seq: one :meth:`prepare_params` output per state.
          states_seq: the decode states.
          steps: the most steps (compiled in: one program per value, so callers keep to a few).
          budgets: per state, int [B]: the most tokens each slot may produce (0: none).
          stop_ids: per state, each slot's stop ids (end-of-sequence ids and the request's own), or the table
            :func:`~dora_jax.rollout.engine_api.stop_table` makes of them (int32 [B, M], -1 padded).
          final: per state, bool [B]: the budget's last token ends the slot's request (its ``max_new_tokens``),
            so producing it frees the slot. Default: none does.
          end_after: per state, end the program after the step at which this many of the state's slots have
            been freed (stopped, or their final token produced); 0: never (the default). A caller ends it where
            it would act on a freed slot: admit a waiting request, or compact the state.
          limit: run at most this many steps (<= ``steps``). Default ``steps``.
          filtered: as in :meth:`generate`.

        Only ``steps`` and ``filtered`` are compiled in; budgets, stop ids, ``final``, ``end_after`` and ``limit``
        are arguments.
        """
        if len(params_seq) != len(states_seq):
            raise EngineError(f"generate_steps: {len(params_seq)} params for {len(states_seq)} decode states")
        limit, budget_arrays, stop_arrays, final_arrays, end_after = _step_arguments(
            states_seq, steps, budgets, stop_ids, final, end_after, limit)
        recs = [self._record(st) for st in states_seq]
        # Pages for every token a slot may produce; a slot the pool cannot serve safely gets a smaller budget
        # (what its pages cover), and its final flag only if it keeps its whole budget.
        starts = [self.book.dispatched(rec.ids) for rec in recs] if self.count_reads else None
        granted = self.book.dispatch([rec.ids for rec in recs], [np.minimum(b, limit) for b in budget_arrays])
        final_arrays = [f & (g == np.minimum(b, limit)) for f, g, b in zip(final_arrays, granted, budget_arrays)]
        budget_arrays = [g.astype(np.int32) for g in granted]
        decode = self._next_decode()
        states, self._pool, data = self._generate_steps_jit(
            tuple(self._prepared_params(p) for p in params_seq), tuple(states_seq), self.pool,
            tuple(self.book.tables([rec.ids for rec in recs])),
            tuple(budget_arrays), tuple(stop_arrays), tuple(final_arrays), end_after, np.int32(limit), int(steps),
            filtered)
        # What each row was granted, to take back what the program did not write once its results are read.
        ids = np.concatenate([rec.ids for rec in recs])
        rows = np.flatnonzero(ids)
        booked = ids[rows], self.book.serials(ids[rows]), np.concatenate(budget_arrays)[rows]

        def on_read(d):
            produced = d[..., 1].sum(axis=0)
            while self._retired and self._retired[0][0] < decode:
                self._retired.popleft()
            self.book.settle(*booked, produced[rows])
            if starts is not None:
                start = time.perf_counter()
                self._count_reads(starts, produced)
                self.count_reads_s += time.perf_counter() - start

        return tuple(self._handoff(a, b) for a, b in zip(states_seq, states)), ResultSteps(data, on_read,
                                                                                            granted=budget_arrays)

    def _retire(self, x: Any) -> None:
        self._retired.append((self._decodes, x))

    def _next_decode(self) -> int:
        """Counts a decode program about to be dispatched and drops what the one two before it consumed: a
        driver has read that one by now (one program in flight, two with overlap)."""
        self._decodes += 1
        while self._retired and self._retired[0][0] < self._decodes - 2:
            self._retired.popleft()
        return self._decodes

    def _count_reads(self, starts: list[np.ndarray], produced: np.ndarray) -> None:
        """Adds one program's attention reads and live tokens (per layer) to :attr:`kv_read_tokens` and
        :attr:`kv_live_tokens`: at each step, every producing row reads its cached tokens."""
        impl = resolve_attention_impl(self.settings)
        row = 0
        for start in starts:
            n = produced[row:row + start.shape[0]]
            row += start.shape[0]
            for s in range(int(n.max(initial=0))):
                lengths = np.where(n > s, start + s, 0)
                for shard in np.split(lengths, self.shards):  # each shard's slots are planned apart
                    self.kv_read_tokens += attention_read_tokens(impl, shard, self.table_width, self.page_tokens,
                                                                 self.cfg.head_dim, self.settings.pallas_interpret)
                self.kv_live_tokens += int(lengths.sum())

    @property
    def kv_read_ratio(self) -> float | None:
        """Cached tokens the decode attention read over the live tokens it had to read, over the programs counted
        since :attr:`count_reads` was set (None before any)."""
        return self.kv_read_tokens / self.kv_live_tokens if self.kv_live_tokens else None

    def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Marks ``slot`` empty and returns its pages to the pool: no program steps it again (its row is
        computed but never reported) until an insertion fills it."""
        return self.free_slots(decode_state, [slot])

    def free_slots(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """:meth:`free_slot` of several slots. Host work only: a row without a request gets no budget and no
        step from the page book in any later program, so nothing on the device needs to change."""
        rec = self._record(decode_state)
        for slot in slots:
            self._release_row(rec, slot)
        return decode_state

    def resize(self, decode_state: DecodeState, rows: list[int], capacity: int) -> DecodeState:
        """Compacts or grows a decode state: new slot ``i`` holds old slot ``rows[i]`` (-1 or missing: empty).
        A slot left out ends its request. Pages stay where they are: only the slots' rows move."""
        idx = np.full((capacity,), -1, np.int32)
        idx[:len(rows)] = rows
        rec = self._record(decode_state)
        old = decode_state.tokens.shape[0]
        if capacity % self.shards:
            raise EngineError(f"resize: {capacity} slots do not split over the {self.shards} batch shards")
        moved_shard = [(int(r), i) for i, r in enumerate(idx) if r >= 0 and rec.ids[r]
                       and self.row_shard(old, int(r)) != self.row_shard(capacity, i)]
        if moved_shard:
            r, i = moved_shard[0]
            raise EngineError(f"resize: slot {r} would move from batch shard {self.row_shard(old, r)} to "
                              f"{self.row_shard(capacity, i)}; a slot's pages stay in its shard")
        kept = {int(r) for r in idx if r >= 0}
        for r in np.flatnonzero(rec.ids).tolist():
            if r not in kept:
                self._release_row(rec, r)
        moved = np.where(idx >= 0, rec.ids[np.maximum(idx, 0)], 0)
        state = self._handoff(decode_state, self._resize_jit(decode_state, idx, capacity))
        rec.ids = moved
        return state

    # -- warm-up --------------------------------------------------------------------------------------------

    def capacities(self) -> list[int]:
        """The decode-state capacities a driver uses: powers of two below the slots, and the slots (every slot
        on an engine whose slots split over batch shards, where a driver never compacts)."""
        full = self._max_concurrent_decodes
        if self.shards > 1:
            return [full]
        return sorted({min(1 << i, full) for i in range(full.bit_length() + 1)})

    def prompt_rows(self, distinct: int) -> int:
        """:func:`prompt_rows` of this engine."""
        return prompt_rows(distinct, self._max_concurrent_decodes)

    def prompt_buckets(self, prefix_tokens: int = 0) -> list[int]:
        """The prompt buckets :meth:`prefill_batch` compiles for prompts after a prefix of ``prefix_tokens``."""
        longest = self._max_prefill_length - prefix_tokens
        lengths = {min(1 << i, longest) for i in range(longest.bit_length() + 1)}
        return sorted({min(bucket(x), self.max_target_length - prefix_tokens) for x in lengths})

    def program_catalog(self, *, versions: int = 1, decode_steps: int | None = None,
                        filtered: Sequence[bool] = (False,), prefix_tokens: int = 0, prefill_tokens: int = 8192
                        ) -> list[tuple]:
        """Every program shape a :class:`~dora_jax.rollout.driver.RolloutDriver` of this engine can dispatch, as
        ``(program, *shape key)``: what :meth:`warmup` compiles and ``dora-jax check`` counts.

        Args:
          versions: the most policy versions the driver steps together (K + 1).
          decode_steps: the driver's decode steps per program (default: the engine's setting).
          filtered: the sampling variants (:func:`~dora_jax.rollout.sampling.needs_filter` of the requests).
          prefix_tokens: the driver's shared prefix (0: prompts are prefilled whole).
          prefill_tokens: the driver's prefill budget (distinct prompts x prompt bucket per program).
        """
        steps = resolve_decode_steps(self.settings) if decode_steps is None else int(decode_steps)
        caps = self.capacities()
        decode = "generate_steps" if steps > 1 else "generate"
        out: list[tuple] = [(decode if v == 1 or steps > 1 else "generate_many", v, cap, bool(f), steps)
                            for v in range(1, versions + 1) for cap in caps for f in dict.fromkeys(filtered)]
        for cap in caps:
            out += [("zeros", cap)] + [("resize", cap, new) for new in caps if new != cap]
        if prefix_tokens:
            out.append(("shared_prefix", prefix_tokens))
        n = self.request_rows
        buckets = self.prompt_buckets(prefix_tokens)
        # Prefill and first tokens: distinct prompts (powers of four) x prompt bucket within the driver's budget,
        # then the pool write, and the slots set in a decode state of every capacity.
        for t in buckets:
            for d in sorted({self.prompt_rows(1 << i) for i in range(n.bit_length() + 1)}):
                if d == 1 or d * t <= prefill_tokens:
                    out.append(("prefill_batch", d, t))
                    out.append(("write_prompts", d, t))
        out += [("set_slots", cap) for cap in caps]
        return out

    def warmup_plan(self, params: Any = None, *, stop_width: int = 4, prefix_tokens: int = 0,
                    **catalog_args: Any) -> list[tuple[str, tuple]]:
        """:meth:`program_catalog` (same arguments) as ``(program, arguments)`` to compile, arguments abstract
        where they are device arrays, in the layouts the calls will have. ``params``: prepared params of one
        version (``None``: the engine's own; only shapes are used); ``stop_width``: stop ids per slot, as
        :func:`~dora_jax.rollout.engine_api.stop_table` pads them. Programs whose outputs feed others (the
        prefill chain) are compiled here to learn their outputs' layouts."""
        spec = self._spec
        prepared = jax.tree.map(spec, self._prepared_params(params))
        pool = jax.tree.map(spec, self.pool)
        width, n = self.table_width, self.request_rows
        states = {cap: jax.tree.map(spec, self._zeros_jit(cap)) for cap in self.capacities()}

        def host(cap, dtype, value=0, *tail):
            return np.full((cap,) + tail, value, dtype)

        prefix = None
        if prefix_tokens:
            prefix = self._outputs("shared_prefix", prepared, jax.ShapeDtypeStruct((prefix_tokens,), np.int32))
        sampling = SamplingParams(host(n, np.float32), host(n, np.int32), host(n, np.float32, 1.0))
        def prefill(d, t):
            lengths = np.ones((d,), np.int32)
            return (prepared, np.zeros((d, t), np.int32), lengths, prefix, lengths, host(n, np.int32), host(n, bool),
                    host(n, np.int32), np.int32(0), host(n, np.int32), sampling)

        outputs: dict[tuple[int, int], Any] = {}  # (distinct prompts, bucket) -> prefill_batch's outputs

        def prefilled(d, t):
            if (d, t) not in outputs:
                outputs[d, t] = self._outputs("prefill_batch", *prefill(d, t))
            return outputs[d, t]

        plan: list[tuple[str, tuple]] = []
        for name, *key in self.program_catalog(prefix_tokens=prefix_tokens, **catalog_args):
            if name in ("generate_steps", "generate", "generate_many"):
                v, cap, f, steps = key
                st, tables = (states[cap],) * v, tuple(host(cap, np.int32, 0, width) for _ in range(v))
                if name == "generate_steps":
                    args = ((prepared,) * v, st, pool, tables, tuple(host(cap, np.int32) for _ in range(v)),
                            tuple(host(cap, np.int32, -1, stop_width) for _ in range(v)),
                            tuple(host(cap, bool) for _ in range(v)), np.zeros((v,), np.int32), np.int32(0), steps, f)
                elif name == "generate":
                    args = (prepared, st[0], pool, tables[0], host(cap, bool), f)
                else:
                    args = ((prepared,) * v, st, pool, tables, tuple(host(cap, bool) for _ in range(v)), f)
            elif name == "zeros":
                args = (key[0],)
            elif name == "resize":
                args = (states[key[0]], host(key[1], np.int32, -1), key[1])
            elif name == "shared_prefix":
                args = (prepared, jax.ShapeDtypeStruct((prefix_tokens,), np.int32))
            elif name == "prefill_batch":
                args = prefill(*key)
            elif name == "write_prompts":
                cache, rest, _ = prefilled(*key)
                cols = cache.v.shape[3]
                args = (cache, rest[0], pool, host(n, np.int32, 0, cols), host(n, np.int32, 0, cols))
            else:  # set_slots
                _, rest, _ = prefilled(1, self.prompt_buckets(prefix_tokens)[0])
                args = (PrefixBatch(None, *rest), states[key[0]], host(n, np.int32))
            plan.append((name, args))
        return plan

    def warmup(self, params: Any = None, *, progress: bool = False, **plan_args: Any) -> dict[str, Any]:
        """Compiles every program of :meth:`warmup_plan` (same arguments) without running any, then logs any
        later compile with its shape (:class:`~dora_jax.compiles.Programs`).

        Returns:
          ``programs`` (compiled now), ``seconds`` (the warm-up's wall time), ``by_program`` (counts).
        """
        from tqdm.auto import tqdm

        start = time.perf_counter()
        plan = self.warmup_plan(params, **plan_args)
        # Tracing holds the GIL, XLA's compiler does not: programs are traced here one by one and compiled on
        # every core at once.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool, \
                tqdm(total=len(plan), desc="compiling rollout programs", unit="program", disable=not progress,
                     leave=False) as bar:
            futures = [pool.submit(self.compiled.compile_lowered, name, self.compiled.lower(name, *args))
                       for name, args in plan]
            for f in concurrent.futures.as_completed(futures):
                f.result()
                bar.update()
        self.compiled.seal()
        by_program: dict[str, int] = {}
        for name, _ in plan:
            by_program[name] = by_program.get(name, 0) + 1
        return {"programs": len(plan), "seconds": time.perf_counter() - start, "by_program": by_program}

    def _outputs(self, name: str, *args: Any) -> Any:
        """Program ``name``'s outputs for ``args``, abstract, in the layout its compiled form gives them (what a
        program fed by them is compiled for). Compiles it: warm-up compiles it anyway, and JAX keeps it."""
        lowered = self.compiled.lower(name, *args)
        if self.mesh is None:
            lowered.compile()
            return lowered.out_info
        return jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                            lowered.out_info, lowered.compile().output_shardings)

    def _spec(self, x: Any) -> Any:
        """A device array as an abstract argument with its sharding (the program is compiled for that layout);
        host values as they are."""
        if isinstance(x, jax.Array):
            # Without a mesh every array sits on the default device uncommitted: no sharding, as calls see them.
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if self.mesh is not None else None)
        return x

    # -- the page pool --------------------------------------------------------------------------------------

    @property
    def pool(self) -> PagedKV:
        """The KV cache of every decode state: ``num_pages`` pages and the scratch page (made at first use)."""
        if self._pool is None:
            self._pool = self._pool_jit() if self.mesh is not None else self.programs.new_pool()
        return self._pool

    def pool_shape(self) -> PagedKV:
        """The pool's shapes and dtypes, without making it."""
        return jax.eval_shape(self.programs.new_pool)

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.token_bytes

    @property
    def pages_available(self) -> int:
        """Free pages (all shards)."""
        return self.book.free_pages

    def shard_pages_available(self, shard: int) -> int:
        return self.book.shard_free(shard)

    @property
    def pages_held(self) -> int:
        """Pages live requests and shared prefixes hold now (shared pages once)."""
        return self.book.held_pages

    @property
    def page_waits(self) -> int:
        """Dispatches of a live slot cut short, or to nothing, to wait for pages."""
        return self.book.waits

    def row_shard(self, capacity: int, row: int) -> int:
        """The batch shard of slot ``row`` in a decode state of ``capacity`` slots."""
        return row * self.shards // capacity

    def page_table(self, decode_state: DecodeState, slot: int) -> list[int]:
        """The pages of the request ``slot`` of ``decode_state`` holds, in order (empty for an empty slot)."""
        return self.book.table(self._record(decode_state).ids[slot])

    def pages_needed(self, limit: int) -> int:
        """Pages a request of up to ``limit`` tokens holds at its longest (sharing with its group aside)."""
        return pages_for(limit, self.page_tokens)

    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int] | None:
        """:meth:`~dora_jax.rollout.page_book.PageBook.admissible`: the batch shard each request of (prompt
        tokens, limit) would go to if admitted now together, or ``None`` when they do not all fit safely now."""
        return self.book.admissible(requests)

    def grant_pages(self, states_seq: Sequence[DecodeState], tokens_seq: Sequence[Any]) -> list[np.ndarray]:
        """Takes the pages for ``tokens_seq[g][b]`` more tokens of each live slot where the pool can serve them
        safely, and returns how many tokens each slot's pages now cover past what is already dispatched: the
        budgets :meth:`generate_steps` will run (it grants the same, taking nothing more). A slot the pool
        cannot serve safely gets what its held pages still cover, maybe 0: it waits for pages."""
        return self.book.grant([self._record(st).ids for st in states_seq], tokens_seq)

    def _release_row(self, rec: _Rows, row: int) -> None:
        ref = int(rec.ids[row])
        if ref:
            rec.ids[row] = 0
            self.book.release(ref)

    def _track(self, state: DecodeState, rows: _Rows) -> DecodeState:
        key = id(state.tokens)
        fin = weakref.finalize(state.tokens, self._drop_record, key, rows)
        fin.atexit = False
        self._records[key] = (rows, fin)
        return state

    def _drop_record(self, key: int, rows: _Rows) -> None:
        """A decode state dropped without being passed on: its requests end, their pages return to the pool."""
        self._records.pop(key, None)
        for r in range(len(rows.ids)):
            self._release_row(rows, r)

    def _record(self, state: DecodeState) -> _Rows:
        entry = self._records.get(id(state.tokens))
        if entry is None:
            raise EngineError("a decode state this engine does not know: pass the state its last call returned "
                              "(each call donates the state it is given), made by init_decode_state")
        return entry[0]

    def _handoff(self, old: DecodeState, new: DecodeState) -> DecodeState:
        """Moves the host record of ``old`` to ``new`` (what a call returns for the state it was given)."""
        rows, fin = self._records.pop(id(old.tokens))
        fin.detach()
        return self._track(new, rows)
