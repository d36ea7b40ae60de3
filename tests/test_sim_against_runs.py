"""The run simulator (:mod:`dora_jax.sim.local`) against real runs of the runner, on a workload small enough for a
test: the `bench modes` comparison in miniature. With the same prompts and length budgets, a simulated run makes
the same schedule decisions as the real one where they do not depend on time: in ``sync`` (a batch is dispatched
only after the previous one is trained) the decode batch-steps, the samples and the slot utilization are the
real run's exactly, whatever the profile says each call costs. The wall-time half of the comparison needs a quiet
machine and minutes of runs; ``dora-jax bench modes`` makes it (docs/simulator.md).
"""

import pytest

from benchmarks.harness import Harness, Variant
from dora_jax.dora.scheduler import SchedulePolicy
from dora_jax.run.setup import schedule_policy
from dora_jax.sim.local import simulate_run
from dora_jax.sim.profile import parse_profile
from test_sim_profile import synthetic

SMALL = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "task.name=longtail", "task.longtail_max_len=24",
         "task.eval_size=0", "rollout.slots=8", "rollout.max_new_tokens=24", "rollout.max_prompt_len=32",
         "train.group_size=4", "train.max_response_tokens=24", "train.length_buckets=[64]", "dora.train_batch=8",
         "dora.steps=2", "dora.mode=sync", "dora.rollout_batch=8", "train.max_staleness=1", "run.checkpoint_every=0"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return Harness("tiny_llama", SMALL, str(tmp_path_factory.mktemp("runs")), split=False, shared_devices=1)


def test_a_simulated_sync_run_counts_what_the_real_run_counts(harness):
    v = Variant("sync", ["dora.mode=sync", "train.max_staleness=1", "dora.rollout_batch=8"])
    real = harness.run(v)["summary"]
    cfg = harness.cfg(v.overrides)
    policy = schedule_policy(cfg)
    assert isinstance(policy, SchedulePolicy) and policy.mode == "sync"
    setup = harness.run_setup(cfg, False)
    # Two profiles far apart: the counts are the schedule's, not the clock's.
    for costs in ({}, {"decode.step_s": [[[0.5]]], "train.seconds": [0.001], "rewards.latency_s": 0.3}):
        sim = simulate_run(parse_profile(synthetic(**costs)), setup, policy)
        assert sim["samples"] == real["samples"] == 16
        assert sim["decode_batch_steps"] == real["decode_batch_steps"]
        assert sim["slot_utilization"] == pytest.approx(real["slot_utilization"], abs=1e-12)
        assert sim["max_resident_versions"] == real["max_resident_versions"]
