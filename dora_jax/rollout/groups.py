"""Several rollout drivers, each over its own engine on its own devices (``roles.rollout_groups``: data-parallel
rollout), driven as one driver: every group holding every live version (:class:`DriverGroups`), or one version
per group, reassigned by the balancer's plans (:class:`VersionGroups`, ``roles.versions_per_group: 1``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

from dora_jax.dora.balancer import GroupState, Move, Plan
from dora_jax.rollout.driver import RolloutDriver, run_all
from dora_jax.rollout.engine import EngineError
from dora_jax.rollout.samples import Request, Trajectory
from dora_jax.rollout.stats import DriverStats


class DriverGroups:
    """Several drivers, each over its own engine on its own devices (``roles.rollout_groups``), driven as one.

    A request goes to the group with the most free slots (ties to the lower group), and stays there from
    its first token to its last. A step dispatches every busy group's decode step before reading any result
    back, so groups on disjoint devices decode at the same time. Sampling depends on (seed, sample id,
    position) only, so a sample's tokens do not depend on its group. Every version is loaded in every group
    (:meth:`add_version` takes one copy per group, placed on that group's devices).
    """

    def __init__(self, drivers: Sequence[RolloutDriver]):
        if not drivers:
            raise EngineError("DriverGroups: at least one driver")
        self.drivers = list(drivers)

    def add_version(self, version: int, params_per_group: Sequence[Any]) -> None:
        if len(params_per_group) != len(self.drivers):
            raise EngineError(f"policy version {version}: {len(params_per_group)} copies for {len(self.drivers)} groups")
        for d, p in zip(self.drivers, params_per_group):
            d.add_version(version, p)

    def remove_version(self, version: int) -> None:
        for d in self.drivers:
            d.remove_version(version)

    def held(self) -> list[int]:
        """The versions held by any group (each group holds its own copy of each, on its own devices)."""
        return sorted({v for d in self.drivers for v in d.held()})

    @property
    def versions(self) -> list[int]:
        return self.drivers[0].versions

    def in_flight(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in self.drivers:
            for v, n in d.in_flight().items():
                out[v] = out.get(v, 0) + n
        return out

    @property
    def slots(self) -> int:
        return sum(d.engine.max_concurrent_decodes for d in self.drivers)

    @property
    def overlap(self) -> bool:
        """Whether the groups' drivers dispatch a step before reading the previous one back."""
        return all(d.overlap for d in self.drivers)

    def submit(self, request: Request) -> None:
        free = [d.engine.max_concurrent_decodes - sum(d.in_flight().values()) for d in self.drivers]
        self.drivers[free.index(max(free))].submit(request)

    @property
    def idle(self) -> bool:
        return all(d.idle for d in self.drivers)

    def block_until_ready(self) -> None:
        for d in self.drivers:
            d.block_until_ready()

    def step(self) -> list[Trajectory]:
        busy = [d for d in self.drivers if not d.idle]
        for d in busy:
            d.dispatch()
        return sorted((t for d in busy for t in d.harvest()), key=lambda t: t.sample_id)

    def run(self, requests: Iterable[Request] = ()) -> list[Trajectory]:
        """Submits ``requests`` and steps until everything has finished."""
        return run_all(self, requests)

    @property
    def stats(self) -> DriverStats:
        """Every group's counters summed, ``max_held`` the most versions one group held at once."""
        return DriverStats.total(d.stats for d in self.drivers)

    def restore_stats(self, counters: dict[str, int]) -> None:
        """Continues a resumed run's counters: the totals go to the first group, the others start at zero."""
        self.drivers[0].restore_stats(counters)
        for d in self.drivers[1:]:
            d.restore_stats(dict.fromkeys(counters, 0))

    @property
    def waiting_outside(self) -> bool:
        return any(d.waiting_outside for d in self.drivers)

    @waiting_outside.setter
    def waiting_outside(self, value: bool) -> None:  # requests wait outside every group (RolloutDriver's)
        for d in self.drivers:
            d.waiting_outside = value


class VersionGroups(DriverGroups):
    """Rollout groups that each hold at most one policy version (``roles.versions_per_group: 1``, DORA's
    Algorithm 1), reassigned between versions by the balancer's plans (:meth:`apply` takes a
    :class:`~dora_jax.dora.balancer.Plan`).

    A group serves the version whose weights it holds (:attr:`serving`; None before its first). A request goes to
    a group serving its version and not draining, the one with the most free slots (ties to the lower group); a
    caller admits a version's requests only into :meth:`free_slots` of that version. A group changes version
    only when it is empty: its old version is removed (the driver waits for a decode step still computing with
    it) before the new one's weights are loaded, so no group ever holds two versions (``stats.max_held`` 1).
    Versions are loaded per group by :meth:`apply`, never into every group (:meth:`add_version` refuses).

    A plan's moves take live requests, with their KV pages, to another group of their version
    (:meth:`RolloutDriver.take`, :meth:`RolloutDriver.put`: nothing is prefilled again), so the emptied group
    changes version at once. A move that does not fit its destination's free slots and pages now waits: nothing
    is evicted or dropped, and its group drains instead (:meth:`movable` tells the balancer beforehand).
    Trajectories that finished while the moving groups' programs in flight were read back come with the next
    :meth:`step`.

    An ``elastic`` driver (on the trainer's devices, ``roles.elastic_group``) is the last group, :attr:`elastic`.
    The balancer plans the :attr:`regular` groups only; the elastic group serves the version :meth:`lend` gives it
    and admits while lent, and :meth:`reclaim` moves its requests to the regular groups of that version.
    """

    def __init__(self, drivers: Sequence[RolloutDriver], elastic: RolloutDriver | None = None):
        super().__init__(list(drivers) + ([] if elastic is None else [elastic]))
        self.regular = len(drivers)  # the groups the balancer plans
        self.elastic = None if elastic is None else self.regular  # the elastic group's index
        self.lent = False  # whether the elastic group admits requests now
        self.serving: list[int | None] = [None] * len(self.drivers)
        self.draining: set[int] = set()
        self.loads = [0] * self.regular  # versions loaded into each regular group (its first one included)
        # The elastic group over the run: versions lent to it, requests moved out at reclaims, and the wall time of
        # the steps in which it had requests.
        self.elastic_loads = 0
        self.elastic_moved = 0
        self.elastic_busy_s = 0.0
        self.max_versions = 0  # the most versions all groups together held at once
        # Totals over the run: requests moved between groups, the KV bytes their pages held, moves that waited.
        self.moved_requests = 0
        self.moved_kv_bytes = 0
        self.move_waits = 0
        self._finished: list[Trajectory] = []  # read back before a move, returned by the next step

    def add_version(self, version: int, params_per_group: Sequence[Any]) -> None:
        raise EngineError(f"policy version {version}: at one version per rollout group a version is loaded into the "
                          "groups a balancer's plan gives it (VersionGroups.apply), not into every group")

    def remove_version(self, version: int) -> None:
        """Unloads ``version`` from the groups that serve it (none is fine: a drained version may have lost its
        groups already); they serve nothing until a plan gives them a version.

        Raises:
          EngineError: a group serving it still has requests of it.
        """
        for i, v in enumerate(self.serving):
            if v == version:
                self.drivers[i].remove_version(version)
                self.serving[i] = None
                self.draining.discard(i)

    @property
    def versions(self) -> list[int]:
        """The versions some group serves."""
        return sorted({v for v in self.serving if v is not None})

    def group_in_flight(self, group: int) -> int:
        """Requests submitted to ``group`` and not finished (decoding or pending in its driver)."""
        return sum(self.drivers[group].in_flight().values())

    def group_slots(self, group: int) -> int:
        return self.drivers[group].engine.max_concurrent_decodes

    def admitting(self, version: int) -> list[int]:
        """The groups that take new requests of ``version``: those serving it that do not drain (the elastic
        group while lent)."""
        return [i for i, v in enumerate(self.serving)
                if v == version and i not in self.draining and (i != self.elastic or self.lent)]

    def free_slots(self, version: int) -> int:
        """Free decode slots of the groups that take new requests of ``version`` (0 when none does)."""
        return sum(max(0, self.group_slots(i) - self.group_in_flight(i)) for i in self.admitting(version))

    def group_for(self, version: int) -> int | None:
        """The group a new request of ``version`` goes to: of :meth:`admitting`, the one with the most free slots
        (ties to the lower group); None when no group takes them."""
        groups = self.admitting(version)
        if not groups:
            return None
        return max(groups, key=lambda i: (self.group_slots(i) - self.group_in_flight(i), -i))

    def driver_for(self, version: int) -> RolloutDriver | None:
        """The driver of :meth:`group_for`'s group (None when no group takes requests of ``version``)."""
        group = self.group_for(version)
        return None if group is None else self.drivers[group]

    def submit(self, request: Request) -> None:
        """Submits ``request`` to :meth:`group_for` its version.

        Raises:
          EngineError: no group takes requests of its version (naming what each group serves).
        """
        group = self.group_for(request.version)
        if group is None:
            raise EngineError(f"request {request.sample_id}: no rollout group takes requests of policy version "
                              f"{request.version} (the groups serve {self.serving}, draining "
                              f"{sorted(self.draining)}); admit only into free_slots(version)")
        self.drivers[group].submit(request)

    def states(self) -> tuple[GroupState, ...]:
        """Every regular group as the balancer sees it (:class:`~dora_jax.dora.balancer.GroupState`), in order."""
        return tuple(GroupState(v, self.group_slots(i), self.group_in_flight(i), i in self.draining)
                     for i, v in enumerate(self.serving[:self.regular]))

    def movable(self) -> list[bool]:
        """Per group, whether its requests could all move now to the other groups of its version, split as the
        balancer splits them (most free slots first): each destination has the free slots and, for the live
        requests' written tokens, the pages (:meth:`RolloutDriver.fits`). An empty group's is True. What the run
        passes the balancer as ``can_move``; :meth:`apply` checks each move again when it performs it."""
        out = []
        for i, v in enumerate(self.serving[:self.regular]):
            n = self.group_in_flight(i)
            if v is None or not n:
                out.append(True)
                continue
            sizes = self.drivers[i].take_sizes(v, n)
            room = {j: self.group_slots(j) - self.group_in_flight(j) for j, w in enumerate(self.serving[:self.regular])
                    if w == v and j != i}
            ok = True
            for j in sorted(room, key=lambda j: (-room[j], j)):
                k = min(n, room[j])
                if k > 0:
                    ok = ok and self.drivers[j].fits(v, k, sizes[:k])
                    sizes, n = sizes[k:], n - k
            out.append(ok and n == 0)
        return out

    def apply(self, plan: Plan, load: Callable[[int, int], Any],
              settle: Callable[[set[int]], set[int]] | None = None) -> list[int]:
        """Applies ``plan``: first its moves (:meth:`move`), then the groups in ``plan.drain`` admit nothing new,
        and each group whose version changes, which must be empty, drops its old version's weights and then takes
        ``load(group, version)``, the new version's params placed on that group's devices. A group a move of
        which waited keeps its version and drains. Returns the groups that changed version.

        ``settle`` (several processes, each applying the same plan to its own groups): the moves are this
        process's (:meth:`local_moves`), and ``settle`` turns the groups whose moves waited here into those that
        waited on any process, so that every process keeps the same groups' versions.

        Raises:
          EngineError: the plan has another number of groups, moves requests from or to a group not serving
            their version, or changes the version of a group that still has requests.
        """
        if len(plan.versions) != self.regular:
            raise EngineError(f"plan for {len(plan.versions)} groups applied to {self.regular}")
        waited = self.move(plan.moves if settle is None else self.local_moves(plan.moves))
        if settle is not None:
            waited = settle(waited)
        versions = [self.serving[i] if i in waited else v for i, v in enumerate(plan.versions)]
        changed = [i for i, v in enumerate(versions) if v != self.serving[i]]
        busy = [i for i in changed if self.group_in_flight(i)]
        if busy:
            raise EngineError(f"plan changes the version of groups {busy}, which still have requests "
                              f"{[self.group_in_flight(i) for i in busy]}: a busy group drains first")
        self.draining = set(plan.drain) | waited
        for i in changed:
            old, new = self.serving[i], versions[i]
            if old is not None:
                self.drivers[i].remove_version(old)  # before the new weights arrive: one version per group
                self.serving[i] = None
            if new is not None:
                self.drivers[i].add_version(new, load(i, new))
                self.serving[i] = new
                self.loads[i] += 1
        self._count()
        return changed

    def local_moves(self, moves: Sequence[Move]) -> list[Move]:
        """A plan's moves (counted over every process's groups) as this process performs them: all of each source
        group's requests here, split over that source's destinations in the plan by their free slots here (most
        first, ties to the lower group); the last destination takes what the others have no room for (a move
        that does not fit waits)."""
        dsts: dict[int, list[int]] = {}
        for m in moves:
            dsts.setdefault(m.src_group, []).append(m.dst_group)
        out = []
        for src, to in dsts.items():
            n, v = self.group_in_flight(src), self.serving[src]
            order = sorted(to, key=lambda j: (self.group_in_flight(j) - self.group_slots(j), j))
            for j in order:
                k = n if j == order[-1] else min(n, max(0, self.group_slots(j) - self.group_in_flight(j)))
                if k:
                    out.append(Move(src, j, v, k))
                n -= k
        return out

    def move(self, moves: Sequence[Move]) -> set[int]:
        """Performs ``moves`` in order: each takes the requests of its version with the lowest sample ids out of
        its source group (at most those still in flight there) into its destination, with their KV pages. A move
        that does not fit the destination's free slots and pages waits, and so do its source's later moves.
        Returns the source groups of moves that waited (they still have requests)."""
        waited: set[int] = set()
        for i in sorted({m.src_group for m in moves}):  # nothing in flight: their requests can be taken
            self._finished += self.drivers[i].read_in_flight()
        for m in moves:
            if self.serving[m.src_group] != m.version or self.serving[m.dst_group] != m.version:
                raise EngineError(f"move {m}: the groups serve {self.serving}")
            src, dst = self.drivers[m.src_group], self.drivers[m.dst_group]
            n = min(m.count, self.group_in_flight(m.src_group))
            if m.src_group in waited or not n:
                continue
            if not dst.fits(m.version, n, src.take_sizes(m.version, n)):
                waited.add(m.src_group)
                self.move_waits += 1
                continue
            departing = src.take(m.version, n)
            dst.put(departing)
            self.moved_requests += departing.count
            self.moved_kv_bytes += departing.kv_bytes
        return waited

    def lend(self, version: int, load: Callable[[int, int], Any]) -> None:
        """Lends the elastic group to ``version``: it loads ``load(group, version)`` (dropping another version it
        still holds, which must have no requests) and admits that version's requests until :meth:`reclaim`.

        Raises:
          EngineError: there is no elastic group, or it still has requests of another version.
        """
        e = self.elastic
        if e is None:
            raise EngineError("lend: these rollout groups have no elastic group (roles.elastic_group)")
        old = self.serving[e]
        if old != version:
            if old is not None:
                if self.group_in_flight(e):
                    raise EngineError(f"lend: the elastic group still has {self.group_in_flight(e)} requests of "
                                      f"version {old}")
                self.drivers[e].remove_version(old)
                self.serving[e] = None
            self.drivers[e].add_version(version, load(e, version))
            self.serving[e] = version
            self.elastic_loads += 1
        self.lent = True
        self._count()

    def reclaim(self) -> bool:
        """Takes the elastic group back: it admits nothing more, and its requests move with their KV pages to the
        regular groups taking its version's requests (most free slots first) as they fit; a move that does not
        fit waits while the group decodes on. Returns True once the group is empty, its version's weights
        dropped (True at once without an elastic group)."""
        e = self.elastic
        if e is None:
            return True
        self.lent = False
        v = self.serving[e]
        if v is None:
            return True
        n = self.group_in_flight(e)
        if n:
            room = {j: self.group_slots(j) - self.group_in_flight(j) for j in self.admitting(v)}
            moves = []
            for j in sorted(room, key=lambda j: (-room[j], j)):
                k = min(n, room[j])
                if k > 0:
                    moves.append(Move(e, j, v, k))
                    n -= k
            before = self.moved_requests
            self.move(moves)
            self.elastic_moved += self.moved_requests - before
        if self.group_in_flight(e):
            return False
        self.drivers[e].remove_version(v)
        self.serving[e] = None
        return True

    @property
    def idle(self) -> bool:
        return not self._finished and super().idle

    def _count(self) -> None:
        self.max_versions = max(self.max_versions, len(self.held()))

    def step(self) -> list[Trajectory]:
        busy = self.elastic is not None and self.group_in_flight(self.elastic) > 0
        start = time.perf_counter()
        out = super().step()
        if busy:
            self.elastic_busy_s += time.perf_counter() - start
        if self._finished:
            out, self._finished = sorted(self._finished + out, key=lambda t: t.sample_id), []
        self._count()
        return out
