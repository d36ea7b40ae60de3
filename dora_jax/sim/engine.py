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
so every row on it is of that version. Switching versions costs the instance ``weight_sync_s`` (it loads the version's weights), except
under colocated sync, where the update's own weight sync leaves the new weights in the engines. Partial rollout
stops every instance at its next step boundary after an update, loads the new weights and re-prefills each
live row's prompt and generated tokens; its rows of any version share an instance.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

from dora_jax.dora.ledger import Group, Ledger
from dora_jax.dora.scheduler import SchedulePolicy, Scheduler
from dora_jax.sim.config import Costs

_LIVE = ("pending", "in_flight", "finished")


class SimLedger(Ledger):
    """A :class:`Ledger` whose ``outstanding()`` and ``group_ready()`` are kept incrementally (O(1) instead of
    a scan over every sample), so the scheduler's queries stay cheap over long runs. Same answers as the
    base class (a test compares them)."""

    def __init__(self) -> None:
        super().__init__()
        self._out: Counter = Counter()
        self._finished: Counter = Counter()
        self._ready: set[int] = set()

    def add_group(self, group_id, sample_ids, version, prompt_index) -> Group:
        g = super().add_group(group_id, sample_ids, version, prompt_index)
        self._out[version] += len(g.sample_ids)
        return g

    def _track(self, e, before: str) -> None:
        if before in _LIVE and e.state not in _LIVE:
            self._out[e.version] -= 1
            if not self._out[e.version]:
                del self._out[e.version]
        gid = e.group_id
        self._finished[gid] += (e.state == "finished") - (before == "finished")
        if self._finished[gid] == len(self.groups[gid].sample_ids):
            self._ready.add(gid)
        else:
            self._ready.discard(gid)

    def _move(self, sample_id, frm, to):
        before = self.entries[sample_id].state if sample_id in self.entries else None
        e = super()._move(sample_id, frm, to)
        self._track(e, before)
        return e

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


@dataclass
class Row:
    version: int
    prompt: int  # prompt tokens
    start: int  # instance step counter when it joined
    before: int  # tokens generated before joining this instance's batch (partial rollout re-prefill)
    target: int  # step counter at which it finishes


@dataclass
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

    def ctx(self) -> int:
        return self.base + len(self.rows) * self.counter

    def steps_time(self, costs: Costs, k: int) -> float:
        """Seconds for ``k`` decode steps from the current state (contexts grow by one token per step)."""
        n = len(self.rows)
        if k <= 0 or n == 0:
            return 0.0
        first = costs.decode_time(n, self.ctx())
        return k * first + costs.ctx_rate(n, self.ctx()) * n * k * (k - 1) / 2

    def steps_by(self, costs: Costs, dt: float) -> int:
        """The smallest ``k`` whose ``k`` steps end at or after ``dt`` seconds from ``t``."""
        if dt <= 0 or not self.rows:
            return 0
        n = len(self.rows)
        a = costs.ctx_rate(n, self.ctx()) * n / 2
        b = costs.decode_time(n, self.ctx()) - a
        k = dt / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)
        k = max(0, math.ceil(k) - 1)
        while self.steps_time(costs, k) < dt:
            k += 1
        return k

    def advance(self, costs: Costs, k: int) -> None:
        dt = self.steps_time(costs, k)
        self.busy_slot_s += dt * len(self.rows)
        self.t += dt
        self.counter += k

    def add(self, sid: int, row: Row) -> None:
        self.rows[sid] = row
        self.base += row.prompt + row.before - row.start
        heapq.heappush(self.heap, (row.target, sid))

    def remove(self, sid: int) -> Row:
        row = self.rows.pop(sid)
        self.base -= row.prompt + row.before - row.start
        return row

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


def make_policy(mode: str, train_batch: int, group_size: int, total: int, k: int = 0,
                rollout_batch: int = 0):
    """The scheduler for ``mode``: a real :class:`Scheduler` for sync / one_step_off / dora, or
    :class:`PartialRollout`."""
    if mode == "partial":
        return PartialRollout(train_batch, group_size, total, rollout_batch)
    k = {"sync": 0, "one_step_off": 1}.get(mode, k)
    rb = rollout_batch if mode == "dora" else train_batch
    return Scheduler(SchedulePolicy(mode, k, rb, train_batch, group_size, total), SimLedger())
