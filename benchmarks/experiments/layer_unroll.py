"""The decode step with its layer scan unrolled, against the loop as shipped.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.layer_unroll [ROUNDS] [UNROLLS]``
(defaults 4 and ``1,2,30``). SmolLM2-135M float32, the weights as
``Engine.prepare_params`` makes them, batch 32, 256-slot cache, every row at one position. Each unroll factor
is ``jax.lax.scan(..., unroll=u)`` for the step's layer scan (``1`` is the shipped loop; ``30`` is every layer
in line, the form a python loop over the layers compiles to). Prints each step's compile time, then best and
median of ROUNDS alternated rounds (``benchmarks.decode.time_decode_steps``), and the largest logit difference
against the first factor.
"""

import sys
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.decode import time_decode_steps
from benchmarks.timing import timed
from dora_jax.config import load_config
from dora_jax.models import decoder
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
UNROLLS = [int(u) for u in (sys.argv[2] if len(sys.argv) > 2 else "1,2,30").split(",")]
B, S = 32, 256
model, _ = load_model(load_config("smollm2_135m").model, progress=False)
cfg = model.cfg
params = Engine(model, max_concurrent_decodes=B, max_prefill_length=64,
                max_target_length=S).prepare_params(nnx.state(model))
scan = jax.lax.scan


def step_with(unroll):
    def step(p, tokens, positions, cache):
        # decode_forward has one scan (the layers); tracing it under this patch sets that scan's unroll.
        with mock.patch.object(jax.lax, "scan", partial(scan, unroll=unroll)):
            return decoder.decode_forward(cfg, p.tree, tokens, positions, cache)
    return jax.jit(step, donate_argnums=(3,))


variants = {u: (step_with(u), params) for u in UNROLLS}
for u, (step, _) in variants.items():
    seconds = timed(lambda: step.lower(params, *(jax.ShapeDtypeStruct((B, 1), jnp.int32),) * 2,
                                       decoder.init_cache(cfg, B, S)).compile())[1]
    print(f"unroll {u}: compiled in {seconds:.1f} s", flush=True)
base = UNROLLS[0]
for pos in (64, 200):
    times, logits = time_decode_steps(variants, cfg, B, S, pos, ROUNDS)
    best = {u: 1e3 * min(t) for u, t in times.items()}
    for u, t in times.items():
        print(f"position {pos}, unroll {u}: best {best[u]:.1f} ms, median {1e3 * np.median(t):.1f} ms, "
              f"best / unroll {base}'s {best[u] / best[base]:.2f}, "
              f"max |logit diff| {np.abs(logits[u] - logits[base]).max():.1e}", flush=True)
