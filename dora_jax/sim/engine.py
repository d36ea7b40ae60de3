"""The discrete-event core: rollout instances with continuous batching, one trainer, and the real scheduler.

Events are sample completions, admissions and updates, not decode steps: between two events an instance's
batch is fixed, so the time of ``k`` decode steps is a closed-form sum (contexts grow by one token per row per
step) and a run over tens of thousands of samples takes seconds. Decisions come from
:class:`dora_jax.dora.scheduler.Scheduler` (``sync``, ``one_step_off``, ``dora``: ``dispatch``, ``assign_slots``,
``next_batch``, ``trained``) or from :class:`PartialRollout`; the ledger records every transition and is
checked with :meth:`Ledger.check` when the run ends.

Conventions: a prompt is prefilled when it is admitted to a slot (the instance stalls for the prefill), each
decode step then yields one token per live row, and a row of length ``L`` frees its slot after ``L`` steps.
Rows join at step boundaries. An update costs the trainer ``train_time + weight_sync_s``; the new version is
published (and new prompts use it) when both are done.

An instance holds the weights of one policy version at a time (a 32B-class model's weights fill a fifth of
an 80 GB GPU at TP 4: a second resident version would take 30% of its KV cache, and K + 1 = 6 would not fit),
so every row on it is of that version. Switching versions costs the instance ``weight_sync_s`` (it loads the
version's weights), except under colocated sync, where the update's own weight sync leaves the new weights in
the engines. Partial rollout stops every instance at its next step boundary after an update, loads the new
weights and re-prefills each live row's prompt and generated tokens; its rows of any version share an instance.
DORA with every version on every instance (``versions_per_instance: all``) mixes rows of the live versions on an
instance (:attr:`Instance.mix`); a step then pays each version's weight matmuls (:meth:`Costs.mixed_decode_time`).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from dora_jax.dora.ledger import Group, Ledger
from dora_jax.dora.scheduler import SchedulePolicy, Scheduler
from dora_jax.sim.config import Costs

_LIVE = ("pending", "in_flight", "finished")


class SimLedger(Ledger):
    """A :class:`Ledger` whose ``outstanding()`` and ``group_ready()`` are kept incrementally (O(1) instead of
    a scan over every sample), so the scheduler's queries stay cheap over long runs, and whose ``start``,
    ``finish`` and ``consume`` (once per sample) take a direct path. Same answers and errors as the base class
    (a test compares them)."""

    def __init__(self) -> None:
        super().__init__()
        self._out: Counter = Counter()  # version -> samples pending, in flight or finished
        self._left: dict[int, int] = {}  # group id -> members not in the finished state (ready at 0)
        self._ready: set[int] = set()

    def add_group(self, group_id, sample_ids, version, prompt_index) -> Group:
        g = super().add_group(group_id, sample_ids, version, prompt_index)
        self._out[version] += len(g.sample_ids)
        self._left[group_id] = len(g.sample_ids)
        return g

    def _track(self, e, before: str) -> None:
        if before in _LIVE and e.state not in _LIVE:
            self._out[e.version] -= 1
            if not self._out[e.version]:
                del self._out[e.version]
        gid = e.group_id
        left = self._left[gid] - (e.state == "finished") + (before == "finished")
        self._left[gid] = left
        if left:
            self._ready.discard(gid)
        else:
            self._ready.add(gid)

    def _move(self, sample_id, frm, to):
        e = self.entries.get(sample_id)
        if e is None or e.state not in frm:
            return super()._move(sample_id, frm, to)  # raises, naming the sample and its state
        before = e.state
        counts = self._counts
        counts[before] -= 1
        counts[to] += 1
        e.state = to
        if "finished" in (to, before) or (before in _LIVE and to not in _LIVE):
            self._track(e, before)  # (a move between pending and in flight changes neither figure)
        return e

    def start(self, sample_id: int) -> None:
        try:
            e = self.entries[sample_id]
        except KeyError:
            e = None
        if e is None or e.state != "pending":
            return super().start(sample_id)  # raises, naming the sample and its state
        counts = self._counts
        counts["pending"] -= 1
        counts["in_flight"] += 1
        e.state = "in_flight"

    def finish(self, sample_id: int) -> bool:
        """As :meth:`Ledger.finish`; returns whether the sample's group is now ready."""
        try:
            e = self.entries[sample_id]
        except KeyError:
            e = None
        if e is None or e.state != "in_flight" or self._causes:
            super().finish(sample_id)  # raises on a wrong state; a group that lost a member filters it
            return self.group_ready(self.entries[sample_id].group_id)
        counts = self._counts
        counts["in_flight"] -= 1
        counts["finished"] += 1
        e.state = "finished"
        gid = e.group_id
        left = self._left[gid] - 1
        self._left[gid] = left
        if left:
            return False  # (and it was not ready before either)
        self._ready.add(gid)
        return True

    def consume(self, group_ids, trainer_version: int) -> None:
        """As :meth:`Ledger.consume`."""
        entries, counts, out = self.entries, self._counts, self._out
        for gid in group_ids:
            if gid not in self._ready:
                return super().consume([gid], trainer_version)  # raises, naming the member states
            members = self.groups[gid].sample_ids
            for s in members:  # each finished (the group is ready), none consumed yet
                e = entries[s]
                e.state, e.trained_at = "consumed", trainer_version
                out[e.version] -= 1
                if not out[e.version]:
                    del out[e.version]
            counts["finished"] -= len(members)
            counts["consumed"] += len(members)
            self._left[gid] = len(members)
            self._ready.discard(gid)

    def _filter_one(self, e, reason) -> None:
        before = e.state
        super()._filter_one(e, reason)
        self._track(e, before)

    def outstanding(self) -> dict[int, int]:
        return dict(self._out)

    def group_ready(self, group_id: int) -> bool:
        return group_id in self._ready

    def ready_group_ids(self) -> list[int]:
        return list(self._ready)

    def ready_groups(self) -> int:
        """How many groups are ready (every member finished, none consumed)."""
        return len(self._ready)


class PartialRollout:
    """Partial rollout: new groups on the newest version while fewer than ``rollout_batch`` samples are
    outstanding; the trainer takes ``train_batch`` samples (whole ready groups, oldest first) as soon as they
    are ready; in-flight trajectories continue on each new version (so one trajectory mixes versions and its
    staleness, counted from the version it started on, has no bound but the one ``rollout_batch`` implies)."""

    def __init__(self, train_batch: int, group_size: int, total_samples: int, rollout_batch: int):
        self.train_batch, self.group_size, self.total = train_batch, group_size, total_samples
        self.rollout_batch = rollout_batch
        self.ledger = SimLedger()
        self.version = self.next_group = self.next_sample = self.trained_samples = 0

    def dispatch(self) -> list[Group]:
        out = []
        outstanding = sum(self.ledger.outstanding().values())
        while (outstanding + self.group_size <= self.rollout_batch
               and self.trained_samples + outstanding + self.group_size <= self.total):
            ids = range(self.next_sample, self.next_sample + self.group_size)
            out.append(self.ledger.add_group(self.next_group, ids, self.version, self.next_group))
            self.next_group += 1
            self.next_sample += self.group_size
            outstanding += self.group_size
        return out

    def assign_slots(self, free: int, pending: dict[int, int]) -> dict[int, int]:
        """Oldest work first (every row runs on the newest weights anyway)."""
        out = {}
        for v in sorted(pending):
            take = min(free, pending[v])
            if take:
                out[v], free = take, free - take
        return out

    def next_batch(self) -> list[int] | None:
        need = min(self.train_batch, self.total - self.trained_samples) // self.group_size
        ready = sorted(g for g in self.ledger.groups if self.ledger.group_ready(g))
        return ready[:need] if need and len(ready) >= need else None

    def trained(self, group_ids: list[int]) -> None:
        self.ledger.consume(group_ids, self.version)
        self.trained_samples += sum(len(self.ledger.groups[g].sample_ids) for g in group_ids)
        self.version += 1

    def done(self) -> bool:
        return self.trained_samples >= self.total


@dataclass(slots=True)
class Row:
    version: int
    prompt: int  # prompt tokens
    start: int  # instance step counter when it joined
    before: int  # tokens generated before joining this instance's batch (partial rollout re-prefill)
    target: int  # step counter at which it finishes


@dataclass(slots=True)
class Instance:
    """One rollout engine: ``slots`` decode slots, a step counter and the one policy version whose weights it
    holds (``loaded``; every row on it decodes with those weights). Its state is valid at time ``t``."""

    slots: int
    t: float = 0.0
    counter: int = 0
    base: int = 0  # sum over rows of (prompt + before - start): contexts sum to base + n * counter
    rows: dict[int, Row] = field(default_factory=dict)
    heap: list[tuple[int, int]] = field(default_factory=list)
    loaded: int | None = None  # policy version of the weights on the instance (None: none yet)
    gen: int = 0  # bumps invalidate queued events
    reprefill: bool = False
    check: bool = False  # re-examine a hand-off at the next step boundary
    busy_slot_s: float = 0.0
    reloads: int = 0  # weight loads (version switches)
    moved_in: int = 0  # rows received from another instance of the same version
    moved_tokens: int = 0  # their context tokens (prompt and generated), whose KV cache came with them
    moved_s: float = 0.0  # seconds this instance spent receiving them
    # One version per instance under the balancer: rows handed over to this instance and waiting for its next step
    # boundary, (sample id, tokens generated); rows a plan's moves still owe it; the moves it makes at its next
    # boundary, (destination, rows); the version it loads once they are made (None: it keeps its own).
    inbox: deque = field(default_factory=deque)
    incoming: int = 0
    outbox: list[tuple[int, int]] = field(default_factory=list)
    switch_to: int | None = None
    draining: bool = False  # a plan said so: it admits nothing new until a later plan reassigns it
    pull: bool = False  # every version resident: load the newest at the next step boundary
    mix: Counter | None = None  # every version resident: rows per version on the instance (no zero entries)

    def ctx(self) -> int:
        return self.base + len(self.rows) * self.counter

    def step_terms(self, costs: Costs) -> tuple[float, float]:
        """The next step's seconds and what one more context token adds to a step, for the rows on the instance."""
        n, ctx = len(self.rows), self.ctx()
        if self.mix is not None and len(self.mix) > 1:
            counts = tuple(self.mix.values())
            return costs.mixed_decode_time(counts, ctx), costs.mixed_ctx_rate(counts, ctx)
        return costs.decode_time(n, ctx), costs.ctx_rate(n, ctx)

    def steps_time(self, costs: Costs, k: int) -> float:
        """Seconds for ``k`` decode steps from the current state (contexts grow by one token per step)."""
        n = len(self.rows)
        if k <= 0 or n == 0:
            return 0.0
        first, rate = self.step_terms(costs)
        return k * first + rate * n * k * (k - 1) / 2

    def steps_by(self, costs: Costs, dt: float) -> int:
        """The smallest ``k`` whose ``k`` steps end at or after ``dt`` seconds from ``t``."""
        if dt <= 0 or not self.rows:
            return 0
        n = len(self.rows)
        first, rate = self.step_terms(costs)
        a = rate * n / 2
        b = first - a
        k = dt / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)
        k = max(0, math.ceil(k) - 1)
        while self.steps_time(costs, k) < dt:
            k += 1
        return k

    def add(self, sid: int, row: Row) -> None:
        self.rows[sid] = row
        self.base += row.prompt + row.before - row.start
        heapq.heappush(self.heap, (row.target, sid))
        if self.mix is not None:
            self.mix[row.version] += 1

    def remove(self, sid: int) -> Row:
        """Takes ``sid``'s row off the instance (its entry in :attr:`heap` is left for the caller)."""
        row = self.rows.pop(sid)
        self.base -= row.prompt + row.before - row.start
        if self.mix is not None:
            self.unmix(row.version)
        return row

    def unmix(self, version: int) -> None:
        mix = self.mix
        mix[version] -= 1
        if not mix[version]:
            del mix[version]

    def generated(self, row: Row) -> int:
        """Tokens ``row`` has generated so far (before it joined this instance and here)."""
        return row.before + self.counter - row.start


@dataclass
class Placement:
    """How the cluster is split: ``instances`` rollout engines and ``trainer_gpus``; colocated means the
    trainer uses the rollout GPUs in turn (sync only)."""

    instances: int
    slots: int
    trainer_gpus: int
    colocated: bool = False


def decode_table(costs: Costs, slots: int) -> tuple[list[float], list[float], float] | None:
    """The terms of a decode step of ``n <= slots`` rows under the linear model of :class:`Costs` (``decode_time``
    and ``ctx_rate`` not overridden), computed once: ``fixed[n]`` (``decode_step_s + max(decode_weights_s,
    n * decode_row_s)``), ``slope[n]`` (``ctx_rate * n``) and ``ctx_rate``, so that ``fixed[n] + ctx * ctx_rate``
    is ``decode_time(n, ctx)`` in the same operations, to the bit. None for another cost model."""
    if type(costs).decode_time is not Costs.decode_time or type(costs).ctx_rate is not Costs.ctx_rate:
        return None
    rate = costs.decode_ctx_s
    fixed = [costs.decode_step_s + max(costs.decode_weights_s, n * costs.decode_row_s) for n in range(slots + 1)]
    return fixed, [rate * n for n in range(slots + 1)], rate


def make_policy(mode: str, train_batch: int, group_size: int, total: int, k: int = 0,
                rollout_batch: int = 0):
    """The scheduler for ``mode``: a real :class:`Scheduler` for sync / one_step_off / dora, or
    :class:`PartialRollout`."""
    if mode == "partial":
        return PartialRollout(train_batch, group_size, total, rollout_batch)
    k = {"sync": 0, "one_step_off": 1}.get(mode, k)
    rb = rollout_batch if mode == "dora" else train_batch
    return Scheduler(SchedulePolicy(mode, k, rb, train_batch, group_size, total), SimLedger())
