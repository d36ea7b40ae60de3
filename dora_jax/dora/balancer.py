"""Which policy version each rollout group serves at ``roles.versions_per_group: 1`` (DORA's Algorithm 1), as
plain, deterministic Python. See docs/design.md, "Load balancing".

The caller applies the :class:`Plan` from :meth:`Balancer.plan` moves first, then versions. A group in
``Plan.drain`` admits nothing and keeps its version; the caller passes it back with ``draining=True`` until a
later plan reassigns it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence


class BalancerError(ValueError):
    """A group count that cannot serve the live versions, or group states that cannot be (named with the numbers)."""


@dataclasses.dataclass(frozen=True)
class GroupState:
    """One rollout group as the balancer sees it: the version it holds (None: none yet), its decode slots, the
    requests of that version decoding there, and whether it drains (a previous plan said so)."""

    version: int | None
    slots: int
    in_flight: int = 0
    draining: bool = False


@dataclasses.dataclass(frozen=True)
class Move:
    """``count`` requests of ``version`` that leave group ``src_group`` for ``dst_group`` with their KV pages."""

    src_group: int
    dst_group: int
    version: int
    count: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the groups do next: ``versions[i]`` is the version group ``i`` serves (None: none yet); ``drain`` the
    groups that finish their requests before changing version; ``moves`` the requests that change group, each to
    a group of its version; ``targets`` the groups each version with work is owed, as (version, groups); ``reason``
    what made the plan differ from the groups' state, in words ("" when nothing changes)."""

    versions: tuple[int | None, ...]
    drain: tuple[int, ...]
    moves: tuple[Move, ...]
    targets: tuple[tuple[int, int], ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """A plan that changed something, with the inputs it was made from."""

    groups: tuple[GroupState, ...]
    waiting: tuple[tuple[int, int], ...]
    newest: int
    plan: Plan


def targets(work: Mapping[int, int], groups: int, slots: int) -> dict[int, int]:
    """The groups owed to each version with work: ``groups * work[w] / sum(work)`` by largest remainder (ties to
    the older), at least one, at most ``ceil(work[w] / slots)``; the sum may fall short of ``groups``.

    Args:
        work: requests per version, waiting plus in flight; versions with none are left out of the result.
        groups: the rollout groups, at least the versions with work.
        slots: decode slots of one group.
    """
    versions = sorted(v for v, r in work.items() if r > 0)
    if len(versions) > groups:
        raise BalancerError(f"{len(versions)} versions with work {versions} for {groups} groups: each needs a group")
    total = sum(work[v] for v in versions)
    out = {v: 1 for v in versions}
    cap = {v: -(-work[v] // slots) for v in versions}
    # One group at a time to the version furthest below its exact share (integers: share * total); from zero this
    # is the largest-remainder rounding, and starting from the one group each is owed takes it from the largest.
    for _ in range(groups - len(versions)):
        open_ = [v for v in versions if out[v] < cap[v]]
        if not open_:
            break
        v = max(open_, key=lambda v: (groups * work[v] - out[v] * total, -v))
        out[v] += 1
    return out


class Balancer:
    """Plans which version each of ``groups`` rollout groups serves, one version per group, for at most
    ``max_live`` live versions (K + 1).

    :meth:`plan` is deterministic. ``decisions`` holds the latest ``keep`` plans that changed something;
    ``counters`` the totals a run's metrics read.

    Raises:
        BalancerError: when ``groups < max_live``: a version with work could get no group.
    """

    def __init__(self, groups: int, *, max_live: int, keep: int = 1000):
        if max_live < 1:
            raise BalancerError(f"max_live {max_live}: at least the newest version is live")
        if groups < max_live:
            raise BalancerError(f"{groups} rollout groups cannot serve {max_live} live versions (K + 1) at one version "
                                f"per group: a version with work could get no group; use at least {max_live} groups")
        self.groups, self.max_live = groups, max_live
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=keep)
        self.counters = {"plans": 0, "changes": 0, "reassigned": 0, "drains": 0, "moved": 0}

    def plan(self, groups: Sequence[GroupState], waiting: Mapping[int, int], newest: int, *,
             can_move: bool | Sequence[bool] = True) -> Plan:
        """The next plan for ``groups``.

        Args:
            groups: every group's state, in group order.
            waiting: requests waiting to be admitted, per version.
            newest: the newest published version (new prompts go to it).
            can_move: whether requests may move between groups, for all groups or per group (group ``i``'s
                requests may leave it); a group whose requests may not move changes version only by draining.

        Raises:
            BalancerError: naming the bad state (a count out of range, work outside the window of live versions).
        """
        groups = tuple(groups)
        if not isinstance(can_move, bool) and len(can_move) != len(groups):
            raise BalancerError(f"can_move for {len(can_move)} groups, {len(groups)} group states")
        work = self._check(groups, waiting, newest)
        owed = targets(work, len(groups), min(g.slots for g in groups))
        plan = assign(groups, owed, newest, can_move)
        self._record(groups, waiting, newest, plan)
        return plan

    def _check(self, groups: tuple[GroupState, ...], waiting: Mapping[int, int], newest: int) -> dict[int, int]:
        """Refuses impossible states; returns the work (waiting + in flight) of each version."""
        if len(groups) != self.groups:
            raise BalancerError(f"{len(groups)} group states for {self.groups} groups")
        for i, g in enumerate(groups):
            if g.slots < 1 or not 0 <= g.in_flight <= g.slots:
                raise BalancerError(f"group {i}: {g.in_flight} in flight in {g.slots} slots")
            if g.version is None and (g.in_flight or g.draining):
                raise BalancerError(f"group {i} holds no version but has {g.in_flight} in flight (draining "
                                    f"{g.draining})")
        if any(n < 0 for n in waiting.values()):
            raise BalancerError(f"waiting {dict(waiting)}: counts must be >= 0")
        work = {v: n for v, n in waiting.items() if n}
        for g in groups:
            if g.in_flight:
                work[g.version] = work.get(g.version, 0) + g.in_flight
        if work and not newest - self.max_live < min(work) <= max(work) <= newest:
            raise BalancerError(f"versions with work {sorted(work)}: must lie in the {self.max_live} live versions "
                                f"up to the newest, {newest}")
        return work

    def _record(self, groups: tuple[GroupState, ...], waiting: Mapping[int, int], newest: int, plan: Plan) -> None:
        c = self.counters
        c["plans"] += 1
        if not plan.reason:
            return
        c["changes"] += 1
        c["reassigned"] += sum(g.version != v for g, v in zip(groups, plan.versions))
        c["drains"] += sum(not groups[i].draining for i in plan.drain)
        c["moved"] += sum(m.count for m in plan.moves)
        self.decisions.append(Decision(groups, tuple(sorted(waiting.items())), newest, plan))


def _give_up(groups: tuple[GroupState, ...], owed: Mapping[int, int],
             movable: Sequence[bool]) -> tuple[dict[int, list[int]], list[int], list[int], dict[int, int]]:
    """What each version gives up of the groups it holds beyond its ``owed`` share, in the order the plan uses
    them (empty groups, ``sources``, then up to ``drains[v]`` busy groups that received no moved request).
    Returns the groups each version keeps, the empty ones, the sources and ``drains``."""
    members: dict[int | None, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g.version, []).append(i)
    kept: dict[int, list[int]] = {}
    empty: list[int] = []
    sources: list[int] = []
    drains: dict[int, int] = {}
    for v, ids in members.items():
        give = len(ids) - (owed.get(v, 0) if v is not None else 0)
        gone = [i for i in ids if not groups[i].in_flight][:max(give, 0)]
        out = _sources(groups, [i for i in ids if i not in gone], give - len(gone), movable)
        left = sorted((i for i in ids if groups[i].in_flight and i not in out),
                      key=lambda i: (not groups[i].draining, groups[i].in_flight, i))
        drainable = left[:max(give - len(gone) - len(out), 0)]
        empty += gone
        sources += out
        if v is not None:
            drains[v] = len(drainable)
            kept[v] = [i for i in ids if i not in gone and i not in out and i not in drainable]
    return kept, empty, sources, drains


def _sources(groups: tuple[GroupState, ...], ids: list[int], give: int, movable: Sequence[bool]) -> list[int]:
    """Up to ``give`` of the busy groups ``ids`` (one version's, empty ones given up left out) whose requests fit
    together into the free slots of the others, fewest in flight first."""
    room = sum(groups[i].slots - groups[i].in_flight for i in ids)
    out: list[int] = []
    rows = 0
    for i in sorted((i for i in ids if groups[i].in_flight), key=lambda i: (groups[i].in_flight, i)):
        if len(out) >= give:
            break
        g = groups[i]
        # Every source's requests within the free slots of the groups that are not sources: the moves then find
        # room whichever of the sources the plan uses.
        if movable[i] and rows + g.in_flight <= room - (g.slots - g.in_flight):
            out.append(i)
            rows += g.in_flight
            room -= g.slots - g.in_flight
    return out


def _moves(src: int, groups: tuple[GroupState, ...], dsts: list[int], incoming: list[int]) -> list[Move] | None:
    """Moves that empty group ``src`` into ``dsts`` (groups of its version, most free slots first), or None when
    they lack the free slots. ``incoming`` counts requests already moved into each group; it is updated."""
    n, version = groups[src].in_flight, groups[src].version
    room = {j: groups[j].slots - groups[j].in_flight - incoming[j] for j in dsts}
    if sum(room.values()) < n:
        return None
    out = []
    for j in sorted(dsts, key=lambda j: (-room[j], j)):
        k = min(n, room[j])
        if k > 0:
            out.append(Move(src, j, version, k))
            incoming[j] += k
            n -= k
    return out


def assign(groups: tuple[GroupState, ...], owed: Mapping[int, int], newest: int,
           can_move: bool | Sequence[bool]) -> Plan:
    """The plan for ``groups`` given the groups ``owed`` to each version with work (:func:`targets`), by the
    rules of docs/design.md, "Load balancing". :meth:`Balancer.plan` checks its inputs and records the plan."""
    movable = [can_move] * len(groups) if isinstance(can_move, bool) else list(can_move)
    kept, empty, sources, drains = _give_up(groups, owed, movable)
    # A version's moves go to its groups that are not sources; of those, ones that received none may drain.
    stay = {v: [i for i, g in enumerate(groups) if g.version == v and i not in empty and i not in sources]
            for v in drains}
    # What each version under target still needs, most urgent first: a first group for versions with none (older
    # first), then the rest (older first); True marks a first group.
    short = {v: t - len(kept.get(v, ())) for v, t in owed.items() if t > len(kept.get(v, ()))}
    wants = [(v, True) for v in sorted(short) if not kept.get(v)]
    wants += [(v, False) for v in sorted(short) for _ in range(short[v] - (not kept.get(v)))]
    needs = [v for v, _ in wants]
    free = sorted(empty, key=lambda i: (groups[i].version == newest, i))
    # Sources newest version first, then fewest requests first: moving requests packs them into fewer groups, whose
    # steps then take longer, and the oldest versions' requests are the ones the staleness window waits for. Then
    # the groups that may drain.
    busy = sorted(sources, key=lambda i: (-groups[i].version, groups[i].in_flight, i))
    busy += sorted((i for v in stay if drains[v] for i in stay[v] if groups[i].in_flight),
                   key=lambda i: (not groups[i].draining, groups[i].in_flight, i))
    versions = [g.version for g in groups]
    drain: list[int] = []
    moves: list[Move] = []
    incoming = [0] * len(groups)
    while wants and (free or busy):
        if free:
            versions[free.pop(0)] = wants.pop(0)[0]
            continue
        i = busy.pop(0)
        v = groups[i].version
        out = _moves(i, groups, stay[v], incoming) if i in sources else None
        if out is not None:
            moves += out
            versions[i] = wants.pop(0)[0]
        elif incoming[i] or not drains[v]:
            continue  # requests moved into it, or its version gave up enough: it serves its version
        elif any(first for _, first in wants):
            # A drain stops the group's admissions and holds it until its longest request ends: only a version
            # with no group is worth that; others get groups as moves free them.
            drain.append(i)
            drains[v] -= 1
            wants.pop(max(k for k, (_, first) in enumerate(wants) if first))
    idle = sorted(i for i in free if versions[i] != newest)
    for i in free:  # empty groups no version needs: new prompts arrive on the newest
        versions[i] = newest
    reason = _reason(groups, versions, drain, moves, needs, kept, idle, newest)
    return Plan(tuple(versions), tuple(sorted(drain)), tuple(moves), tuple(sorted(owed.items())), reason)


def _reason(groups: tuple[GroupState, ...], versions: list[int | None], drain: list[int], moves: list[Move],
            needs: list[int], kept: Mapping[int, list[int]], idle: list[int], newest: int) -> str:
    """Why the plan differs from the groups' state, in words; "" when it does not."""
    was_draining = [i for i, g in enumerate(groups) if g.draining]
    if versions == [g.version for g in groups] and not moves and sorted(drain) == was_draining:
        return ""
    out = []
    for v in sorted(set(needs)):
        have = len(kept.get(v, ()))
        out.append(f"version {v} has work and no group" if not have else
                   f"version {v} has {have} of {have + needs.count(v)} groups")
    if idle:
        out.append(f"groups {idle} idle: to the newest version {newest}")
    stopped = [i for i in was_draining if i not in drain and versions[i] == groups[i].version]
    if stopped:
        out.append(f"groups {stopped} no longer drain")
    return "; ".join(out) or "groups reassigned"
