"""How much one run of ``bench engine``'s fixed batch moves, alone and right after transformers' ``generate``.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.fixed_batch_spread``. SmolLM2-135M
float32, the 32 chat prompts x 128 sampled tokens of ``dora-jax bench engine`` (``benchmarks.engine.run_fixed_batch``,
the chat template's head prefilled once). Prints tokens/s of four runs alone; then three rounds of one
transformers run, an engine run right after it and one more after a 2 s pause; then three runs alone again.
"""

import time

import numpy as np
from flax import nnx

from benchmarks.engine import bench_prompts, hf_generate_run, run_fixed_batch
from dora_jax.config import load_config
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine
from dora_jax.tokenizer import chat_template_head

B, NEW = 32, 128
model, tok = load_model(load_config("smollm2_135m").model, progress=False)
prompts = bench_prompts(tok, B, np.random.default_rng(0))
plen = max(map(len, prompts))
engine = Engine(model, max_concurrent_decodes=B, max_prefill_length=plen,
                max_target_length=1 << (plen + NEW - 1).bit_length())
params, head = nnx.state(model), tuple(chat_template_head(tok))


def run():
    return run_fixed_batch(engine, params, prompts, NEW, head)[0]


run()  # compile
print("engine alone:", [round(run(), 1) for _ in range(4)], flush=True)
hf = hf_generate_run(prompts, NEW, "float32", {})
for _ in range(3):
    h, right_after = hf(), run()
    time.sleep(2)
    print(f"transformers {h:.1f}, engine right after {right_after:.1f}, after a 2 s pause {run():.1f}", flush=True)
print("engine alone again:", [round(run(), 1) for _ in range(3)], flush=True)
