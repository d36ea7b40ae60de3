"""One simulated run: the event loop that drives rollout instances and the trainer with a scheduler, and the
metrics it reports.

Definitions (per run; a *step* is the interval between the ends of two consecutive updates, the first starting
at time 0):

* ``rollout_share``: over the measured steps (those after ``warmup_steps``), the time the trainer waits for
  rollout (from the end of the previous update to the start of this one: no trainable batch yet, or the
  staleness window holds it back) divided by the step time. In colocated sync this is the rollout phase's
  share of the step, the figure papers quote.
* ``throughput``: trained samples (and generated tokens of trained samples) per second over the measured steps.
* ``trainer_idle``: the trainer's waiting time over the whole run (pipeline fill and drain included) / wall.
* ``slot_utilization``: occupied slot-seconds (decoding or prefilling) / (slots x the time the rollout GPUs
  are available: the whole run, or for colocated sync the run minus the update time, weight sync included).
* ``staleness``: histogram of ``trained_at - version`` over consumed samples (for partial rollout, the age of
  a trajectory's first token).
* ``weight_loads``: times an instance loaded another version's weights (not counting colocated sync, whose
  update leaves them in place); ``migrated_rows``: rows handed from one instance to another of the same version.

Rollout side: every instance holds one version (see :mod:`dora_jax.sim.engine`). An instance with free slots
takes queued rows of its own version (rows handed over first, then fresh prompts); an empty instance with none
of its version queued takes the version :meth:`Scheduler.assign_slots` gives most of its slots (ties to the
older) and loads it. When a version has no fresh prompts queued and another version has work waiting, its
instance with the fewest rows hands them to its other instances if they have room (zero re-prefill: the KV
cache moves, ``migrate_token_s`` per context token on the receiving instance) and takes the waiting work: the
orchestrator's re-partitioning of instances between versions.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from typing import Any

from tqdm import tqdm

from dora_jax.sim.config import Costs
from dora_jax.sim.engine import Instance, PartialRollout, Placement, Row, make_policy
from dora_jax.sim.lengths import LengthDist


class SimulationError(RuntimeError):
    """The simulated run broke an invariant or stopped making progress."""


def simulate(mode: str, costs: Costs, placement: Placement, lengths: LengthDist, *, train_batch: int,
             group_size: int, prompt_tokens: int, steps: int, warmup_steps: int = 0, max_staleness: int = 0,
             rollout_batch: int = 0, seed: int = 0, progress: bool = False, label: str = "") -> dict[str, Any]:
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

    Returns:
        Metrics (see the module docstring), the per-update records and the timeline of live versions.

    Raises:
        SimulationError: the ledger's invariants fail at the end, or no event is left before the run is done.
    """
    extra = {"sync": 0, "one_step_off": 1}.get(mode, -(-rollout_batch // train_batch) + 1)
    total = (steps + extra) * train_batch
    sched = make_policy(mode, train_batch, group_size, total, max_staleness, rollout_batch)
    led = sched.ledger
    partial = isinstance(sched, PartialRollout)
    bound = None if partial else sched.policy.bound
    rng = __import__("random").Random(seed)
    insts = [Instance(placement.slots) for _ in range(placement.instances)]
    lengths_of: dict[int, int] = {}
    pending: dict[int, deque] = {}  # per version: fresh samples not yet on an instance
    moving: dict[int, deque] = {}  # per version: (sample, tokens so far) handed over, waiting for a slot
    holding: dict[int | None, set[int]] = {None: set(range(len(insts)))}  # instances by loaded version
    reload_s = 0.0 if placement.colocated else costs.weight_sync_s  # colocated: the update's sync loads it
    events: list = []
    seq = itertools.count()
    state = {"now": 0.0, "busy": False, "idle_since": 0.0, "idle": 0.0, "train_s": 0.0, "max_live": 1}
    updates: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []

    def waiting(v: int | None) -> int:
        return len(pending.get(v, ())) + len(moving.get(v, ()))

    def all_waiting(but: int | None = None) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in (pending, moving):
            for v, q in d.items():
                if q and v != but:
                    out[v] = out.get(v, 0) + len(q)
        return out

    def admissible(inst: Instance) -> bool:
        """Whether the instance has work to take at its next step boundary."""
        if len(inst.rows) >= inst.slots:
            return False
        if partial:  # every row decodes on the newest weights, whatever version it started on
            return any(pending.values())
        return waiting(inst.loaded) > 0 or (not inst.rows and bool(all_waiting()))

    def schedule(i: int) -> None:
        inst = insts[i]
        inst.gen += 1
        wants = inst.reprefill or inst.check or admissible(inst)
        if not inst.rows:
            inst.t = max(inst.t, state["now"])
            if wants:
                heapq.heappush(events, (inst.t, next(seq), "inst", (i, inst.gen, 0)))
            return
        k = inst.heap[0][0] - inst.counter
        if wants:
            k = min(k, inst.steps_by(costs, state["now"] - inst.t))
        heapq.heappush(events, (inst.t + inst.steps_time(costs, k), next(seq), "inst", (i, inst.gen, k)))

    def load(i: int, v: int) -> None:
        """Puts version ``v``'s weights on instance ``i`` (a stall unless it already holds them)."""
        inst = insts[i]
        if inst.loaded == v:
            return
        if inst.loaded is not None and reload_s:  # the first load happens before the run
            inst.t = max(inst.t, state["now"]) + reload_s
            inst.busy_slot_s += reload_s * len(inst.rows)
            inst.reloads += 1
        holding[inst.loaded].discard(i)
        holding.setdefault(v, set()).add(i)
        inst.loaded = v

    def bind(i: int, but: int | None = None) -> None:
        """An empty instance takes the version that ``assign_slots`` gives most of its slots (ties: older)."""
        w = all_waiting(but)
        if w:
            alloc = sched.assign_slots(insts[i].slots, w)
            load(i, max(alloc, key=lambda v: (alloc[v], -v)))

    def admit(i: int) -> None:
        inst = insts[i]
        free = inst.slots - len(inst.rows)
        if free <= 0:
            return
        cost = 0.0
        if partial:
            if not any(pending.values()):
                return
            load(i, sched.version)
            alloc = sched.assign_slots(free, {v: len(q) for v, q in pending.items() if q})
            if sum(alloc.values()) > free:
                raise SimulationError(f"assign_slots gave {alloc} for {free} free slots")
            take = [(v, pending[v].popleft()) for v in sorted(alloc) for _ in range(alloc[v])]
        else:
            if not inst.rows and not waiting(inst.loaded):
                bind(i)
            v = inst.loaded
            while free and moving.get(v):  # rows handed over with their KV cache: no re-prefill
                sid, done = moving[v].popleft()
                inst.add(sid, Row(v, prompt_tokens, inst.counter, done, inst.counter + lengths_of[sid] - done))
                inst.moved_in += 1
                cost += costs.migrate_token_s * (prompt_tokens + done)
                free -= 1
            take = []
            while free and pending.get(v):
                take.append((v, pending[v].popleft()))
                free -= 1
        for v, sid in take:
            led.start(sid)
            inst.add(sid, Row(v, prompt_tokens, inst.counter, 0, inst.counter + lengths_of[sid]))
            cost += costs.prefill_token_s * prompt_tokens + costs.prefill_pair_s * prompt_tokens ** 2 / 2
        inst.t = max(inst.t, state["now"]) + cost
        inst.busy_slot_s += cost * len(inst.rows)

    def giver(v: int | None) -> int | None:
        """The instance of version ``v`` that should hand its rows to the other instances of ``v``: the one
        with the fewest rows, when the others have room for them, ``v`` has no fresh work left and another
        version has work waiting for the instance this frees (the orchestrator's defragmentation)."""
        if partial or v is None or pending.get(v) or not all_waiting(but=v):
            return None
        hs = [j for j in holding.get(v, ()) if insts[j].rows]
        if len(hs) < 2:
            return None
        m = min(hs, key=lambda j: (len(insts[j].rows), j))
        room = sum(insts[j].slots - len(insts[j].rows) for j in hs if j != m) - len(moving.get(v, ()))
        return m if room >= len(insts[m].rows) else None

    def hand_off(i: int) -> None:
        inst = insts[i]
        v = inst.loaded
        q = moving.setdefault(v, deque())
        for sid in sorted(inst.rows):
            q.append((sid, inst.generated(inst.remove(sid))))
        inst.heap.clear()
        bind(i, but=v)
        for j in holding[v]:
            if insts[j].rows and len(insts[j].rows) < insts[j].slots:
                schedule(j)

    def look_for_giver(v: int | None, here: int | None = None) -> bool:
        """Flags version ``v``'s giver to stop at its next step boundary; True if it is ``here``."""
        g = giver(v)
        if g is None or g == here:
            return g is not None
        insts[g].check = True
        schedule(g)
        return False

    def dispatch() -> None:
        new = sched.dispatch()
        for g in new:
            for sid in g.sample_ids:
                lengths_of[sid] = lengths.sample(rng)
            pending.setdefault(g.version, deque()).extend(g.sample_ids)
        if new:
            note_live()
            for i, inst in enumerate(insts):
                if admissible(inst):
                    schedule(i)
            for v in list(holding):
                look_for_giver(v)

    def note_live() -> None:
        live = set(led.outstanding()) | {sched.version}
        state["max_live"] = max(state["max_live"], len(live))
        if bound is not None and max(live) - min(live) > bound:
            raise SimulationError(f"{mode}: live versions {sorted(live)} span more than K = {bound}")

    def try_train() -> None:
        if state["busy"] or sched.done():
            return
        if mode == "dora":  # Scheduler.next_batch needs this many ready groups; skip its scan until then
            p = sched.policy
            if led.ready_groups() < min(p.train_batch, p.total_samples - sched.trained_samples) // p.group_size:
                return
        batch = sched.next_batch()
        if not batch:
            return
        now = state["now"]
        ids = [s for g in batch for s in led.groups[g].sample_ids]
        seqs = [prompt_tokens + lengths_of[s] for s in ids]
        dur = costs.train_time(sum(seqs), sum(x * x for x in seqs) / 2, placement.trainer_gpus)
        state.update(busy=True, idle=state["idle"] + now - state["idle_since"],
                     train_s=state["train_s"] + dur + costs.weight_sync_s)
        updates.append({"start": now, "samples": len(ids), "tokens": sum(lengths_of[s] for s in ids),
                        "version": sched.version})
        heapq.heappush(events, (now + dur + costs.weight_sync_s, next(seq), "train", (batch,)))

    bar = tqdm(total=steps + extra, desc=label or mode, unit="update", disable=not progress, leave=False)
    dispatch()
    try_train()
    while not sched.done():
        if not events:
            raise SimulationError(f"{mode}: no event left before the run is done (ledger {led.counts()}, "
                                  f"version {sched.version})")
        t, _, kind, args = heapq.heappop(events)
        state["now"] = t
        ready = False
        if kind == "train":
            sched.trained(args[0])
            updates[-1]["end"] = t
            state.update(busy=False, idle_since=t)
            timeline.append({"t": t, "version": sched.version, "live": sorted(set(led.outstanding()) |
                                                                              {sched.version})})
            bar.update(1)
            if partial:
                for i, inst in enumerate(insts):
                    if inst.rows:
                        inst.reprefill = True
                        schedule(i)
            ready = True
        else:
            i, gen, k = args
            inst = insts[i]
            if gen != inst.gen:
                continue
            inst.advance(costs, k)
            inst.t = max(inst.t, t)
            while inst.heap and inst.heap[0][0] <= inst.counter:
                _, sid = heapq.heappop(inst.heap)
                inst.remove(sid)
                led.finish(sid)
                ready |= led.group_ready(led.entries[sid].group_id)
            if inst.reprefill:  # partial rollout: the newest weights, then every live row re-prefilled
                load(i, sched.version)
                ctxs = [r.prompt + inst.generated(r) for r in inst.rows.values()]
                cost = sum(costs.prefill_token_s * c + costs.prefill_pair_s * c * c / 2 for c in ctxs)
                inst.t += cost
                inst.busy_slot_s += cost * len(ctxs)
                inst.reprefill = False
            inst.check = False
            if look_for_giver(inst.loaded, here=i):
                hand_off(i)
            admit(i)
            schedule(i)
        if ready:
            dispatch()
            try_train()
    bar.close()
    counts = led.counts()
    if counts["pending"] or counts["in_flight"] or counts["finished"]:
        raise SimulationError(f"{mode}: samples abandoned at the end: {counts}")
    led.check(bound)
    return _metrics(mode, updates, timeline, insts, placement, state, led, steps, warmup_steps)


def _metrics(mode, updates, timeline, insts, placement, state, led, steps, warm) -> dict[str, Any]:
    ends = [0.0] + [u["end"] for u in updates]
    measured = range(warm, steps)
    t0, t1 = ends[warm], ends[steps]
    wait = sum(updates[i]["start"] - ends[i] for i in measured)
    wall = ends[-1]
    avail = wall - (state["train_s"] if placement.colocated else 0.0)
    stale = Counter(e.trained_at - e.version for e in led.entries.values() if e.state == "consumed")
    samples = sum(updates[i]["samples"] for i in measured)
    return {
        "mode": mode,
        "instances": placement.instances,
        "trainer_gpus": placement.trainer_gpus,
        "colocated": placement.colocated,
        "step_s": (t1 - t0) / len(measured),
        "samples_per_s": samples / (t1 - t0),
        "tokens_per_s": sum(updates[i]["tokens"] for i in measured) / (t1 - t0),
        "rollout_share": wait / (t1 - t0),
        "trainer_idle": (state["idle"]) / wall,
        "slot_utilization": sum(i.busy_slot_s for i in insts) / (placement.slots * len(insts) * avail),
        "staleness": {str(k): v for k, v in sorted(stale.items())},
        "max_live_versions": state["max_live"],
        "weight_loads": sum(i.reloads for i in insts),
        "migrated_rows": sum(i.moved_in for i in insts),
        "wall_s": wall,
        "updates": [{k: round(v, 3) if isinstance(v, float) else v for k, v in u.items()} for u in updates],
        "timeline": timeline,
        "ledger": led.counts(),
    }
