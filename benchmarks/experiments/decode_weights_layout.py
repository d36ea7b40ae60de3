"""The decode weight layouts side by side (``rollout.decode_weights``: ``in_out``, ``x @ W``, against ``out_in``,
``W^T @ x^T``).

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.decode_weights_layout [ROUNDS]``.
SmolLM2-135M float32. Part 1: one decode step (batch 32, 256-slot cache, every row at one position), best of
ROUNDS alternated rounds. Part 2: the fixed batch of ``dora-jax bench engine`` (32 chat prompts x 128 sampled
tokens through ``RolloutDriver``), the two layouts alternated ROUNDS times, with how many of the 32
trajectories have the same tokens.
"""

import sys

import jax
import numpy as np
from flax import nnx

from benchmarks.decode import time_decode_steps
from benchmarks.engine import bench_prompts, compare_fixed_batches, run_fixed_batch
from dora_jax.config import load_config
from dora_jax.models.decoder import DecodeSettings, decode_forward
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine
from dora_jax.tokenizer import chat_template_head

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
LAYOUTS = ("in_out", "out_in")
B, S = 32, 256
model, tok = load_model(load_config("smollm2_135m").model, progress=False)
cfg = model.cfg

# Part 1: the step alone.
step = jax.jit(lambda p, t, pos, c: decode_forward(cfg, p, t, pos, c), donate_argnums=(3,))
variants = {lay: (step, model.decode_params(fuse=True, transpose=lay == "out_in")) for lay in LAYOUTS}
for pos in (64, 128, 200):
    times, _ = time_decode_steps(variants, cfg, B, S, pos, ROUNDS)
    best = {lay: min(t) for lay, t in times.items()}
    print(f"step at position {pos}: in_out {1e3 * best['in_out']:.1f} ms, out_in {1e3 * best['out_in']:.1f} ms, "
          f"out_in / in_out {best['out_in'] / best['in_out']:.2f}", flush=True)

# Part 2: the fixed batch end to end.
prompts = bench_prompts(tok, B, np.random.default_rng(0))
plen = max(map(len, prompts))
engines = {lay: (Engine(model, max_concurrent_decodes=B, max_prefill_length=plen,
                        max_target_length=1 << (plen + 127).bit_length(), settings=DecodeSettings(decode_weights=lay)),
                 nnx.state(model)) for lay in LAYOUTS}


def run(lay):
    eng, params = engines[lay]
    rate, _, trajectories = run_fixed_batch(eng, params, prompts, shared_prefix=tuple(chat_template_head(tok)))
    return rate, trajectories


compare_fixed_batches({lay: lambda lay=lay: run(lay) for lay in LAYOUTS}, ROUNDS)
