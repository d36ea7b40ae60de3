"""One policy version per rollout group in a run (``roles.versions_per_group: 1``): when the balancer plans, and how
its plans reach the groups. docs/design.md, "Load balancing", holds the reasoning.

:class:`GroupBalancing` asks :class:`~dora_jax.dora.balancer.Balancer` for a plan at the design's triggers (a
version published, a version drained, and imbalance: a group with no version, a draining group that has emptied,
a version with waiting work and no group, a group idle while another version has more waiting than free slots),
and applies it to the :class:`~dora_jax.rollout.groups.VersionGroups`: draining groups admit nothing, empty
groups change version, their new weights copied from the run's store onto their own devices only.

Requests move between groups with their KV pages where they fit: the balancer gets ``can_move`` per group from
:meth:`~dora_jax.rollout.groups.VersionGroups.movable` (whether the group's requests, split over the other groups of
its version as the balancer splits them, fit those groups' free slots and pages now, by the admission's test), so a
busy group that must change version hands its requests over and changes version at once, or drains where they do
not fit. A move that no longer fits when applied waits, and its group drains (nothing is evicted or dropped).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Mapping

from dora_jax.distributed import gather_decisions
from dora_jax.dora.balancer import Balancer, GroupState, Plan
from dora_jax.rollout.groups import VersionGroups
from dora_jax.run.evaluation import RunError
from dora_jax.run.residency import Residency

RECENT_DECISIONS = 8  # the newest decisions each metrics row names
MOVE_TOTALS = ("moved_requests", "moved_kv_bytes", "move_waits")  # the groups' move totals over the run


def check_saved(saved: Any, groups: int) -> str | None:
    """What is wrong with a checkpoint's balancer totals (:meth:`GroupBalancing.state`) for ``groups`` rollout
    groups, in words (None: nothing)."""
    if not isinstance(saved, dict):
        return f"balancer: {saved!r:.80} is not a mapping"
    want = {*Balancer(groups, max_live=1).counters, *MOVE_TOTALS, "loads"}
    if set(saved) != want:
        return f"balancer: fields {sorted(saved)}, expected {sorted(want)}"
    loads = saved["loads"]
    if not isinstance(loads, list) or len(loads) != groups:
        return f"balancer.loads: {loads!r:.80} is not a list of {groups} counts (one per rollout group)"
    for name, n in [*((k, v) for k, v in saved.items() if k != "loads"), *((f"loads[{i}]", v) for i, v in
                                                                           enumerate(loads))]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return f"balancer.{name}: {n!r:.80} is not a count (an integer >= 0)"
    return None


@dataclasses.dataclass(frozen=True)
class GroupsView:
    """The regular rollout groups and the waiting work as a plan is made from them: this process's, or under several
    processes every process's, group ``g`` of each taken together (slots, requests in flight and waiting summed).
    ``lent``: the elastic group's version and free slots while it is lent (it admits that version's requests
    beside the regular groups)."""

    serving: tuple[int | None, ...]
    draining: frozenset[int]
    slots: tuple[int, ...]
    in_flight: tuple[int, ...]
    waiting: tuple[tuple[int, int], ...]  # (version, requests) with requests waiting, by version
    lent: tuple[int, int] | None = None

    @classmethod
    def of(cls, groups: VersionGroups, waiting: Mapping[int, int]) -> "GroupsView":
        """This process's groups and waiting requests."""
        r, e = range(groups.regular), groups.elastic
        lent = ((groups.serving[e], max(0, groups.group_slots(e) - groups.group_in_flight(e)))
                if e is not None and groups.lent and groups.serving[e] is not None else None)
        return cls(tuple(groups.serving[:groups.regular]), frozenset(groups.draining),
                   tuple(groups.group_slots(i) for i in r), tuple(groups.group_in_flight(i) for i in r),
                   tuple(sorted((int(v), n) for v, n in waiting.items() if n)), lent)

    @classmethod
    def across(cls, views: list["GroupsView"], where: str) -> "GroupsView":
        """Every process's view taken together (they must agree on each group's version and draining).

        Raises:
          RunError: the processes' groups serve or drain differently, naming both.
        """
        first = views[0]
        for p, v in enumerate(views):
            if (v.serving, v.draining) != (first.serving, first.draining):
                raise RunError(f"the processes disagree on the rollout groups {where}: process 0's serve "
                               f"{list(first.serving)} draining {sorted(first.draining)}, process {p}'s serve "
                               f"{list(v.serving)} draining {sorted(v.draining)}")
        waiting: dict[int, int] = {}
        for v in views:
            for version, n in v.waiting:
                waiting[version] = waiting.get(version, 0) + n
        return cls(first.serving, first.draining, tuple(map(sum, zip(*(v.slots for v in views)))),
                   tuple(map(sum, zip(*(v.in_flight for v in views)))), tuple(sorted(waiting.items())))

    def states(self) -> tuple[GroupState, ...]:
        """The groups as the balancer sees them (:class:`~dora_jax.dora.balancer.GroupState`), in order."""
        return tuple(GroupState(v, n, k, i in self.draining)
                     for i, (v, n, k) in enumerate(zip(self.serving, self.slots, self.in_flight)))

    def admitting(self, version: int) -> list[int]:
        """The regular groups that take new requests of ``version``: serving it and not draining."""
        return [i for i, v in enumerate(self.serving) if v == version and i not in self.draining]

    def free_slots(self, version: int) -> int:
        """Free decode slots for new requests of ``version`` (the lent elastic group's included)."""
        free = sum(max(0, self.slots[i] - self.in_flight[i]) for i in self.admitting(version))
        return free + (self.lent[1] if self.lent is not None and self.lent[0] == version else 0)

    def trigger(self) -> str | None:
        """What calls for a plan now, in words (None: nothing): a group idle with no version, or drained; a version
        waiting with no group; a group idle while another version has more waiting than free slots."""
        idle = [i for i, n in enumerate(self.in_flight) if not n]
        for i in idle:
            if self.serving[i] is None:
                return f"group {i} holds no version"
            if i in self.draining:
                return f"group {i} drained"
        for v, n in self.waiting:
            if not self.admitting(v) and not (self.lent is not None and self.lent[0] == v):
                return f"version {v} waits with no group"
        for v, n in self.waiting:
            if n > self.free_slots(v):
                for i in idle:
                    if self.serving[i] != v and i not in self.draining:
                        return f"group {i} idle while version {v} waits"
        return None


class GroupBalancing:
    """Drives a run's balancer over its rollout groups.

    Args:
      groups: the run's rollout groups, one version each.
      residency: the run's versions (the store the groups' weights come from).
      max_live: the live versions, K + 1 (the balancer refuses fewer groups).

    A caller passes the requests waiting per version (published versions only: a version still training has no
    group to wait for) to :meth:`rebalance` before each admission, and with a ``trigger`` after a publish or a
    drain; :meth:`report` is the per-update metrics entry.
    """

    def __init__(self, groups: VersionGroups, residency: Residency, max_live: int, multi: bool = False):
        self.groups, self.residency, self.multi = groups, residency, multi
        self.balancer = Balancer(groups.regular, max_live=max_live)
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT_DECISIONS)
        self.decided = 0  # decisions since the last report
        self._last: tuple[Any, ...] | None = None
        self._moved = (0, 0, 0)  # the groups' move totals at the last report

    def view(self, waiting: Mapping[int, int], where: str) -> GroupsView:
        """The groups and ``waiting`` as the next plan sees them: under several processes every process's together
        (one exchange; every process must call it at the same point)."""
        mine = GroupsView.of(self.groups, waiting)
        if not self.multi:
            return mine
        views = [GroupsView(tuple(d["serving"]), frozenset(d["draining"]), tuple(d["slots"]), tuple(d["in_flight"]),
                            tuple(map(tuple, d["waiting"])))
                 for d in gather_decisions({**dataclasses.asdict(mine), "draining": sorted(mine.draining)})]
        return GroupsView.across(views, where)

    def movable(self) -> tuple[bool, ...]:
        """Per group, whether its requests can move now (:meth:`VersionGroups.movable`): under several processes,
        on every process (one exchange; every process must call it at the same point). Asked only when a plan is
        due: it sizes every busy group's requests against the others' pages."""
        mine = self.groups.movable()
        if not self.multi:
            return tuple(mine)
        return tuple(map(all, zip(*gather_decisions(mine))))

    def rebalance(self, waiting: Mapping[int, int], trigger: str | None = None) -> Plan | None:
        """Plans when ``trigger`` is given or the groups call for one (:meth:`GroupsView.trigger`), and applies the
        plan; returns it (None when nothing called for one, or the inputs are those of the last plan: it would be
        the same). Under several processes every process calls it at the same point, plans from every process's
        groups taken together, and applies the same plan to its own.

        Args:
          waiting: requests waiting to be admitted per published version (held-out ones included), this process's.
          trigger: why the caller asks (a version published or drained), in words.
        """
        view = self.view(waiting, f"at {trigger or 'an admission'}")
        why = trigger or view.trigger()
        newest = self.residency.store.newest
        if why is None or newest is None:
            return None
        movable = self.movable()
        if (view.states(), view.waiting, newest, movable) == self._last:
            return None
        plan = self.balancer.plan(view.states(), dict(view.waiting), newest, can_move=movable)
        if plan.reason:
            waits, before = self.groups.move_waits, [getattr(self.groups, k) for k in MOVE_TOTALS]
            settle = functools.partial(self._settle, before) if self.multi else None
            changed = self.groups.apply(plan, self.residency.load_group, settle)
            self.decided += 1
            loads = ", ".join(f"group {i} -> version {plan.versions[i]}" for i in changed)
            moves = ", ".join(f"{m.count} group {m.src_group} -> {m.dst_group}" for m in plan.moves)
            self.recent.append(f"{why}: {plan.reason}" + (f" ({loads})" if loads else "")
                               + (f"; moving {moves}" if moves else "")
                               + ("; a move waited" if self.groups.move_waits > waits else "")
                               + (f"; draining {sorted(self.groups.draining)}" if self.groups.draining else ""))
            view, movable = self.view(waiting, f"after {why}"), self.movable()
        # The groups as the plan left them: planning them again with the same work would change nothing (a plan's
        # result planned again is the same plan: tests/test_balancer.py checks it on random schedules).
        self._last = (view.states(), view.waiting, newest, movable)
        return plan

    def _settle(self, before: list[int], waited: set[int]) -> set[int]:
        """Under several processes, after this process's moves: the groups whose moves waited on any process, and
        the move totals (``before`` the plan) made every process's (each process moved its own requests)."""
        g = self.groups
        moved = [getattr(g, k) - b for k, b in zip(MOVE_TOTALS, before)]
        everyone = gather_decisions({"waited": sorted(waited), "moved": moved})
        for k, b, *deltas in zip(MOVE_TOTALS, before, *(e["moved"] for e in everyone)):
            setattr(g, k, b + sum(deltas))
        return {i for e in everyone for i in e["waited"]}

    def trigger(self, waiting: Mapping[int, int]) -> str | None:
        """What calls for a plan now in this process's groups, in words (None: nothing; :meth:`GroupsView.trigger`)."""
        return GroupsView.of(self.groups, waiting).trigger()

    def report(self) -> dict[str, Any]:
        """The per-update metrics entry: the balancer's counters (totals over the run), group version loads, each
        group's version and the draining groups now, and the decisions since the previous report (the newest
        :data:`RECENT_DECISIONS`, each ``trigger: reason``)."""
        g = self.groups
        moved = (g.moved_requests, g.moved_kv_bytes, g.move_waits)
        out = {**self.balancer.counters, "loads": sum(g.loads), "versions": list(g.serving),
               "draining": sorted(g.draining), "decided": self.decided, "decisions": list(self.recent),
               "moved_requests": moved[0] - self._moved[0], "moved_kv_bytes": moved[1] - self._moved[1],
               "move_waits": moved[2] - self._moved[2]}
        self.recent.clear()
        self.decided = 0
        self._moved = moved
        return out

    def state(self) -> dict[str, Any]:
        """The run's totals a checkpoint saves (:meth:`restore` continues them): the balancer's counters, each
        group's version loads and the move totals."""
        g = self.groups
        return {**self.balancer.counters, "loads": list(g.loads), **{k: getattr(g, k) for k in MOVE_TOTALS}}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continues the totals of a checkpoint's :meth:`state` (checked by :func:`check_saved`): they are added
        to this run's own, which already count the versions a resume loaded into the groups (loaded again: the
        groups' weights are not saved). The next report's move counts start from the saved totals."""
        g = self.groups
        for k in self.balancer.counters:
            self.balancer.counters[k] += saved[k]
        g.loads = [a + b for a, b in zip(g.loads, saved["loads"])]
        for k in MOVE_TOTALS:
            setattr(g, k, getattr(g, k) + saved[k])
        self._moved = tuple(self._moved[i] + saved[k] for i, k in enumerate(MOVE_TOTALS))

    def summary(self) -> dict[str, Any]:
        """The run's totals: the balancer's counters, each group's version loads (its first included), and the
        requests moved between groups, their KV bytes and the moves that waited."""
        g = self.groups
        return {**self.balancer.counters, "loads": list(g.loads), "moved_requests": g.moved_requests,
                "moved_kv_bytes": g.moved_kv_bytes, "move_waits": g.move_waits}


class ElasticLending:
    """The elastic group of a run (``roles.elastic_group``): lent to the newest version while the trainer waits for
    a batch, handed back before each train step (docs/design.md, "The elastic group").

    Args:
      groups: the run's rollout groups, with an elastic group.
      residency: the run's versions (the newest version's weights come from its store, on the trainer's devices).
    """

    FIGURES = ("lends", "moved_out", "wait_s", "busy_s", "rows")

    def __init__(self, groups: VersionGroups, residency: Residency):
        if groups.elastic is None:
            raise ValueError("ElasticLending: the rollout groups have no elastic group")
        self.groups, self.residency = groups, residency
        self.wait_s = 0.0  # seconds ready batches waited for the group to empty
        self._waiting_since: float | None = None
        self._reported = dict.fromkeys(self.FIGURES, 0)

    def lend(self) -> None:
        """Lends the group to the newest resident version, unless it is lent or still has an older version's
        requests."""
        g, newest = self.groups, self.residency.store.newest
        if g.lent or newest is None or newest not in self.residency:
            return
        if g.serving[g.elastic] not in (None, newest) and g.group_in_flight(g.elastic):
            return
        g.lend(newest, self.residency.load_group)

    def hand_back(self) -> bool:
        """Reclaims the group for a train step (:meth:`VersionGroups.reclaim`); True once it is empty and its
        device work has finished, so the step has the devices to itself. The time until then is counted."""
        now = time.perf_counter()
        if self._waiting_since is None:
            self._waiting_since = now
        if not self.groups.reclaim():
            return False
        self.groups.drivers[self.groups.elastic].block_until_ready()
        self.wait_s += time.perf_counter() - self._waiting_since
        self._waiting_since = None
        return True

    def totals(self) -> dict[str, Any]:
        """The run's figures: versions lent, requests moved out at hand-backs, seconds ready batches waited, wall
        seconds of the decode steps in which the group had requests, and rows it decoded."""
        g = self.groups
        return {"lends": g.elastic_loads, "moved_out": g.elastic_moved, "wait_s": self.wait_s,
                "busy_s": g.elastic_busy_s, "rows": g.drivers[g.elastic].stats.rows_live}

    def report(self) -> dict[str, Any]:
        """The per-update metrics entry: the figures since the previous report, and whether the group is lent."""
        now = self.totals()
        out = {k: now[k] - self._reported[k] for k in self.FIGURES}
        self._reported = now
        return {"lent": self.groups.lent, **out}
