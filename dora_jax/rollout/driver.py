"""The generation driver: continuous batching over several policy versions at once.

:class:`RolloutDriver` decodes each policy version in its own group (its own ``DecodeState`` and params), so a
trajectory is sampled from first to last token by the version it was submitted with; :func:`run_all` steps a
driver until its requests finish. docs/rollout.md, "Several versions at once", gives the design.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from dora_jax.rollout.engine import (Engine, EngineError, KVRows, SharedPrefix, bucket, prompt_rows,
                                     resolve_decode_steps)
from dora_jax.rollout.engine_api import RolloutEngine, continues
from dora_jax.rollout.samples import Request, Trajectory
from dora_jax.rollout.sampling import needs_filter
from dora_jax.rollout.stats import DriverStats


# While requests wait for a slot, a program of several steps ends once this fraction of the engine's slots
# (1 / N, at least one slot, at most the requests waiting) has been freed, so they are admitted together: one
# prefill for several requests and programs that run most of their steps, for at most a few steps' wait of the
# freed slots. An engine of fewer than 2N slots admits at every freed slot.
ADMIT_SLOTS_FRACTION = 32


@dataclasses.dataclass(eq=False)  # compared by identity: a row is found again after resizes
class _Live:
    request: Request
    tokens: list[int]
    logprobs: list[float]
    submitted_s: float
    started_s: float
    in_flight: int = 0  # tokens that decode programs dispatched and not yet read back may produce for this row
    finished: bool = False  # its last token is read: rows of it in steps still in flight are discarded
    stops: tuple[int, ...] = ()  # the ids that end it on the device: the driver's eos ids and its own stop ids

    @property
    def needs_step(self) -> bool:
        """Whether a step dispatched now could still produce one of its tokens."""
        return not self.finished and len(self.tokens) + self.in_flight < self.request.max_new_tokens


@dataclasses.dataclass
class Departing:
    """Requests of one version taken out of a driver (:meth:`RolloutDriver.take`) for another holding the same
    version (:meth:`RolloutDriver.put`): those not admitted yet, and the live ones with their tokens, log-probs,
    decode rows and KV pages (``rows``)."""

    version: int
    pending: list[tuple[Request, float]]
    live: list[_Live]
    rows: KVRows | None

    @property
    def count(self) -> int:
        return len(self.pending) + len(self.live)

    @property
    def sample_ids(self) -> list[int]:
        return sorted([r.sample_id for r, _ in self.pending] + [x.request.sample_id for x in self.live])

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pages taken with the live requests."""
        return 0 if self.rows is None else self.rows.kv_bytes


@dataclasses.dataclass
class _Group:
    version: int
    params: Any
    state: Any = None
    slots: list[_Live | None] = dataclasses.field(default_factory=list)
    prefix: SharedPrefix | None = None  # the driver's shared prefix prefilled by this version, made at first use
    freed: list[int] = dataclasses.field(default_factory=list)  # rows ended since the state last freed slots
    live: int = 0  # rows holding a live trajectory (kept with ``slots``: the hot path reads it per program)
    filtering: int = 0  # live rows sampling with top-k or top-p, kept with ``slots`` as ``live`` is
    # Each row's stop ids as the engine reads them (int32 [rows, M], -1 padded), kept with ``slots``.
    stops: np.ndarray = dataclasses.field(default_factory=lambda: np.full((0, 4), -1, np.int32))

    def put(self, rows: list[tuple[int, _Live]]) -> None:
        """Places each live row at its slot; the stop table is copied once for all of them."""
        # A new table, not written in place: a program in flight may read the one it was given (on CPU, JAX
        # reads a NumPy argument without copying it).
        width = max([self.stops.shape[1]] + [bucket(len(live.stops), minimum=4) for _, live in rows])
        self.stops = np.pad(self.stops, ((0, 0), (0, width - self.stops.shape[1])), constant_values=-1)
        for slot, live in rows:
            self.slots[slot] = live
            self.live += 1
            self.filtering += _filters(live)
            self.stops[slot] = -1
            self.stops[slot, :len(live.stops)] = live.stops

    def clear(self, slot: int) -> None:
        self.filtering -= _filters(self.slots[slot])
        self.slots[slot] = None
        self.live -= 1


def _filters(live: _Live) -> bool:
    """Whether the row samples with top-k or top-p (the decode program's ``filtered`` variant)."""
    sampling = live.request.sampling
    return needs_filter((sampling.top_k,), (sampling.top_p,))


@dataclasses.dataclass
class _Launched:
    """A decode step dispatched by :meth:`RolloutDriver.launch`, not yet read back."""

    done: list[Trajectory]
    active: list[_Group]
    results: list[Any]  # one per active group, or one for all when fused
    floor: int
    fused: bool = False
    rows: list[list[_Live | None]] = dataclasses.field(default_factory=list)  # each group's slots at dispatch
    budgets: list[list[int]] = dataclasses.field(default_factory=list)  # each row's budget of tokens, per group
    # With overlap: requests admitted by this launch, inserted before their first token (sampled at prefill)
    # was read; it is read with this step's results. One entry per prefill program: its first tokens, the
    # requests' rows in order.
    admitted: list[tuple[Any, list[_Live]]] = dataclasses.field(default_factory=list)
    stops: list[np.ndarray] = dataclasses.field(default_factory=list)  # each group's stop table at dispatch
    steady: bool = False  # every slot was live, and could run the whole program, when it was dispatched


class RolloutDriver:
    """Owns one decode group per policy version; admits, steps, and emits finished trajectories."""

    def __init__(self, engine: RolloutEngine, *, eos_ids: Sequence[int] = (), compact: bool = True, fuse: bool = True,
                 prefill_tokens: int = 8192, batch_prefill: bool = True, overlap: bool | None = None,
                 shared_prefix: Sequence[int] = (), decode_steps: int | None = None):
        if prefill_tokens < 1:
            raise EngineError(f"prefill_tokens must be >= 1, got {prefill_tokens!r}")
        # Decode steps per program (Engine.generate_steps, each slot stopped on the device); None: the engine's
        # setting (rollout.decode_steps).
        self.decode_steps = resolve_decode_steps(engine.settings) if decode_steps is None else decode_steps
        if not (isinstance(self.decode_steps, (int, np.integer)) and self.decode_steps >= 1):
            raise EngineError(f"decode_steps must be an integer >= 1, got {self.decode_steps!r}")
        self.shared_prefix = tuple(int(x) for x in shared_prefix)
        if len(self.shared_prefix) >= engine.max_prefill_length:
            raise EngineError(f"shared_prefix of {len(self.shared_prefix)} tokens; it must be shorter than "
                              f"max_prefill_length ({engine.max_prefill_length})")
        self.engine = engine
        # Slots split over batch shards keep their pages in their shard: rows never move between shards, so a
        # group keeps every slot (no compaction) on such an engine.
        self.shards = engine.shards
        if self.shards > 1:
            compact = False
        # None: overlap where the host's share of a step is large (accelerators; docs/rollout.md), not on CPU,
        # where a step's compute dwarfs the host's work and the discarded rows would cost more than it hides.
        self.overlap = default_overlap(engine) if overlap is None else bool(overlap)
        self._launched: collections.deque[_Launched] = collections.deque()
        self.prefill_tokens = prefill_tokens
        self.batch_prefill = batch_prefill
        self.compact = compact
        self.fuse = fuse
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._eos_tuple = tuple(sorted(self.eos_ids))
        self._groups: dict[int, _Group] = {}
        self._pending: collections.deque[tuple[Request, float]] = collections.deque()
        # Requests wait for a slot outside the driver (a caller that submits only into free slots sets this
        # before each step): as with requests pending here, a program of several steps ends once
        # 1 / ADMIT_SLOTS_FRACTION of the slots (at least one) are freed, so the caller can fill them.
        self.waiting_outside = False
        self.stats = DriverStats()  # counters and the figures derived from them (rollout/stats.py)

    # -- versions -------------------------------------------------------------------------------------------

    def add_version(self, version: int, params: Any) -> None:
        """Loads a policy version: its params are prepared for decode once here (``Engine.prepare_params``)."""
        if version in self._groups:
            raise EngineError(f"policy version {version} is already loaded")
        self._groups[version] = _Group(version, self.engine.prepare_params(params))
        self._count_held()

    def remove_version(self, version: int) -> None:
        """Unloads a policy version with no trajectory left. On return nothing of the driver holds its weights: a
        dispatched step still using them is waited for, and the group's params, decode state and shared prefix are
        dropped."""
        g = self._groups.get(version)
        if g is None:
            raise EngineError(f"policy version {version} is not loaded")
        if g.live or any(r.version == version for r, _ in self._pending):
            raise EngineError(f"policy version {version} still has trajectories in flight")
        computing = [x for x in self._launched if any(a is g for a in x.active)]
        jax.block_until_ready([r.data for x in computing for r in x.results])
        del self._groups[version]
        g.params = g.state = g.prefix = None  # the launched step keeps the group for its bookkeeping only

    def params(self, version: int) -> Any:
        """A loaded version's params as the engine takes them (prepared for decode, on the engine's devices)."""
        if version not in self._groups:
            raise EngineError(f"policy version {version} is not loaded (loaded: {self.versions})")
        return self._groups[version].params

    def decode_state(self, version: int) -> Any:
        """A loaded version's decode state (its rows; the engine's pages hold their cache)."""
        if version not in self._groups:
            raise EngineError(f"policy version {version} is not loaded (loaded: {self.versions})")
        return self._groups[version].state

    def results_in_flight(self, version: int) -> list[Any]:
        """The results of dispatched programs not read back yet that compute a row of ``version``."""
        return [r.data for x in self._launched if any(g.version == version for g in x.active) for r in x.results]

    def held(self) -> list[int]:
        """The versions whose weights this driver holds now: the loaded ones, plus any a dispatched step not yet read
        back still refers to."""
        groups = list(self._groups.values()) + [g for x in self._launched for g in x.active]
        return sorted({g.version for g in groups if g.params is not None})

    def _count_held(self) -> None:
        self.stats.max_held = max(self.stats.max_held, len(self.held()))

    @property
    def versions(self) -> list[int]:
        return sorted(self._groups)

    def restore_stats(self, counters: dict[str, int]) -> None:
        """Continues a resumed run's counters (:data:`~dora_jax.rollout.stats.RESUMED`)."""
        self.stats.restore(counters)

    def in_flight(self) -> dict[int, int]:
        """Live plus pending trajectories per version."""
        out = {v: g.live for v, g in self._groups.items()}
        for r, _ in self._pending:
            out[r.version] = out.get(r.version, 0) + 1
        return out

    # -- requests -------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if request.version not in self._groups:
            raise EngineError(f"request {request.sample_id}: policy version {request.version} is not loaded "
                              f"(loaded: {self.versions})")
        n = len(request.prompt_ids)
        if n == 0 or n > self.engine.max_prefill_length:
            raise EngineError(f"request {request.sample_id}: prompt of {n} tokens; allowed 1..{self.engine.max_prefill_length}")
        if request.max_new_tokens < 1 or n + request.max_new_tokens > self.engine.max_target_length:
            raise EngineError(f"request {request.sample_id}: prompt ({n}) + max_new_tokens ({request.max_new_tokens}) "
                              f"must fit max_target_length ({self.engine.max_target_length})")
        pool = self.engine.shard_pages
        need = self._pages(request)
        if need > pool - 1:
            raise EngineError(f"request {request.sample_id}: prompt ({n}) + max_new_tokens ({request.max_new_tokens}) "
                              f"tokens need {need} pages of {self.engine.page_tokens} tokens; the page pool holds "
                              f"{pool - 1} per batch shard (rollout.kv_pages): it could never be admitted")
        request.sampling.validate()
        self._pending.append((request, time.perf_counter()))

    def _pages(self, request: Request) -> int:
        """Pages the request holds at its longest (its prompt's sharing with its group aside)."""
        return self.engine.pages_needed(len(request.prompt_ids) + request.max_new_tokens)

    def _count_kv(self) -> None:
        held = self.engine.pages_held
        if held is None:
            return

        def tokens() -> tuple[int, int]:
            lives = [s for g in self._groups.values() for s in g.slots if s is not None]
            return held * self.engine.page_tokens, sum(len(s.request.prompt_ids) + len(s.tokens) + s.in_flight
                                                       for s in lives)
        self.stats.count_kv(self.live_rows == self.engine.max_concurrent_decodes, tokens)

    @property
    def live_rows(self) -> int:
        """Slots holding a live trajectory now, over every version."""
        return sum(g.live for g in self._groups.values())

    @property
    def idle(self) -> bool:
        return not self._pending and all(g.live == 0 for g in self._groups.values())

    def block_until_ready(self) -> None:
        """Waits for every dispatched decode step and decode-state update, so a caller can hand the devices over
        with nothing of the rollout running."""
        jax.block_until_ready([g.state for g in self._groups.values() if g.state is not None]
                              + [r.data for x in self._launched for r in x.results]
                              + [first.data for x in self._launched for first, _ in x.admitted])

    # -- moving requests to another driver ------------------------------------------------------------------

    def read_in_flight(self) -> list[Trajectory]:
        """Reads back every dispatched program and returns what finished; afterwards requests can be :meth:`take`-n."""
        out: list[Trajectory] = []
        while self._launched:
            out += self.collect(self._launched.popleft())
        return out

    def _chosen(self, version: int, count: int) -> tuple[list[tuple[Request, float]], list[_Live]]:
        """The (at most) ``count`` requests of ``version`` with the lowest sample ids, pending or live."""
        if version not in self._groups:
            raise EngineError(f"policy version {version} is not loaded (loaded: {self.versions})")
        pending = [x for x in self._pending if x[0].version == version]
        live = [s for s in self._groups[version].slots if s is not None and not s.finished]
        keep = set(sorted([r.sample_id for r, _ in pending] + [s.request.sample_id for s in live])[:count])
        return [x for x in pending if x[0].sample_id in keep], [s for s in live if s.request.sample_id in keep]

    def take_sizes(self, version: int, count: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(Tokens written to the KV cache, limit, the pool ids of its full written pages) of each live request
        :meth:`take` would take, for the destination's :meth:`fits` (which counts pages the requests share once);
        exact once nothing is in flight (:meth:`read_in_flight`)."""
        _, live = self._chosen(version, count)
        if not live:
            return []
        g = self._groups[version]
        written = [len(x.request.prompt_ids) + len(x.tokens) - 1 for x in live]
        heads = self.engine.written_heads(g.state, [g.slots.index(x) for x in live], written)
        return [(w, len(x.request.prompt_ids) + x.request.max_new_tokens, h) for w, x, h in zip(written, live, heads)]

    def fits(self, version: int, count: int, sizes: Sequence[tuple[int, int, tuple[int, ...]]]) -> bool:
        """Whether ``count`` requests of ``version`` (live ones' ``sizes`` from :meth:`take_sizes`) can be put here
        now: free slots for all, and pages for the live ones (pages they share in one batch shard counted once)
        while every live request here could still reach its limit. Each live one is checked in the batch shard
        :meth:`put` would place it in."""
        if count > self.engine.max_concurrent_decodes - sum(self.in_flight().values()):
            return False
        if not sizes:
            return True
        g = self._groups.get(version)
        if self.shards == 1 or g is None:
            return self.engine.admissible_moved(list(sizes)) is not None
        slots = g.slots
        if g.live + len(sizes) > len(slots):  # put grows the state to every slot first, live rows first
            slots = [x for x in slots if x is not None]
            slots += [None] * (self.engine.max_concurrent_decodes - len(slots))
        rows = self._rows_by_room(slots, [self.engine.pages_needed(w) for w, _, _ in sizes])
        shards = [self.engine.row_shard(len(slots), r) for r in rows]
        return self.engine.admissible_moved(list(sizes), shards) is not None

    def take(self, version: int, count: int) -> Departing:
        """Takes the ``count`` requests of ``version`` with the lowest sample ids out of this driver, for another's
        :meth:`put`: live ones with their tokens, log-probs, decode rows and KV pages (:meth:`Engine.take_rows`).

        Raises:
          EngineError: fewer requests of ``version`` here, or a program still in flight (:meth:`read_in_flight` first).
        """
        if self._launched:
            raise EngineError("take: a dispatched program is still in flight; read_in_flight first")
        pending, live = self._chosen(version, count)
        if len(pending) + len(live) < count:
            raise EngineError(f"take: {count} requests of policy version {version} asked for, "
                              f"{len(pending) + len(live)} here")
        for x in pending:
            self._pending.remove(x)
        rows = None
        if live:
            g = self._groups[version]
            slots = [g.slots.index(x) for x in live]
            rows = self.engine.take_rows(g.state, slots)
            for slot in slots:
                g.clear(slot)
        return Departing(version, pending, live, rows)

    def put(self, departing: Departing) -> None:
        """Puts requests from another driver's :meth:`take` here: pending ones wait for admission, live ones take
        free slots with their KV pages copied over and decode on (no prefill again). Check :meth:`fits` first.

        Raises:
          EngineError: the version is not loaded here, or the engine has no room for them now.
        """
        g = self._groups.get(departing.version)
        if g is None:
            raise EngineError(f"policy version {departing.version} is not loaded (loaded: {self.versions})")
        lives = departing.live
        if lives:
            full = self.engine.max_concurrent_decodes
            need = g.live + len(lives)
            if need > full:
                raise EngineError(f"put: {len(lives)} live requests, {full - g.live} free slots")
            if need > len(g.slots):
                self._resize(g, full if self.shards > 1 else min(bucket(need, minimum=1), full))
            written = departing.rows.written.tolist()
            slots = [int(s) for s in self._rows_by_room(g.slots, [self.engine.pages_needed(w) for w in written])]
            limits = [len(x.request.prompt_ids) + x.request.max_new_tokens for x in lives]
            g.state = self.engine.put_rows(g.state, departing.rows, slots, limits)
            for x in lives:
                x.stops = self._stops(x.request)
            g.put(list(zip(slots, lives)))
        self._pending.extend(departing.pending)

    # -- the loop -------------------------------------------------------------------------------------------

    def _resize(self, g: _Group, capacity: int) -> None:
        rows = [i for i, s in enumerate(g.slots) if s is not None]
        if g.state is None:
            g.state = self.engine.init_decode_state(capacity)
        else:
            g.state = self.engine.resize(g.state, rows, capacity)
        g.slots = [g.slots[i] for i in rows] + [None] * (capacity - len(rows))
        stops = np.full((capacity, g.stops.shape[1]), -1, np.int32)
        stops[:len(rows)] = g.stops[rows]
        g.stops = stops

    def _finish(self, live: _Live, reason: str, now: float) -> Trajectory:
        r = live.request
        return Trajectory(r.sample_id, r.version, list(r.prompt_ids), live.tokens, live.logprobs, reason,
                          live.submitted_s, live.started_s, now)

    def _stops(self, request: Request) -> tuple[int, ...]:
        return self._eos_tuple + tuple(i for i in request.stop_ids if i not in self.eos_ids)

    def _reason(self, live: _Live, token: int) -> str | None:
        r = live.request
        if token in self.eos_ids:
            return "eos"
        if token in r.stop_ids:
            return "stop"
        if len(live.tokens) >= r.max_new_tokens:
            return "length"
        return None

    def _admit(self, done: list[Trajectory], admitted: list[tuple[Any, list[_Live]]]) -> None:
        """Admits pending requests into free capacity, oldest first: one version's are prefilled together
        (:meth:`Engine.prefill_batch`), their first tokens read with one transfer and inserted with one update. With
        ``overlap`` the first tokens are read with the next step's results (``admitted``)."""
        free = self.engine.max_concurrent_decodes - sum(g.live for g in self._groups.values())
        taken: dict[int, list[tuple[Request, float]]] = {}
        # The oldest requests wait until the pool can take them safely (nothing is evicted for them).
        for _ in range(self.admissible_count(free)):
            request, submitted = self._pending.popleft()
            taken.setdefault(request.version, []).append((request, submitted))
        n = len(self.shared_prefix)
        for version, items in taken.items():
            g = self._groups[version]
            # Prompts that continue the shared prefix are prefilled after it; any other prompt whole.
            after = [x for x in items if continues(self.shared_prefix, x[0].prompt_ids)]
            whole = [x for x in items if not continues(self.shared_prefix, x[0].prompt_ids)]
            if after and g.prefix is None:
                g.prefix = self.engine.prefill_shared_prefix(params=g.params, tokens=self.shared_prefix,
                                                             version=version)
                self.stats.prefilled_tokens += n
            for chunk in self.prefill_chunks(whole):
                self._prefill_and_insert(g, chunk, done, admitted, None)
            for chunk in self.prefill_chunks(after, skip=n):
                self._prefill_and_insert(g, chunk, done, admitted, g.prefix)

    def admissible_count(self, free: int) -> int:
        """How many of the oldest pending requests (at most ``free``) the pool takes now: the longest head of the
        queue :meth:`Engine.admissible` accepts together. A request joining only makes a set harder to admit, so this
        bisects rather than testing each head."""
        k = min(free, len(self._pending))
        if k <= 0:
            return 0
        sizes = [(len(r.prompt_ids), len(r.prompt_ids) + r.max_new_tokens)
                 for r, _ in itertools.islice(self._pending, k)]
        if self.engine.admissible(sizes) is not None:
            return k
        good, bad = 0, k  # admissible(sizes[:good]) holds (nothing at all, or tested); sizes[:bad] is refused
        while bad - good > 1:
            mid = (good + bad) // 2
            if self.engine.admissible(sizes[:mid]) is not None:
                good = mid
            else:
                bad = mid
        return good

    def prefill_chunks(self, items: list[tuple[Request, float]], skip: int = 0) -> list[list[tuple[Request, float]]]:
        """Splits admitted requests so that (distinct prompts x bucket of the tokens prefilled from ``skip``) stays
        within the budget; without ``batch_prefill``, one request per chunk."""
        if not items:
            return []
        if not self.batch_prefill:
            return [[item] for item in items]
        chunks: list[list[tuple[Request, float]]] = [[]]
        prompts: set[tuple[int, ...]] = set()
        longest = 0
        for item in items:
            p = item[0].prompt_ids
            grown, new_longest = prompts | {p}, max(longest, len(p) - skip)
            cost = prompt_rows(len(grown), self.engine.max_concurrent_decodes) * bucket(new_longest)
            if p not in prompts and chunks[-1] and cost > self.prefill_tokens:
                chunks.append([])
                grown, new_longest = {p}, len(p) - skip
            chunks[-1].append(item)
            prompts, longest = grown, new_longest
        return chunks

    def _prefill_and_insert(self, g: _Group, chunk: list[tuple[Request, float]], done: list[Trajectory],
                            admitted: list[tuple[Any, list[_Live]]], prefix: SharedPrefix | None) -> None:
        started = time.perf_counter()
        requests = [r for r, _ in chunk]
        batch, first = self.engine.prefill_batch(params=g.params, prompts=[r.prompt_ids for r in requests],
                                                 sample_ids=[r.sample_id for r in requests], version=g.version,
                                                 samplings=[r.sampling for r in requests], shared_prefix=prefix)
        distinct = {r.prompt_ids for r in requests}
        skip = 0 if prefix is None else len(prefix.tokens)
        self.stats.prefill_rows += len(distinct)
        self.stats.prefilled_tokens += sum(len(p) - skip for p in distinct)
        lives: list[_Live | None] = []
        if self.overlap:
            # Reading the first tokens now would wait for the step in flight (one device stream): insert every
            # request, its first token counted in flight, and read it with the next step's results.
            lives = [_Live(request, [], [], submitted, started, in_flight=1, stops=self._stops(request))
                     for request, submitted in chunk]
            admitted.append((first, list(lives)))
        else:
            self.stats.wait(first.data)
            cols = first.to_host().columns()
            for i, (request, submitted) in enumerate(chunk):
                live = _Live(request, [int(cols["token"][i])], [float(cols["logprob"][i])], submitted, started,
                             stops=self._stops(request))
                reason = self._reason(live, live.tokens[0])
                if reason is not None:
                    done.append(self._finish(live, reason, time.perf_counter()))
                    live = None
                lives.append(live)
        need = g.live + sum(x is not None for x in lives)
        if need == g.live:
            return
        if need > len(g.slots):
            full = self.engine.max_concurrent_decodes
            self._resize(g, full if self.shards > 1 else min(bucket(need, minimum=1), full))
        slots = self._free_rows(g, lives)
        limits = [len(r.prompt_ids) + r.max_new_tokens for r in requests]
        g.state = self.engine.insert_batch(batch, g.state, slots, limits)
        g.put([(slot, live) for slot, live in zip(slots, lives) if slot is not None])

    def _free_rows(self, g: _Group, lives: list[_Live | None]) -> list[int | None]:
        """A free row of ``g`` for each live request, in order (:meth:`_rows_by_room`, each taking its prompt's
        pages)."""
        return self._rows_by_room(g.slots, [None if live is None else
                                            self.engine.pages_needed(len(live.request.prompt_ids)) for live in lives])

    def _rows_by_room(self, slots: list[Any], pages: list[int | None]) -> list[int | None]:
        """A free row among ``slots`` for each entry of ``pages`` that is not None, in order; across batch
        shards, each in the shard with the most pages left after the rows before it took theirs (a shard's pages
        serve only its rows)."""
        free = [i for i, s in enumerate(slots) if s is None]
        if self.shards == 1:
            it = iter(free)
            return [None if p is None else next(it) for p in pages]
        cap = len(slots)
        room = {k: self.engine.shard_pages_available(k) for k in range(self.shards)}
        out: list[int | None] = []
        for p in pages:
            if p is None:
                out.append(None)
                continue
            row = max(free, key=lambda i: (room[self.engine.row_shard(cap, i)], -i))
            free.remove(row)
            room[self.engine.row_shard(cap, row)] -= p
            out.append(row)
        return out

    def step(self) -> list[Trajectory]:
        """Admits pending requests, runs one decode dispatch of every version group (at most ``decode_steps``
        steps) and returns what finished. With ``fuse`` all groups step in one program (:meth:`Engine.generate_steps`);
        with ``overlap`` it returns what the previous step finished while this one runs."""
        self.dispatch()
        return self.harvest()

    def dispatch(self) -> None:
        """First half of :meth:`step`: admits and dispatches a decode step (:meth:`launch`) for :meth:`harvest`."""
        with self.stats.host_time():
            self._launched.append(self.launch())
            self._count_held()

    def harvest(self) -> list[Trajectory]:
        """Second half of :meth:`step`: reads back the oldest dispatched step (with ``overlap``, the one before the
        newest) and returns what finished."""
        with self.stats.host_time():
            out: list[Trajectory] = []
            if len(self._launched) > (1 if self.overlap else 0):
                out += self.collect(self._launched.popleft())
            if self._launched and (not self._launched[0].active or all(g.live == 0 for g in self._groups.values())):
                # With overlap, the newest launch is read at once when it dispatched no step (only its admitted
                # requests' first tokens are left to read), or when every row of its step belongs to a finished
                # trajectory (an eos or stop at the step just read): nothing would run beside it, and keeping it
                # would keep its groups alive past the end of the work.
                out += self.collect(self._launched.popleft())
        return out

    def launch(self) -> "_Launched":
        """Admits pending requests and dispatches one decode program without waiting for it; :meth:`collect` reads
        it back."""
        done: list[Trajectory] = []
        admitted: list[tuple[Any, list[_Live]]] = []
        self._admit(done, admitted)
        # A group steps while a row of it can still produce a token: with overlap, rows whose last token is
        # already being computed by the step in flight need no other.
        active = [g for g in self._groups.values() if any(s is not None and s.needs_step for s in g.slots)]
        if not active:
            return _Launched(done, [], [], 1, admitted=admitted)
        filtered = any(g.filtering for g in active)
        return self._dispatch_decode(done, active, filtered, admitted)

    def _dispatch_decode(self, done: list[Trajectory], active: list[_Group], filtered: bool,
                         admitted: list[tuple[Any, list[_Live]]]) -> "_Launched":
        """The decode part of :meth:`launch` (:meth:`Engine.generate_steps`): each live row may produce up to
        ``decode_steps`` tokens (fewer where ``max_new_tokens`` ends sooner) and stops on the device at an eos or stop
        id. The program ends where the host would act: while requests wait, at the step that frees
        1/:data:`ADMIT_SLOTS_FRACTION` of the slots; otherwise where a group could compact."""
        n = self.decode_steps
        fused = self.fuse and len(active) > 1
        floor = max(len(g.slots) for g in active) if fused else 1
        for g in active:  # fused groups share one capacity, as in launch
            if len(g.slots) < floor:
                self._resize(g, floor)
        budgets, final = [], []
        for g in active:  # each live row's budget, and whether its budget's last token ends it
            left = np.array([0 if s is None or s.finished else s.request.max_new_tokens - len(s.tokens) - s.in_flight
                             for s in g.slots], np.int64)
            budgets.append(np.clip(left, 0, n).astype(np.int32))
            final.append((left > 0) & (left <= n))
        stops = [g.stops for g in active]
        if self._pending or self.waiting_outside:  # freed slots take waiting requests
            want = max(1, self.engine.max_concurrent_decodes // ADMIT_SLOTS_FRACTION)
            if not self.waiting_outside:
                want = min(want, len(self._pending))
            end_after = [min(want, g.live) for g in active]
        elif self.compact:  # frees that bring a group to half its rows, where _compact shrinks it
            end_after = [max(g.live - len(g.slots) // 2, 0) for g in active]
        else:
            end_after = [0] * len(active)
        programs = [list(range(len(active)))] if fused or len(active) == 1 else [[i] for i in range(len(active))]
        results, granted = [], [None] * len(active)
        for idx in programs:
            # The engine cuts a budget the page pool cannot serve now (that slot waits), and then its final flag.
            states, result = self.engine.generate_steps(
                [active[i].params for i in idx], [active[i].state for i in idx], steps=n,
                budgets=[budgets[i] for i in idx], stop_ids=[stops[i] for i in idx], final=[final[i] for i in idx],
                end_after=[end_after[i] for i in idx], filtered=filtered)
            for i, state, got in zip(idx, states, result.granted):
                active[i].state = state
                granted[i] = got
            results.append(result)
        self.stats.page_waits += sum(int((got < want).sum()) for got, want in zip(granted, budgets))
        rows = [list(g.slots) for g in active]
        steady = sum(g.live for g in self._groups.values()) == self.engine.max_concurrent_decodes
        for slots, got in zip(rows, granted):
            taken = got.tolist()
            for i in np.flatnonzero(got).tolist():
                slots[i].in_flight += taken[i]
            # Every live row that is not already finished runs the whole program.
            if steady and not (got == n).all():
                steady = all(slots[i] is None or slots[i].finished for i in np.flatnonzero(got != n).tolist())
        self._count_kv()
        # The steady state: every slot live, and each may run the whole program (none about to drain).
        return _Launched(done, active, results, floor, fused=fused, rows=rows, admitted=admitted,
                         budgets=[g.tolist() for g in granted], stops=stops, steady=steady)

    def collect(self, launched: "_Launched") -> list[Trajectory]:
        """Reads a launched step's results (one device-to-host transfer) and returns what finished."""
        done, active = launched.done, launched.active
        for first, lives in launched.admitted:  # first tokens before the step's: they come first
            self.stats.wait(first.data)
            cols = first.to_host().columns()
            now = time.perf_counter()
            for i, live in enumerate(lives):
                live.in_flight -= 1
                self._append(live, int(cols["token"][i]), float(cols["logprob"][i]), now, done)
        for g in self._groups.values():
            self._free(g)
        if not active:  # nothing was dispatched
            return done
        self.stats.wait([r.data for r in launched.results])
        # One transfer per program, each row's tokens in step order; the rows computed are the program's rows
        # times the steps it ran.
        per_group, ran = [], []
        groups = list(zip(active, launched.rows, launched.budgets, launched.stops))
        programs = [groups] if len(launched.results) == 1 else [[x] for x in groups]  # fused, or one per group
        for result, members in zip(launched.results, programs):
            host = result.to_host()
            cols, steps = host.columns(), host.steps_run()
            ran.append(steps)
            self.stats.batch_steps += steps
            row = 0
            for g, rows, budgets, stops in members:
                self.stats.rows_computed += len(rows) * steps
                per_group.append((g, rows, budgets, stops, {k: v[:, row:row + len(rows)] for k, v in cols.items()}))
                row += len(rows)
        now = time.perf_counter()
        floor = bucket(max(g.live for g in active), minimum=1) if launched.floor > 1 else 1
        for g, rows, budgets, stops, cols in per_group:
            self._take_steps(g, rows, budgets, stops, cols, now, done, floor)
        self.stats.count_dispatch(max(ran), launched.steady)
        return done

    def _append(self, live: _Live, token: int, logprob: float, now: float, done: list[Trajectory]) -> None:
        """One token of a live trajectory; at its last, the trajectory is finished and its slot freed where it is
        now (rows compare by identity)."""
        live.tokens.append(token)
        live.logprobs.append(logprob)
        self._ended(self._groups[live.request.version], live, token, now, done)

    def _ended(self, g: _Group, live: _Live, token: int, now: float, done: list[Trajectory],
               slot: int | None = None) -> None:
        """Finishes ``live`` if ``token``, its last, ends it, freeing its slot (``slot``: where it was at dispatch)."""
        reason = self._reason(live, token)
        if reason is None:
            return
        live.finished = True
        done.append(self._finish(live, reason, now))
        if slot is None or slot >= len(g.slots) or g.slots[slot] is not live:
            slot = g.slots.index(live)
        g.clear(slot)
        g.freed.append(slot)

    def _free(self, g: _Group) -> None:
        """Frees the rows of ``g`` ended since the last call, in one program."""
        if g.freed:
            g.state = self.engine.free_slots(g.state, g.freed)
            g.freed = []

    def _take_steps(self, g: _Group, rows: list[_Live | None], budgets: list[int], stops: np.ndarray,
                    cols: dict[str, np.ndarray], now: float, done: list[Trajectory], floor: int = 1) -> None:
        """:meth:`_take` for several steps (``cols`` [steps, rows]; ``stops``: the stop table at dispatch): each
        row's valid tokens, in order, up to the one that ends its trajectory."""
        valid, tokens = cols["valid"], cols["token"]
        counts = valid.sum(axis=0)
        step = np.arange(valid.shape[0])[:, None]
        order = valid == (step < counts)  # each row's tokens are the first steps'
        ours = ~valid | (cols["version"] == g.version)
        stop = (tokens[..., None] == stops[None]).any(axis=-1) & valid  # an eos or one of the row's stop ids
        early = stop & (step < counts - 1)  # a stop before the row's last token
        granted = np.asarray(budgets)
        bad = (~order.all(axis=0) | ~ours.all(axis=0) | early.any(axis=0) | (counts > granted)).tolist()
        ends = stop[np.maximum(counts - 1, 0), np.arange(counts.size)].tolist()
        toks, lps = tokens.T.tolist(), cols["logprob"].T.tolist()
        # A row with no budget and no token has nothing to book: the empty rows of a draining group are skipped.
        busy = np.flatnonzero((granted > 0) | (counts > 0)).tolist()
        counts = counts.tolist()
        produced = 0
        for slot in busy:
            live = rows[slot]
            if live is None:
                continue
            live.in_flight -= budgets[slot]
            n = counts[slot]
            if live.finished or not n:  # ended before this program's results (the device stopped it: no tokens)
                continue
            if bad[slot]:
                raise RuntimeError(f"slot {slot} of version {g.version} returned {n} tokens out of order, past its "
                                   f"end or past its budget of {budgets[slot]}")  # engine bug
            produced += n
            live.tokens += toks[slot][:n]
            live.logprobs += lps[slot][:n]
            if ends[slot] or len(live.tokens) >= live.request.max_new_tokens:
                self._ended(g, live, toks[slot][n - 1], now, done, slot)
        self.stats.rows_live += produced
        self._free(g)
        self._compact(g, floor)

    def _compact(self, g: _Group, floor: int) -> None:
        """Shrinks a group once at most half its rows are live and no request waits for its version; not below
        ``floor``, the fused groups' capacity."""
        target = max(bucket(g.live, minimum=1), floor)
        if self.compact and g.live and target <= len(g.slots) // 2 and not any(r.version == g.version for r, _ in self._pending):
            self._resize(g, target)

    def run(self, requests: Iterable[Request] = ()) -> list[Trajectory]:
        """Submits ``requests`` and steps until everything has finished."""
        return run_all(self, requests)


def run_all(driver, requests: Iterable[Request]) -> list[Trajectory]:
    """Submits ``requests`` to a driver (or :class:`~dora_jax.rollout.groups.DriverGroups`) and steps it until all finish."""
    for r in requests:
        driver.submit(r)
    out: list[Trajectory] = []
    while not driver.idle:
        out.extend(driver.step())
    return out


def default_overlap(engine: Engine) -> bool:
    """Overlap host and device (see :class:`RolloutDriver`) unless the engine decodes on CPU."""
    mesh = engine.mesh
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return device.platform != "cpu"
