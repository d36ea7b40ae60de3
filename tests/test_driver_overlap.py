"""The rollout driver on one shared 4-slot engine (the ``engine4`` fixture, so the tests share its compiled
programs): host / device overlap, several decode steps per program, a shared prompt prefix, DriverGroups.

References: the same requests without overlap, with one decode step per program, with whole-prompt prefills,
on a single driver; a full forward of the same params.
"""

import collections
import dataclasses
import gc
import weakref

import jax
import pytest
from flax import nnx

from conftest import rel_err
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import EngineError, RequestSampling
from dora_jax.rollout.samples import Request
from engine_helpers import GREEDY, assert_same_trajectory, make_engine, make_requests, recompute


@pytest.fixture(scope="module")
def engine4(models):
    """One 4-slot engine shared by the overlap tests, so they share its compiled programs."""
    return make_engine(models[0], slots=4)


def _staggered(driver, reqs):
    """Submits the first half, steps three times, submits the rest, then runs to the end: later requests
    are admitted into slots freed while a step may be in flight."""
    half = len(reqs) // 2
    out = []
    for r in reqs[:half]:
        driver.submit(r)
    for _ in range(3):
        out += driver.step()
    out += driver.run(reqs[half:])
    return {t.sample_id: t for t in out}


def _mixed_requests(eos_probe):
    """16 requests over three versions: mixed prompt lengths and budgets (1..29 tokens), greedy and sampled,
    every third with a stop id; with eos and stop ids frequent in ``eos_probe``'s trajectories."""
    common = collections.Counter(x for t in eos_probe for x in t.tokens).most_common(2)
    eos, stop = common[0][0], common[1][0]
    reqs = [dataclasses.replace(r, stop_ids=(stop,) if i % 3 == 0 else ())
            for i, r in enumerate(make_requests(16, seed=12, versions=(0, 1, 2)))]
    return eos, [dataclasses.replace(r, sampling=RequestSampling(temperature=1.0, top_k=20, seed=3)) if i % 2 else r
                 for i, r in enumerate(reqs)]


def test_driver_with_a_shared_prefix_gives_the_same_trajectories(models, engine4):
    """Two versions, requests that continue the shared prefix and requests that do not (one is the prefix
    itself), staggered admissions, with and without overlap: the same tokens, reasons and log-probs as whole-
    prompt prefills, and log-probs equal to a full forward of each version. Each version prefills the prefix
    once; each prompt only its tokens after it."""
    m0, m1 = models
    head = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
    sampling = RequestSampling(temperature=1.0, seed=5)
    reqs = [dataclasses.replace(r, prompt_ids=(head + r.prompt_ids)[:32] if i % 4 else r.prompt_ids)
            for i, r in enumerate(make_requests(14, seed=21, versions=(0, 1), sampling=sampling))]
    reqs.append(Request(14, head, version=1, max_new_tokens=6, sampling=sampling))  # the prefix alone: whole
    runs, drivers = {}, {}
    for prefix, overlap in (((), False), (head, False), (head, True)):
        d = RolloutDriver(engine4, overlap=overlap, shared_prefix=prefix)
        for v, m in enumerate((m0, m1)):
            d.add_version(v, nnx.state(m))
        runs[prefix, overlap], drivers[prefix, overlap] = _staggered(d, reqs), d
    base = runs[(), False]
    assert sorted(base) == list(range(15))
    for key, run in runs.items():
        for i, t in base.items():
            assert_same_trajectory(run[i], t, reqs[i], (m0, m1)[t.version])
    for t in runs[head, False].values():
        want, _ = recompute((m0, m1)[t.version], t)
        assert rel_err(t.logprobs, want) <= 1e-4
    continues = [r for r in reqs if len(r.prompt_ids) > len(head) and r.prompt_ids[:len(head)] == head]
    assert len(continues) == 10
    distinct = {(r.version, r.prompt_ids) for r in reqs}
    whole = sum(len(p) for v, p in distinct)
    saved = sum(len(head) for r in continues) - 2 * len(head)  # each version prefilled the prefix once
    assert drivers[(), False].stats.prefilled_tokens == whole
    assert drivers[head, False].stats.prefilled_tokens == drivers[head, True].stats.prefilled_tokens == whole - saved
    assert all(d.stats.prefill_rows == len(distinct) for d in drivers.values())
    with pytest.raises(EngineError, match="shared_prefix of 32 tokens; it must be shorter than max_prefill_length"):
        RolloutDriver(engine4, shared_prefix=range(32))


@pytest.mark.parametrize("fuse", [True, False])
def test_overlap_gives_the_same_trajectories(models, engine4, fuse):
    """Dispatching step t + 1 before reading step t back changes when results are read, not what they are:
    three versions, eos / stop / length finishes, admissions into slots freed by the step read while the next
    one runs, compaction; greedy and sampled requests."""
    m0, m1 = models
    eng = engine4
    probe = RolloutDriver(eng)
    probe.add_version(0, nnx.state(m0))
    common = collections.Counter(x for t in probe.run(make_requests(8, seed=11)) for x in t.tokens).most_common(2)
    eos, stop = common[0][0], common[1][0]  # frequent tokens: many trajectories end early
    reqs = [dataclasses.replace(r, stop_ids=(stop,) if i % 3 == 0 else ())
            for i, r in enumerate(make_requests(16, seed=12, versions=(0, 1, 2)))]
    reqs = [dataclasses.replace(r, sampling=RequestSampling(temperature=1.0, top_k=20, seed=3)) if i % 2 else r
            for i, r in enumerate(reqs)]
    runs, drivers = {}, {}
    for overlap in (False, True):
        d = RolloutDriver(eng, eos_ids=[eos], fuse=fuse, overlap=overlap)
        for v, m in enumerate((m0, m1, m0)):
            d.add_version(v, nnx.state(m))
        runs[overlap], drivers[overlap] = _staggered(d, reqs), d
    assert sorted(runs[True]) == list(range(16))
    reasons = collections.Counter(t.finish_reason for t in runs[False].values())
    assert set(reasons) == {"eos", "stop", "length"}, reasons  # every way of finishing is exercised
    same = [assert_same_trajectory(runs[True][i], t, reqs[i], (m0, m1, m0)[t.version]) for i, t in runs[False].items()]
    off, on = drivers[False], drivers[True]
    for d, run in ((off, runs[False]), (on, runs[True])):
        assert d.stats.rows_live == sum(len(t.tokens) - 1 for t in run.values())
    if all(same):  # (trajectories parted at a tie have rows of their own)
        assert on.stats.rows_computed >= off.stats.rows_computed  # rows of finished trajectories computed once more
    assert on.idle and off.idle


def test_overlap_dispatches_the_next_step_before_reading_the_last(models, engine4, monkeypatch):
    """With overlap, two decode steps are outstanding (dispatched, not yet read back) at a time; without it
    one. A fixed batch of equal lengths runs exactly max_new_tokens - 1 steps either way (the first token
    comes from prefill): no step is dispatched for rows whose last token is already being computed. One
    decode step per program here; test_multi_step_decode_* cover several."""
    from dora_jax.rollout.engine import ResultSteps, ResultTokens

    m0, _ = models
    eng = engine4
    outstanding, peak = [0], [0]

    class Counted(ResultSteps):
        def to_host(self):
            outstanding[0] -= 1
            return super().to_host()

    def counting(method):
        def wrapped(*args, **kwargs):
            states, result = method(*args, **kwargs)
            outstanding[0] += 1
            peak[0] = max(peak[0], outstanding[0])
            result.__class__ = Counted  # the engine's own result, its bookkeeping at the first read kept
            return states, result
        return wrapped

    monkeypatch.setattr(eng, "generate_steps", counting(eng.generate_steps))
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=10, sampling=GREEDY) for i in range(4)]
    for overlap, expect_peak in ((False, 1), (True, 2)):
        outstanding[0] = peak[0] = 0
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        out = d.run(reqs)
        assert peak[0] == expect_peak, overlap
        assert outstanding[0] == 0  # every dispatched step was read: none was wasted at the end
        assert d.stats.steps == 9 and d.stats.rows_computed == 4 * 9 and all(len(t.tokens) == 10 for t in out)

    # Compaction between a step's dispatch and its read: two rows end at step 2 and the group shrinks from 4
    # slots to 2 while step 3 (dispatched with 4) is in flight; a row of step 3 ends, found in its new slot.
    lengths = (3, 3, 4, 10)
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in enumerate(lengths)]
    tokens = {}
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        tokens[overlap] = {t.sample_id: t.tokens for t in d.run(reqs)}
        assert [len(tokens[overlap][i]) for i in range(4)] == list(lengths)
        assert d.stats.rows_live == sum(n - 1 for n in lengths)
    assert tokens[True] == tokens[False]

    # Requests that end at their first token (sampled at prefill): with overlap they are inserted and their
    # first tokens read with the next launch, which here dispatches no step at all.
    ones = [Request(20 + i, (3 + i, 7), max_new_tokens=1, sampling=GREEDY) for i in range(6)]
    firsts = {}
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        firsts[overlap] = {t.sample_id: (t.tokens, t.finish_reason) for t in d.run(ones)}
        assert d.idle and d.stats.steps == 0 and d.stats.rows_computed == 0
    assert firsts[True] == firsts[False] and sorted(firsts[True]) == list(range(20, 26))

    # Admissions do not wait either: with overlap nothing is read back inside a launch (a request's first
    # token, sampled at prefill, is read with the next step's results), without it the first tokens are.
    reads_in_launch, in_launch = [0], [False]
    to_host = ResultTokens.to_host

    def reading(self):
        reads_in_launch[0] += in_launch[0]
        return to_host(self)

    monkeypatch.setattr(ResultTokens, "to_host", reading)
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=2 + i % 5, sampling=GREEDY) for i in range(10)]
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        launch = d.launch

        def flagged():
            in_launch[0] = True
            try:
                return launch()
            finally:
                in_launch[0] = False

        d.launch, reads_in_launch[0] = flagged, 0
        out = {t.sample_id: t.tokens for t in d.run(reqs)}
        assert [len(out[i]) for i in range(10)] == [2 + i % 5 for i in range(10)]
        assert (reads_in_launch[0] == 0) is overlap, (overlap, reads_in_launch[0])

    # The last trajectory ends by eos: the step dispatched after its last token holds only finished rows and
    # is read before the driver reports idle, so removing the version lets its group (cache, params) go.
    free = RolloutDriver(eng, overlap=False, decode_steps=1)
    free.add_version(0, nnx.state(m0))
    (probe,) = free.run([Request(9, (5, 6, 7), max_new_tokens=10, sampling=GREEDY)])
    eos = next(tok for i, tok in enumerate(probe.tokens) if 2 <= i < 8 and tok not in probe.tokens[:i])
    d = RolloutDriver(eng, eos_ids=[eos], overlap=True, decode_steps=1)
    d.add_version(0, nnx.state(m0))
    outstanding[0] = 0
    (t,) = d.run([Request(9, (5, 6, 7), max_new_tokens=10, sampling=GREEDY)])
    assert t.finish_reason == "eos" and t.tokens == probe.tokens[:probe.tokens.index(eos) + 1]
    # One dispatch past the eos, read back; it runs no step: the device stopped the row at its eos.
    assert d.idle and outstanding[0] == 0 and d.stats.dispatches == len(t.tokens) and d.stats.steps == len(t.tokens) - 1
    # Its decode state goes with it (its params may share arrays with the model the test still holds).
    arrays = [weakref.ref(x) for x in jax.tree.leaves(d.decode_state(0))]
    d.remove_version(0)
    gc.collect()
    assert arrays and all(a() is None for a in arrays)


def test_driver_groups_with_and_without_overlap(models, engine4):
    """Two rollout groups driven as one: every request is answered once, by one group, with the tokens it
    gets from a single driver (sampling depends on (seed, sample id, position) only); with overlap each group
    keeps one step in flight and the answers are the same."""
    from dora_jax.rollout.groups import DriverGroups

    m0, m1 = models
    engines = [engine4, engine4]  # two groups of 4 slots (on one device here; the runner gives each its own)
    reqs = make_requests(10, seed=14, versions=(0, 1), sampling=RequestSampling(temperature=1.0, seed=2))
    single = RolloutDriver(engine4)
    for v, m in enumerate((m0, m1)):
        single.add_version(v, nnx.state(m))
    want = {t.sample_id: t for t in single.run(reqs)}
    for overlap in (False, True):
        groups = DriverGroups([RolloutDriver(e, overlap=overlap) for e in engines])
        for v, m in enumerate((m0, m1)):
            groups.add_version(v, [nnx.state(m)] * 2)
        assert groups.overlap is overlap
        got = _staggered(groups, reqs)
        assert sorted(got) == list(range(10)) and groups.idle
        assert all(d.stats.rows_live > 0 for d in groups.drivers)  # both groups decoded
        for i, t in want.items():
            assert_same_trajectory(got[i], t, reqs[i], (m0, m1)[t.version])


def test_multi_step_decode_gives_the_tokens_of_one_step_per_program(models, engine4):
    """Several decode steps per program (each slot stopped on the device) give the trajectories of one step
    per program: three versions, mixed lengths, eos and stop ids inside a program, admissions while requests
    wait, overlap on and off; and the driver's counters stay the counts of what ran."""
    m0, m1 = models
    probe = RolloutDriver(engine4, decode_steps=1)
    probe.add_version(0, nnx.state(m0))
    eos, reqs = _mixed_requests(probe.run(make_requests(8, seed=11)))
    runs, drivers = {}, {}
    for steps, overlap in ((1, False), (8, False), (8, True)):
        d = RolloutDriver(engine4, eos_ids=[eos], overlap=overlap, decode_steps=steps)
        for v, m in enumerate((m0, m1, m0)):
            d.add_version(v, nnx.state(m))
        runs[steps, overlap], drivers[steps, overlap] = _staggered(d, reqs), d
    want = runs[1, False]
    assert sorted(want) == list(range(16))
    assert set(collections.Counter(t.finish_reason for t in want.values())) == {"eos", "stop", "length"}
    for key, got in runs.items():
        for i, t in want.items():
            assert_same_trajectory(got[i], t, reqs[i], (m0, m1, m0)[t.version])
        d = drivers[key]
        assert d.idle and d.stats.rows_live == sum(len(t.tokens) - 1 for t in got.values())
        s = d.stats
        assert s.rows_computed >= s.rows_live and s.batch_steps == s.steps  # one program per dispatch (fused)
        assert d.in_flight() == {0: 0, 1: 0, 2: 0}  # no row of any version live or waiting
    one, many = drivers[1, False], drivers[8, False]
    assert one.stats.decode_steps_per_dispatch == 1 and one.stats.steps == one.stats.dispatches
    assert many.stats.decode_steps_per_dispatch > 2 and many.stats.dispatches < one.stats.dispatches / 2


def test_multi_step_decode_counts_and_admission(models, engine4, monkeypatch):
    """A fixed batch runs exactly max_new_tokens - 1 decode steps in programs of N (the last one shorter),
    with and without overlap; while a request waits for a slot, a program ends at the first step that frees
    one (a row's last token, or a stop id sampled on the device), and the waiting request takes it; otherwise
    it ends where the group can compact, so it computes the rows one step per program computes."""
    m0, _ = models
    for overlap in (False, True):
        d = RolloutDriver(engine4, overlap=overlap, decode_steps=4)
        d.add_version(0, nnx.state(m0))
        out = d.run([Request(i, (3 + i, 7, 9), max_new_tokens=10, sampling=GREEDY) for i in range(4)])
        assert all(len(t.tokens) == 10 for t in out)
        s = d.stats
        assert (s.steps, s.dispatches, s.batch_steps, s.rows_computed, s.rows_live) == (9, 3, 9, 4 * 9, 4 * 9)
        assert d.stats.decode_steps_per_dispatch == 3
        # The steady state: the two whole programs of every slot; the drain's last step is not counted.
        assert (d.stats.steady_dispatches, d.stats.steady_decode_steps_per_dispatch) == (2, 4)

    ran = []
    generate_steps = engine4.generate_steps

    def recorded(*args, **kwargs):
        states, result = generate_steps(*args, **kwargs)
        ran.append((kwargs["end_after"], result))
        return states, result

    monkeypatch.setattr(engine4, "generate_steps", recorded)
    # Request 3 ends after 2 decode steps (its first token comes from prefill) while request 4 waits: the
    # first program runs 2 steps; the next one, with nothing waiting, would end when 2 of its 4 rows are
    # freed (compaction) and runs its 8.
    lengths = {0: 20, 1: 20, 2: 20, 3: 3, 4: 20}
    reqs = [Request(i, (7 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in lengths.items()]
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    got = {t.sample_id: t for t in d.run(reqs)}
    assert [len(got[i].tokens) for i in lengths] == list(lengths.values())
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], 2), ([2], 8)]
    # The same when request 4 waits outside the driver (a runner that submits only into free slots).
    ran.clear()
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    for req in reqs[:4]:
        d.submit(req)
    d.waiting_outside = True
    outside = d.step()
    d.waiting_outside = False
    outside = {t.sample_id: t.tokens for t in outside + d.run(reqs[4:])}
    assert outside == {i: t.tokens for i, t in got.items()}
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], 2), ([2], 8)]
    # The same with request 1 ending at a stop id it samples at decode step `at`: the first program ends there.
    probe = RolloutDriver(engine4, decode_steps=1)
    probe.add_version(0, nnx.state(m0))
    alone = {t.sample_id: t for t in probe.run([dataclasses.replace(r, max_new_tokens=20) for r in reqs])}
    b = alone[1].tokens
    at = next(i for i, x in enumerate(b) if i >= 2 and x not in b[:i])  # the first token new at its index
    assert at < 8
    reqs = [dataclasses.replace(r, max_new_tokens=20, stop_ids=(b[at],) if r.sample_id == 1 else ()) for r in reqs]
    ran.clear()
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    got = {t.sample_id: t for t in d.run(reqs)}
    assert got[1].finish_reason == "stop" and got[1].tokens == b[:at + 1]
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], at), ([2], 8)]
    assert all(got[i].tokens == alone[i].tokens for i in (0, 2, 3, 4))
    # Nothing waits; two rows end by length after 2 and 3 decode steps: the first program ends when the group
    # can compact (2 of 4 rows freed), and the rows computed are those of one step per program.
    reqs = [Request(i, (7 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in enumerate((3, 4, 20, 20))]
    computed = {}
    for steps in (1, 8):
        ran.clear()  # the programs of the 8-step run are checked
        d = RolloutDriver(engine4, decode_steps=steps)
        d.add_version(0, nnx.state(m0))
        d.run(reqs)
        computed[steps] = d.stats.rows_computed
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([2], 3), ([1], 8)]
    assert computed[8] == computed[1] == 3 * 4 + 16 * 2


def test_overlap_default_follows_the_backend(engine4):
    """Off where the engine decodes on CPU (a step's compute dwarfs the host's work), on elsewhere."""
    from dora_jax.rollout.driver import default_overlap

    eng = engine4
    assert default_overlap(eng) is (jax.devices()[0].platform != "cpu")
    assert RolloutDriver(eng).overlap is default_overlap(eng)
    assert RolloutDriver(eng, overlap=True).overlap is True
