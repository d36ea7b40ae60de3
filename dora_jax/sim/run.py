"""One simulated run: :func:`simulate` drives rollout instances and the trainer with a scheduler in an event
loop (:class:`Simulation`) and returns its metrics. The model and the metrics' definitions are in
docs/simulator.md ('Model', 'Definitions').
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from collections import Counter, deque
from operator import add, attrgetter, eq, mul, sub
from typing import Any

from tqdm import tqdm

from dora_jax.sim.balancing import InstanceBalancing
from dora_jax.sim.config import Costs
from dora_jax.sim.engine import Instance, PartialRollout, Placement, Row, decode_table, make_policy
from dora_jax.sim.lengths import LengthDist


class SimulationError(RuntimeError):
    """The simulated run broke an invariant or stopped making progress."""


def simulate(mode: str, costs: Costs, placement: Placement, lengths: LengthDist, *, train_batch: int,
             group_size: int, prompt_tokens: int, steps: int, warmup_steps: int = 0, max_staleness: int = 0,
             rollout_batch: int = 0, seed: int = 0, progress: bool = False, label: str = "",
             versions_per_instance: int | str = 1) -> dict[str, Any]:
    """Simulates ``steps`` measured updates (plus the drain needed to finish every dispatched sample).

    Args:
        mode: ``sync``, ``one_step_off``, ``dora`` (the real :class:`~dora_jax.dora.scheduler.Scheduler`) or
            ``partial`` (:class:`~dora_jax.sim.engine.PartialRollout`).
        costs: the cost model.
        placement: rollout instances, slots per instance, trainer GPUs, colocated or not.
        lengths: completion-length distribution (drawn per sample at dispatch, seeded).
        train_batch: samples per update (TBS, whole groups); group_size: samples per prompt.
        prompt_tokens: tokens per prompt.
        steps: updates whose metrics are reported; ``warmup_steps`` of them are excluded as pipeline fill.
        max_staleness: K for dora; rollout_batch: RBS in samples for dora and partial.
        seed: seeds the length draws.
        progress: show a progress bar over updates.
        versions_per_instance: dora only: ``1`` (the runner's balancer places one version per instance) or
            ``all`` (every live version on every instance).

    Returns:
        Metrics (docs/simulator.md, 'Definitions'), the per-update records and the timeline of live versions.

    Raises:
        SimulationError: the ledger's invariants fail at the end, no event is left before the run is done, or
            ``versions_per_instance`` is not one of dora's (or is not 1 for another mode), or one version per
            instance leaves fewer instances than the K + 1 live versions.
    """
    sim = Simulation(mode, costs, placement, lengths, train_batch=train_batch, group_size=group_size,
                      prompt_tokens=prompt_tokens, steps=steps, max_staleness=max_staleness,
                      rollout_batch=rollout_batch, seed=seed, versions_per_instance=versions_per_instance)
    collecting = gc.isenabled()
    gc.disable()  # the run allocates millions of small acyclic objects: collections would only walk them
    try:
        sim.run(progress, label)
    finally:
        if collecting:
            gc.enable()
    return _metrics(sim, steps, warmup_steps)


class Simulation:
    """One simulated run's state (scheduler, instances, queues, event heap, clock) and the steps of its event
    loop; :func:`simulate` makes one and runs it once."""

    def __init__(self, mode: str, costs: Costs, placement: Placement, lengths: LengthDist, *, train_batch: int,
                 group_size: int, prompt_tokens: int, steps: int, max_staleness: int, rollout_batch: int,
                 seed: int, versions_per_instance: int | str = 1) -> None:
        self.mode, self.costs, self.placement, self.lengths = mode, costs, placement, lengths
        self.prompt_tokens = prompt_tokens
        self.total_updates = steps + {"sync": 0, "one_step_off": 1}.get(mode, -(-rollout_batch // train_batch) + 1)
        self.sched = make_policy(mode, train_batch, group_size, self.total_updates * train_batch, max_staleness,
                                 rollout_batch)
        self.led = self.sched.ledger
        self.partial = isinstance(self.sched, PartialRollout)
        self.bound = None if self.partial else self.sched.policy.bound
        self.rng = random.Random(seed)
        if isinstance(lengths, LengthDist):
            self.draw = lengths.draw
        else:  # any object with LengthDist.sample
            self.draw = lambda rng, n: [lengths.sample(rng) for _ in range(n)]
        self.insts = [Instance(placement.slots) for _ in range(placement.instances)]
        self.table = decode_table(costs, placement.slots)  # None: ask the cost model at every step
        self.lengths_of: dict[int, int] = {}
        self.pending: dict[int, deque] = {}  # per version: fresh samples not yet on an instance
        self.moving: dict[int, deque] = {}  # per version: (sample, tokens so far) handed over, waiting for a slot
        self.queued = 0  # rows in pending and moving, every version
        p = prompt_tokens
        self.prefill_s = costs.prefill_token_s * p + costs.prefill_pair_s * p ** 2 / 2  # one fresh prompt
        self.holding: dict[int | None, set[int]] = {None: set(range(len(self.insts)))}  # instances by version
        self.reload_s = 0.0 if placement.colocated else costs.weight_sync_s  # colocated: the update's sync loads it
        # (time, seq, instance, gen, k steps, their seconds), or (time, seq, None, batch, 0, 0.0) for an update's end
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.busy = False  # an update is in progress
        self.idle_since = self.idle = 0.0  # when the trainer last went idle; its waiting seconds so far
        self.train_s = 0.0  # update seconds so far, weight sync included
        self.max_live = 1
        self.updates: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.every, self.balancing = False, None
        self.versions(versions_per_instance)

    def versions(self, per_instance: int | str) -> None:
        """Sets up dora's version placement: the balancer (``1``) or every version on every instance (``all``)."""
        allowed = (1, "all") if self.mode == "dora" else (1,)
        if isinstance(per_instance, bool) or per_instance not in allowed:
            raise self.error(f"versions_per_instance {per_instance!r}: dora takes 1 or 'all', other modes 1")
        if self.mode != "dora":
            return
        live = self.bound + 1
        if per_instance == 1:
            if len(self.insts) < live:
                raise self.error(f"{len(self.insts)} rollout instances cannot serve K + 1 = {live} live versions at "
                                 f"one version per instance (a version with work could get none); use at least "
                                 f"{live} instances or every version per instance")
            self.balancing = InstanceBalancing(self, live)
            return
        self.every = True
        for inst in self.insts:  # version 0's weights are loaded before the run, as the first load elsewhere
            inst.mix, inst.loaded = Counter(), 0
        self.holding = {0: set(range(len(self.insts)))}

    def error(self, message: str) -> SimulationError:
        return SimulationError(f"{self.mode}: {message}")

    # -- the event loop ----------------------------------------------------------------------------------------

    def run(self, progress: bool, label: str) -> None:
        """Runs events until every update is trained; SimulationError when no event is left before the run is
        done, samples are abandoned at the end, or the ledger's invariants fail."""
        bar = tqdm(total=self.total_updates, desc=label or self.mode, unit="update", disable=not progress,
                   leave=False)
        self.dispatch()
        self.try_train()
        sched, events, step, pop = self.sched, self.events, self.instance_step, heapq.heappop
        done = sched.done()  # changes only when an update ends
        while not done:
            if not events:
                raise SimulationError(f"{self.mode}: no event left before the run is done (ledger "
                                      f"{self.led.counts()}, version {sched.version})")
            t, _, i, gen, k, dt = pop(events)
            self.now = t
            if i is None:  # an update ends (its event carries the batch in place of gen)
                self.trained(t, gen)
                bar.update(1)
                done = sched.done()
            elif not step(t, i, gen, k, dt):
                continue
            self.dispatch()
            self.try_train()
        bar.close()
        counts = self.led.counts()
        if counts["pending"] or counts["in_flight"] or counts["finished"]:
            raise SimulationError(f"{self.mode}: samples abandoned at the end: {counts}")
        self.led.check(self.bound)

    def trained(self, t: float, batch: Any) -> None:
        """An update ends at ``t``: the trainer idles from here; under partial rollout every live row will
        re-prefill on the new weights."""
        sched, led = self.sched, self.led
        sched.trained(batch)
        self.updates[-1]["end"] = t
        self.busy, self.idle_since = False, t
        self.timeline.append({"t": t, "version": sched.version, "live": sorted(set(led.outstanding()) |
                                                                                {sched.version})})
        if self.partial:
            for i, inst in enumerate(self.insts):
                if inst.rows:
                    inst.reprefill = True
                    self.schedule(i)
        elif self.every and not sched.done():  # each instance loads the new version beside the others it holds
            for i, inst in enumerate(self.insts):
                if inst.rows:
                    inst.pull = inst.check = True
                else:
                    self.load(i, sched.version)
                self.schedule(i)
        elif self.balancing is not None and not sched.done():  # (the last update leaves nothing to place)
            self.balancing.owed = f"version {sched.version} published"  # planned after the dispatch that follows

    def instance_step(self, t: float, i: int, gen: int, k: int, dt: float) -> bool:
        """Instance ``i`` reaches a step boundary after ``k`` steps (``dt`` seconds); True if a group became ready
        to train. A stale event (the instance was rescheduled since) does nothing."""
        inst = self.insts[i]
        if gen != inst.gen:
            return False
        ready, rows, heap = False, inst.rows, inst.heap
        inst.busy_slot_s += dt * len(rows)  # k decode steps (dt as steps_time gave it)
        inst.t += dt
        if t > inst.t:
            inst.t = t
        counter = inst.counter = inst.counter + k
        finish, pop, mix = self.led.finish, heapq.heappop, inst.mix
        while heap and heap[0][0] <= counter:
            sid = pop(heap)[1]
            row = rows.pop(sid)  # Instance.remove
            inst.base -= row.prompt + row.before - row.start
            if mix is not None:
                inst.unmix(row.version)
            if finish(sid):  # its group is ready
                ready = True
        if inst.reprefill:
            self.reprefill(i)
        inst.check = False
        bal = self.balancing
        if bal is not None:
            if inst.outbox:
                bal.hand_over(i)
            if not rows and not inst.inbox and not inst.incoming:
                bal.emptied(i)
        elif self.every:
            if inst.pull:
                inst.pull = False
                self.load(i, self.sched.version)
        else:
            v = inst.loaded
            if self.queued and not self.pending.get(v) and self.look_for_giver(v, here=i):
                self.hand_off(i)  # (a giver needs another version's work queued and none of its own)
        self.admit(i)
        self.schedule(i)
        if bal is not None:
            bal.settle()
        return ready

    def reprefill(self, i: int) -> None:
        """Partial rollout: the newest weights on instance ``i``, then every live row re-prefilled."""
        inst, costs = self.insts[i], self.costs
        self.load(i, self.sched.version)
        ctxs = [r.prompt + inst.generated(r) for r in inst.rows.values()]
        cost = sum(costs.prefill_token_s * c + costs.prefill_pair_s * c * c / 2 for c in ctxs)
        inst.t += cost
        inst.busy_slot_s += cost * len(ctxs)
        inst.reprefill = False

    # -- queues --------------------------------------------------------------------------------------------------

    def waiting(self, v: int | None) -> int:
        return len(self.pending.get(v, ())) + len(self.moving.get(v, ()))

    def all_waiting(self, but: int | None = None) -> dict[int, int]:
        out: dict[int, int] = {}
        if not self.queued:
            return out
        for d in (self.pending, self.moving):
            for v, q in d.items():
                if q and v != but:
                    out[v] = out.get(v, 0) + len(q)
        return out

    def admissible(self, inst: Instance) -> bool:
        """Whether the instance has work to take at its next step boundary."""
        if not self.queued or len(inst.rows) >= inst.slots:
            return False
        if self.partial or self.every:  # rows of any version share the instance
            return True
        v = inst.loaded
        if self.balancing is not None:
            if inst.inbox:
                return True
            return not (inst.draining or inst.outbox) and len(inst.rows) + inst.incoming < inst.slots and \
                bool(self.pending.get(v))
        return bool(self.pending.get(v) or self.moving.get(v) or not inst.rows)

    # -- instances -----------------------------------------------------------------------------------------------

    def schedule(self, i: int) -> None:
        """Queues instance ``i``'s next step boundary (the event queued before goes stale): when its next row
        finishes, or the first boundary at or after now if it has something to do there."""
        inst = self.insts[i]
        gen = inst.gen = inst.gen + 1
        n = len(inst.rows)
        wants = inst.reprefill or inst.check or (n < inst.slots and self.admissible(inst))
        if not n:
            if self.now > inst.t:
                inst.t = self.now
            if wants:
                heapq.heappush(self.events, (inst.t, next(self.seq), i, gen, 0, 0.0))
            return
        counter = inst.counter
        k = inst.heap[0][0] - counter
        if self.table is None:
            if wants:
                k = min(k, inst.steps_by(self.costs, self.now - inst.t))
            dt = inst.steps_time(self.costs, k)
        else:  # Instance.steps_by and steps_time, with the cost model's terms from the table
            fixed, slopes, rate = self.table
            if inst.mix is not None and len(inst.mix) > 1:
                first = self.costs.mixed_decode_time(tuple(inst.mix.values()), inst.base + n * counter)
            else:
                first = fixed[n] + (inst.base + n * counter) * rate  # decode_time(n, ctx)
            slope = slopes[n]
            if wants:
                by = _linear_steps_by(first, slope, self.now - inst.t)
                k = by if by < k else k
            dt = k * first + slope * k * (k - 1) / 2 if k > 0 else 0.0
        heapq.heappush(self.events, (inst.t + dt, next(self.seq), i, gen, k, dt))

    def load(self, i: int, v: int) -> None:
        """Puts version ``v``'s weights on instance ``i`` (a stall unless it already holds them)."""
        inst = self.insts[i]
        if inst.loaded == v:
            return
        if inst.loaded is not None and self.reload_s:  # the first load happens before the run
            inst.t = max(inst.t, self.now) + self.reload_s
            inst.busy_slot_s += self.reload_s * len(inst.rows)
            inst.reloads += 1
        self.holding[inst.loaded].discard(i)
        self.holding.setdefault(v, set()).add(i)
        inst.loaded = v

    def bind(self, i: int, but: int | None = None) -> None:
        """An empty instance takes the version that ``assign_slots`` gives most of its slots (ties: older)."""
        w = self.all_waiting(but)
        if w:
            alloc = self.sched.assign_slots(self.insts[i].slots, w)
            self.load(i, max(alloc, key=lambda v: (alloc[v], -v)))

    def admit(self, i: int) -> None:
        """Instance ``i`` fills its free slots with rows of its version: rows handed over by another instance
        first, then fresh prompts (prefilled); placement rules: docs/simulator.md, 'Model'."""
        inst = self.insts[i]
        free = inst.slots - len(inst.rows)
        if free <= 0:
            return
        if not self.queued:  # nothing to take: what taking none would leave
            if self.now > inst.t:
                inst.t = self.now
            return
        if self.partial or self.every:
            cost = self.admit_any(i, free)
        else:
            bal = self.balancing
            if bal is None and not inst.rows and not self.waiting(inst.loaded):
                self.bind(i)
            v = inst.loaded
            moving = inst.inbox if bal is not None else self.moving.get(v)
            cost, took = self.take_moved(inst, moving, free) if moving else (0.0, 0)
            free -= took
            if bal is not None:
                bal.transfers -= took
                free = 0 if inst.draining or inst.outbox else free - inst.incoming  # room the moves still owe
            fresh = self.pending.get(v)
            if fresh and free > 0:
                n = len(fresh) if len(fresh) < free else free
                self.queued -= n
                p, start, add, lengths_of, per, at = self.prompt_tokens, self.led.start, inst.add, \
                    self.lengths_of, self.prefill_s, inst.counter
                for _ in range(n):
                    sid = fresh.popleft()
                    start(sid)
                    add(sid, Row(v, p, at, 0, at + lengths_of[sid]))
                    cost += per
        now = self.now
        inst.t = (now if now > inst.t else inst.t) + cost  # max(inst.t, now) + cost
        inst.busy_slot_s += cost * len(inst.rows)

    def take_moved(self, inst: Instance, moving: deque | None, free: int) -> tuple[float, int]:
        """``inst`` takes up to ``free`` rows handed over with their KV cache (no re-prefill; ``migrate_token_s``
        per context token). Returns their seconds and how many it took."""
        v, took, cost = inst.loaded, 0, 0.0
        while free > took and moving:
            sid, done = moving.popleft()
            inst.add(sid, Row(v, self.prompt_tokens, inst.counter, done, inst.counter + self.lengths_of[sid] - done))
            inst.moved_in += 1
            inst.moved_tokens += self.prompt_tokens + done
            cost += self.costs.migrate_token_s * (self.prompt_tokens + done)
            took += 1
        self.queued -= took
        inst.moved_s += cost
        return cost, took

    def admit_any(self, i: int, free: int) -> float:
        """Partial rollout and dora at ``versions_per_instance: all``: instance ``i`` takes the fresh prompts of
        any version that ``assign_slots`` gives its ``free`` slots. Returns their prefill seconds."""
        inst, pending = self.insts[i], self.pending
        if self.partial:
            self.load(i, self.sched.version)
        alloc = self.sched.assign_slots(free, {v: len(q) for v, q in pending.items() if q})
        if sum(alloc.values()) > free:
            raise SimulationError(f"assign_slots gave {alloc} for {free} free slots")
        take = [(v, pending[v].popleft()) for v in sorted(alloc) for _ in range(alloc[v])]
        self.queued -= len(take)
        cost = 0.0
        for v, sid in take:
            self.led.start(sid)
            inst.add(sid, Row(v, self.prompt_tokens, inst.counter, 0, inst.counter + self.lengths_of[sid]))
            cost += self.prefill_s
        return cost

    # -- the orchestrator's re-partitioning ----------------------------------------------------------------------

    def giver(self, v: int | None) -> int | None:
        """The instance of version ``v`` that should hand its rows to the other instances of ``v``: the one
        with the fewest rows, when the others have room for them, ``v`` has no fresh work left and another
        version has work waiting for the instance this frees (the orchestrator's defragmentation)."""
        if self.partial or v is None or self.pending.get(v) or self.queued == len(self.moving.get(v, ())):
            return None  # (the last: no other version has work waiting)
        insts = self.insts
        hs = [j for j in self.holding.get(v, ()) if insts[j].rows]
        if len(hs) < 2:
            return None
        m = min(hs, key=lambda j: (len(insts[j].rows), j))
        room = sum(insts[j].slots - len(insts[j].rows) for j in hs if j != m) - len(self.moving.get(v, ()))
        return m if room >= len(insts[m].rows) else None

    def hand_off(self, i: int) -> None:
        inst = self.insts[i]
        v = inst.loaded
        q = self.moving.setdefault(v, deque())
        for sid in sorted(inst.rows):
            q.append((sid, inst.generated(inst.remove(sid))))
            self.queued += 1
        inst.heap.clear()
        self.bind(i, but=v)
        for j in self.holding[v]:
            if self.insts[j].rows and len(self.insts[j].rows) < self.insts[j].slots:
                self.schedule(j)

    def look_for_giver(self, v: int | None, here: int | None = None) -> bool:
        """Flags version ``v``'s giver to stop at its next step boundary; True if it is ``here``."""
        g = self.giver(v)
        if g is None or g == here:
            return g is not None
        self.insts[g].check = True
        self.schedule(g)
        return False

    # -- the scheduler and the trainer ---------------------------------------------------------------------------

    def dispatch(self) -> None:
        new = self.sched.dispatch()
        for g in new:
            self.lengths_of.update(zip(g.sample_ids, self.draw(self.rng, len(g.sample_ids))))
            self.pending.setdefault(g.version, deque()).extend(g.sample_ids)
            self.queued += len(g.sample_ids)
        if new:
            self.note_live()
        if self.balancing is not None and (new or self.balancing.owed):
            self.balancing.rebalance()
        if new:
            for i, inst in enumerate(self.insts):
                if self.admissible(inst):
                    self.schedule(i)
            if self.balancing is None and not self.every:
                for v in list(self.holding):
                    self.look_for_giver(v)

    def note_live(self) -> None:
        live = set(self.led.outstanding()) | {self.sched.version}
        self.max_live = max(self.max_live, len(live))
        if self.bound is not None and max(live) - min(live) > self.bound:
            raise SimulationError(f"{self.mode}: live versions {sorted(live)} span more than K = {self.bound}")

    def try_train(self) -> None:
        sched, led = self.sched, self.led
        if self.busy or sched.done():
            return
        if self.mode == "dora":  # Scheduler.next_batch needs this many ready groups; skip its scan until then
            p = sched.policy
            if led.ready_groups() < min(p.train_batch, p.total_samples - sched.trained_samples) // p.group_size:
                return
        batch = sched.next_batch()
        if not batch:
            return
        now = self.now
        ids = [s for g in batch for s in led.groups[g].sample_ids]
        lengths = list(map(self.lengths_of.__getitem__, ids))
        seqs = list(map(add, itertools.repeat(self.prompt_tokens), lengths))
        dur = self.costs.train_time(sum(seqs), sum(map(mul, seqs, seqs)) / 2, self.placement.trainer_gpus)
        self.busy = True
        self.idle = self.idle + now - self.idle_since
        self.train_s = self.train_s + dur + self.costs.weight_sync_s
        self.updates.append({"start": now, "samples": len(ids), "tokens": sum(lengths),
                             "version": sched.version})
        heapq.heappush(self.events, (now + dur + self.costs.weight_sync_s, next(self.seq), None, batch, 0, 0.0))


def _linear_steps_by(first: float, slope: float, dt: float) -> int:
    """:meth:`Instance.steps_by` for an instance whose next step costs ``first`` and whose ``k`` steps cost
    ``k * first + slope * k * (k - 1) / 2`` (the linear cost model, ``slope`` = ``ctx_rate * n``)."""
    if dt <= 0:
        return 0
    a = slope / 2
    b = first - a
    k = dt / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)
    k = max(0, math.ceil(k) - 1)
    while (k * first + slope * k * (k - 1) / 2 if k > 0 else 0.0) < dt:
        k += 1
    return k


def _metrics(sim: Simulation, steps: int, warm: int) -> dict[str, Any]:
    mode, updates, insts, placement, led = sim.mode, sim.updates, sim.insts, sim.placement, sim.led
    ends = [0.0] + [u["end"] for u in updates]
    measured = range(warm, steps)
    t0, t1 = ends[warm], ends[steps]
    wait = sum(updates[i]["start"] - ends[i] for i in measured)
    wall = ends[-1]
    avail = wall - (sim.train_s if placement.colocated else 0.0)
    entries = list(led.entries.values())
    is_consumed = map(eq, map(attrgetter("state"), entries), itertools.repeat("consumed"))
    consumed = list(itertools.compress(entries, is_consumed))
    stale = Counter(map(sub, map(attrgetter("trained_at"), consumed), map(attrgetter("version"), consumed)))
    samples = sum(updates[i]["samples"] for i in measured)
    moved_tokens = sum(i.moved_tokens for i in insts)
    per_token = sim.costs.kv_bytes_per_token
    return {
        "mode": mode,
        "instances": placement.instances,
        "trainer_gpus": placement.trainer_gpus,
        "colocated": placement.colocated,
        "step_s": (t1 - t0) / len(measured),
        "samples_per_s": samples / (t1 - t0),
        "tokens_per_s": sum(updates[i]["tokens"] for i in measured) / (t1 - t0),
        "rollout_share": wait / (t1 - t0),
        "trainer_idle": sim.idle / wall,
        "slot_utilization": sum(i.busy_slot_s for i in insts) / (placement.slots * len(insts) * avail),
        "staleness": {str(k): v for k, v in sorted(stale.items())},
        "max_live_versions": sim.max_live,
        "weight_loads": sum(i.reloads for i in insts),
        "migrated_rows": sum(i.moved_in for i in insts),
        "versions_per_instance": ("all" if sim.every else 1) if mode == "dora" else None,
        "moved_rows": sum(i.moved_in for i in insts),
        "moved_kv_tokens": moved_tokens,
        "moved_kv_bytes": moved_tokens * per_token if per_token else None,
        "transfer_share": sum(i.moved_s for i in insts) / (len(insts) * wall),
        "balancer": None if sim.balancing is None else sim.balancing.report(len(updates)),
        "wall_s": wall,
        "updates": [{k: round(v, 3) if isinstance(v, float) else v for k, v in u.items()} for u in updates],
        "timeline": sim.timeline,
        "ledger": led.counts(),
    }
