"""The rollout side of a run: the scheduler's groups become requests, decode steps, and scored samples.

:class:`RolloutSide` tokenizes what the scheduler dispatched into a waiting queue per version, admits waiting
requests to free decode slots as the scheduler shares them, runs one decode step at a time, and hands finished
trajectories to the reward pool; the scheduler's ledger records scored samples. Held-out requests of an
evaluation during training (:class:`~dora_jax.run.evals.HeldOutEvals`) go first and never reach the ledger.
Multi-process generation is in docs/scale.md ("A training run under several processes"); one version per
rollout group in docs/design.md ("Load balancing").
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections import deque
from typing import Any, Callable

from dora_jax.config import Config
from dora_jax.distributed import gather_decisions
from dora_jax.rewards import RewardPool
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import RequestSampling
from dora_jax.rollout.groups import DriverGroups, VersionGroups
from dora_jax.rollout.samples import Sample
from dora_jax.rollout.samples import Request, Trajectory
from dora_jax.run.evals import HeldOutEvals
from dora_jax.run.evaluation import EVAL_IDS, RunError, prompt_ids, score
from dora_jax.dora.scheduler import Scheduler
from dora_jax.tasks import Item, Task
from dora_jax.trainer.losses import overlong_penalty


class RolloutSide:
    """Requests, decode steps and rewards of one run (this process's share of them).

    Args:
      cfg: the run's config (``rollout`` and ``task`` sections).
      sched: the run's scheduler; its ledger records every sample's state.
      task: the task the prompts come from and answers are scored by; tokenizer: the policy's.
      driver: the rollout driver (or driver groups; at one version per group, :class:`VersionGroups`).
      slots: decode slots of every rollout group together.
      spans: whether the engine spans every process (each then generates every group with the same calls).
    """

    def __init__(self, cfg: Config, sched: Scheduler, task: Task, tokenizer: Any,
                 driver: RolloutDriver | DriverGroups, slots: int, spans: bool = False):
        import jax

        self.cfg, self.sched, self.task, self.tokenizer, self.driver, self.slots = cfg, sched, task, tokenizer, driver, slots
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        # Groups shared out by process, and samples exchanged after each step, only with an engine per process.
        self.shares = self.nproc > 1 and not spans
        r = cfg.rollout
        self.sampling = RequestSampling(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
        self.rewards = RewardPool(cfg.task.reward_workers, cfg.task.reward_timeout_s)
        self.waiting: dict[int, deque[Request]] = {}
        self.items: dict[int, tuple[int, Item]] = {}  # sample id -> (group id, item), until it is generated
        self.done: dict[int, Sample] = {}  # finished samples not yet trained
        self.generated = 0  # trajectories this process's engine generated (a spanning engine's, all of them)
        self.first = driver.drivers[0] if isinstance(driver, DriverGroups) else driver
        self.evals = (HeldOutEvals(cfg, task, tokenizer, self.first.engine, self.rewards, self.generates)
                      if cfg.task.eval_every > 0 else None)

    def generates(self, group_id: int) -> bool:
        """Whether this process generates the group: every ``nproc``-th group (strided); every group under a
        spanning engine."""
        return not self.shares or group_id % self.nproc == self.rank

    def enqueue(self, sample_id: int, group_id: int, version: int, item: Item, ids: list[int]) -> None:
        """Queues one sample on its version (when this process generates its group)."""
        self.items[sample_id] = (group_id, item)
        if self.generates(group_id):
            budget = item.budget(self.member(sample_id, group_id), self.cfg.rollout.max_new_tokens)
            self.waiting.setdefault(version, deque()).append(
                Request(sample_id, tuple(ids), version=version, max_new_tokens=budget, sampling=self.sampling))

    def member(self, sample_id: int, group_id: int) -> int:
        """The sample's place in its group (which of the item's per-member length budgets it takes)."""
        return self.sched.ledger.groups[group_id].sample_ids.index(sample_id)

    def dispatch(self) -> int:
        """Tokenizes newly dispatched groups into per-version waiting queues; returns how many groups."""
        led, limit = self.sched.ledger, self.cfg.rollout.max_prompt_len
        groups = self.sched.dispatch()
        for g in groups:
            item = self.task.train_item(g.prompt_index)
            ids = prompt_ids(self.tokenizer, item.prompt)
            if len(ids) > limit:
                led.filter(g.sample_ids[0], f"prompt {g.prompt_index} has {len(ids)} tokens > "
                                            f"rollout.max_prompt_len {limit}")
                for sid in g.sample_ids[1:]:
                    led.filter(sid, f"group member {g.sample_ids[0]} filtered")
                continue
            for sid in g.sample_ids:
                self.enqueue(sid, g.group_id, g.version, item, ids)
        return len(groups)

    def resume(self, sched: Scheduler, finished: list[Sample]) -> None:
        """Continues a checkpoint's ledger: finished samples as they were, every pending one queued again on its version."""
        self.sched, led, prompts = sched, sched.ledger, {}
        for f in finished:
            self.done[f.sample_id] = f
        for sid in sorted(s for s, e in led.entries.items() if e.state == "pending"):
            e = led.entries[sid]
            if e.group_id not in prompts:
                item = self.task.train_item(e.prompt_index)
                prompts[e.group_id] = (item, prompt_ids(self.tokenizer, item.prompt))
            self.enqueue(sid, e.group_id, e.version, *prompts[e.group_id])

    def move_waiting(self, frm: int, to: int) -> None:
        """Requests waiting on version ``frm`` (never published) wait on ``to`` instead."""
        for req in self.waiting.pop(frm, ()):
            self.waiting.setdefault(to, deque()).append(dataclasses.replace(req, version=to))

    def has_waiting(self, loaded: Callable[[int], bool]) -> bool:
        """Whether requests wait on a version the engines have loaded (held-out ones: always loaded)."""
        return any(q for v, q in self.waiting.items() if loaded(v)) or bool(self.evals and self.evals.waiting())

    def pinned(self) -> dict[int, int]:
        """Held-out answers still to decode per version: what keeps a version resident besides its samples."""
        return self.evals.pins() if self.evals is not None else {}

    def waiting_counts(self, loaded: Callable[[int], bool]) -> dict[int, int]:
        """Requests waiting per loaded version, held-out ones included: what the balancer reads."""
        out = {v: len(q) for v, q in self.waiting.items() if q and loaded(v)}
        for v, n in (self.evals.waiting_by_version() if self.evals is not None else {}).items():
            out[v] = out.get(v, 0) + n
        return out

    def _eval_group(self, version: int) -> RolloutDriver | None:
        """The driver a held-out request of ``version`` decodes in: the first group's, or at one version per group one
        serving it (None while none does)."""
        return self.driver.driver_for(version) if isinstance(self.driver, VersionGroups) else self.first

    def admit(self, loaded: Callable[[int], bool]) -> list[int]:
        """Submits waiting requests of loaded versions to free slots as the scheduler shares them (at one version per
        group: into their own groups' slots), held-out ones first; returns their sample ids (:meth:`step` records
        them as started)."""
        if self.evals is not None:
            self.evals.admit(self._eval_group)
        waiting = {v: len(q) for v, q in self.waiting.items() if q and loaded(v)}
        if isinstance(self.driver, VersionGroups):
            shares = {v: min(n, self.driver.free_slots(v)) for v, n in sorted(waiting.items())}
        else:
            shares = self.sched.assign_slots(self.slots - sum(self.driver.in_flight().values()), waiting)
        started = []
        for v, n in shares.items():
            for _ in range(n):
                req = self.waiting[v].popleft()
                self.driver.submit(req)
                started.append(req.sample_id)
        return started

    def step(self, started: list[int]) -> tuple[float, int, int]:
        """One decode step of this process's engine (if it has work); then the ledger and reward pool take the
        started and finished samples (every process's, under several, in sample-id order). Returns (seconds
        decoded, rows decoded, decode batch-steps issued), all 0 with nothing to decode."""
        finished: list[Trajectory] = []
        secs = rows = batch_steps = 0
        if not self.driver.idle:
            stats = self.driver.stats
            ts, before_rows, before_steps = time.perf_counter(), stats.rows_live, stats.batch_steps
            finished = self.driver.step()
            secs, rows = time.perf_counter() - ts, self.driver.stats.rows_live - before_rows
            batch_steps = self.driver.stats.batch_steps - before_steps
            self.generated += len(finished)
        if self.shares:
            everyone = gather_decisions({"started": started, "finished": [dataclasses.asdict(t) for t in finished]})
            started = sorted(sid for e in everyone for sid in e["started"])
            finished = sorted((Trajectory(**d) for e in everyone for d in e["finished"]), key=lambda t: t.sample_id)
        for sid in started:
            self.sched.ledger.start(sid)
        for traj in finished:
            if traj.sample_id >= EVAL_IDS:
                self.evals.answered(traj)
                continue
            group_id, item = self.items.pop(traj.sample_id)  # the sample holds it from here
            text = self.tokenizer.decode(traj.tokens, skip_special_tokens=True)
            self.done[traj.sample_id] = Sample.from_trajectory(traj, group_id, item=item, text=text)
            self.rewards.submit(traj.sample_id, score, self.task, item, text)
        return secs, rows, batch_steps

    def collect_rewards(self, wait_s: float = 0.0) -> None:
        """Records the scores that are in: a sample is finished, or filtered with the reward's error."""
        led = self.sched.ledger
        results = self.rewards.poll(wait_s)
        if self.nproc > 1:
            # Every process takes the scheduler's next decision on the same ledger: no result may still be on its
            # way on one process and in on another.
            while self.rewards.outstanding:
                results += self.rewards.poll(0.05)
            results.sort(key=lambda res: res.key)
        for res in results:
            if res.key < 0:  # a held-out answer's
                self.evals.scored(res)
                continue
            if res.error:
                led.filter(res.key, res.error)
                if led.count("filtered") > 4 * self.sched.policy.total_samples + 64:
                    reasons = collections.Counter(led.filtered_reasons().values()).most_common(3)
                    raise RunError(f"{led.count('filtered')} samples filtered and {led.count('consumed')} "
                                   f"trained: the reward function fails on nearly everything. Most common "
                                   f"reasons: {reasons}")
            else:
                d = self.done[res.key]
                d.reward, d.correct, d.reason = res.reward + self._overlong(d), res.correct, res.reason
                led.finish(res.key)
            group = led.groups[led.entries[res.key].group_id]
            if self.cfg.train.dynamic_sampling and led.group_ready(group.group_id):
                rewards = {self.done[s].reward for s in group.sample_ids}
                if len(rewards) == 1:  # no advantage to learn from: filtered, and the scheduler draws another
                    led.filter(group.sample_ids[0], f"dynamic sampling: all {len(group.sample_ids)} rewards "
                                                    f"equal ({rewards.pop():g})")
            for sid in group.sample_ids:  # a filtered group's trajectories are never trained: let them go
                if led.entries[sid].state == "filtered":
                    self.done.pop(sid, None)

    def _overlong(self, d: Sample) -> float:
        """The overlong penalty of a finished sample (``train.overlong_buffer``; 0 when off)."""
        t, r = self.cfg.train, self.cfg.rollout
        budget = d.item.budget(self.member(d.sample_id, d.group_id), r.max_new_tokens)
        return overlong_penalty(len(d.response_ids), budget, t.overlong_buffer, t.overlong_penalty)

    def take(self, group_ids: list[int]) -> list[Sample]:
        """The finished samples of whole groups, handed to the trainer (they leave this side)."""
        led = self.sched.ledger
        return [self.done.pop(s) for g in group_ids for s in led.groups[g].sample_ids]

    def close(self) -> None:
        self.rewards.close()
