"""The same ``sync`` run on one device and on eight fake devices (mesh data=2, fsdp=2, tensor=2).

Sharding must change where the work runs, not what it computes: from the same weights and seed both runs
sample the same tokens and take the same updates, up to float32 rounding from reductions that the sharded
programs do in another order (partial sums per shard, then a cross-device sum), and so up to a draw that such
rounding can tip (a tie, conftest.TIE).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err, same_updates_up_to_a_tie
from dora_jax.config import load_config
from dora_jax.metrics import read_metrics
from dora_jax.models.weights import load_model
from dora_jax.run import Runner, RunError
from dora_jax.sharding import create_mesh

STEPS = 3
# Adam's eps is 1e-6 here, not the default 1e-8. Every group's advantages sum to zero, and a response token
# whose hidden state and distribution are the same for the whole group (one-token responses to one prompt)
# therefore adds exactly zero, in exact arithmetic, to the gradient of every vocabulary column it did not
# sample. In float32 those columns get rounding residue instead (~1e-9 here), whose value depends on the
# reduction order. Adam divides each component by its own magnitude plus eps, so with eps 1e-8 it turns that
# residue into updates of a sizeable fraction of the learning rate whose signs depend on the reduction order
# (measured with eps 1e-8: weights 4% of the learning rate apart after one update, more than a whole learning
# rate after three). With eps above the residue the update is a smooth function of the gradient, and what is
# left to compare is the sharding alone.
RUN = [f"dora.steps={STEPS}", "dora.mode=sync", "dora.train_batch=8", "dora.rollout_batch=8", "train.group_size=4",
       "train.max_staleness=0", "train.learning_rate=0.003", "train.eps=0.000001", "train.kl_coef=0.1",
       "rollout.slots=8", "rollout.max_new_tokens=16", "rollout.max_prompt_len=32", "task.name=longtail",
       "task.longtail_max_len=16", "task.eval_size=0", "task.reward=toy_rewards:mean_char_code",
       "train.length_buckets=[64]", "train.max_response_tokens=16", "run.checkpoint_every=0", "run.seed=3"]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def _run(run_dir, cfg, model, devices, published):
    graphdef, params = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))  # the run's train steps donate its params
    runner = Runner(cfg, str(run_dir), model=model, devices=devices, progress=False)
    assert set(runner.trainer.mesh.devices.flat) == set(runner.placement.engine.mesh.devices.flat) == set(devices)
    runner.run()
    versions = published(runner.versions.store)
    with open(os.path.join(run_dir, "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    return versions, read_metrics(str(run_dir)), samples


def _flat(params):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)])


def test_one_device_and_eight_devices_give_the_same_sync_run(tmp_path, published):
    devices = jax.devices()
    assert len(devices) >= 8, "tests run with 8 fake CPU devices (see conftest.py)"
    cfg1 = load_config("tiny_llama", RUN + ONE_DEVICE)
    cfg8 = load_config("tiny_llama", RUN)
    assert dict(cfg8.mesh.axis_sizes) == {"data": 2, "fsdp": 2, "tensor": 2}
    # One model for both runs (its random init compiles once): built on the first device, and each run's
    # trainer places its params on that run's own mesh.
    model, _ = load_model(cfg1.model, create_mesh(cfg1.mesh, devices[:1]), cfg1.mesh.logical_axis_rules,
                          seed=cfg1.run.seed, progress=False)
    one, m1, s1 = _run(tmp_path / "one", cfg1, model, devices[:1], published)
    eight, m8, s8 = _run(tmp_path / "eight", cfg8, model, devices[:8], published)
    np.testing.assert_array_equal(_flat(eight[0]), _flat(one[0]))

    # The same trajectories. Sampling draws from per-row keys of the seed, so tokens can only differ where a
    # rounding-level logit difference tips a draw at a tie; the runs then part there, and the updates before it
    # are what is compared below (measured: no tie in 8 seeds at XLA optimization levels 0 and 3).
    assert len(s1) == len(s8) == STEPS * 8
    graphdef = nnx.split(model)[0]

    def logits_after(version, ids):  # on the one-device run's weights of that version
        return np.asarray(nnx.merge(graphdef, one[version])(jnp.asarray([ids])), np.float64)[0, -1]

    same = same_updates_up_to_a_tie(s1, s8, logits_after, cfg1.rollout)
    lp1, lp8 = (np.array([x for r in s if r["trained_at"] < same for x in r["logprobs"]]) for s in (s1, s8))
    assert same == 0 or rel_err(lp8, lp1) <= 1e-5  # a float32 log-softmax over 256 logits, at every version

    # The same updates, step by step. float32 has a unit roundoff u = 6e-8: sums of ~1e3 token terms and a
    # norm over ~1e5 gradient components taken in another order differ by ~1e-6 relative, and each step's
    # weights carry that into the next step's values; the KL, quadratic in how far the policy moved, doubles
    # the relative error of that movement. 1e-4 relative leaves a margin of 7x and more over that (measured
    # over 8 seeds at XLA optimization levels 0 and 3: <= 1.4e-5), and is still far below what one update
    # changes (the KL goes from 0 to ~2e-2).
    # The GRPO part of the loss is a mean of zero-sum advantages times ratios that are 1 on policy: it is 0 up
    # to the rounding of its ~n = train_batch * max_response_tokens terms of size |advantage| < 2, at most
    # n * u * 2; the loss is that plus kl_coef * KL.
    assert [r["step"] for r in m1] == [r["step"] for r in m8] == list(range(1, STEPS + 1))
    assert all(r["train"]["skipped"] == 0 for r in m1 + m8)
    assert max(len(r["tokens"]) for r in s1) > 1  # decode steps ran, not only the prefill's first token
    kl = np.array([r["train"]["kl"] for r in m1])
    assert kl[0] == 0 and np.all(kl[1:] > 1e-3)  # step 1 trains the reference policy itself
    pg_atol = cfg1.dora.train_batch * cfg1.train.max_response_tokens * 6e-8 * 2
    for r in m1 + m8:
        assert abs(r["train"]["pg_loss"]) <= pg_atol, r["train"]
    for k, atol in (("loss", pg_atol), ("kl", 0.0), ("grad_norm", 0.0)):  # the updates on the same samples
        a, b = np.array([r["train"][k] for r in m1[:same]]), np.array([r["train"][k] for r in m8[:same]])
        assert np.all(np.abs(b - a) <= 1e-4 * np.abs(a) + atol), (k, a, b)

    # And the weights they produce. Adam moves a weight by lr * m / (sqrt(v) + eps), so a gradient rounding
    # error d moves it by up to lr * d / eps: with d ~ 1e-8 (the unit roundoff times the largest gradient
    # terms, ~0.1 after clipping) that is 1e-2 of the learning rate per update (measured over 8 seeds at XLA
    # optimization levels 0 and 3: <= 2.1e-3).
    lr = cfg1.train.learning_rate
    for v in range(1, STEPS + 1):
        moved = np.abs(_flat(one[v]) - _flat(one[0])).max()
        assert moved >= 0.5 * lr  # Adam moves weights by ~lr per update
        if v <= same:  # version v: the weights after v updates on the same samples
            diff = np.abs(_flat(eight[v]) - _flat(one[v])).max()
            assert diff <= 2e-2 * v * lr, (v, diff)


def test_devices_and_a_placement_together_are_refused(tmp_path):
    cfg = load_config("tiny_llama", RUN)
    with pytest.raises(RunError, match="devices or a placement, not both"):
        Runner(cfg, str(tmp_path), placement=object(), devices=jax.devices()[:1], progress=False)
    assert not os.path.exists(tmp_path / "metrics.jsonl")
