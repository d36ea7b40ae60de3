"""The train step on tiny models: micro-batching, sharding, staleness, LoRA, guards, bad input, and learning.

References: the one-batch gradient (for micro-batches), the single-device step (for 8 fake devices), numpy
(for LoRA merging), the engine's own log-probs (for recomputed behaviour), and chance level (for learning).
Gradients are read off a plain SGD step with learning rate 1 (``params - new_params``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from benchmarks.digit_task import GREEDY_AT_LEAST, LEARNING_RATE, REWARD_AT_LEAST, START_BELOW, STEPS, learn_digit_task
from conftest import rel_err
from dora_jax.config import Config, ConfigError, MeshConfig, ModelConfig, TrainConfig, LoraConfig, load_config
from dora_jax.models.build import init_model
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.samples import Request
from dora_jax.sharding import create_mesh
from dora_jax.trainer import BatchError, Sample, Trainer, make_batch
from dora_jax.trainer.lora import TARGETS

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, init_std=0.1, max_seq_len=64)
SGD = optax.sgd(1.0)


def _mesh(n):
    if n == 1:
        return create_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    return create_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])


def _config(**train):
    base = dict(group_size=4, length_buckets=(16, 32), max_response_tokens=12, max_staleness=1, grad_clip=0.0)
    base.update(train)
    return Config(model=MODEL, train=TrainConfig(**base))


def _samples(seed=0, groups=4, group_size=4, versions=(3,)):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        for j in range(group_size):
            p = rng.integers(1, 64, rng.integers(2, 7)).tolist()
            r = rng.integers(1, 64, rng.integers(1, 12)).tolist()
            out.append(Sample(sample_id=100 * g + j, group_id=7 * g + 1, version=versions[(g + j) % len(versions)],
                              prompt_ids=p, response_ids=r, logprobs=(-rng.uniform(2, 6, len(r))).tolist(),
                              reward=float(rng.normal())))
    return out


def _trainer(cfg, n_devices=1, tx=SGD, seed=0, version=3):
    mesh = _mesh(n_devices)
    model = init_model(cfg.model, seed=seed)
    if n_devices > 1:
        graphdef, params = nnx.split(model)
        from dora_jax.models.build import state_shardings

        params = jax.device_put(params, state_shardings(params, mesh, cfg.mesh.logical_axis_rules))
        model = nnx.merge(graphdef, params)
    trainer, state = Trainer.create(cfg, model=model, mesh=mesh, tx=tx)
    return trainer, state.replace(version=jnp.asarray(version, jnp.int32))


def _batch(trainer, samples, cfg):
    return trainer.put(make_batch(samples, group_size=cfg.train.group_size, length_buckets=cfg.train.length_buckets,
                                  row_multiple=trainer.row_multiple))


def _grads(trainer, state, batch):
    old = jax.tree.map(np.asarray, state.params)
    new, metrics = trainer.train_step(state, batch)
    return jax.tree.map(lambda o, n: o - np.asarray(n), old, new.params), metrics, new


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


# grpo (each sequence's token mean, then the batch's), dapo (normalized by the whole batch's token count) and
# gspo (sequence-level ratios): each aggregates over the batch in its own way, which micro-batching can get wrong.
@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_micro_batched_gradient_equals_one_batch(loss):
    samples = _samples()
    one, s1 = _trainer(_config(loss=loss, correction="decoupled", kl_coef=0.0))
    four, s4 = _trainer(_config(loss=loss, correction="decoupled", micro_batches=4))
    g1, m1, _ = _grads(one, s1, _batch(one, samples, one.cfg))
    g4, m4, _ = _grads(four, s4, _batch(four, samples, four.cfg))
    assert np.abs(_flat(g1)).max() > 0
    assert rel_err(_flat(g4), _flat(g1)) <= 1e-5
    assert abs(float(m4["loss"]) - float(m1["loss"])) <= 1e-5 * abs(float(m1["loss"])) + 1e-7


def test_sharded_step_equals_single_device():
    cfg = _config(loss="dapo", kl_coef=0.1, micro_batches=2)
    samples = _samples(1, versions=(2, 3))
    single, s1 = _trainer(cfg, 1)
    sharded, s8 = _trainer(cfg, 8)
    assert len(s8.params["wq"][...].sharding.device_set) == 8
    b1, b8 = _batch(single, samples, cfg), _batch(sharded, samples, cfg)
    b1, b8 = single.with_reference(s1, b1), sharded.with_reference(s8, b8)
    _, _, s1 = _grads(single, s1, b1)  # one step away from the reference, so the KL term is not zero
    _, _, s8 = _grads(sharded, s8, b8)
    g1, m1, _ = _grads(single, s1, b1)
    g8, m8, new8 = _grads(sharded, s8, b8)
    assert float(m1["kl"]) > 0
    assert rel_err(_flat(g8), _flat(g1)) <= 1e-5
    for k in ("loss", "kl", "grad_norm", "kept_tokens"):
        assert abs(float(m8[k]) - float(m1[k])) <= 1e-5 * abs(float(m1[k])), k
    specs = [s.spec for s in jax.tree.leaves(sharded.state_shardings.params)]
    assert [x.sharding.spec for x in jax.tree.leaves(new8.params)] == specs


def test_model_built_on_another_device_set_is_moved_to_the_trainer_mesh():
    """A model built on one device handed to a trainer on eight: its params move onto the trainer's mesh, and
    the step equals the one of a model built directly on that mesh."""
    cfg = _config(loss="grpo", kl_coef=0.1, micro_batches=2)
    mesh = _mesh(8)
    samples = _samples(3)
    elsewhere = init_model(cfg.model, seed=5)  # on jax.devices()[0] only
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(nnx.state(elsewhere)))
    direct = init_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=5)
    moved, s_moved = Trainer.create(cfg, model=elsewhere, mesh=mesh, tx=optax.adam(1e-2))
    ref, s_ref = Trainer.create(cfg, model=direct, mesh=mesh, tx=optax.adam(1e-2))
    devices = set(mesh.devices.flat)
    for x, r in zip(jax.tree.leaves(s_moved), jax.tree.leaves(s_ref), strict=True):
        assert x.sharding.device_set == devices
        assert x.sharding.is_equivalent_to(r.sharding, x.ndim)
    s_moved, s_ref = (s.replace(version=jnp.asarray(3, jnp.int32)) for s in (s_moved, s_ref))  # the samples' version
    # Both states go through one trainer's compiled functions (compiling them once is most of this test's time).
    batch = _batch(moved, samples, cfg)
    b_moved, b_ref = moved.with_reference(s_moved, batch), ref.with_reference(s_ref, batch)
    for _ in range(2):  # the second step starts from the first one's Adam moments and a nonzero KL
        s_moved, m_moved = moved.train_step(s_moved, b_moved)
        s_ref, m_ref = moved.train_step(s_ref, b_ref)
        for k in ("loss", "kl", "grad_norm"):
            np.testing.assert_allclose(float(m_moved[k]), float(m_ref[k]), rtol=1e-5, err_msg=k)
    assert float(m_ref["kl"]) > 0 and float(m_ref["grad_norm"]) > 0
    assert rel_err(_flat(s_moved.params), _flat(s_ref.params)) <= 1e-5


def test_stale_samples_change_nothing_and_are_counted():
    cfg = _config(max_staleness=1)
    fresh = _samples(2, versions=(3, 2))  # trainer version 3: lags 0 and 1 are kept
    trainer, state = _trainer(cfg)
    g_fresh, m_fresh, _ = _grads(trainer, state, _batch(trainer, fresh, cfg))
    rng = np.random.default_rng(9)
    stale = [Sample(1000 + i, 999, 0, rng.integers(1, 64, 3).tolist(), rng.integers(1, 64, 5).tolist(),
                    (-rng.uniform(0, 9, 5) - 1e4).tolist(), float(rng.normal() * 100)) for i in range(4)]
    trainer2, state2 = _trainer(cfg)
    g_mixed, m_mixed, _ = _grads(trainer2, state2, _batch(trainer2, fresh + stale, cfg))
    assert float(m_mixed["stale_samples"]) == 4 and float(m_fresh["stale_samples"]) == 0
    assert float(m_mixed["kept_samples"]) == len(fresh)
    assert rel_err(_flat(g_mixed), _flat(g_fresh)) <= 1e-6
    # Without a recompute there is nothing to compare the engine's log-probs with: no gap is reported (it used to
    # be measured against the empty recomputed field, about the size of a log-prob itself).
    assert "logprob_gap_max" not in m_fresh and "logprob_gap_mean" not in m_fresh


def test_non_finite_step_leaves_state_unchanged():
    cfg = _config(learning_rate=1e-2)
    trainer, state = _trainer(cfg, tx=None)
    host = make_batch(_samples(), group_size=4, length_buckets=(16, 32))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = host.replace(behaviour_logprobs=np.where(host.loss_mask > 0, np.nan, 0.0).astype(np.float32))
    new, metrics = trainer.train_step(state, trainer.put(bad))
    assert float(metrics["skipped"]) == 1.0
    assert int(new.version) == 3 and int(new.step) == 1
    after = jax.tree.map(np.asarray, (new.params, new.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    new, metrics = trainer.train_step(new, trainer.put(host))
    assert float(metrics["skipped"]) == 0.0 and int(new.version) == 4


def test_lora_trains_only_adapters_and_merges():
    cfg = _config(learning_rate=1e-2, lora=LoraConfig(rank=2, alpha=4.0, targets=("q", "o", "down")))
    trainer, state = _trainer(cfg, tx=None)
    base_before = jax.tree.map(np.asarray, state.frozen)
    lora_before = jax.tree.map(np.asarray, state.params)
    assert set(state.params) == {"wq", "wo", "w_down"}
    new, metrics = trainer.train_step(state, _batch(trainer, _samples(), cfg))
    new, metrics = trainer.train_step(new, _batch(trainer, _samples(5), cfg))
    assert float(metrics["kept_samples"]) == 16 and float(metrics["skipped"]) == 0
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(new.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for name in ("wq", "wo", "w_down"):
        assert not np.array_equal(lora_before[name]["b"], np.asarray(new.params[name]["b"]))
    merged = trainer.policy_params(new)
    scale = 4.0 / 2
    for name, (param, n_in) in TARGETS.items():
        w = base_before[param]
        got = np.asarray(merged[param][...])
        if param not in new.params:
            np.testing.assert_array_equal(got, w)
            continue
        a, b = np.asarray(new.params[param]["a"], np.float64), np.asarray(new.params[param]["b"], np.float64)
        for layer in range(w.shape[0]):
            w2 = w[layer].reshape(int(np.prod(w.shape[1:1 + n_in])), -1).astype(np.float64)
            # HF convention: W_hf [out, in] + scale * B [out, r] @ A [r, in], with B = b^T and A = a^T
            expected_hf = w2.T + scale * (b[layer].T @ a[layer].T)
            assert rel_err(got[layer].reshape(w2.shape).T, expected_hf) <= 1e-6


def test_lora_on_activations_equals_merged_weights():
    """The training forward applies adapters on the activations; it must be the same function (and the same
    adapter gradient) as the forward on merged weights, whose merge is checked against numpy above."""
    from dora_jax.trainer.lora import init_lora, merge
    from dora_jax.trainer.step import sequence_logprobs

    lcfg = LoraConfig(rank=3, alpha=6.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    graphdef, base = nnx.split(init_model(MODEL, seed=4))
    lora = init_lora(base, lcfg, jax.random.key(0))
    lora = {n: {"a": ab["a"], "b": 0.1 * jax.random.normal(jax.random.key(i), ab["b"].shape)}
            for i, (n, ab) in enumerate(lora.items())}
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 64, (3, 10)), jnp.int32)
    seg = jnp.asarray(np.arange(10)[None] < np.array([[10], [7], [4]]), jnp.int32)
    w = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32) * seg

    def on_activations(lo):
        return (sequence_logprobs(graphdef, base, tokens, seg, lo, 2.0) * w).sum()

    def on_merged(lo):
        return (sequence_logprobs(graphdef, merge(base, lo, lcfg), tokens, seg) * w).sum()

    v1, g1 = jax.value_and_grad(on_activations)(lora)
    v2, g2 = jax.value_and_grad(on_merged)(lora)
    assert abs(float(v1) - float(v2)) <= 1e-5 * abs(float(v2))
    assert rel_err(_flat(g1), _flat(g2)) <= 1e-5


def test_recomputed_behaviour_equals_engine_logprobs():
    """The missing-old-logits problem solved exactly: the training forward on the behaviour version's params
    reproduces the log-probs the engine recorded for it."""
    cfg = _config(behaviour_logprobs="recompute", correction="decoupled")
    trainer, state = _trainer(cfg, version=1)
    old = init_model(MODEL, seed=11)
    _, old_params = nnx.split(old)
    driver = RolloutDriver(Engine(old, max_concurrent_decodes=8, max_prefill_length=8, max_target_length=24))
    driver.add_version(0, old_params)
    rng = np.random.default_rng(0)
    reqs = [Request(i, tuple(rng.integers(1, 64, 4).tolist()), version=0, max_new_tokens=10,
                    sampling=RequestSampling(temperature=1.0, seed=3)) for i in range(8)]
    trajs = driver.run(reqs)
    samples = [Sample.from_trajectory(t, group_id=t.sample_id // 4, reward=float(len(t.tokens))) for t in trajs]
    batch = _batch(trainer, samples, cfg)
    batch = trainer.with_recomputed_behaviour(batch, {0: old_params})
    mask = np.asarray(batch.loss_mask) > 0
    engine_lp = np.asarray(batch.behaviour_logprobs)[mask]
    assert rel_err(np.asarray(batch.recomputed_logprobs)[mask], engine_lp) <= 1e-4
    # The metric is that largest gap itself: a float32 difference, its absolute value and a max are exact, so the
    # host's value is the device's. Checked against it rather than against 0: the decode program and the training
    # forward may round alike on some machines, and then the gap is 0.
    gap = np.abs(np.asarray(batch.recomputed_logprobs) - np.asarray(batch.behaviour_logprobs))[mask].max()
    _, metrics = trainer.train_step(state, batch)
    assert float(metrics["logprob_gap_max"]) == gap <= 1e-4 * np.abs(engine_lp).max()


# -- bad input -------------------------------------------------------------------------------------------------


def test_bad_batches_are_named():
    good = _samples()
    with pytest.raises(BatchError, match="group 8 has 3 of 4 samples"):
        make_batch(good[:7], group_size=4, length_buckets=(32,))
    broken = list(good)
    broken[1] = Sample(1, 1, 3, [5, 6], [7, 8, 9], [-1.0, -2.0], 0.0)
    with pytest.raises(BatchError, match="sample 1 .*2 log-probs for 3 response tokens"):
        make_batch(broken, group_size=4, length_buckets=(32,))
    broken[1] = Sample(1, 1, 3, [5, 6], [7], [-1.0], float("nan"))
    with pytest.raises(BatchError, match="sample 1 .*reward is nan"):
        make_batch(broken, group_size=4, length_buckets=(32,))
    with pytest.raises(BatchError, match="exceeds the largest length bucket 8"):
        make_batch(good, group_size=4, length_buckets=(8,))
    cfg = _config()
    trainer, _ = _trainer(cfg)
    host = make_batch(good, group_size=4, length_buckets=(32,))
    with pytest.raises(BatchError, match=r"batch.rewards has shape \(3,\)"):
        trainer.put(host.replace(rewards=np.zeros(3, np.float32)))
    with pytest.raises(BatchError, match=r"batch.rewards\[2\] is nan"):
        trainer.put(host.replace(rewards=np.where(np.arange(16) == 2, np.nan, host.rewards).astype(np.float32)))
    two, _ = _trainer(_config(micro_batches=3))
    with pytest.raises(BatchError, match="multiple of 3"):
        two.put(host)


def test_bad_train_config_is_named():
    with pytest.raises(ConfigError, match="train.loss.*allowed"):
        load_config(None, ["train.loss=ppo"])
    with pytest.raises(ConfigError, match="train.max_staleness"):
        load_config(None, ["train.max_staleness=-1"])
    with pytest.raises(ConfigError, match="train.lora.targets.*allowed"):
        load_config(None, ["train.lora.rank=4", "train.lora.targets=[qq]"])


# -- learning --------------------------------------------------------------------------------------------------

# The task, its learning loop and its thresholds (benchmarks/digit_task.py) are shared with
# benchmarks/learning_seeds.py, which measures the thresholds' margin over many seeds: a seed ends the same way
# in both, and a threshold moved there is moved here.


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_learns_a_verifiable_task(seed):
    """Prompt [1, d] for a digit token d; reward 1 iff the one response token is the digit three places on
    (mod 10). Chance is 1/16."""
    rewards, greedy_acc = learn_digit_task(seed, STEPS, LEARNING_RATE)
    assert np.mean(rewards[:3]) < START_BELOW, rewards[:3]  # starts near chance (1/16)
    assert np.mean(rewards[-5:]) >= REWARD_AT_LEAST and greedy_acc >= GREEDY_AT_LEAST, (greedy_acc, rewards)


def test_optimizer_moments_are_sharded_like_their_parameters():
    """Adam's moments must not be replicated on every device: each takes its parameter's sharding."""
    trainer, state = Trainer.create(load_config("tiny_llama"))  # mesh (2, 2, 2) on 8 fake devices
    params = dict(jax.tree_util.tree_leaves_with_path(state.params))
    checked = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
        keys = jax.tree_util.keystr(path)
        if ".mu" in keys or ".nu" in keys:
            ppath = [p for p in params if jax.tree_util.keystr(p) in keys]
            assert len(ppath) == 1, keys
            assert leaf.sharding.is_equivalent_to(params[ppath[0]].sharding, leaf.ndim), keys
            checked += 1
        else:
            assert leaf.sharding.is_fully_replicated, keys
    assert checked == 2 * len(params)
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.opt_state))


# -- the RL iteration: minibatches x epochs updates, one version ---------------------------------------------


def test_an_iteration_is_its_minibatch_updates_in_order():
    """``minibatches=2, epochs=2``: four updates of two whole groups each, every epoch a fresh shuffle, the
    version advanced once. Equal to four single-update iterations on the same minibatches (the version held at
    the iteration's), and the plan itself partitions the groups."""
    from dora_jax.trainer.step import minibatch_rows

    samples = _samples(seed=4)
    cfg = _config(minibatches=2, epochs=2)
    trainer, state = _trainer(cfg, tx=optax.sgd(0.05))
    host = make_batch(samples, group_size=4, length_buckets=cfg.train.length_buckets, row_multiple=1)
    plan = minibatch_rows(host.group_ids, host.valid, 2, 2, np.random.default_rng([cfg.run.seed, 9]), 1)
    assert len(plan) == 4
    for epoch in (plan[:2], plan[2:]):  # each epoch: every group exactly once, whole, two per update
        seen = [tuple(sorted(set(host.group_ids[idx[real]].tolist()))) for idx, real, _ in epoch]
        assert sorted(g for s in seen for g in s) == [0, 1, 2, 3] and all(len(s) == 2 for s in seen)
        for idx, real, _ in epoch:
            assert sorted(np.bincount(host.group_ids[idx[real]]).tolist())[-2:] == [4, 4]
    orders = {tuple(host.group_ids[plan[i][0][plan[i][1]]].tolist()) for i in range(4)}
    assert len(orders) > 2  # shuffled, not the same split every epoch

    new, metrics = trainer.train_step(state, trainer.put(host), iteration=9)
    assert int(new.version) == 4 and int(new.step) == 4
    assert float(metrics["updates"]) == 4 and float(metrics["applied"]) == 4 and float(metrics["skipped"]) == 0

    one, ref = _trainer(_config(), tx=optax.sgd(0.05))
    for idx, real, gid in plan:
        mb = jax.tree.map(lambda x: np.asarray(x)[idx], host)
        mb = mb.replace(valid=mb.valid & real, group_ids=gid)
        ref, _ = one.train_step(ref, one.put(mb))
        ref = ref.replace(version=jnp.asarray(3, jnp.int32))  # the iteration's version for all four
    assert rel_err(_flat(new.params), _flat(ref.params)) <= 1e-6


def test_decoupled_ppo_ratio_is_one_on_the_first_update_and_moves_after():
    """Decoupled PPO over four updates: the proximal log-probs are taken once, at the iteration's start, so the
    first update's ratio is exactly 1 (nothing clipped) and the later ones clip once the policy moved."""
    cfg = _config(minibatches=4, correction="decoupled", learning_rate=0.05)
    trainer, state = _trainer(cfg, tx=optax.adam(0.05))
    batch = _batch(trainer, _samples(seed=5), cfg)
    new, metrics = trainer.train_step(state, batch)
    assert float(metrics["clip_frac_min"]) == 0.0  # the first update: pi == pi_prox
    assert float(metrics["clip_frac_max"]) > 0.0 and float(metrics["clip_frac"]) > 0.0
    assert float(metrics["applied"]) == 4 and int(new.version) == 4


def test_a_non_finite_update_is_skipped_and_the_iteration_goes_on():
    """One of two updates sees a NaN: it is skipped and counted, the other applies and the version advances;
    when every update is non-finite the version stays where it was."""
    samples = _samples(seed=6)
    for minibatches, applied, version in ((2, 1, 4), (1, 0, 3)):
        cfg = _config(minibatches=minibatches, correction="tis")
        trainer, state = _trainer(cfg, tx=optax.sgd(0.05))
        host = make_batch(samples, group_size=4, length_buckets=cfg.train.length_buckets, row_multiple=1)
        poisoned = np.asarray(host.behaviour_logprobs).copy()
        poisoned[host.group_ids == 0] = np.nan  # one group's behaviour log-probs
        batch = trainer.put(host).replace(behaviour_logprobs=jnp.asarray(poisoned))
        before = _flat(state.params)
        new, metrics = trainer.train_step(state, batch, iteration=1)
        assert float(metrics["skipped"]) == minibatches - applied and float(metrics["applied"]) == applied
        assert int(new.version) == version
        assert np.all(np.isfinite(_flat(new.params)))
        assert (np.abs(_flat(new.params) - before).max() > 0) == bool(applied)


def test_log_probs_are_the_rollouts_at_its_temperature():
    """At rollout.temperature 0.6 the engine records log-probs of softmax(logits / 0.6), and the trainer's
    recompute on the same version gives the same numbers (it was T = 1 before, silently biasing IS weights)."""
    cfg = _config(behaviour_logprobs="recompute")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.6))
    trainer, state = _trainer(cfg, version=0)
    driver = RolloutDriver(Engine(nnx.merge(trainer.graphdef, state.params), max_concurrent_decodes=8,
                                  max_prefill_length=8, max_target_length=32))
    driver.add_version(0, trainer.policy_params(state))
    rng = np.random.default_rng(2)
    reqs = [Request(i, tuple(rng.integers(1, 64, 4).tolist()), version=0, max_new_tokens=10,
                    sampling=RequestSampling(temperature=0.6, seed=1)) for i in range(8)]
    samples = [Sample.from_trajectory(t, t.sample_id // 4, 0.0) for t in driver.run(reqs)]
    batch = _batch(trainer, samples, cfg)
    recomputed = trainer.with_recomputed_behaviour(batch, {0: trainer.policy_params(state)})
    mask = np.asarray(batch.loss_mask) > 0
    assert rel_err(np.asarray(recomputed.recomputed_logprobs)[mask], np.asarray(batch.behaviour_logprobs)[mask]) <= 1e-4
    at_one = np.asarray(Trainer.create(_config(), model=nnx.merge(trainer.graphdef, state.params), mesh=_mesh(1))[0]
                        .with_recomputed_behaviour(batch, {0: trainer.policy_params(state)}).recomputed_logprobs)
    assert rel_err(at_one[mask], np.asarray(batch.behaviour_logprobs)[mask]) > 1e-2  # T = 1 would be detectably off


def test_iteration_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match=r"train.minibatches.*must divide the iteration's 4 groups"):
        load_config("tiny_llama", ["train.minibatches=3", "dora.train_batch=16", "train.group_size=4"])
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config("tiny_llama", ["train.epochs=0"])
    with pytest.raises(ConfigError, match=r"rollout.top_k/top_p.*temperature-scaled full distribution"):
        load_config("tiny_llama", ["rollout.top_p=0.9"])


@pytest.mark.parametrize("packing", ["none", "pack"])
def test_recomputed_behaviour_runs_each_row_on_its_own_version_without_leaving_the_devices(packing):
    """Rows of three versions, on a data x fsdp x tensor mesh: each row's recomputed log-probs equal the forward of
    its own version on the whole batch (an independent path: no rows gathered), and with the host batch given
    nothing is read back from the devices."""
    cfg = _config(packing=packing, group_size=3)
    trainer, state = _trainer(cfg, n_devices=8)
    samples = _samples(seed=5, groups=3, group_size=3, versions=(1, 2, 3))  # 9 rows: padded, invalid ones
    host = make_batch(samples, group_size=3, length_buckets=cfg.train.length_buckets,
                      row_multiple=trainer.row_multiple)
    batch = trainer.put(host)
    base = trainer.policy_params(state)
    params = {v: jax.tree.map(lambda x, v=v: x * (1.0 + 0.05 * v), base) for v in (1, 2, 3)}
    # The trainer module may read no device array back (the guard holds on accelerators; on the CPU backend
    # device arrays are host memory, so the module's numpy is watched too).
    import dora_jax.trainer.step as step_module

    class Watched:
        def __getattr__(self, name):
            def guarded(x, *args, **kwargs):
                if isinstance(x, jax.Array):
                    raise AssertionError(f"a device array {x.shape} read back to the host")
                return getattr(np, name)(x, *args, **kwargs)
            return guarded if name in ("asarray", "array") else getattr(np, name)

    with pytest.MonkeyPatch.context() as mp, jax.transfer_guard_device_to_host("disallow"):
        mp.setattr(step_module, "np", Watched())
        got = trainer.with_recomputed_behaviour(batch, params, host).recomputed_logprobs
    got = np.asarray(got)
    versions, valid, mask = np.asarray(host.versions), np.asarray(host.valid), np.asarray(host.loss_mask) > 0
    want = np.zeros_like(got)
    for v in (1, 2, 3):
        rows = valid & (versions == v)
        want[rows] = np.asarray(trainer.logprobs(params[v], batch))[rows]
    want *= np.asarray(host.loss_mask)
    assert mask.any() and (~valid).any() and len(set(versions[valid].tolist())) == 3
    assert rel_err(got[mask], want[mask]) <= 1e-5
    assert not got[~mask].any()  # outside the loss mask (padding rows included): zeros
    # Each version matters: the rows of version 1 through version 3's params differ.
    swapped = np.asarray(trainer.with_recomputed_behaviour(batch, {1: params[3], 2: params[2], 3: params[1]},
                                                           host).recomputed_logprobs)
    assert rel_err(swapped[mask], want[mask]) > 1e-3
    # Without the host batch the versions are read from the devices: the same result.
    again = np.asarray(trainer.with_recomputed_behaviour(batch, params).recomputed_logprobs)
    np.testing.assert_array_equal(again, got)
