"""The balancer of one version per rollout group: hand-derived plans, and random schedules checked every step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from dora_jax.dora import balancer as balancer_mod
from dora_jax.dora.balancer import Balancer, BalancerError, GroupState, Move, targets

G = GroupState


def plan(states, waiting, newest, *, max_live=2, can_move=True):
    return Balancer(len(states), max_live=max_live).plan(states, waiting, newest, can_move=can_move)


# -- hand-derived plans ------------------------------------------------------------------------------------------


def test_groups_follow_work_in_proportion():
    # 4 groups, work 30 : 10 -> exact shares 3 and 1.
    p = plan([G(None, 8)] * 4, {3: 30, 4: 10}, 4)
    assert dict(p.targets) == {3: 3, 4: 1}
    assert sorted(p.versions, key=str) == [3, 3, 3, 4] and not p.drain and not p.moves
    assert "version 4 has work and no group" in p.reason


def test_a_tie_goes_to_the_older_version():
    # 3 groups, work 10 : 10 -> shares 1.5 each; the remainder's group goes to version 3.
    assert targets({3: 10, 4: 10}, 3, 8) == {3: 2, 4: 1}
    assert targets({4: 10, 3: 10}, 3, 8) == {3: 2, 4: 1}  # the mapping's order does not matter


def test_a_version_with_one_request_still_gets_a_group():
    assert targets({3: 1, 4: 99}, 4, 8) == {3: 1, 4: 3}
    p = plan([G(4, 8, 8), G(4, 8, 8), G(4, 8, 8), G(4, 8, 0)], {3: 1, 4: 75}, 4)
    assert p.versions == (4, 4, 4, 3)  # the empty group, not a busy one


def test_a_version_gets_no_more_groups_than_its_work_fills():
    # Version 3's 3 requests fill one group of 8 slots; the other three go to the newest, where prompts arrive.
    assert targets({3: 3}, 4, 8) == {3: 1}
    p = plan([G(3, 8, 3), G(3, 8), G(3, 8), G(None, 8)], {}, 4)
    assert p.versions == (3, 4, 4, 4) and p.reason == "groups [1, 2, 3] idle: to the newest version 4"


def test_the_same_input_twice_changes_nothing():
    bal = Balancer(4, max_live=2)
    states = [G(None, 8)] * 4
    first = bal.plan(states, {3: 30, 4: 10}, 4)
    # The groups after the plan, requests admitted: 24 of version 3 (8 a group), 8 of version 4.
    after = [G(v, 8, 8) for v in first.versions]
    again = bal.plan(after, {3: 6, 4: 2}, 4)
    assert again.versions == first.versions and not again.drain and not again.moves and again.reason == ""
    assert bal.plan(after, {3: 6, 4: 2}, 4) == again
    assert bal.counters["plans"] == 3 and bal.counters["changes"] == 1 and len(bal.decisions) == 1
    d = bal.decisions[0]
    assert d.newest == 4 and d.waiting == ((3, 30), (4, 10)) and d.plan == first


def test_a_busy_group_moves_its_requests_when_its_version_has_room_elsewhere():
    # Version 4 arrives with no group. Version 3's work (14) fills two groups of 8: groups 1 and 2 are over, and
    # group 2, the one with the fewest in flight, hands its request to group 0 (the most free slots).
    states = [G(3, 8, 5), G(3, 8, 2), G(3, 8, 1), G(3, 8, 6)]
    p = plan(states, {4: 1}, 4)
    assert dict(p.targets) == {3: 2, 4: 1}
    assert p.moves == (Move(2, 0, 3, 1),) and p.versions == (3, 3, 4, 3) and not p.drain


def test_a_busy_group_drains_without_room_or_without_moves():
    states = [G(3, 8, 5), G(3, 8, 7), G(3, 8, 7), G(3, 8, 6)]  # 1 + 1 + 2 free: no room for group 0's 5
    p = plan(states, {4: 1}, 4)
    assert p.drain == (0,) and p.versions == (3, 3, 3, 3) and not p.moves
    # With room but no moves (another process, or KV pages that do not fit): drains too.
    p = plan([G(3, 8, 5), G(3, 8, 2), G(3, 8, 1), G(3, 8, 6)], {4: 1}, 4, can_move=False)
    assert p.drain == (2,) and p.versions == (3, 3, 3, 3) and not p.moves
    # The drained group keeps draining while busy, and changes version once empty.
    states = [G(3, 8, 5, draining=True), G(3, 8, 7), G(3, 8, 7), G(3, 8, 6)]
    assert plan(states, {4: 1}, 4).reason == ""
    states[0] = G(3, 8, 0, draining=True)
    assert plan(states, {4: 1}, 4).versions == (4, 3, 3, 3)


def test_a_draining_group_goes_back_to_work_when_its_version_needs_it():
    # Version 4's work is gone (its request was taken back): group 0 need not change version any more.
    states = [G(3, 8, 5, draining=True), G(3, 8, 7), G(3, 8, 7), G(3, 8, 6)]
    p = plan(states, {3: 4}, 4)
    assert not p.drain and p.versions == (3, 3, 3, 3) and p.reason == "groups [0] no longer drain"


def test_a_version_consolidates_its_requests_into_the_groups_they_need_rather_than_drain():
    # Work 14 : 30 over 4 groups of 8 -> targets {3: 1, 4: 3} (exact shares 1.27 and 2.73; version 3's cap is 2).
    # Version 3 gives up 3 of its 4 groups. Its requests (6, 6, 1, 1) need two groups: the two groups of 1 fit
    # the free slots of the others (1 + 1 <= 2 + 2), so they move, each to the group with the most free slots
    # left (group 0, then group 1), and serve version 4. The third group given up could only drain, and version 4
    # has groups now: it keeps its requests and its version, so nothing waits for its longest request.
    states = [G(3, 8, 6), G(3, 8, 6), G(3, 8, 1), G(3, 8, 1)]
    p = plan(states, {4: 30}, 4)
    assert dict(p.targets) == {3: 1, 4: 3}
    assert p.moves == (Move(2, 0, 3, 1), Move(3, 1, 3, 1)) and p.versions == (3, 3, 4, 4) and not p.drain
    # The plan's result is a fixed point: version 3's 14 requests need both groups it has left.
    after = [G(3, 8, 7), G(3, 8, 7), G(4, 8), G(4, 8)]
    assert plan(after, {4: 30}, 4).reason == ""


def test_the_fewest_requests_move_and_a_draining_destination_goes_back_to_work():
    # Targets {3: 1, 4: 1} (version 3's 7 requests fill one group). Group 1's single request moves to group 0
    # (draining, the most free slots among the groups that are not sources); group 2's 2 would fit too, but one
    # group is all version 4 needs. Group 0 received a request, so it admits again.
    states = [G(3, 8, 4, draining=True), G(3, 8, 1), G(3, 8, 2)]
    p = plan(states, {4: 8}, 4)
    assert p.moves == (Move(1, 0, 3, 1),) and p.versions == (3, 4, 3) and not p.drain
    assert p.reason == "version 4 has work and no group; groups [0] no longer drain"


def test_the_newer_versions_requests_move_first():
    # Targets {3: 1, 4: 1, 5: 1}: versions 3 and 4 can each free a group by moving its single request, and version
    # 5 needs one. Version 4's moves: the staleness window waits for version 3's requests, which would decode
    # slower packed three to a group.
    states = [G(3, 8, 1), G(3, 8, 2), G(4, 8, 1), G(4, 8, 2)]
    p = plan(states, {5: 8}, 5, max_live=3)
    assert dict(p.targets) == {3: 1, 4: 1, 5: 1}
    assert p.moves == (Move(2, 3, 4, 1),) and p.versions == (3, 3, 5, 4) and not p.drain


def test_only_a_version_with_no_group_drains_a_group_with_work_waiting():
    # Work 42 : 40 over 4 full groups -> targets {4: 2, 5: 2}. No request can move (every slot is taken). Version
    # 5 has no group, so one group drains for it (the first of the fewest in flight); the second group version 5
    # is owed would stop admitting version 4's 10 waiting requests until its longest request ended, so it keeps
    # serving version 4, and version 5 gets it once its requests fit elsewhere.
    states = [G(4, 8, 8)] * 4
    p = plan(states, {4: 10, 5: 40}, 5)
    assert dict(p.targets) == {4: 2, 5: 2}
    assert p.drain == (0,) and p.versions == (4, 4, 4, 4) and not p.moves
    assert plan([G(4, 8, 8, draining=True)] + [G(4, 8, 8)] * 3, {4: 10, 5: 40}, 5).reason == ""


def test_too_few_groups_and_impossible_states_are_refused():
    with pytest.raises(BalancerError, match=r"2 rollout groups cannot serve 3 live versions .* at least 3 groups"):
        Balancer(2, max_live=3)
    bal = Balancer(2, max_live=2)
    with pytest.raises(BalancerError, match="3 group states for 2 groups"):
        bal.plan([G(None, 4)] * 3, {}, 0)
    with pytest.raises(BalancerError, match="group 1: 5 in flight in 4 slots"):
        bal.plan([G(0, 4), G(0, 4, 5)], {}, 0)
    with pytest.raises(BalancerError, match=r"versions with work \[1, 3\]: must lie in the 2 live versions up to "
                                            "the newest, 3"):
        bal.plan([G(1, 4, 1), G(3, 4)], {3: 2}, 3)


# -- random schedules ----------------------------------------------------------------------------------------------


class Broken(AssertionError):
    """An invariant a plan or a schedule broke."""


@dataclasses.dataclass
class World:
    """A toy rollout side: groups decode requests of their one version; requests finish after a random number of
    steps; new requests arrive on the newest version, which advances while the window of live versions allows."""

    slots: list[int]
    max_live: int
    rng: random.Random
    longest: int
    versions: list[int | None] = dataclasses.field(default_factory=list)
    draining: list[bool] = dataclasses.field(default_factory=list)
    rows: list[dict[int, int]] = dataclasses.field(default_factory=list)  # per group: request -> steps left
    waiting: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    version_of: dict[int, int] = dataclasses.field(default_factory=dict)
    finished: set[int] = dataclasses.field(default_factory=set)
    newest: int = 0

    def __post_init__(self):
        n = len(self.slots)
        self.versions, self.draining, self.rows = [None] * n, [False] * n, [{} for _ in range(n)]

    def states(self) -> list[GroupState]:
        return [G(v, s, len(r), d) for v, s, r, d in zip(self.versions, self.slots, self.rows, self.draining)]

    def waiting_counts(self) -> dict[int, int]:
        return {v: len(q) for v, q in self.waiting.items() if q}

    def work(self) -> set[int]:
        return set(self.waiting_counts()) | {self.version_of[r] for rows in self.rows for r in rows}

    def step(self, arrive: int, publish: bool) -> None:
        for rows in self.rows:
            for r in list(rows):
                rows[r] -= 1
                if not rows[r]:
                    del rows[r]
                    self.finished.add(r)
        if publish and all(v > self.newest + 1 - self.max_live for v in self.work()):
            self.newest += 1
        if sum(self.waiting_counts().values()) + sum(map(len, self.rows)) < 2 * sum(self.slots):  # a rollout batch
            for _ in range(arrive):
                r = len(self.version_of)
                self.version_of[r] = self.newest
                self.waiting.setdefault(self.newest, []).append(r)

    def apply(self, plan) -> None:
        for m in plan.moves:
            for r in sorted(self.rows[m.src_group])[:m.count]:
                self.rows[m.dst_group][r] = self.rows[m.src_group].pop(r)
        self.versions = list(plan.versions)
        self.draining = [i in plan.drain for i in range(len(self.slots))]

    def admit(self) -> None:
        for i, (v, rows) in enumerate(zip(self.versions, self.rows)):
            q = self.waiting.get(v, [])
            while q and len(rows) < self.slots[i] and not self.draining[i]:
                rows[q.pop(0)] = self.rng.randint(1, self.longest)


def check_plan(states, waiting, plan) -> None:
    """Raises :class:`Broken` where ``plan`` does not fit the groups it was made for."""
    if len(plan.versions) != len(states):
        raise Broken(f"{len(plan.versions)} versions for {len(states)} groups")
    out, into = [0] * len(states), [0] * len(states)
    for m in plan.moves:
        src, dst = states[m.src_group], states[m.dst_group]
        if m.count <= 0 or m.src_group == m.dst_group:
            raise Broken(f"{m}: moves nothing")
        if not m.version == src.version == dst.version:
            raise Broken(f"{m}: between groups of another version ({src.version} -> {dst.version})")
        if plan.versions[m.dst_group] != m.version or m.dst_group in plan.drain:
            raise Broken(f"{m}: into a group that changes version or drains")
        out[m.src_group] += m.count
        into[m.dst_group] += m.count
    for i, (g, v) in enumerate(zip(states, plan.versions)):
        if out[i] > g.in_flight or into[i] > g.slots - g.in_flight:
            raise Broken(f"group {i}: {out[i]} out of {g.in_flight} in flight, {into[i]} into {g.slots - g.in_flight}"
                         " free slots")
        if g.in_flight - out[i] and v != g.version:
            raise Broken(f"group {i}: version {g.version} -> {v} with {g.in_flight - out[i]} requests left: two "
                         "versions in one group")
        if i in plan.drain and (v != g.version or not g.in_flight):
            raise Broken(f"group {i} drains, but changes version or has nothing in flight")
    work = set(waiting) | {g.version for g in states if g.in_flight}
    owed = dict(plan.targets)
    if set(owed) != work or min(owed.values(), default=1) < 1 or sum(owed.values()) > len(states):
        raise Broken(f"targets {owed} for versions with work {sorted(work)} and {len(states)} groups")


def check_world(w: World, ids: int, admitted_while_draining: int) -> None:
    """Raises :class:`Broken` where the toy rollout side lost, duplicated or mixed requests."""
    seen = [r for rows in w.rows for r in rows] + [r for q in w.waiting.values() for r in q] + sorted(w.finished)
    if sorted(seen) != list(range(ids)):
        raise Broken(f"{ids} requests made, {len(seen)} found ({len(set(seen))} distinct)")
    for i, (v, rows) in enumerate(zip(w.versions, w.rows)):
        if {w.version_of[r] for r in rows} - {v}:
            raise Broken(f"group {i} (version {v}) decodes versions {sorted({w.version_of[r] for r in rows})}")
        if len(rows) > w.slots[i]:
            raise Broken(f"group {i}: {len(rows)} requests in {w.slots[i]} slots")
    if admitted_while_draining:
        raise Broken(f"{admitted_while_draining} requests admitted by draining groups")


def run_schedule(seed: int, groups: int, max_live: int, slots: int, longest: int, steps: int = 30,
                 admit=World.admit) -> int:
    """Runs a random schedule, checking every plan and every step; returns the most consecutive plans a version
    with work went without a group."""
    rng = random.Random(seed)
    w = World([slots] * groups, max_live, rng, longest)
    bal = Balancer(groups, max_live=max_live)
    without: dict[int, int] = {}
    worst = 0
    for _ in range(steps):
        w.step(arrive=rng.randint(0, 2 * slots), publish=rng.random() < 0.3)
        states, waiting, can_move = w.states(), w.waiting_counts(), rng.random() < 0.5
        p = bal.plan(states, waiting, w.newest, can_move=can_move)
        if Balancer(groups, max_live=max_live).plan(states, waiting, w.newest, can_move=can_move) != p:
            raise Broken("the same input gave another plan")
        check_plan(states, waiting, p)
        w.apply(p)
        again = bal.plan(w.states(), waiting, w.newest, can_move=can_move)
        if again.reason:
            raise Broken(f"the plan's own result planned again: {again}")
        before = [len(r) for r in w.rows]
        admit(w)
        check_world(w, len(w.version_of), sum(len(r) - b for r, b, d in zip(w.rows, before, w.draining) if d))
        served = set(w.versions)
        for v in w.work():
            without[v] = 0 if v in served else without.get(v, 0) + 1
            worst = max(worst, without[v])
    return worst


schedules = dict(seed=st.integers(0, 2**32 - 1), max_live=st.integers(1, 4), extra=st.integers(0, 2),
                 slots=st.integers(1, 6), longest=st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(**schedules)
def test_random_schedules_keep_every_invariant(seed, max_live, extra, slots, longest):
    worst = run_schedule(seed, max_live + extra, max_live, slots, longest)
    # A version with work and no group waits at most for a drain, which admits nothing: its longest request.
    assert worst <= longest


# -- the checks catch a broken balancer ------------------------------------------------------------------------------


def broken(monkeypatch, change):
    real = balancer_mod.assign
    monkeypatch.setattr(balancer_mod, "assign", lambda *a: change(real(*a), a[0]))


def two_versions(p, states):
    """Changes a busy group's version without moving its requests out."""
    busy = [i for i, g in enumerate(states) if g.in_flight and not any(m.src_group == i for m in p.moves)]
    if not busy:
        return p
    versions = list(p.versions)
    versions[busy[0]] = versions[busy[0]] + 1
    return dataclasses.replace(p, versions=tuple(versions), reason="broken")


def short_move(p, states):
    """Moves one request fewer than the group holds (drops the move of one), then changes its version anyway."""
    if not p.moves:
        return p
    m, rest = p.moves[0], p.moves[1:]
    return dataclasses.replace(p, moves=((dataclasses.replace(m, count=m.count - 1),) if m.count > 1 else ()) + rest)


def long_move(p, states):
    """Moves one request more than the destination has free slots for."""
    if not p.moves:
        return p
    m = p.moves[0]
    return dataclasses.replace(p, moves=(dataclasses.replace(m, count=m.count + 1),) + p.moves[1:])


@pytest.mark.parametrize("change,message", [(two_versions, "two versions in one group"),
                                            (short_move, "two versions in one group"),
                                            (long_move, "out of .* in flight, .* free slots")])
def test_the_checks_catch_a_broken_balancer(monkeypatch, change, message):
    broken(monkeypatch, change)
    with pytest.raises(Broken, match=message):
        for seed in range(50):
            run_schedule(seed, groups=3, max_live=2, slots=2, longest=4, steps=40)


def test_the_checks_catch_admission_while_draining():
    def admit_everywhere(w: World) -> None:
        draining, w.draining = w.draining, [False] * len(w.draining)
        World.admit(w)
        w.draining = draining

    with pytest.raises(Broken, match="admitted by draining groups"):
        for seed in range(50):
            run_schedule(seed, groups=3, max_live=2, slots=2, longest=4, steps=40, admit=admit_everywhere)


def test_the_checks_catch_a_lost_request():
    def lose(w: World) -> None:
        World.admit(w)
        for rows in w.rows:
            if rows:
                rows.pop(min(rows))
                return

    with pytest.raises(Broken, match="requests made"):
        run_schedule(0, groups=3, max_live=2, slots=2, longest=4, steps=40, admit=lose)
