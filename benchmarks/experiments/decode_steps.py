"""Several decode steps per dispatched program (``rollout.decode_steps``) against one, on a training run's
rollout: the config's model, chat prompts ("What is a + b?", the benchmark's), GRPO groups of
``train.group_size`` samples per prompt, the tokenizer's end-of-sequence ids, ``rollout.max_new_tokens`` and
``rollout.slots``, sampling at the config's temperature.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.decode_steps [CONFIG [ROUNDS [N]]]``
(default ``smollm2_arith``, 3 rounds, N = 8). Two workloads: as many requests as slots (nothing waits, as in
a run whose rollout batch equals its slots), and twice as many (requests wait for slots, so a program of N
steps ends at the first step that frees one). Each workload runs with N steps and with one step per program,
alternated ROUNDS times after one untimed run each; prints tokens/s (best), the ratio, and each run's decode
steps, dispatches and rows computed. Trajectories are checked equal between the two. Last, the device side
alone: N steps of every slot (all live, sampled) as N one-step programs against one
``Engine.generate_steps`` program (and N programs of one step), alternated ROUNDS times, ms per step.
"""

import sys

import jax
import numpy as np
from flax import nnx

from benchmarks.engine import bench_prompts
from benchmarks.timing import alternated, timed
from dora_jax.config import load_config
from dora_jax.models.decoder import DecodeSettings
from dora_jax.models.weights import load_model
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling, bucket
from dora_jax.rollout.samples import Request
from dora_jax.tokenizer import chat_template_head

CONFIG = sys.argv[1] if len(sys.argv) > 1 else "smollm2_arith"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
N = int(sys.argv[3]) if len(sys.argv) > 3 else 8

cfg = load_config(CONFIG)
r = cfg.rollout
model, tok = load_model(cfg.model, progress=False)
params = nnx.state(model)
g = cfg.train.group_size
prompts = bench_prompts(tok, 2 * r.slots // g + 1, np.random.default_rng(0))
head = tuple(chat_template_head(tok)) if r.shared_prefix else ()
engine = Engine(model, max_concurrent_decodes=r.slots, max_prefill_length=r.max_prompt_len,
                max_target_length=min(bucket(r.max_prompt_len + r.max_new_tokens), cfg.model.max_seq_len),
                dtype=r.dtype, settings=DecodeSettings.of(r))
print(f"{CONFIG}: {r.slots} slots, groups of {g}, max_new_tokens {r.max_new_tokens}, temperature {r.temperature}, "
      f"eos ids {tok.eos_ids}", flush=True)


def requests(n):
    sampling = RequestSampling(temperature=r.temperature, seed=0)
    return [Request(i, tuple(prompts[i // g]), max_new_tokens=r.max_new_tokens, sampling=sampling)
            for i in range(n)]


def run(reqs, steps):
    d = RolloutDriver(engine, eos_ids=tok.eos_ids, overlap=r.overlap, shared_prefix=head, decode_steps=steps)
    d.add_version(0, params)
    trajs, seconds = timed(lambda: (d.run(reqs), d.block_until_ready())[0])
    tokens = sum(len(t.tokens) for t in trajs)
    run.last[steps] = (d, {t.sample_id: t.tokens for t in trajs})
    return tokens / seconds


run.last = {}
for name, n in (("requests = slots", r.slots), ("requests = 2 x slots", 2 * r.slots)):
    reqs = requests(n)
    run(reqs, 1), run(reqs, N)  # compile
    assert run.last[1][1] == run.last[N][1], "the trajectories differ"
    seen = alternated({"one": lambda: run(reqs, 1), "many": lambda: run(reqs, N)}, ROUNDS)
    one, many = max(seen["one"]), max(seen["many"])
    print(f"{name}: {N} steps per program {many:.1f} tokens/s, one {one:.1f} tokens/s, {many / one:.2f}x "
          f"(runs: {[round(x, 1) for x in seen['many']]} / {[round(x, 1) for x in seen['one']]})", flush=True)
    for steps in (1, N):
        d = run.last[steps][0].stats
        print(f"  decode_steps={steps}: {d.steps} steps in {d.dispatches} dispatches "
              f"({d.decode_steps_per_dispatch:.2f} per dispatch), {d.rows_computed} rows computed, "
              f"{d.rows_live} live", flush=True)

# The device side alone: every slot live for N steps.
params_p = engine.prepare_params(params)
sampling = RequestSampling(temperature=r.temperature, seed=0)
batch, _ = engine.prefill_batch(params=params_p, prompts=[tuple(prompts[i % len(prompts)]) for i in range(r.slots)],
                                sample_ids=list(range(r.slots)), samplings=[sampling] * r.slots)


def fresh():
    return jax.block_until_ready(engine.insert_batch(batch, engine.init_decode_state(r.slots), list(range(r.slots))))


def one_step_calls(state):
    for _ in range(N):
        (state,), result = engine.generate_steps([params_p], [state], steps=1, budgets=[[1] * r.slots],
                                                 stop_ids=[[()] * r.slots], filtered=False)
        result.to_host()


def programs_of(k):
    def run_programs(state):
        for _ in range(N // k):
            (state,), result = engine.generate_steps([params_p], [state], steps=k, budgets=[[k] * r.slots],
                                                     stop_ids=[[()] * r.slots], filtered=False)
            result.to_host()
    return run_programs


device = {"generate x N": one_step_calls, "generate_steps(N)": programs_of(N), "generate_steps(1) x N": programs_of(1)}
for fn in device.values():
    fn(fresh())  # compile
seen = {name: [] for name in device}
for _ in range(ROUNDS):
    for name, fn in device.items():
        state = fresh()
        seen[name].append(timed(lambda: fn(state))[1] * 1e3 / N)
print(f"device side, {r.slots} slots x {N} steps, ms per step (best, median): " + ", ".join(
    f"{name} {min(v):.1f}, {np.median(v):.1f}" for name, v in seen.items()), flush=True)
