"""Where a decode step's time goes, op by op, from a ``jax.profiler`` trace of the engine's own step.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.step_profile [POSITION] [STEPS]``
(SmolLM2-135M float32, batch 32, 256-slot cache, ``bench engine``'s chat prompts, sampling at temperature 1).
Decodes until the rows reach POSITION (default 100), then traces STEPS steps (default 5) and prints the ops
that took the most time per step, each with the source op XLA compiled it from (from the compiled program's
metadata). Times of ops nested in a conditional (the per-layer weight switch, the cache-prefix switch) are
also counted in the conditional's own line.
"""

import collections
import glob
import gzip
import json
import re
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from benchmarks.engine import bench_prompts
from benchmarks.timing import timed
from dora_jax.config import load_config
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine, RequestSampling

POSITION = int(sys.argv[1]) if len(sys.argv) > 1 else 100
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
TOP = int(sys.argv[3]) if len(sys.argv) > 3 else 30
B = 32
model, tok = load_model(load_config("smollm2_135m").model, progress=False)
engine = Engine(model, max_concurrent_decodes=B, max_prefill_length=64, max_target_length=256)
params = engine.prepare_params(nnx.state(model))
rng = np.random.default_rng(0)
prompts = bench_prompts(tok, B, rng)
batch, _ = engine.prefill_batch(params=params, prompts=prompts, sample_ids=list(range(B)), version=0,
                                samplings=[RequestSampling(1.0)] * B)
state = engine.insert_batch(batch, engine.init_decode_state(), list(range(B)))
while int(np.max(np.asarray(state.positions))) < POSITION:
    state, _ = engine.generate(params, state, filtered=False)
jax.block_until_ready(state)
hlo = engine._generate_jit.lower(params, state, False).compile().as_text()
# Each op's result shape and the source op it was compiled from (a conditional's shape tells which it is:
# [3072, 32] is gate|up for 32 rows, [32, 1, 9, 64] the attention output, ...).
ops = {m.group(1): (m.group(2), m.group(3))
       for m in re.finditer(r'^\s*%(\S+) = (\S+) .*?op_name="([^"]*)"', hlo, re.M)}


def run_steps(state):
    for _ in range(STEPS):
        state, _ = engine.generate(params, state, filtered=False)
        jax.block_until_ready(state)
    return state


with tempfile.TemporaryDirectory() as out:
    with jax.profiler.trace(out, create_perfetto_trace=True):
        state, seconds = timed(lambda: run_steps(state))
        wall = seconds / STEPS
    trace = json.load(gzip.open(glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True)[0]))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
total, calls = collections.defaultdict(float), collections.Counter()
for e in events:
    if e.get("ph") == "X" and e["name"] in ops:
        total[e["name"]] += e["dur"] / 1e3 / STEPS
        calls[e["name"]] += 1
print(f"{STEPS} steps from position {POSITION}: {1e3 * wall:.1f} ms a step under the profiler")
print(f"{'ms/step':>8} {'calls':>5}  op: result  <-  source")
for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:TOP]:
    shape, src = ops[name]
    print(f"{ms:8.2f} {calls[name] / STEPS:5.0f}  {name}: {shape}  <-  {src.replace('jit(_generate_impl)/', '')}")
