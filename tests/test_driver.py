"""The multi-version rollout driver on tiny random models: versions in flight, fused and per-version steps,
a sample's independence of its slot and batch, log-probs, eos / stop, decode programs per capacity, bad input,
the sampling variant, group prefill and the decode_steps setting. test_driver_overlap.py has the tests that
share one engine: overlap, several decode steps per program, the shared prefix, DriverGroups.

References: per-version full-forward recomputation of the same params, a one-slot engine, one call per version.
"""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from flax import nnx

from conftest import rel_err
from dora_jax.models.decoder import DecodeSettings
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from dora_jax.rollout.samples import Request
from engine_helpers import GREEDY, assert_same_trajectory, make_engine, make_requests, recompute, trace_limit


def test_two_versions_in_flight(models):
    """Every token of every trajectory comes from its own version: greedy tokens are the argmax of that
    version's full forward and differ from the other version's; log-probs equal its recomputation."""
    m0, m1 = models
    driver = RolloutDriver(make_engine(m0))
    driver.add_version(0, nnx.state(m0))
    driver.add_version(1, nnx.state(m1))
    out = driver.run(make_requests(12, versions=(0, 1)))
    assert sorted(t.sample_id for t in out) == list(range(12))
    differs = 0
    for t in out:
        mine, other = (m0, m1) if t.version == 0 else (m1, m0)
        lp, argmax = recompute(mine, t)
        assert t.tokens == argmax.tolist()
        assert rel_err(t.logprobs, lp) <= 1e-4
        differs += t.tokens != recompute(other, t)[1].tolist()
        assert t.finish_reason == "length"
    assert differs >= 6  # the versions really are different policies


def test_fused_step_equals_one_call_per_version(models, monkeypatch):
    """Stepping every version in one program gives the tokens and log-probs of one call per version, and
    compiles one program per multiset of group capacities (one decode step per program)."""
    m0, m1 = models
    reqs = make_requests(12, seed=4, versions=(0, 1, 2), sampling=RequestSampling(temperature=1.0, top_k=20, seed=5))
    runs = {}
    limit = trace_limit(monkeypatch, "generate_steps")
    fused = collections.Counter()
    generate_steps = Engine.generate_steps
    monkeypatch.setattr(Engine, "generate_steps", lambda self, params, *a, **k: fused.update(
        ["steps"] * (len(params) > 1)) or generate_steps(self, params, *a, **k))
    eng = make_engine(m0, slots=8)  # one engine: both drivers share its compiled prefill, insert and resize
    for fuse in (False, True):
        # One program per (versions stepping together, shared capacity): unfused, one version x capacities
        # 1..8; fused, 2 or 3 versions x capacities 1..8 (one version alone: the programs of the unfused run).
        limit(4 if not fuse else 8)
        driver = RolloutDriver(eng, fuse=fuse, decode_steps=1)
        for v, m in enumerate((m0, m1, m0)):
            driver.add_version(v, nnx.state(m))
        runs[fuse] = {t.sample_id: t for t in driver.run(reqs)}
        assert (fused["steps"] > 0) == fuse  # several versions did step together, only when fused
    assert sorted(runs[True]) == list(range(12))
    for i, t in runs[False].items():
        assert_same_trajectory(runs[True][i], t, reqs[i], (m0, m1, m0)[t.version])


def test_alone_equals_busy_batch(models):
    """A sample's tokens do not depend on its slot or on what else is decoding (greedy and sampled)."""
    m0, _ = models
    busy_engine, alone_engine = make_engine(m0, slots=4), make_engine(m0, slots=1)  # each compiles once for both cases
    for sampling in (GREEDY, RequestSampling(temperature=1.0, top_k=20, seed=7)):
        reqs = make_requests(9, seed=3, sampling=sampling)
        busy = RolloutDriver(busy_engine)
        busy.add_version(0, nnx.state(m0))
        crowd = {t.sample_id: t for t in busy.run(reqs)}
        alone = RolloutDriver(alone_engine)
        alone.add_version(0, nnx.state(m0))
        for r in reqs[::3]:
            (t,) = alone.run([r])
            assert_same_trajectory(t, crowd[r.sample_id], r, m0)


def test_sampled_logprobs_match_recompute(models):
    m0, _ = models
    d = RolloutDriver(make_engine(m0))
    d.add_version(0, nnx.state(m0))
    out = d.run(make_requests(6, seed=5, sampling=RequestSampling(temperature=0.7, top_p=0.9, seed=1)))
    for t in out:  # recorded under the distribution that drew the token: T 0.7, the 0.9 nucleus, renormalized
        lp, _ = recompute(m0, t, temperature=0.7, top_p=0.9)
        assert rel_err(t.logprobs, lp) <= 1e-4
    assert any(rel_err(t.logprobs, recompute(m0, t, temperature=0.7)[0]) > 1e-3 for t in out)  # truncation shows


def test_stop_and_eos_reasons(models):
    m0, _ = models
    probe = RolloutDriver(make_engine(m0))
    probe.add_version(0, nnx.state(m0))
    (free,) = probe.run([Request(0, (5, 6, 7), max_new_tokens=12, sampling=GREEDY)])
    eos, stop = free.tokens[4], free.tokens[2]
    d = RolloutDriver(make_engine(m0), eos_ids=[eos])
    d.add_version(0, nnx.state(m0))
    (a,) = d.run([Request(0, (5, 6, 7), max_new_tokens=12, sampling=GREEDY)])
    (b,) = d.run([Request(1, (5, 6, 7), max_new_tokens=12, sampling=GREEDY, stop_ids=(stop,))])
    assert a.finish_reason == "eos" and a.tokens == free.tokens[:free.tokens.index(eos) + 1]
    assert b.finish_reason == "stop" and b.tokens == free.tokens[:free.tokens.index(stop) + 1]


@pytest.mark.parametrize("steps", [1, 8])
def test_compaction_utilization_and_bounded_compilation(models, monkeypatch, steps):
    """One decode program per capacity, with one step per program or several (the budgets, the step limit
    and whether to end at the first stop are arguments, not compiled in)."""
    m0, _ = models
    limit = trace_limit(monkeypatch, "generate_steps")
    limit(4)  # capacities 1, 2, 4, 8
    eng = make_engine(m0, slots=8)
    d = RolloutDriver(eng, decode_steps=steps)
    d.add_version(0, nnx.state(m0))
    d.run(make_requests(24, seed=9))
    assert d.stats.slot_utilization > 0.75
    if steps == 1:  # the first workload reached every capacity: nothing new to compile
        limit(0)
    d.run(make_requests(24, seed=10))  # with several steps per program, at most the 4 programs in all


def test_bad_input(models):
    m0, _ = models
    eng = make_engine(m0)
    d = RolloutDriver(eng)
    d.add_version(0, nnx.state(m0))
    with pytest.raises(EngineError, match="prompt of 40 tokens; allowed 1..32"):
        d.submit(Request(0, tuple(range(40))))
    with pytest.raises(EngineError, match="policy version 3 is not loaded"):
        d.submit(Request(0, (1, 2), version=3))
    with pytest.raises(EngineError, match="top_p must be in"):
        d.submit(Request(0, (1, 2), max_new_tokens=8, sampling=RequestSampling(top_p=0.0)))
    with pytest.raises(EngineError, match="temperature must be"):
        d.submit(Request(0, (1, 2), max_new_tokens=8, sampling=RequestSampling(temperature=-1.0)))
    with pytest.raises(EngineError, match="must fit max_target_length"):
        d.submit(Request(0, (1, 2), max_new_tokens=63))
    batch, _ = eng.prefill_batch(prompts=[(1, 2, 3)], sample_ids=[0], samplings=[GREEDY])
    with pytest.raises(EngineError, match="slot 9 does not exist"):
        eng.insert_batch(batch, eng.init_decode_state(), [9])
    with pytest.raises(EngineError, match=r"prompt of 40 tokens; allowed 1..32"):
        eng.prefill_batch(prompts=[tuple(range(40))], sample_ids=[0], samplings=[GREEDY])
    with pytest.raises(EngineError, match="still has trajectories in flight"):
        d.submit(Request(5, (1, 2), max_new_tokens=8))
        d.remove_version(0)


def test_sampling_variant_does_not_change_samples(models):
    """Unfiltered requests decode under the sort-free variant alone and under the filtering variant when a
    top-p request shares their batch: their tokens and log-probs are the same either way."""
    m0, _ = models
    plain = RequestSampling(temperature=1.0, seed=3)
    reqs = [dataclasses.replace(r, sampling=RequestSampling(temperature=0.8, top_p=0.7, seed=3) if i == 0 else plain)
            for i, r in enumerate(make_requests(4, seed=11))]
    busy = RolloutDriver(make_engine(m0, slots=4))
    busy.add_version(0, nnx.state(m0))
    crowd = {t.sample_id: t for t in busy.run(reqs)}
    alone = RolloutDriver(make_engine(m0, slots=1))
    alone.add_version(0, nnx.state(m0))
    for r in reqs[1:]:
        (t,) = alone.run([r])
        assert_same_trajectory(t, crowd[r.sample_id], r, m0)


def test_group_prefill_does_not_change_samples(models):
    """GRPO-style groups (equal prompts) admitted together are prefilled once per group; every member still
    draws its own tokens, the same as when it is admitted and prefilled alone (a one-slot engine)."""
    m0, _ = models
    base = make_requests(6, seed=12, sampling=RequestSampling(temperature=1.0, top_p=0.9, seed=2))
    reqs = [dataclasses.replace(r, sample_id=4 * i + j) for i, r in enumerate(base) for j in range(4)]
    runs, prefilled = {}, {}
    for slots in (1, 8):
        eng = make_engine(m0, slots=slots)
        real, calls = eng.prefill_batch, prefilled.setdefault(slots, [])

        def counting(real=real, calls=calls, **kw):  # distinct prompts per prefill call
            calls.append(len(set(map(tuple, kw["prompts"]))))
            return real(**kw)

        eng.prefill_batch = counting
        d = RolloutDriver(eng)
        d.add_version(0, nnx.state(m0))
        runs[slots] = {t.sample_id: t for t in d.run(reqs)}
    assert prefilled[1] == [1] * 24
    assert sum(prefilled[8]) == 6  # each group's prompt once (groups finish together: they are admitted whole)
    assert sorted(runs[1]) == sorted(runs[8]) == list(range(24))
    for i, t in runs[1].items():
        assert_same_trajectory(runs[8][i], t, reqs[i], m0)
    assert any(len({tuple(runs[8][4 * i + j].tokens) for j in range(4)}) > 1 for i in range(6))
    # The prefill budget splits admitted requests by distinct prompt, never a group.
    d = RolloutDriver(make_engine(m0, slots=8))
    assert [len(c) for c in d.prefill_chunks([(r, 0.0) for r in reqs[:8]])] == [8]
    d.prefill_tokens = 1
    assert [[r.sample_id for r, _ in c] for c in d.prefill_chunks([(r, 0.0) for r in reqs[:8]])] == [
        [0, 1, 2, 3], [4, 5, 6, 7]]


def test_decode_steps_setting(models):
    """rollout.decode_steps: validated in the config and by the engine, resolved by the driver ("auto": 8)."""
    from dora_jax.config import ConfigError, load_config

    m0, _ = models
    assert load_config("tiny_llama").rollout.decode_steps == "auto"
    assert load_config("tiny_llama", ["rollout.decode_steps=3"]).rollout.decode_steps == 3
    for bad in ("0", "257", "many"):
        with pytest.raises(ConfigError, match="rollout.decode_steps"):
            load_config("tiny_llama", [f"rollout.decode_steps={bad}"])
    with pytest.raises(EngineError, match="decode_steps 0: allowed 'auto' or 1 .. 256"):
        make_engine(m0, settings=DecodeSettings(decode_steps=0))
    assert RolloutDriver(make_engine(m0)).decode_steps == 8
    assert RolloutDriver(make_engine(m0, settings=DecodeSettings(decode_steps=3))).decode_steps == 3
    assert RolloutDriver(make_engine(m0), decode_steps=1).decode_steps == 1


def test_a_second_engine_of_equal_programs_compiles_and_loads_nothing(models):
    """Engines of equal programs in one process share their jitted functions: a second engine like the first
    decodes the same requests to the same trajectories with no compile and no load from the compilation cache
    (which a freshly jitted copy would need for every program); an engine of other programs gets its own."""
    from dora_jax.compiles import CompileCount, compile_count

    m0, _ = models
    reqs = make_requests(5, seed=11)

    def run(engine):
        driver = RolloutDriver(engine)
        driver.add_version(0, nnx.state(m0))
        return {t.sample_id: t for t in driver.run(reqs)}

    first = run(make_engine(m0, slots=2))
    before = compile_count()
    again = run(make_engine(m0, slots=2))
    assert compile_count() - before == CompileCount(0, 0)
    for i, t in first.items():
        assert again[i].tokens == t.tokens and again[i].logprobs == t.logprobs
    before = compile_count()
    run(make_engine(m0, slots=2, num_pages=2 * 3 * 2 * 64 // 16))  # another pool: other programs
    other = compile_count() - before
    assert other.compiles + other.cache_loads > 0


def _one_by_one(book, sizes, free):
    """The admission as a queue of one test per request: the oldest request joins while the pool takes all of
    them together, and the first it refuses stops the queue."""
    taken: list = []
    for size in sizes[:max(free, 0)]:
        if book.admissible(taken + [size]) is None:
            break
        taken.append(size)
    return len(taken)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 3), st.integers(3, 40), st.lists(st.tuples(st.integers(1, 30), st.integers(0, 40)), max_size=8),
       st.integers(0, 12), st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40)), max_size=12),
       st.integers(0, 14))
def test_admission_takes_the_head_of_the_queue_the_one_by_one_test_takes(shards, pages, live, grow, queue, free):
    """The driver admits the longest head of its queue that the page pool takes together (a bisection where it
    does not take them all): the same count as testing one more request at a time, on page books of 1-3 shards
    with live requests grown by a program, in at most 1 + log2(head) tests."""
    from dora_jax.rollout.page_book import PageBook
    from dora_jax.rollout.pages import PageError
    from dora_jax.sim.local import Clock, TimedEngine
    from test_sim_profile import parse_profile, synthetic

    book = PageBook(pages * shards, 4, shards, table_width=32)
    refs = []
    for i, (prompt, more) in enumerate(live):
        try:
            refs.append(book.admit(i % shards, prompt, prompt + more))
        except PageError:  # no room now, or none ever: the book holds what it took
            pass
    book.dispatch([refs], [[grow] * len(refs)])
    engine = TimedEngine(parse_profile(synthetic()), Clock(), slots=64, max_prefill_length=32,
                         max_target_length=128, decode_steps=8)
    tests = []
    engine.admissible = lambda sizes: tests.append(len(sizes)) or book.admissible(sizes)
    driver = RolloutDriver(engine, decode_steps=8)
    driver.add_version(0, 0)
    for i, (prompt, new) in enumerate(queue):
        driver.submit(Request(i, (1,) * prompt, max_new_tokens=new))
    sizes = [(p, p + n) for p, n in queue]
    assert driver.admissible_count(free) == _one_by_one(book, sizes, free)
    head = min(free, len(queue))
    assert len(tests) <= (1 + int(np.ceil(np.log2(head))) if head > 1 else head)


def test_host_time_counts_the_driver_work_and_leaves_out_cpu_spent_waiting_for_the_device(monkeypatch):
    """host_ms_per_dispatch is the driver thread's CPU time less its device waits: on a simulated engine whose
    decode dispatch burns 4 ms of CPU and whose result wait burns 30 ms (a runtime spinning while it waits),
    each dispatch counts at least the 4 ms and less than one wait."""
    import time

    from dora_jax.rollout import driver as driver_module
    from dora_jax.sim.local import Clock, TimedEngine
    from test_sim_profile import parse_profile, synthetic

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    engine = TimedEngine(parse_profile(synthetic()), Clock(), slots=4, max_prefill_length=8, max_target_length=64,
                         decode_steps=8)
    generate_steps = engine.generate_steps
    engine.generate_steps = lambda *a, **k: (burn(0.004), generate_steps(*a, **k))[1]
    monkeypatch.setattr(driver_module.jax, "block_until_ready", lambda data: burn(0.03))
    driver = RolloutDriver(engine, decode_steps=8)
    driver.add_version(0, 0)
    driver.run([Request(i, (1, 2, 3), max_new_tokens=20) for i in range(6)])
    assert driver.stats.dispatches >= 3 and driver.stats.wait_s >= 0.03 * driver.stats.dispatches
    assert 4.0 <= driver.stats.host_ms_per_dispatch < 30.0
