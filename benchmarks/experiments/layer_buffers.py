"""Transposed decode weights as one buffer per layer against one stacked array.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.layer_buffers [ROUNDS]``. SmolLM2-135M
float32, ``rollout.decode_weights=out_in``. ``per_layer`` is what ``Engine.prepare_params`` makes: each layer's
projections its own buffer, read in the scan through ``decoder.LayerWeights``. ``stacked`` is the same
weights stacked on a leading layer axis, as before: the scan slices (copies) each layer's weights out of them.
Part 1: one decode step (batch 32, 256-slot cache, every row at one position), best and median of ROUNDS
alternated rounds. Part 2: the fixed batch of ``dora-jax bench engine`` (32 chat prompts x 128 sampled
tokens through ``RolloutDriver``), alternated ROUNDS times, with how many trajectories have the same tokens.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.decode import time_decode_steps
from benchmarks.engine import bench_prompts, compare_fixed_batches, run_fixed_batch
from dora_jax.config import load_config
from dora_jax.models.decoder import DecodeSettings, decode_forward
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine, PreparedParams
from dora_jax.tokenizer import chat_template_head

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
B, S = 32, 256
model, tok = load_model(load_config("smollm2_135m").model, progress=False)
cfg = model.cfg
prompts = bench_prompts(tok, B, np.random.default_rng(0))
plen = max(map(len, prompts))
engine = Engine(model, max_concurrent_decodes=B, max_prefill_length=plen,
                max_target_length=1 << (plen + 127).bit_length(), settings=DecodeSettings(decode_weights="out_in"))
per_layer = engine.prepare_params(nnx.state(model))
stacked = PreparedParams({**per_layer.tree, "layers": {k: jnp.stack(v) if isinstance(v, tuple) else v
                                                       for k, v in per_layer.tree["layers"].items()}})
params = {"stacked": stacked, "per_layer": per_layer}

# Part 1: the step alone.
step = jax.jit(lambda p, t, pos, c: decode_forward(cfg, p.tree, t, pos, c), donate_argnums=(3,))
for pos in (64, 128, 200):
    times, _ = time_decode_steps({k: (step, p) for k, p in params.items()}, cfg, B, S, pos, ROUNDS)
    a, b = (np.array(times[k]) * 1e3 for k in params)
    print(f"step at position {pos}, best / median ms: stacked {a.min():.1f} / {np.median(a):.1f}, per_layer "
          f"{b.min():.1f} / {np.median(b):.1f}, per_layer / stacked {b.min() / a.min():.2f} / "
          f"{np.median(b) / np.median(a):.2f}", flush=True)


# Part 2: the fixed batch end to end.
def run(k):
    rate, _, trajectories = run_fixed_batch(engine, params[k], prompts, shared_prefix=tuple(chat_template_head(tok)))
    return rate, trajectories


compare_fixed_batches({k: lambda k=k: run(k) for k in params}, ROUNDS)
