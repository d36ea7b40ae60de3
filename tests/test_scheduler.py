"""The scheduler and the ledger under random completion orders, lengths and filtering (hypothesis).

A fake rollout side with a fixed number of slots decodes one token per step for every admitted sample; each
sample's length is drawn at dispatch; a few samples are filtered (a reward function failing). The
invariants of promises 2-4 are checked after every event, and the run must finish (no deadlock).
"""

import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from dora_jax.dora.ledger import Ledger, LedgerError
from dora_jax.dora.scheduler import SchedulePolicy, ScheduleError, Scheduler


def simulate(policy: SchedulePolicy, slots: int, seed: int, filter_p: float = 0.0, max_len: int = 40,
             scheduler: type = Scheduler):
    rng = random.Random(seed)
    sched = scheduler(policy)
    led = sched.ledger
    pending: dict[int, list[int]] = {}  # version -> sample ids waiting for a slot
    remaining: dict[int, int] = {}  # in-flight sample -> tokens left
    max_live_versions, trained_lags = 0, []
    for _ in range(100_000):
        if sched.done():
            break
        free = slots - len(remaining)
        alloc = sched.assign_slots(free, {v: len(ids) for v, ids in pending.items()})
        assert sum(alloc.values()) <= free, f"{sum(alloc.values())} slots handed out, {free} free"
        for v, n in alloc.items():
            for s in pending[v][:n]:
                led.start(s)
                # long-tailed: mostly short, a few very long
                remaining[s] = rng.randint(1, 4) if rng.random() < 0.85 else rng.randint(max_len // 2, max_len)
            pending[v] = pending[v][n:]
        for s in list(remaining):
            remaining[s] -= 1
            if remaining[s] == 0:
                del remaining[s]
                if rng.random() < filter_p:
                    led.filter(s, "reward function raised")
                else:
                    led.finish(s)
        live = set(led.outstanding()) | {sched.version}
        max_live_versions = max(max_live_versions, len(live))
        assert max(live) - min(live) <= policy.bound, f"live versions {sorted(live)} span more than K = {policy.bound}"
        # As in the runner: new work is dispatched before the trainer takes its batch, so in one_step_off
        # the next batch starts on the version the trainer is about to update.
        for g in sched.dispatch():
            assert g.version == sched.version, f"group {g.group_id} dispatched on version {g.version}, the newest " \
                                               f"is {sched.version}"  # new prompts only on the newest version
            pending.setdefault(g.version, []).extend(g.sample_ids)
        batch = sched.next_batch()
        if batch:
            version = sched.version
            for gid in batch:
                for s in led.groups[gid].sample_ids:
                    trained_lags.append(version - led.entries[s].version)
            sched.trained(batch)
        led.check(policy.bound)
        assert led.holds(policy.bound), "the fast verdict refused a valid ledger"
    else:
        raise AssertionError(f"no progress: {led.counts()}, version {sched.version}")
    return sched, max_live_versions, trained_lags


policies = st.builds(
    lambda mode, k, g, tb_groups, extra, steps: SchedulePolicy(
        mode=mode, max_staleness=max(k, 1 if mode == "one_step_off" else 0), group_size=g,
        train_batch=g * tb_groups,
        rollout_batch=min(g * (tb_groups + extra), (max(k, 1 if mode == "one_step_off" else 0) + 1) * g * tb_groups), total_samples=g * tb_groups * steps),
    mode=st.sampled_from(["sync", "one_step_off", "dora"]), k=st.integers(0, 3), g=st.integers(1, 4),
    tb_groups=st.integers(1, 4), extra=st.integers(0, 6), steps=st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(policy=policies, slots=st.integers(1, 24), seed=st.integers(0, 10**6),
       filter_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]))
def test_invariants_under_random_completions(policy, slots, seed, filter_p):
    sched, max_live, lags = simulate(policy, slots, seed, filter_p)
    led = sched.ledger
    counts = led.counts()
    # Integrity: nothing left behind, every sample consumed once or filtered with a reason.
    assert counts["pending"] == counts["in_flight"] == counts["finished"] == 0, counts
    assert counts["consumed"] + counts["filtered"] == len(led.entries)
    assert counts["consumed"] == sched.trained_samples == policy.total_samples
    assert all(led.filtered_reasons().values())
    # Bounded staleness and residency.
    assert all(0 <= lag <= policy.bound for lag in lags)
    assert max_live <= policy.bound + 1
    # Groups whole, one version per group.
    led.check(policy.bound)


def test_dora_uses_staleness_and_sync_does_not():
    k2 = SchedulePolicy("dora", max_staleness=2, rollout_batch=24, train_batch=8, group_size=4, total_samples=96)
    _, live, lags = simulate(k2, slots=16, seed=1)
    assert max(lags) == 2 and live == 3  # the window is used in full, never exceeded
    sync = SchedulePolicy("sync", max_staleness=2, rollout_batch=8, train_batch=8, group_size=4, total_samples=96)
    _, live, lags = simulate(sync, slots=16, seed=1)
    assert set(lags) == {0} and live == 1
    off = SchedulePolicy("one_step_off", max_staleness=1, rollout_batch=8, train_batch=8, group_size=4,
                         total_samples=96)
    _, live, lags = simulate(off, slots=16, seed=1)
    assert set(lags) == {0, 1} and live == 2


def test_assign_slots_is_proportional_and_exact():
    s = Scheduler(SchedulePolicy("dora", 2, 16, 8, 4, 64))
    assert s.assign_slots(10, {0: 30, 1: 10}) == {0: 8, 1: 2}  # hand-computed: 7.5 / 2.5, tie to older
    assert s.assign_slots(10, {0: 3, 1: 2}) == {0: 3, 1: 2}  # everything fits
    assert s.assign_slots(0, {0: 3}) == {}
    assert s.assign_slots(3, {0: 1, 1: 1, 2: 1, 3: 1}) == {0: 1, 1: 1, 2: 1}


def test_window_waits_for_the_oldest_version():
    """K = 1: a group of version 0 still decoding blocks the update to version 2."""
    s = Scheduler(SchedulePolicy("dora", max_staleness=1, rollout_batch=8, train_batch=4, group_size=4,
                                 total_samples=64))
    led = s.ledger
    slow, fast = s.dispatch()  # two groups on version 0
    for sid in fast.sample_ids:
        led.start(sid)
        led.finish(sid)
    for sid in slow.sample_ids:
        led.start(sid)
    s.trained(s.next_batch())  # version 0 -> 1: slow (version 0) stays within K = 1
    (g1,) = s.dispatch()
    assert g1.version == 1
    for sid in g1.sample_ids:
        led.start(sid)
        led.finish(sid)
    assert s.next_batch() is None  # training g1 would move to version 2 and strand `slow` at lag 2
    for sid in slow.sample_ids:
        led.finish(sid)
    assert s.next_batch() == [slow.group_id]  # oldest version first
    s.trained([slow.group_id])
    assert s.next_batch() == [g1.group_id]


def test_no_version_is_left_with_more_work_than_its_remaining_updates():
    """K = 2, TBS = one group, RBS = three. Training a newer ready group while two groups of version 0 are
    still decoding would leave version 0 with two groups but only one update (at version 2) able to take
    them: a deadlock two updates later. The scheduler must wait instead."""
    s = Scheduler(SchedulePolicy("dora", max_staleness=2, rollout_batch=12, train_batch=4, group_size=4,
                                 total_samples=64))
    led = s.ledger

    def run(group, finish=True):
        for sid in group.sample_ids:
            led.start(sid)
            if finish:
                led.finish(sid)

    a, b, c = s.dispatch()
    run(a)
    run(b, finish=False)
    run(c, finish=False)
    assert s.next_batch() == [a.group_id]  # 8 samples of version 0 left, 2 updates (v1, v2) can take them
    s.trained([a.group_id])
    (d,) = s.dispatch()
    run(d)
    assert s.next_batch() is None  # training d would leave 8 samples of version 0 for the single update v2
    for sid in b.sample_ids:
        led.finish(sid)
    assert s.next_batch() == [b.group_id]
    s.trained([b.group_id])
    for sid in c.sample_ids:
        led.finish(sid)
    assert s.next_batch() == [c.group_id]  # the window's oldest version drains first


def test_ledger_rejects_bad_transitions_and_filters_whole_groups():
    led = Ledger()
    led.add_group(0, [0, 1, 2], version=0, prompt_index=0)
    with pytest.raises(LedgerError, match="group 0 was already dispatched"):
        led.add_group(0, [3], 0, 1)
    with pytest.raises(LedgerError, match="sample 1 was already dispatched"):
        led.add_group(1, [1], 0, 1)
    with pytest.raises(LedgerError, match="sample 0 is pending; cannot become finished"):
        led.finish(0)
    for s in (0, 1, 2):
        led.start(s)
    led.finish(0)
    led.filter(1, "reward timed out after 5s")
    led.finish(2)
    assert led.filtered_reasons() == {0: "group member 1 filtered", 1: "reward timed out after 5s",
                                      2: "group member 1 filtered"}
    with pytest.raises(LedgerError, match="group 0 is not ready"):
        led.consume([0], 0)
    restored = Ledger.from_dict(led.to_dict())
    assert restored.counts() == led.counts() and restored.filtered_reasons() == led.filtered_reasons()
    # A member finishing after its group lost two names the first of them in group order, also in a ledger
    # restored from its saved form.
    led.add_group(1, [3, 4, 5], version=0, prompt_index=1)
    for s in (3, 4, 5):
        led.start(s)
    led.filter(4, "reward raised ValueError")
    led.filter(3, "reward timed out after 5s")
    restored = Ledger.from_dict(led.to_dict())
    for ledger in (led, restored):
        ledger.finish(5)
        assert ledger.filtered_reasons()[5] == "group member 3 filtered"


def test_bad_policies_are_named():
    with pytest.raises(ScheduleError, match="mode 'async'; allowed: sync, one_step_off, dora"):
        Scheduler(SchedulePolicy("async", 1, 8, 8, 4, 8))
    with pytest.raises(ScheduleError, match="group_size 0: must be >= 1"):
        Scheduler(SchedulePolicy("dora", 1, 8, 8, 0, 8))
    with pytest.raises(ScheduleError, match="max_staleness -1: must be >= 0"):
        Scheduler(SchedulePolicy("dora", -1, 8, 8, 4, 8))
    for total in (0, 12):  # none, and not a multiple
        with pytest.raises(ScheduleError, match=f"total_samples {total}: must be a positive multiple of train_batch 8"):
            Scheduler(SchedulePolicy("dora", 1, 8, 8, 4, total))
    with pytest.raises(ScheduleError, match=r"rollout_batch 4: must be >= train_batch 8 \(the trainer could never "
                                            r"fill a batch\)"):
        Scheduler(SchedulePolicy("dora", 1, 4, 8, 4, 8))
    with pytest.raises(ScheduleError, match="train_batch 6: must be a positive multiple of the group size 4"):
        Scheduler(SchedulePolicy("dora", 1, 8, 6, 4, 12))
    with pytest.raises(ScheduleError, match="rollout_batch 4: must be >= train_batch 8"):
        Scheduler(SchedulePolicy("dora", 1, 4, 8, 4, 8))
    with pytest.raises(ScheduleError, match=r"rollout_batch 18: must be <= \(max_staleness \+ 1\) \* train_batch = 12 "
                                            r"\(the next K \+ 1 updates are all that can train a sample dispatched "
                                            r"now; more would be dropped or break the staleness bound\)"):
        Scheduler(SchedulePolicy("dora", 0, 18, 12, 3, 60))
    with pytest.raises(ScheduleError, match="^one_step_off trains every batch one version late: max_staleness must "
                                            "be >= 1$"):
        Scheduler(SchedulePolicy("one_step_off", 0, 8, 8, 4, 8))


# -- every check the tests rely on is shown to fail on broken input ----------------------------------------------


def _valid_ledger():
    """Three groups of two: group 0 (version 0) trained at 1, group 1 (version 1) trained at 2, group 2
    (version 1) filtered (a reward failure, then its other member). Valid for K = 1."""
    led = Ledger()
    led.add_group(0, [0, 1], version=0, prompt_index=0)
    led.add_group(1, [2, 3], version=1, prompt_index=1)
    led.add_group(2, [4, 5], version=1, prompt_index=2)
    for s in range(6):
        led.start(s)
    for s in range(4):
        led.finish(s)
    led.consume([0], 1)
    led.consume([1], 2)
    led.filter(4, "reward function raised ValueError")
    led.finish(5)
    return led


def _entry(**fields):
    def brk(led, sample_id):
        for k, v in fields.items():
            setattr(led.entries[sample_id], k, v)
    return brk


BROKEN_LEDGERS = {
    "split group": (lambda led: led.set_state(1, "finished"), r"group 0 was split: member states \['consumed', "
                                                                r"'finished'\]"),
    "two versions in one group": (lambda led: _entry(version=0)(led, 5), r"group 2 mixes versions \[0, 1\]"),
    "staleness above K": (lambda led: [_entry(trained_at=3)(led, s) for s in (2, 3)],
                          r"sample 2 \(version 1\) was trained at version 3: lag 2 outside \[0, 1\]"),
    "trained before its version": (lambda led: [_entry(trained_at=0)(led, s) for s in (2, 3)],
                                   r"lag -1 outside \[0, 1\]"),
    "group trained in two updates": (lambda led: _entry(trained_at=1)(led, 3),
                                     "group 1 was trained in more than one update"),
    "consumed without its version": (lambda led: _entry(trained_at=-1)(led, 0),
                                     "sample 0 is consumed without the version it was trained at"),
    # A field of another type (a hand-edited saved ledger): the fast verdict cannot compare it, the walk names it.
    "trained at no version": (lambda led: _entry(trained_at=None)(led, 0),
                              "sample 0 is consumed without the version it was trained at"),
    "filtered without a reason": (lambda led: _entry(reason="")(led, 4), "sample 4 is filtered without a reason"),
    # A state changed behind the ledger's back: its counts no longer match the entries.
    "counts off": (lambda led: _entry(state="finished")(led, 0), "state counts .* do not match the entries"),
    "unknown state": (lambda led: _entry(state="lost")(led, 5), "sample 5 has unknown state 'lost'"),
    "a sample in two groups": (lambda led: led.groups[2].sample_ids.append(0),
                               r"sample 0 names group 0 but is listed by groups \[0, 2\]"),
    "a group listing an unknown sample": (lambda led: led.groups[2].sample_ids.append(99),
                                          r"groups list samples that are not in the ledger: \[99\]"),
    "a sample no group lists": (lambda led: led.groups[2].sample_ids.remove(5),
                                r"sample 5 names group 2 but is listed by groups \[\]"),
    "an empty group": (lambda led: led.groups.__setitem__(9, dataclasses.replace(led.groups[2], group_id=9,
                                                                                  sample_ids=[])),
                       "group 9 has no samples"),
}


@pytest.mark.parametrize("defect", sorted(BROKEN_LEDGERS))
def test_ledger_check_rejects_broken_ledgers(defect):
    led = _valid_ledger()
    led.check(1)
    assert led.holds(1) and Ledger.from_dict(led.to_dict()).holds(1)
    assert Ledger.from_dict(led.to_dict()).counts() == led.counts()
    brk, message = BROKEN_LEDGERS[defect]
    brk(led)
    assert not led.holds(1)  # the fast verdict sees it too
    with pytest.raises(LedgerError, match=message):
        led.check(1)


# A ledger whose every sample is consumed takes another path through the check (whole groups compared at once).
ALL_CONSUMED_DEFECTS = {
    **{name: BROKEN_LEDGERS[name] for name in ("staleness above K", "trained before its version",
                                               "group trained in two updates")},
    "two versions in one group": (lambda led: _entry(version=2)(led, 3), r"group 1 mixes versions \[1, 2\]"),
    "consumed without its version": (lambda led: [_entry(trained_at=-1)(led, s) for s in (0, 1)],
                                     "sample 0 is consumed without the version it was trained at"),
}


@pytest.mark.parametrize("defect", sorted(ALL_CONSUMED_DEFECTS))
def test_ledger_check_rejects_broken_ledgers_all_consumed(defect):
    led = Ledger()  # _valid_ledger's groups 0 and 1, both consumed
    led.add_group(0, [0, 1], version=0, prompt_index=0)
    led.add_group(1, [2, 3], version=1, prompt_index=1)
    for s in range(4):
        led.start(s)
        led.finish(s)
    led.consume([0], 1)
    led.consume([1], 2)
    led.check(1)
    assert led.holds(1)
    brk, message = ALL_CONSUMED_DEFECTS[defect]
    brk(led)
    assert not led.holds(1)
    with pytest.raises(LedgerError, match=message):
        led.check(1)


def test_set_state_names_an_unknown_sample_or_state():
    led = _valid_ledger()
    with pytest.raises(LedgerError, match="sample 99 is not in the ledger"):
        led.set_state(99, "finished")
    with pytest.raises(LedgerError, match="sample 0: unknown state 'lost'"):
        led.set_state(0, "lost")
    led.check(1)  # refused before anything changed


def test_a_sample_is_consumed_once_and_saved_once():
    led = _valid_ledger()
    with pytest.raises(LedgerError, match=r"group 0 is not ready \(member states \['consumed', 'consumed'\]\)"):
        led.consume([0], 2)
    saved = led.to_dict()
    for entries, message in [(saved["entries"] + [saved["entries"][0]], "saved ledger: sample 0 is listed twice"),
                             (saved["entries"] + [[7, "consumed", "", 1]], "saved ledger: sample 7 belongs to no "
                                                                            "group"),
                             (saved["entries"][1:], r"saved ledger: samples \[0\] have no state")]:
        with pytest.raises(LedgerError, match=message):
            Ledger.from_dict({"groups": saved["groups"], "entries": entries})


def _rows(led):
    """samples.jsonl rows as the runner writes them, for the consumed samples of ``led``."""
    return [{"sample_id": s, "group_id": e.group_id, "version": e.version, "trained_at": e.trained_at}
            for s, e in led.entries.items() if e.state == "consumed"]


def test_the_samples_file_check_rejects_broken_records():
    from invariants import check_trained_samples

    led = _valid_ledger()
    check_trained_samples(_rows(led), led, 1)
    rows = _rows(led)
    with pytest.raises(AssertionError, match=r"samples trained more than once: \[2\]"):
        check_trained_samples(rows + [rows[2]], led, 1)
    with pytest.raises(AssertionError, match=r"consumed but never trained: \[3\]"):
        check_trained_samples(rows[:3], led, 1)
    with pytest.raises(AssertionError, match=r"trained but not consumed in the ledger: \[4\]"):
        check_trained_samples(rows + [{**rows[0], "sample_id": 4, "group_id": 2}], led, 1)
    with pytest.raises(AssertionError, match=r"sample 1: version, trained_at, group \(1, 1, 0\), the ledger has "
                                             r"\(0, 1, 0\)"):
        check_trained_samples([rows[0], {**rows[1], "version": 1}] + rows[2:], led, 1)
    with pytest.raises(AssertionError, match=r"sample 0 \(version 0\) trained at 1: staleness 1 outside \[0, 0\]"):
        check_trained_samples(rows, led, 0)
    for s in (2, 3):  # the ledger and the file agree on a stale group: the bound still catches it
        led.entries[s].trained_at = 3
    with pytest.raises(AssertionError, match=r"sample 2 \(version 1\) trained at 3: staleness 2 outside"):
        check_trained_samples(_rows(led), led, 1)
    led = _valid_ledger()
    led.entries[3].trained_at = 1  # one group, two updates
    with pytest.raises(AssertionError, match=r"group 1 trained on several \(version, update\) pairs: "
                                             r"\[\(1, 1\), \(1, 2\)\]"):
        check_trained_samples(_rows(led), led, 1)
    led = _valid_ledger()
    led.set_state(1, "finished")  # one member trained, the other not
    with pytest.raises(AssertionError, match=r"group 0 trained in part: \[1\] missing"):
        check_trained_samples(_rows(led), led, 1)


class _NoWindow(Scheduler):
    """Trains the oldest ready groups without the check that what stays outstanding fits the bound."""

    def next_batch(self):
        p, led = self.policy, self.ledger
        if self.trained_samples >= p.total_samples or p.mode != "dora":
            return super().next_batch()
        ready = sorted((led.groups[g].version, g) for g in led.ready_group_ids())
        need = min(p.train_batch, p.total_samples - self.trained_samples) // p.group_size
        return [g for _, g in ready[:need]] if len(ready) >= need else None


class _StaleDispatch(Scheduler):
    """Dispatches new groups on the version before the newest."""

    def dispatch(self):
        out = super().dispatch()
        for g in out:
            self.ledger.move_version(g.group_id, max(self.version - 1, 0))
        return out


class _Oversubscribed(Scheduler):
    """Hands out every pending request, whatever the free slots."""

    def assign_slots(self, free, pending):
        return {v: n for v, n in pending.items() if n}


@pytest.mark.parametrize("scheduler,raised,message", [
    (_NoWindow, AssertionError, r"live versions \[0, 1, 2\] span more than K = 1"),
    (_StaleDispatch, AssertionError, "group 4 dispatched on version 0, the newest is 1"),
    (_Oversubscribed, AssertionError, "16 slots handed out, 8 free")])
def test_the_simulation_checks_catch_a_broken_scheduler(scheduler, raised, message):
    """The random-completion simulation's checks (window within K, new prompts on the newest version, no
    more slots than free, the ledger's own check after every event) stop a scheduler with one mistake."""
    policy = SchedulePolicy("dora", max_staleness=1, rollout_batch=16, train_batch=8, group_size=4,
                            total_samples=96)
    simulate(policy, slots=8, seed=3, scheduler=Scheduler)  # the real one passes
    with pytest.raises(raised, match=message):
        simulate(policy, slots=8, seed=3, scheduler=scheduler)


# -- what the scheduler and the ledger record, step by step (hand-derived cases) ------------------------------------


def _run_group(led, group, finish=True):
    for sid in group.sample_ids:
        led.start(sid)
        if finish:
            led.finish(sid)


def _filter_group(led, group):
    """A reward failure on the first member; the others follow it."""
    first, *rest = group.sample_ids
    for sid in group.sample_ids:
        led.start(sid)
    led.filter(first, "reward function raised ValueError")
    for sid in rest:
        led.finish(sid)


def test_groups_take_consecutive_sample_ids_and_data_positions():
    s = Scheduler(SchedulePolicy("dora", 2, 12, 4, 4, 64))
    groups = s.dispatch()
    assert [(g.group_id, g.sample_ids, g.prompt_index, g.version) for g in groups] == [
        (0, [0, 1, 2, 3], 0, 0), (1, [4, 5, 6, 7], 1, 0), (2, [8, 9, 10, 11], 2, 0)]
    assert [s.ledger.entries[i].prompt_index for i in (0, 4, 11)] == [0, 1, 2]
    assert (s.next_group, s.next_sample, s.next_prompt) == (3, 12, 3)


def test_the_state_round_trips_and_the_run_continues_alike():
    """A scheduler restored from its state dict (through JSON, as checkpoints hold it) equals the original and
    takes the same decisions afterwards."""
    import json

    policy = SchedulePolicy("one_step_off", 1, 8, 8, 4, 32)
    a = Scheduler(policy)
    first = a.dispatch()
    for g in first:
        _run_group(a.ledger, g)
    second = a.dispatch()  # the next batch starts once the first is generated
    a.trained(a.next_batch())
    _run_group(a.ledger, second[0], finish=False)
    b = Scheduler.from_state_dict(policy, json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() and b.ledger is not a.ledger
    assert [(g.group_id, g.version, g.prompt_index) for g in b.ledger.groups.values()] == [
        (g.group_id, g.version, g.prompt_index) for g in a.ledger.groups.values()]
    for sched in (a, b):
        _run_group(sched.ledger, sched.ledger.groups[3])
        for sid in sched.ledger.groups[2].sample_ids:
            sched.ledger.finish(sid)
        assert sched.dispatch()[0].group_id == 4 and sched.next_batch() == [2, 3]
    assert b.state_dict() == a.state_dict()


def test_one_step_off_starts_a_batch_once_the_previous_one_is_generated():
    s = Scheduler(SchedulePolicy("one_step_off", 1, 8, 8, 4, 32))
    led = s.ledger
    b0 = s.dispatch()
    assert [g.group_id for g in b0] == [0, 1] and s.dispatch() == []  # batch 0 still decoding
    _run_group(led, b0[0])
    _filter_group(led, b0[1])  # filtered counts as generated
    b1 = s.dispatch()
    assert [(g.group_id, g.version) for g in b1] == [(2, 0), (3, 0)]
    for g in b1:
        _run_group(led, g)
    assert s.dispatch() == []  # two batches in flight at most
    assert s.next_batch() == [0]  # the filtered group is not trained; the batch is still the first
    s.trained([0])
    assert [g.group_id for g in s.dispatch()] == [4, 5] and s.batches == [[2, 3], [4, 5]]


def _budget_left(s):
    """Samples the scheduler may still dispatch: trained + outstanding stays within ``total_samples``."""
    return s.policy.total_samples - s.trained_samples - sum(s.ledger.outstanding().values())


def test_refill_replaces_filtered_groups_within_the_budget():
    """DAPO's dynamic sampling in sync mode: each wholly filtered group of the batch in flight is replaced by a
    new one, exactly enough for TBS live samples, as long as trained + outstanding samples stay within the
    budget (filtered samples count for neither). Without refill a batch stays short."""
    s = Scheduler(SchedulePolicy("sync", 0, 8, 8, 4, 16, refill=True))
    led = s.ledger
    g0, g1 = s.dispatch()
    _filter_group(led, g0)
    (g2,) = s.dispatch()
    assert g2.group_id == 2 and s.batches == [[0, 1, 2]] and s.dispatch() == []
    _run_group(led, g1)
    _run_group(led, g2)
    assert s.next_batch() == [1, 2]
    s.trained([1, 2])
    g3, g4 = s.dispatch()  # the last batch: the budget is spent
    assert _budget_left(s) == 0
    _filter_group(led, g3)
    _filter_group(led, g4)
    assert [g.group_id for g in s.dispatch()] == [5, 6]  # two replacements, the second with exactly 4 left
    assert s.batches == [[3, 4, 5, 6]] and _budget_left(s) == 0 and s.dispatch() == []

    plain = Scheduler(SchedulePolicy("sync", 0, 8, 8, 4, 16))
    g0, g1 = plain.dispatch()
    _filter_group(plain.ledger, g0)
    assert plain.dispatch() == []
    _run_group(plain.ledger, g1)
    assert plain.next_batch() == [1]  # a short batch


def test_slots_go_to_the_largest_remainders():
    s = Scheduler(SchedulePolicy("dora", 2, 16, 8, 4, 64))
    assert s.assign_slots(3, {0: 3, 1: 4}) == {0: 1, 1: 2}  # 9/7 and 12/7: the newer version's .71 wins
    assert s.assign_slots(3, {0: 4, 1: 1}) == {0: 2, 1: 1}  # 2.4 and 0.6: the remainder, not the size, decides
    assert s.assign_slots(-1, {0: 3}) == {} and s.assign_slots(5, {}) == {}


def test_the_window_counts_every_older_version_together():
    """K = 3, one group per update. At version 2: one group of version 0 and two of version 1 decoding, a
    version-2 group ready. Training it would leave three groups that only the updates at versions 3 and 4
    may take: refused, though no single version holds more than its own updates allow."""
    s = Scheduler(SchedulePolicy("dora", max_staleness=3, rollout_batch=8, train_batch=2, group_size=2,
                                 total_samples=40))
    led = s.ledger
    a0, a1, a2, a3 = s.dispatch()
    _run_group(led, a0, finish=False)
    _run_group(led, a1)
    _run_group(led, a2)
    _filter_group(led, a3)
    assert s.next_batch() == [a1.group_id]
    s.trained([a1.group_id])
    b0, b1 = s.dispatch()
    _run_group(led, b0, finish=False)
    _run_group(led, b1, finish=False)
    assert s.next_batch() == [a2.group_id]
    s.trained([a2.group_id])
    (c0,) = s.dispatch()
    _run_group(led, c0)
    assert s.version == 2 and led.outstanding() == {0: 2, 1: 4, 2: 2}
    assert s.next_batch() is None


def test_a_finished_run_hands_out_nothing_more():
    for mode in ("sync", "one_step_off", "dora"):
        k = {"sync": 0, "one_step_off": 1, "dora": 2}[mode]
        policy = SchedulePolicy(mode, k, 8, 8, 4, 32)
        sched, _, _ = simulate(policy, slots=8, seed=5)
        assert sched.done() and sched.next_batch() is None and sched.dispatch() == [] and sched.batches == []
        assert sched.live_versions() == [4] and sched.trained_samples == 32


def test_live_versions_are_the_outstanding_ones_and_the_newest():
    s = Scheduler(SchedulePolicy("dora", 2, 12, 4, 4, 64))
    led = s.ledger
    a, b, c = s.dispatch()
    assert s.live_versions() == [0]
    _run_group(led, a)
    s.trained(s.next_batch())
    assert s.live_versions() == [0, 1]
    for g in (b, c):
        _run_group(led, g)
    s.trained(s.next_batch())
    s.trained(s.next_batch())
    assert s.live_versions() == [3]


def test_retract_moves_the_groups_of_a_version_never_published():
    s = Scheduler(SchedulePolicy("dora", 1, 8, 4, 4, 64))
    led = s.ledger
    a, b = s.dispatch()
    _run_group(led, a)
    s.trained(s.next_batch())
    (c,) = s.dispatch()  # on version 1
    assert c.version == 1 and s.retract() == [c.group_id]
    assert s.version == 0 and led.groups[c.group_id].version == 0
    assert {led.entries[sid].version for sid in c.sample_ids} == {0}
    led.check(1)
    led.start(c.sample_ids[0])
    with pytest.raises(LedgerError, match=r"group 2 cannot move from version 0 to 1: its samples are \['in_flight', "
                                          r"'pending', 'pending', 'pending'\], and only groups that have not started "
                                          r"can"):
        led.move_version(c.group_id, 1)


def test_requeue_moves_in_flight_samples_back_to_pending():
    led = Ledger()
    led.add_group(0, [0, 1], version=3, prompt_index=0)
    led.start(0)
    led.start(1)
    led.finish(1)
    led.requeue(0)
    assert led.entries[0].state == "pending" and led.entries[0].version == 3
    assert led.counts() == {"pending": 1, "in_flight": 0, "finished": 1, "consumed": 0, "filtered": 0}
    led.check()
    for sid in (0, 1):  # pending and finished samples are not requeued
        with pytest.raises(LedgerError, match=f"sample {sid} is (pending|finished); cannot become pending"):
            led.requeue(sid)
    with pytest.raises(LedgerError, match="sample 9 is not in the ledger"):
        led.requeue(9)


def test_filter_names_what_it_refuses_and_who_filtered_a_group():
    led = _valid_ledger()
    with pytest.raises(LedgerError, match="sample 9 is not in the ledger"):
        led.filter(9, "reward raised")
    with pytest.raises(LedgerError, match="sample 0 is consumed; cannot be filtered"):
        led.filter(0, "reward raised")
    with pytest.raises(LedgerError, match="sample 4 is filtered; cannot be filtered"):
        led.filter(4, "reward raised")
    assert led.group_done(0) and led.group_done(2) and not led.group_ready(0)
    # A member filtered because of another ("group member ...") is not a cause: a later member names the one
    # whose own failure filtered the group, also after a save and restore.
    led.add_group(3, [6, 7, 8, 9], version=1, prompt_index=3)
    for sid in (6, 7, 8, 9):
        led.start(sid)
    led.filter(8, "reward timed out after 5s")
    led.filter(6, "group member 8 filtered")
    for ledger in (led, Ledger.from_dict(led.to_dict())):
        ledger.finish(9)
        assert ledger.entries[9].reason == "group member 8 filtered"
    # A restored group with no failure finishes normally.
    led.add_group(4, [10, 11], version=1, prompt_index=4)
    led.start(10)
    restored = Ledger.from_dict(led.to_dict())
    restored.finish(10)
    assert restored.entries[10].state == "finished"
    with pytest.raises(LedgerError, match="saved ledger: sample 10 has unknown state 'lost'"):
        Ledger.from_dict({"groups": led.to_dict()["groups"],
                          "entries": [e if e[0] != 10 else [10, "lost", "", -1] for e in led.to_dict()["entries"]]})
