"""The sample ledger (TransferQueue): where every sample of a run is, from dispatch to training.

Every sample id is in exactly one state:

* ``pending``   dispatched to the rollout side with its policy version, not yet decoding;
* ``in_flight`` decoding on its version;
* ``finished``  generated and rewarded, waiting for the trainer;
* ``consumed``  trained on (at which trainer version is recorded);
* ``filtered``  never trained on, with the reason (a reward function that raised or timed out, a group
  member filtered, ...).

Samples belong to groups (the ``group_size`` samples of one prompt), all on the same version, and groups move
to the trainer whole: a group is *ready* when every member is finished, and if any member is filtered the
rest of the group is filtered with it. The ledger is plain data: :meth:`Ledger.to_dict` / :meth:`from_dict`
save and restore it with run checkpoints, and :meth:`Ledger.check` verifies its invariants.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate, chain, repeat
from operator import attrgetter, eq, ne, sub
from typing import Any, Iterable

STATES = ("pending", "in_flight", "finished", "consumed", "filtered")
_SAMPLE_ID, _GROUP_ID, _VERSION = attrgetter("sample_id"), attrgetter("group_id"), attrgetter("version")
_STATE, _TRAINED_AT, _SAMPLE_IDS = attrgetter("state"), attrgetter("trained_at"), attrgetter("sample_ids")


class LedgerError(RuntimeError):
    """A transition the ledger does not allow (a bug in the caller: a sample moved twice, a split group)."""


@dataclasses.dataclass
class Entry:
    sample_id: int
    group_id: int
    version: int
    prompt_index: int
    state: str = "pending"
    reason: str = ""
    trained_at: int = -1  # trainer version the sample was consumed at


@dataclasses.dataclass
class Group:
    group_id: int
    version: int
    prompt_index: int
    sample_ids: list[int]


class Ledger:
    """Sample states, groups and the transitions between them."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.groups: dict[int, Group] = {}
        self._counts = dict.fromkeys(STATES, 0)
        self._causes: dict[int, set[int]] = {}  # group id -> members filtered for a reason of their own

    # -- transitions ----------------------------------------------------------------------------------------

    def add_group(self, group_id: int, sample_ids: Iterable[int], version: int, prompt_index: int) -> Group:
        ids, entries = list(sample_ids), self.entries
        if group_id in self.groups:
            raise LedgerError(f"group {group_id} was already dispatched")
        if not entries.keys().isdisjoint(ids):
            s = next(s for s in ids if s in entries)
            raise LedgerError(f"sample {s} was already dispatched (group {entries[s].group_id})")
        g = Group(group_id, version, prompt_index, ids)
        self.groups[group_id] = g
        entries.update(zip(ids, map(Entry, ids, repeat(group_id), repeat(version), repeat(prompt_index))))
        self._counts["pending"] += len(ids)
        return g

    def _move(self, sample_id: int, frm: tuple[str, ...], to: str) -> Entry:
        e = self.entries.get(sample_id)
        if e is None:
            raise LedgerError(f"sample {sample_id} is not in the ledger")
        if e.state not in frm:
            raise LedgerError(f"sample {sample_id} is {e.state}; cannot become {to}")
        self._counts[e.state] -= 1
        self._counts[to] += 1
        e.state = to
        return e

    def set_state(self, sample_id: int, state: str) -> None:
        """Puts a sample in ``state`` past the transition rules, the counts kept right (as a saved ledger loads)."""
        e = self.entries.get(sample_id)
        if e is None:
            raise LedgerError(f"sample {sample_id} is not in the ledger")
        if state not in STATES:
            raise LedgerError(f"sample {sample_id}: unknown state {state!r}")
        self._counts[e.state] -= 1
        self._counts[state] += 1
        e.state = state

    def move_version(self, group_id: int, version: int) -> None:
        """Re-tags a group none of whose samples has started to ``version`` (the version it was dispatched on is
        never published, so nothing of it was generated)."""
        g = self.groups[group_id]
        states = [self.entries[s].state for s in g.sample_ids]
        if any(st != "pending" for st in states):
            raise LedgerError(f"group {group_id} cannot move from version {g.version} to {version}: its samples "
                              f"are {states}, and only groups that have not started can")
        g.version = version
        for s in g.sample_ids:
            self.entries[s].version = version

    def start(self, sample_id: int) -> None:
        self._move(sample_id, ("pending",), "in_flight")

    def requeue(self, sample_id: int) -> None:
        """Moves an in-flight sample back to pending: its generation was lost (a restart) and is redone from
        the prompt on the same version. Only ``in_flight`` samples can be requeued."""
        self._move(sample_id, ("in_flight",), "pending")

    def finish(self, sample_id: int) -> None:
        """A generated sample with its reward. If its group already lost a member, it is filtered too."""
        e = self._move(sample_id, ("in_flight",), "finished")
        causes = self._causes.get(e.group_id)
        if causes:  # name the member whose own failure filtered the group, not one that followed it
            first = next(s for s in self.groups[e.group_id].sample_ids if s in causes)
            self._filter_one(e, f"group member {first} filtered")

    def filter(self, sample_id: int, reason: str) -> None:
        """Marks a sample filtered with ``reason``; its finished (and later-finishing) group members follow."""
        e = self.entries.get(sample_id)
        if e is None:
            raise LedgerError(f"sample {sample_id} is not in the ledger")
        if e.state in ("consumed", "filtered"):
            raise LedgerError(f"sample {sample_id} is {e.state}; cannot be filtered")
        self._filter_one(e, reason)
        if not reason.startswith("group member"):
            self._causes.setdefault(e.group_id, set()).add(sample_id)
        for s in self.groups[e.group_id].sample_ids:
            other = self.entries[s]
            if s != sample_id and other.state == "finished":
                self._filter_one(other, f"group member {sample_id} filtered")

    def _filter_one(self, e: Entry, reason: str) -> None:
        self._counts[e.state] -= 1
        self._counts["filtered"] += 1
        e.state, e.reason = "filtered", reason

    def consume(self, group_ids: Iterable[int], trainer_version: int) -> None:
        """Hands whole ready groups to the trainer."""
        for gid in group_ids:
            if not self.group_ready(gid):
                states = [self.entries[s].state for s in self.groups[gid].sample_ids]
                raise LedgerError(f"group {gid} is not ready (member states {states})")
            for s in self.groups[gid].sample_ids:
                self._move(s, ("finished",), "consumed").trained_at = trainer_version

    # -- queries --------------------------------------------------------------------------------------------

    def count(self, state: str) -> int:
        return self._counts[state]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def group_ready(self, group_id: int) -> bool:
        return all(self.entries[s].state == "finished" for s in self.groups[group_id].sample_ids)

    def ready_group_ids(self) -> list[int]:
        """The groups whose members are all finished (none consumed yet)."""
        return [g for g in self.groups if self.group_ready(g)]

    def group_done(self, group_id: int) -> bool:
        """Every member consumed or filtered: nothing more will happen to this group."""
        return all(self.entries[s].state in ("consumed", "filtered") for s in self.groups[group_id].sample_ids)

    def outstanding(self) -> dict[int, int]:
        """Samples not yet consumed or filtered, per version."""
        out: dict[int, int] = {}
        for e in self.entries.values():
            if e.state in ("pending", "in_flight", "finished"):
                out[e.version] = out.get(e.version, 0) + 1
        return out

    def filtered_reasons(self) -> dict[int, str]:
        return {s: e.reason for s, e in self.entries.items() if e.state == "filtered"}

    # -- persistence and invariants ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [[g.group_id, g.version, g.prompt_index, g.sample_ids] for g in self.groups.values()],
                "entries": [[e.sample_id, e.state, e.reason, e.trained_at] for e in self.entries.values()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Ledger":
        led = cls()
        for gid, version, prompt_index, ids in data["groups"]:
            led.add_group(gid, ids, version, prompt_index)
        seen: set[int] = set()
        for sid, state, reason, trained_at in data["entries"]:
            if sid not in led.entries or sid in seen:
                raise LedgerError(f"saved ledger: sample {sid} " + ("is listed twice" if sid in seen
                                                                    else "belongs to no group"))
            seen.add(sid)
            e = led.entries[sid]
            if state not in STATES:
                raise LedgerError(f"saved ledger: sample {sid} has unknown state {state!r}")
            led.set_state(sid, state)
            e.reason, e.trained_at = reason, trained_at
            if state == "filtered" and not reason.startswith("group member"):
                led._causes.setdefault(e.group_id, set()).add(sid)
        if len(seen) != len(led.entries):
            raise LedgerError(f"saved ledger: samples {sorted(set(led.entries) - seen)} have no state")
        led.check()
        return led

    def check(self, max_staleness: int | None = None) -> None:
        """Raises :class:`LedgerError` unless every invariant holds: one state per sample, counts right,
        every sample in exactly one group (the one it names), groups whole (all members consumed together or
        the group filtered), filtered samples with a reason, consumed samples with the version they were
        trained at, and (given ``max_staleness``) every consumed sample trained within the bound."""
        if not self.holds(max_staleness):
            self._raise_first_fault(max_staleness)

    def holds(self, max_staleness: int | None = None) -> bool:
        """The fast verdict :meth:`check` starts with, in whole-column passes (a run's ledger holds hundreds of
        thousands of samples): True only when every invariant holds. False when one fails, and for a ledger
        whose samples are not in the order its groups list them (as :meth:`add_group` makes them) or hold a
        field of an unexpected type, where :meth:`check` walks the entries to name the fault, if any."""
        try:
            return self._holds(max_staleness)
        except TypeError:
            return False

    def _holds(self, max_staleness: int | None) -> bool:
        entries, groups = self.entries, list(self.groups.values())
        ids = list(map(_SAMPLE_IDS, groups))
        sizes = list(map(len, ids))
        keys, vals = list(entries), list(entries.values())
        if 0 in sizes or list(chain.from_iterable(ids)) != keys or list(map(_SAMPLE_ID, vals)) != keys:
            return False  # an empty group, or not every sample listed once, by one group, in order

        def per_member(column: Iterable[Any]) -> list[Any]:
            """A value per group, repeated for each of its members (aligned with ``vals``)."""
            return list(chain.from_iterable(map(repeat, column, sizes)))

        if (list(map(_GROUP_ID, vals)) != per_member(map(_GROUP_ID, groups))
                or list(map(_VERSION, vals)) != per_member(map(_VERSION, groups))):
            return False  # a sample naming another group, or of another version than its group
        states = list(map(_STATE, vals))
        counts = {state: states.count(state) for state in STATES}
        if sum(counts.values()) != len(states) or counts != self._counts:
            return False  # an unknown state, or the counts off
        if counts["filtered"] and not all(e.reason for e in vals if e.state == "filtered"):
            return False
        if not counts["consumed"]:
            return True
        if counts["consumed"] == len(vals):  # every group consumed: compare each group's first member with the rest
            trained = list(map(_TRAINED_AT, vals))
            firsts = list(map(trained.__getitem__, accumulate(sizes[:-1], initial=0)))
            if per_member(firsts) != trained or min(firsts) < 0:
                return False  # a group trained in more than one update, or a sample without its update
            lags = list(map(sub, firsts, map(_VERSION, groups)))  # a member's lag is its group's (same versions)
            return max_staleness is None or 0 <= min(lags) and max(lags) <= max_staleness
        consumed = [e for e in vals if e.state == "consumed"]
        trained = list(map(_TRAINED_AT, consumed))
        if min(trained) < 0:
            return False
        if max_staleness is not None:
            lags = list(map(sub, trained, map(_VERSION, consumed)))
            if min(lags) < 0 or max(lags) > max_staleness:
                return False
        tags = per_member(range(len(groups)))
        split = {t for t, c in zip(tags, map(ne, states, repeat("consumed"))) if c}
        tags = [t for t, c in zip(tags, map(eq, states, repeat("consumed"))) if c]
        if not split.isdisjoint(tags):
            return False  # a group with consumed and other members
        last = dict(zip(tags, trained))
        return list(map(last.__getitem__, tags)) == trained  # every consumed group trained in one update

    def _raise_first_fault(self, max_staleness: int | None) -> None:
        """Raises :class:`LedgerError` naming the first invariant of :meth:`check` that fails, if any."""
        counts = dict.fromkeys(STATES, 0)
        members: dict[int, list[int]] = {}
        for g in self.groups.values():
            for s in g.sample_ids:
                members.setdefault(s, []).append(g.group_id)
        for e in self.entries.values():
            if e.state not in counts:
                raise LedgerError(f"sample {e.sample_id} has unknown state {e.state!r}")
            counts[e.state] += 1
            if members.get(e.sample_id) != [e.group_id]:
                raise LedgerError(f"sample {e.sample_id} names group {e.group_id} but is listed by groups "
                                  f"{members.get(e.sample_id, [])}")
            if e.state == "filtered" and not e.reason:
                raise LedgerError(f"sample {e.sample_id} is filtered without a reason")
            if e.state == "consumed" and not (isinstance(e.trained_at, int) and e.trained_at >= 0):
                raise LedgerError(f"sample {e.sample_id} is consumed without the version it was trained at")
            if e.state == "consumed" and max_staleness is not None:
                lag = e.trained_at - e.version
                if not 0 <= lag <= max_staleness:
                    raise LedgerError(f"sample {e.sample_id} (version {e.version}) was trained at version "
                                      f"{e.trained_at}: lag {lag} outside [0, {max_staleness}]")
        if counts != self._counts:
            raise LedgerError(f"state counts {self._counts} do not match the entries {counts}")
        unknown = sorted(set(members) - set(self.entries))
        if unknown:
            raise LedgerError(f"groups list samples that are not in the ledger: {unknown}")
        for g in self.groups.values():
            if not g.sample_ids:
                raise LedgerError(f"group {g.group_id} has no samples")
            states = {self.entries[s].state for s in g.sample_ids}
            versions = {self.entries[s].version for s in g.sample_ids}
            if versions != {g.version}:
                raise LedgerError(f"group {g.group_id} mixes versions {sorted(versions)}")
            if "consumed" in states and states != {"consumed"}:
                raise LedgerError(f"group {g.group_id} was split: member states {sorted(states)}")
            if "consumed" in states and len({self.entries[s].trained_at for s in g.sample_ids}) != 1:
                raise LedgerError(f"group {g.group_id} was trained in more than one update")
