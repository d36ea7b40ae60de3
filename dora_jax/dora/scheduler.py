"""DORA's rollout/training schedule as plain, deterministic Python (no JAX), so it can be tested with random
completion orders and driven by a simulator as well as by the runner.

Vocabulary: ``K`` the staleness bound, ``G`` the group size (samples per prompt), ``TBS`` samples per update
(whole groups), ``RBS`` samples the rollout side may hold at once (dispatched and not yet trained).

The three modes:

* ``sync``: dispatch ``TBS`` samples on the current version, wait until all are generated, train; K = 0.
* ``one_step_off``: rollout of batch ``n + 1`` starts (on the current version) once batch ``n`` is fully
  generated, so it overlaps with training on batch ``n``; every batch still waits for its longest member;
  K = 1.
* ``dora``: streaming. New groups are dispatched on the newest version whenever fewer than ``RBS`` samples
  are outstanding; every trajectory stays on the version it started with; the trainer takes ``TBS`` samples
  (whole groups, oldest version first) as soon as they are ready. An update to version ``v + 1`` happens only
  if every sample still outstanding afterwards has version ``>= v + 1 - K``: the window of live versions
  advances only when its oldest version has drained, so no sample is ever dropped for staleness and at most
  ``K + 1`` versions are live.

Slots are shared between versions in proportion to their pending work (:meth:`Scheduler.assign_slots`); new
prompts only ever go to the newest version, so older versions only use the capacity their own leftover work
needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dora_jax.dora.ledger import Group, Ledger

MODES = ("sync", "one_step_off", "dora")


class ScheduleError(ValueError):
    """Settings under which the schedule cannot make progress (named with the allowed values)."""


@dataclasses.dataclass(frozen=True)
class SchedulePolicy:
    mode: str
    max_staleness: int  # K for dora; sync uses 0 and one_step_off 1
    rollout_batch: int  # RBS, samples
    train_batch: int  # TBS, samples (a multiple of group_size)
    group_size: int  # G
    total_samples: int  # samples to train on in the whole run (a multiple of train_batch)
    refill: bool = False  # sync / one_step_off: a batch's filtered groups are replaced (DAPO's dynamic sampling)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ScheduleError(f"mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.group_size < 1:
            raise ScheduleError(f"group_size {self.group_size}: must be >= 1")
        if self.train_batch < self.group_size or self.train_batch % self.group_size:
            raise ScheduleError(f"train_batch {self.train_batch}: must be a positive multiple of the group size "
                                f"{self.group_size}")
        if self.max_staleness < 0:
            raise ScheduleError(f"max_staleness {self.max_staleness}: must be >= 0")
        if self.mode == "dora" and self.rollout_batch < self.train_batch:
            raise ScheduleError(f"rollout_batch {self.rollout_batch}: must be >= train_batch {self.train_batch} "
                                "(the trainer could never fill a batch)")
        if self.mode == "dora" and self.rollout_batch > (self.max_staleness + 1) * self.train_batch:
            raise ScheduleError(
                f"rollout_batch {self.rollout_batch}: must be <= (max_staleness + 1) * train_batch = "
                f"{(self.max_staleness + 1) * self.train_batch} (the next K + 1 updates are all that can train a "
                "sample dispatched now; more would be dropped or break the staleness bound)")
        if self.mode == "one_step_off" and self.max_staleness < 1:
            raise ScheduleError("one_step_off trains every batch one version late: max_staleness must be >= 1")
        if self.total_samples < self.train_batch or self.total_samples % self.train_batch:
            raise ScheduleError(f"total_samples {self.total_samples}: must be a positive multiple of train_batch "
                                f"{self.train_batch}")

    @property
    def bound(self) -> int:
        """The staleness bound the schedule keeps."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


class Scheduler:
    """Decides what to dispatch, how to share slots, and when to train. Owns the ledger's transitions that
    are scheduling decisions (dispatch, consume); the runner reports starts, finishes and filters to the
    ledger directly."""

    def __init__(self, policy: SchedulePolicy, ledger: Ledger | None = None):
        policy.validate()
        self.policy = policy
        self.ledger = ledger if ledger is not None else Ledger()
        self.version = 0  # the trainer's (and newest published) version
        self.next_group = 0
        self.next_sample = 0
        self.next_prompt = 0  # data position
        self.trained_samples = 0
        self.batches: list[list[int]] = []  # sync / one_step_off: dispatched batches not yet trained

    # -- dispatch -------------------------------------------------------------------------------------------

    def _new_group(self) -> Group:
        g = self.policy.group_size
        ids = range(self.next_sample, self.next_sample + g)
        group = self.ledger.add_group(self.next_group, ids, self.version, self.next_prompt)
        self.next_group += 1
        self.next_sample += g
        self.next_prompt += 1
        return group

    def _budget(self) -> int:
        """Samples that may still be dispatched: trained + outstanding stays within ``total_samples``."""
        outstanding = sum(self.ledger.outstanding().values())
        return self.policy.total_samples - self.trained_samples - outstanding

    def dispatch(self) -> list[Group]:
        """New groups to start now, all on the newest version."""
        p = self.policy
        out: list[Group] = []
        if p.mode == "dora":
            outstanding = sum(self.ledger.outstanding().values())
            while outstanding + p.group_size <= p.rollout_batch and self._budget() >= p.group_size:
                out.append(self._new_group())
                outstanding += p.group_size
            return out
        limit = 1 if p.mode == "sync" else 2
        if p.refill:  # every batch in flight gets back to TBS live samples, budget allowing
            for batch in self.batches:
                live = sum(not self.ledger.group_done(g) for g in batch)
                while live * p.group_size < p.train_batch and self._budget() >= p.group_size:
                    group = self._new_group()
                    batch.append(group.group_id)
                    out.append(group)
                    live += 1
        if len(self.batches) >= limit:
            return out
        groups = min(p.train_batch, self._budget()) // p.group_size  # a short last batch after filtering
        # A batch's newest groups are the likeliest to be still generating: each is scanned from its end.
        generating = [b for b in self.batches if not all(self._generated(g) for g in reversed(b))]
        if not generating and groups > 0:
            batch = [self._new_group() for _ in range(groups)]
            self.batches.append([g.group_id for g in batch])
            out.extend(batch)
        return out

    def _generated(self, group_id: int) -> bool:
        return all(self.ledger.entries[s].state in ("finished", "consumed", "filtered")
                   for s in self.ledger.groups[group_id].sample_ids)

    def assign_slots(self, free: int, pending: dict[int, int]) -> dict[int, int]:
        """Splits ``free`` decode slots between versions in proportion to their pending requests (largest
        remainder; ties to the older version, whose draining advances the window)."""
        total = sum(pending.values())
        if free <= 0 or total == 0:
            return {}
        if total <= free:
            return {v: n for v, n in pending.items() if n}
        exact = {v: free * n / total for v, n in pending.items() if n}
        out = {v: int(x) for v, x in exact.items()}
        rest = free - sum(out.values())
        for v in sorted(exact, key=lambda v: (-(exact[v] - out[v]), v))[:rest]:
            out[v] += 1
        return {v: n for v, n in out.items() if n}

    # -- training -------------------------------------------------------------------------------------------

    def next_batch(self) -> list[int] | None:
        """Group ids to train on now (``TBS`` samples, whole groups), or None if the trainer must wait."""
        p, led = self.policy, self.ledger
        if self.trained_samples >= p.total_samples:
            return None
        if p.mode != "dora":
            while self.batches and all(led.group_done(g) for g in self.batches[0]):  # wholly filtered
                self.batches.pop(0)
            if not self.batches or not all(led.group_ready(g) or led.group_done(g) for g in reversed(self.batches[0])):
                return None  # (scanned from the newest group, the likeliest not to be ready)
            chosen = [g for g in self.batches[0] if led.group_ready(g)]
            return chosen or None
        ready = sorted((led.groups[g].version, g) for g in led.ready_group_ids())
        need = min(p.train_batch, p.total_samples - self.trained_samples) // p.group_size
        if len(ready) < need:
            return None
        chosen = [gid for _, gid in ready[:need]]
        # The update is allowed only if what stays outstanding can still be trained in time: the updates at
        # versions t+1 .. w+K are all that can take a sample of version w, so after this one (t -> t+1) at
        # most (w + K - t) * TBS samples of versions <= w may remain. For w < t + 1 - K that is zero: the
        # window advances only when its oldest version has drained. Keeping this for every w (not only the
        # oldest) is what guarantees progress: a version never holds more work than its remaining updates.
        after = led.outstanding()
        for gid in chosen:
            after[led.groups[gid].version] -= len(led.groups[gid].sample_ids)
        left = 0
        for w in sorted(after):
            left += after[w]
            if left > max(0, w + p.bound - self.version) * p.train_batch:
                return None
        return chosen

    def trained(self, group_ids: list[int]) -> None:
        """Records an applied update on ``group_ids``: they are consumed at the current version, which then
        advances by one."""
        self.ledger.consume(group_ids, self.version)
        self.trained_samples += sum(len(self.ledger.groups[g].sample_ids) for g in group_ids)
        if self.policy.mode != "dora":
            self.batches.pop(0)
        self.version += 1

    def retract(self) -> list[int]:
        """Takes back the version the last update was to produce: none of its optimizer updates applied (every
        one was non-finite), so it is never published. The trained groups stay consumed; the groups already
        dispatched on the retracted version (none has started: its weights never reached the rollout side) move
        to the version before. Returns their ids."""
        gone, self.version = self.version, self.version - 1
        moved = [g.group_id for g in self.ledger.groups.values() if g.version == gone]
        for gid in moved:
            self.ledger.move_version(gid, self.version)
        return moved

    # -- versions -------------------------------------------------------------------------------------------

    def live_versions(self) -> list[int]:
        """Versions with outstanding samples, plus the newest: what must stay resident."""
        return sorted(set(self.ledger.outstanding()) | {self.version})

    def done(self) -> bool:
        return self.trained_samples >= self.policy.total_samples

    # -- persistence ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "next_group": self.next_group, "next_sample": self.next_sample,
                "next_prompt": self.next_prompt, "trained_samples": self.trained_samples,
                "batches": [list(b) for b in self.batches], "ledger": self.ledger.to_dict()}

    @classmethod
    def from_state_dict(cls, policy: SchedulePolicy, data: dict[str, Any]) -> "Scheduler":
        s = cls(policy, Ledger.from_dict(data["ledger"]))
        s.version, s.next_group, s.next_sample = data["version"], data["next_group"], data["next_sample"]
        s.next_prompt, s.trained_samples = data["next_prompt"], data["trained_samples"]
        s.batches = [list(b) for b in data["batches"]]
        return s
