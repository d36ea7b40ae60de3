"""The out_in layout's products above ``decoder.OUT_IN_MAX_ROWS`` rows: contracted on both minor axes (as
shipped) against the ``W^T @ x^T`` form at every row count (before), side by side.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.out_in_rows [ROUNDS]``. SmolLM2-135M
float32, ``rollout.decode_weights=out_in``. Part 1: single products of SmolLM2's shapes at 32 to 1,024 rows,
GFLOP/s of each form and of ``x @ W``. Part 2: ``Engine.prefill_batch`` of the 32 chat prompts of ``dora-jax
bench engine`` after the chat template's head (32 prompts x a 32-token bucket = 1,024 rows), and the fixed
batch end to end (32 x 128 sampled tokens through ``RolloutDriver``). The two forms run in two engines whose
programs were traced with the threshold at 64 and above every row count; alternated, ROUNDS times.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dora_jax.models.decoder as dec
from benchmarks.engine import bench_prompts, compare_fixed_batches, run_fixed_batch
from benchmarks.timing import best_of, timed
from dora_jax.config import load_config
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.tokenizer import chat_template_head

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
B = 32
SHIPPED, ALWAYS = dec.OUT_IN_MAX_ROWS, 1 << 30
rng = np.random.default_rng(0)


# Part 1: single products.
for out, inp in ((960, 576), (3072, 576), (576, 1536)):
    w_t = jnp.asarray(rng.standard_normal((out, inp)), jnp.float32)
    w = jnp.asarray(np.asarray(w_t).T.copy())
    row = []
    for rows in (32, 64, 96, 128, 256, 1024):
        x = jnp.asarray(rng.standard_normal((rows, 1, inp)), jnp.float32)
        rate = {}
        for name, limit in (("W^T @ x^T", ALWAYS), ("both minor", 0)):
            dec.OUT_IN_MAX_ROWS = limit  # read while tracing
            product = jax.jit(lambda x, w: dec._dot_out_in(x, w, 1))
            rate[name] = 2 * rows * out * inp / best_of(lambda: product(x, w_t), repeats=10) / 1e9
        dec.OUT_IN_MAX_ROWS = SHIPPED
        product = jax.jit(lambda x, w: jnp.einsum("bti,io->bto", x, w))
        rate["x @ W"] = 2 * rows * out * inp / best_of(lambda: product(x, w), repeats=10) / 1e9
        row.append(f"{rows}: " + " / ".join(f"{v:.0f}" for v in rate.values()))
    print(f"[{inp} -> {out}] GFLOP/s, W^T @ x^T / both minor / x @ W, by rows: " + ", ".join(row), flush=True)

# Part 2: prefill and the fixed batch through the engine.
model, tok = load_model(load_config("smollm2_135m").model, progress=False)
prompts = bench_prompts(tok, B, np.random.default_rng(0))
head = tuple(chat_template_head(tok))
plen = max(map(len, prompts))
engines = {}
for name, limit in (("before", ALWAYS), ("shipped", SHIPPED)):
    eng = Engine(model, max_concurrent_decodes=B, max_prefill_length=plen,
                 max_target_length=1 << (plen + 127).bit_length(), settings=dec.DecodeSettings(decode_weights="out_in"))
    params = eng.prepare_params(nnx.state(model))
    prefix = eng.prefill_shared_prefix(params=params, tokens=head, version=0)
    engines[name] = (eng, params, prefix, limit)


def prefill(name):
    eng, params, prefix, limit = engines[name]

    def call():
        batch, first = eng.prefill_batch(params=params, prompts=prompts, sample_ids=list(range(B)), version=0,
                                         samplings=[RequestSampling(1.0)] * B, shared_prefix=prefix)
        return batch, first.data

    dec.OUT_IN_MAX_ROWS = limit
    try:
        (_, first), seconds = timed(call)
        return seconds, np.asarray(first)[:, 0]  # the first tokens
    finally:
        dec.OUT_IN_MAX_ROWS = SHIPPED


def run(name):
    eng, params, _, limit = engines[name]
    dec.OUT_IN_MAX_ROWS = limit
    try:
        rate, _, trajectories = run_fixed_batch(eng, params, prompts, shared_prefix=head)
        return rate, trajectories
    finally:
        dec.OUT_IN_MAX_ROWS = SHIPPED


for name in engines:
    prefill(name)  # compile
for _ in range(ROUNDS):
    (a, ta), (b, tb) = prefill("before"), prefill("shipped")
    print(f"prefill of {B} prompts: before {1e3 * a:.0f} ms, shipped {1e3 * b:.0f} ms, shipped / before "
          f"{b / a:.2f}, same first tokens {int(np.sum(ta == tb))} of {B}", flush=True)
compare_fixed_batches({name: lambda name=name: run(name) for name in engines}, ROUNDS)
