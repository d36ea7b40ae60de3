"""DORA's version placement in the cluster model at one version per rollout instance: the runner's
:class:`~dora_jax.dora.balancer.Balancer` decides which version each instance serves, which instances drain and
which rows move, at the runner's triggers (:mod:`dora_jax.run.balancing`): after a publish, after a version or an
instance drained, and on imbalance (an instance with no version, a version waiting with no instance, an instance
idle while another version waits for more than its free slots).

A plan is applied as a rollout engine would: an empty instance that changes version loads it at once (a
``weight_sync_s`` stall); a busy one hands its rows to the destinations at its next step boundary and then loads
its new version; a destination takes the rows at its own next step boundary, with their KV cache
(``migrate_token_s`` per context token, nothing prefilled again), before any new prompt. A draining instance
admits nothing until a later plan reassigns it. The balancer sees the instances only with no row in transit: a
plan called for while rows are moving is made once they have landed, so every plan starts from instances that
each hold exactly the rows the balancer counts.
"""

from __future__ import annotations

import collections
import heapq
from typing import TYPE_CHECKING, Any

from dora_jax.dora.balancer import Balancer, GroupState, Plan

if TYPE_CHECKING:
    from dora_jax.sim.run import Simulation

CHECK = "imbalance"  # a deferred look at the triggers, as opposed to a named event


class InstanceBalancing:
    """Drives ``Balancer`` over a simulation's instances (``max_live``: K + 1, the balancer refuses fewer
    instances).

    ``transfers`` counts rows a plan has promised to a destination that has not taken them yet; ``owed`` is the
    trigger that waits for them (None: none waits); ``decisions`` the latest plans that changed something, as
    ``(time, trigger, reason)``.
    """

    def __init__(self, sim: Simulation, max_live: int) -> None:
        self.sim = sim
        self.balancer = Balancer(len(sim.insts), max_live=max_live, keep=1)
        self.transfers = 0
        self.owed: str | None = None
        self.last: tuple[Any, ...] | None = None
        self.decisions: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=8)

    # -- when to plan ----------------------------------------------------------------------------------------------

    def trigger(self) -> str | None:
        """What calls for a plan now, in words (None: nothing); the runner's triggers, instances for groups."""
        insts, pending = self.sim.insts, self.sim.pending
        idle = [i for i, inst in enumerate(insts) if not inst.rows]
        for i in idle:
            if insts[i].loaded is None:
                return f"instance {i} holds no version"
            if insts[i].draining:
                return f"instance {i} drained"
        waiting = sorted((v, len(q)) for v, q in pending.items() if q)
        for v, _ in waiting:
            if not any(inst.loaded == v and not inst.draining for inst in insts):
                return f"version {v} waits with no instance"
        for v, n in waiting:
            free = sum(inst.slots - len(inst.rows) for inst in insts if inst.loaded == v and not inst.draining)
            if n > free:
                for i in idle:
                    if insts[i].loaded != v and not insts[i].draining:
                        return f"instance {i} idle while version {v} waits"
        return None

    def emptied(self, i: int) -> None:
        """Instance ``i`` has no row left at a step boundary: it may have drained, or drained its version."""
        inst, sim = self.sim.insts[i], self.sim
        v = inst.loaded
        if inst.draining:
            self.rebalance(f"instance {i} drained")
        elif v is not None and not sim.pending.get(v) and not any(j.loaded == v and j.rows for j in sim.insts):
            self.rebalance(f"version {v} drained")
        else:
            self.rebalance()

    def rebalance(self, why: str | None = None) -> Plan | None:
        """Plans when ``why`` is given or :meth:`trigger` finds a reason, and applies the plan; returns it (None
        when nothing called for one, rows are in transit, or the inputs are those the last plan left)."""
        if self.transfers:
            self.owed = why or self.owed or CHECK
            return None
        owed, self.owed = self.owed, None
        why = why or (owed if owed != CHECK else None) or self.trigger()
        sim = self.sim
        if why is None:
            return None
        states = self.states()
        work = tuple(sorted((v, len(q)) for v, q in sim.pending.items() if q))
        newest = sim.sched.version
        if (states, work, newest) == self.last:
            return None
        plan = self.balancer.plan(states, dict(work), newest)
        if plan.reason:
            self.apply(plan)
            self.decisions.append((sim.now, why, plan.reason))
        # The instances as the plan leaves them (rows in transit counted where they go): planning them again with
        # the same work would give the same plan.
        self.last = (self.states(), work, newest)
        return plan

    def states(self) -> tuple[GroupState, ...]:
        """Every instance as the balancer sees it, rows promised by moves counted at their destination."""
        out = []
        for inst in self.sim.insts:
            gone = sum(n for _, n in inst.outbox)
            version = inst.loaded if inst.switch_to is None else inst.switch_to
            out.append(GroupState(version, inst.slots, len(inst.rows) - gone + len(inst.inbox) + inst.incoming,
                                  inst.draining))
        return tuple(out)

    # -- applying a plan -------------------------------------------------------------------------------------------

    def apply(self, plan: Plan) -> None:
        """Moves are booked (made at the sources' next step boundaries), drains set, empty instances load their
        new version now; every instance the plan touches is rescheduled."""
        sim, insts = self.sim, self.sim.insts
        touched = set()
        for m in plan.moves:
            insts[m.src_group].outbox.append((m.dst_group, m.count))
            insts[m.src_group].check = True
            insts[m.dst_group].incoming += m.count
            self.transfers += m.count
            touched.add(m.src_group)
        drain = set(plan.drain)
        for i, (inst, v) in enumerate(zip(insts, plan.versions)):
            if inst.draining != (i in drain):
                inst.draining = i in drain
                touched.add(i)
            if v == inst.loaded:
                continue
            touched.add(i)
            if inst.outbox:
                inst.switch_to = v
            elif inst.rows:
                raise sim.error(f"plan gives instance {i} version {v} while it decodes {len(inst.rows)} rows of "
                                f"version {inst.loaded} and moves none")
            else:
                sim.load(i, v)
        for i in sorted(touched):
            sim.schedule(i)

    def hand_over(self, i: int) -> None:
        """Instance ``i`` at a step boundary makes its booked moves (its rows with the lowest sample ids first,
        those that finished meanwhile excepted), then loads the version the plan gave it."""
        sim = self.sim
        inst = sim.insts[i]
        order = sorted(inst.rows)
        for dst, count in inst.outbox:
            take, order = order[:count], order[count:]
            d = sim.insts[dst]
            for sid in take:
                d.inbox.append((sid, inst.generated(inst.remove(sid))))
            d.incoming -= count
            self.transfers -= count - len(take)
            sim.queued += len(take)
            sim.schedule(dst)
        inst.outbox.clear()
        inst.heap = [e for e in inst.heap if e[1] in inst.rows]
        heapq.heapify(inst.heap)
        if inst.switch_to is not None:
            if inst.rows:
                raise sim.error(f"instance {i} keeps {len(inst.rows)} rows of version {inst.loaded} after its moves "
                                f"and was to load version {inst.switch_to}")
            sim.load(i, inst.switch_to)
            inst.switch_to = None

    def settle(self) -> None:
        """Makes the plan that waited for rows in transit, once they have all landed."""
        if not self.transfers and self.owed is not None:
            self.rebalance()

    def report(self, updates: int) -> dict[str, Any]:
        """The balancer's counters over the run, per update as well, and its latest decisions."""
        c = self.balancer.counters
        return {**c, "plans_per_update": c["plans"] / max(updates, 1),
                "decisions_per_update": c["changes"] / max(updates, 1),
                "last_decisions": [f"t={t:.1f}: {why}: {reason}" for t, why, reason in self.decisions]}
