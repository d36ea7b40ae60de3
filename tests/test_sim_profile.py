"""Measured cost profiles and the run simulator: the profile loader refuses malformed files by field, the grid is
interpolated as documented, and the run simulator (the real scheduler and rollout driver on a timed engine) fed
a synthetic profile reproduces hand-derived wall times of tiny schedules.

The tiny schedule: 4 slots, groups of 2, 4 samples per update, 3 updates, every completion 6 tokens (the first
sampled at prefill, then 5 decode steps), a decode step 1 ms whatever the batch, prefill free, a train step
100 ms, publishing 10 ms, rewards back at once.
"""

import copy
import json

import pytest

from dora_jax.dora.scheduler import SchedulePolicy
from dora_jax.sim.local import RunSetup, simulate_run
from dora_jax.sim.profile import FORMAT, KIND, ProfileError, load_profile, parse_profile, profile_costs


def synthetic(**over):
    d = {"kind": KIND, "format": FORMAT,
         "decode": {"versions": [1], "batch": [1], "kv": [1], "step_s": [[[0.001]]], "dispatch_s": 0.0},
         "prefill": {"tokens": [1], "seconds": [0.0]}, "shared_prefix_s": 0.0,
         "calls": {"resize_s": 0.0, "free_slot_s": 0.0},
         "train": {"tokens": [1], "seconds": [0.1], "host_s": 0.0, "dispatch_s": 0.0}, "publish_s": 0.01,
         "overlap": {"rows": [1], "decode_factor": [1.0], "train_factor": [1.0]}, "rewards": {"latency_s": 0.0, "host_s": 0.0},
         "update_host_s": 0.0, "iteration_host_s": 0.0}
    for path, value in over.items():
        *head, last = path.split(".")
        node = d
        for k in head:
            node = node[k]
        node[last] = value
    return d


SETUP = RunSetup(slots=4, max_prefill_length=8, max_target_length=64, prompt=lambda i: (1, 2, 3, 4),
                 length=lambda i, m: 6, length_buckets=(16,), decode_steps=1)


def run(mode, profile, setup=SETUP, k=1, rbs=4):
    return simulate_run(profile, setup, SchedulePolicy(mode, k, rbs, 4, 2, 12))


def ends(r):
    return [(round(u["dispatched"], 6), round(u["end"], 6)) for u in r["updates"]]


def test_sync_wall_time_by_hand():
    # Per update: 5 decode steps (5 ms), train 100 ms, publish 10 ms; the next batch is dispatched after it.
    r = run("sync", parse_profile(synthetic()), k=0)
    assert r["wall_s"] == pytest.approx(3 * 0.115)
    assert ends(r) == [(0.005, 0.105), (0.12, 0.22), (0.235, 0.335)]
    assert r["decode_batch_steps"] == 15 and r["samples"] == 12 and r["max_resident_versions"] == 1
    assert r["slot_utilization"] == 1.0


def test_one_step_off_with_overlap_factors_by_hand():
    # Decoding beside a train step takes 2x; the train step then runs at 1 / 1.5 of its speed.
    # 0-5 ms batch 0; train 0 from 5 ms. Batch 1 (version 0) decodes beside it: 5 steps x 2 ms, to 15 ms, while
    # the train step gets 10 / 1.5 = 6.67 ms done; batch 2 waits for version 1: train 0 ends alone at
    # 15 + 93.33 = 108.33, publish to 118.33. One step of batch 2 alone (119.33), then train 1 starts; the other 4
    # steps beside it (8 ms, 5.33 ms of training done) to 127.33; train 1 ends at 127.33 + 94.67 = 222, publish
    # to 232; train 2 alone 232-332, publish: 342 ms.
    p = parse_profile(synthetic(**{"overlap.decode_factor": [2.0], "overlap.train_factor": [1.5]}))
    r = run("one_step_off", p)
    assert ends(r) == [(0.005, pytest.approx(0.108333, abs=1e-6)), (pytest.approx(0.119333, abs=1e-6), 0.222),
                       (0.232, 0.332)]
    assert r["wall_s"] == pytest.approx(0.342)
    assert r["decode_batch_steps"] == 15 and r["max_resident_versions"] == 2
    # Under shared placement nothing runs beside a train step: sync's 345 ms less nothing.
    shared = dataclass_replace(SETUP, split=False)
    assert run("one_step_off", p, shared)["wall_s"] == pytest.approx(0.345)


def dataclass_replace(x, **kw):
    import dataclasses

    return dataclasses.replace(x, **kw)


def test_costs_besides_steps_by_hand():
    # Every cost of the profile in one sync run of 3 updates: per update a shared head (once per version),
    # one prefill program, 5 steps of 1 ms + 0.5 ms dispatch each, the 4 slots freed by one program (they end at
    # the same step), rewards 2 ms after the last
    # sample, the batch built (3 ms), train 100, publish 10 + update host 1, and 0.1 ms per loop iteration.
    p = parse_profile(synthetic(**{"decode.dispatch_s": 0.0005, "prefill.seconds": [0.004], "shared_prefix_s": 0.002,
                                   "calls.free_slot_s": 0.0002, "rewards.latency_s": 0.002, "train.host_s": 0.003,
                                   "update_host_s": 0.001, "iteration_host_s": 0.0001}))
    r = run("sync", p, dataclass_replace(SETUP, shared_prefix=(1,)), k=0)
    assert r["engine_calls"] == {"shared_prefix": 3, "prefill": 3, "decode": 15, "free_slot": 3}
    # Iterations per update: 5 decoding (the 5th finishes every sample), one that waits for the rewards (2 ms) and
    # trains; 6 x 0.1 ms. Then the update's train, publish and host.
    per_update = 0.002 + 0.004 + 5 * 0.0015 + 0.0002 + 0.002 + 6 * 0.0001 + 0.003 + 0.1 + 0.01 + 0.001
    assert r["wall_s"] == pytest.approx(3 * per_update)


def test_several_steps_per_dispatch_by_hand():
    # 3 steps per dispatch: 5 tokens after the prefill take a 3-step and a 2-step program; each dispatch 0.5 ms.
    p = parse_profile(synthetic(**{"decode.dispatch_s": 0.0005}))
    r = run("sync", p, dataclass_replace(SETUP, decode_steps=3), k=0)
    assert r["engine_calls"]["decode"] == 6 and r["decode_batch_steps"] == 15
    assert r["wall_s"] == pytest.approx(3 * (0.005 + 2 * 0.0005 + 0.11))


def test_dora_keeps_its_window_and_holds_the_versions_it_needs():
    p = parse_profile(synthetic(**{"overlap.decode_factor": [2.0], "overlap.train_factor": [1.5]}))
    r = run("dora", p, k=2, rbs=12)
    assert r["samples"] == 12 and r["max_resident_versions"] <= 3
    # Rollout beside training: faster than sync's 345 ms, never faster than the three train steps alone.
    assert 0.3 + 3 * 0.01 < r["wall_s"] < 0.345


def test_grid_interpolation():
    d = synthetic(**{"decode.versions": [1, 2], "decode.batch": [1, 4], "decode.kv": [10, 20],
                     "decode.step_s": [[[1.0, 2.0], [4.0, 8.0]], [[3.0, 3.0], [5.0, 5.0]]],
                     "decode.kv_reads": [10, 20, 40], "train.tokens": [100, 200], "train.seconds": [1.0, 3.0]})
    p = parse_profile(d)
    assert p.decode_step(1, 1, 10) == 1.0 and p.decode_step(1, 4, 20) == 8.0
    assert p.decode_step(1, 1, 12) == 2.0  # 12 slots are read as 20 (kv_reads)
    assert p.decode_step(1, 2.5, 10) == pytest.approx(2.5)  # halfway between batch 1 and 4
    assert p.decode_step(3, 1, 10) == pytest.approx(5.0)  # past the last version: its segment continued
    assert p.decode_step(1, 8, 10) == pytest.approx(4.0 + 3.0 * 4 / 3)  # past the last batch
    assert p.decode_kv_slope(1, 4, 15) == pytest.approx(0.4)
    assert p.train(150) == 2.0 and p.train(300) == 5.0 and p.train(50) == 1.0
    q = parse_profile(synthetic(**{"overlap.rows": [1, 10], "overlap.decode_factor": [1.0, 3.0],
                                   "overlap.train_factor": [1.0, 2.0]}))
    assert q.overlap(5.5) == (2.0, 1.5) and q.overlap(100) == (3.0, 2.0) and q.overlap(0) == (1.0, 1.0)
    assert p.train_per_token() == pytest.approx((0.0, 0.02))  # the line's intercept (-1 s) held at 0


def test_the_cluster_simulator_takes_a_profile(tmp_path):
    from dora_jax.cli import main

    d = synthetic(**{"decode.batch": [1, 16], "decode.step_s": [[[0.01], [0.02]]], "prefill.tokens": [32, 64],
                     "prefill.seconds": [0.001, 0.002], "train.tokens": [1000, 2000], "train.seconds": [0.5, 1.0],
                     "workload": {"train_devices": 1}})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    costs = profile_costs(load_profile(str(path)))
    assert costs.decode_time(16, 16 * 5) == pytest.approx(0.02) and costs.decode_time(1, 5) == pytest.approx(0.01)
    assert costs.train_time(2000, 0, 2) == pytest.approx(0.5)  # 1000 tokens on each of 2 GPUs
    assert costs.prefill_token_s == pytest.approx(0.001 / 32) and costs.weight_sync_s == 0.01
    out = tmp_path / "sim.json"
    assert main(["simulate", "--config", "sim_small", "--profile", str(path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["costs"]["weight_sync_s"] == 0.01 and "measured" in result["derivation"]["decode_step_s"]
    assert main(["simulate", "--config", "sim_small", "--profile", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("field, value, message", [
    ("kind", "something else", r"profile field 'kind' = 'something else': must be 'dora-jax cost profile'"),
    ("format", 2, r"profile field 'format' = 2: must be 1"),
    ("train", None, r"profile field 'train' = None: must be a mapping"),
    ("decode.step_s", [[[0.001, 0.002]]], r"profile field 'decode.step_s\[0\]\[0\]' = .*: must be a list of 1 "),
    ("decode.step_s", [], r"profile field 'decode.step_s' = \[\]: must be a list of 1 \(decode.versions\) lists"),
    ("decode.batch", [4, 2], r"profile field 'decode.batch' = \[4, 2\]: must be a non-empty list of increasing"),
    ("train.seconds", [-1.0], r"profile field 'train.seconds' = \[-1.0\]: must be a list of 1 finite numbers >= 0"),
    ("publish_s", "fast", r"profile field 'publish_s' = 'fast': must be a finite number >= 0"),
    ("overlap.train_factor", [0.5], r"profile field 'overlap.train_factor' = \[0.5\]: must be a list of 1 "
                                    r"\(overlap.rows\) finite numbers >= 1"),
    ("rewards.latency_s", float("nan"), r"profile field 'rewards.latency_s' = nan: must be a finite number"),
])
def test_a_malformed_profile_is_refused_naming_the_field(tmp_path, field, value, message):
    d = synthetic(**{field: value})
    with pytest.raises(ProfileError, match=message):
        parse_profile(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=f"^{path}: {message}") as e:
        load_profile(str(path))
    assert e.value.field.startswith(field)


def test_a_profile_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=f"{bad}: cannot read a profile"):
        load_profile(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ProfileError, match=r"must be a JSON object written by 'dora-jax bench profile'"):
        load_profile(str(bad))
    d = synthetic()
    del d["calls"]["free_slot_s"]
    with pytest.raises(ProfileError, match=r"'calls.free_slot_s' = None"):
        parse_profile(copy.deepcopy(d))


@pytest.mark.parametrize("slots, waiting, expect", [(64, 10, 2), (64, 1, 1), (256, 20, 8), (32, 10, 1)])
def test_waiting_requests_are_admitted_together_once_a_thirty_second_of_the_slots_is_free(slots, waiting, expect):
    """While requests wait for a slot, a program of several steps ends once 1/32 of the engine's slots have been
    freed (at least one, at most the requests waiting), so they are admitted together."""
    from dora_jax.rollout.driver import RolloutDriver
    from dora_jax.rollout.samples import Request
    from dora_jax.sim.local import Clock, TimedEngine

    engine = TimedEngine(parse_profile(synthetic()), Clock(), slots=slots, max_prefill_length=8,
                         max_target_length=512, decode_steps=8)
    asked = []
    generate_steps = engine.generate_steps

    def recorded(*args, **kwargs):
        asked.append(list(kwargs["end_after"]))
        return generate_steps(*args, **kwargs)

    engine.generate_steps = recorded
    driver = RolloutDriver(engine, decode_steps=8)
    driver.add_version(0, 0)  # a simulated version's params are its number
    for i in range(slots + waiting):
        driver.submit(Request(i, (1, 2, 3), max_new_tokens=2 + i % 40))
    driver.step()
    assert asked[0] == [expect]
