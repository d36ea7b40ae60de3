"""The digit task that GRPO must learn: ``tests/test_trainer.py::test_grpo_learns_a_verifiable_task`` asserts
its thresholds on a few seeds, ``benchmarks/learning_seeds.py`` measures their margin over many.

Prompt ``[1, d]`` for a digit token d; reward 1 iff the one response token is the digit three places on (mod
10). Chance is 1/16. Both callers run :func:`learn_digit_task` under the same XLA flags, so a seed ends the
same way in either.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dora_jax.config import Config, MeshConfig, ModelConfig, TrainConfig
from dora_jax.models.build import init_model
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.samples import Request
from dora_jax.sharding import create_mesh
from dora_jax.trainer import Sample, Trainer, make_batch

TASK = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, init_std=0.02, max_seq_len=16)
DIGITS = np.arange(2, 12)
STEPS, LEARNING_RATE = 80, 5e-3
# The test's thresholds, set with a margin below the worst of many seeds (learning_seeds.py; the measurement is
# in docs/trainer.md): sampled rollouts turn a CPU's rounding into different runs, so a threshold near the
# typical outcome would pass on one machine and fail on another.
START_BELOW, REWARD_AT_LEAST, GREEDY_AT_LEAST = 0.3, 0.6, 0.7


def _answer(d):
    return int((d - 2 + 3) % 10 + 2)


def learn_digit_task(seed, steps, learning_rate):
    """GRPO on the digit task with engine rollouts at temperature 1 on the current version; returns the mean
    reward of every step and the final greedy accuracy over all ten prompts."""
    cfg = Config(model=TASK, train=TrainConfig(group_size=8, learning_rate=learning_rate, length_buckets=(4,),
                                               max_response_tokens=1, max_staleness=0), run=Config().run)
    model = init_model(TASK, seed=seed)
    mesh = create_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    trainer, state = Trainer.create(cfg, model=model, mesh=mesh)
    driver = RolloutDriver(Engine(model, max_concurrent_decodes=64, max_prefill_length=2, max_target_length=4))
    rng = np.random.default_rng(seed)
    rewards, sample_id = [], 0
    for _ in range(steps):
        version = int(state.version)
        driver.add_version(version, trainer.policy_params(state))
        reqs, digit, group = [], {}, {}
        for g, d in enumerate(rng.choice(DIGITS, 8, replace=False)):
            for _ in range(8):
                reqs.append(Request(sample_id, (1, int(d)), version=version, max_new_tokens=1,
                                    sampling=RequestSampling(temperature=1.0, seed=seed)))
                digit[sample_id], group[sample_id] = int(d), g
                sample_id += 1
        trajs = driver.run(reqs)
        driver.remove_version(version)
        samples = [Sample.from_trajectory(t, group[t.sample_id], float(t.tokens[0] == _answer(digit[t.sample_id])))
                   for t in trajs]
        rewards.append(float(np.mean([s.reward for s in samples])))
        batch = make_batch(samples, group_size=cfg.train.group_size, length_buckets=cfg.train.length_buckets,
                           row_multiple=trainer.row_multiple)
        state, _ = trainer.train_step(state, trainer.put(batch))
    logits = nnx.merge(trainer.graphdef, trainer.policy_params(state))(
        jnp.asarray([[1, int(d)] for d in DIGITS], jnp.int32))
    greedy_acc = float(np.mean(np.asarray(logits[:, -1].argmax(-1)) == [_answer(d) for d in DIGITS]))
    return rewards, greedy_acc
