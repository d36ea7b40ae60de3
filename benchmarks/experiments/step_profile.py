"""Where a decode step's time goes, op by op, from a ``jax.profiler`` trace of the engine's own step.

Run from the repository root::

    .venv/bin/python -m benchmarks.experiments.step_profile [--model smollm2|accel|quick] [--position P]
        [--steps N] [--top K] [--json OUT.json]

``smollm2``: SmolLM2-135M float32, 32 rows, a 256-slot cache, ``bench engine``'s chat prompts. ``accel``: the
Qwen2.5-1.5B shape of ``bench engine --preset accel`` (random weights, bf16), 64 rows of 256 random prompt
tokens, a cache of 4,352 slots; ``quick``: its two-layer form (a CPU check that the script runs). Every row
decodes until the rows reach position P (default 100; for ``accel`` 2,048, where the step of that preset's run
sits), then N steps (default 5) are traced, sampling at temperature 1, and the ops that took the most time per
step are printed, each with the source op XLA compiled it from (from the compiled program's metadata).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import numpy as np


def build(model_name: str):
    """The engine, its prepared params and the prompts of ``model_name``."""
    from dora_jax.config import ModelConfig, load_config
    from dora_jax.models.build import init_model
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.engine import Engine

    from benchmarks.engine import ACCEL_ENGINE_MODEL, QUICK_ENGINE_MODEL, bench_prompts

    rng = np.random.default_rng(0)
    if model_name == "smollm2":
        model, tok = load_model(load_config("smollm2_135m").model, progress=False)
        engine = Engine(model, max_concurrent_decodes=32, max_prefill_length=64, max_target_length=256)
        prompts = bench_prompts(tok, 32, rng)
    else:
        shape, rows, prompt, target = ((ACCEL_ENGINE_MODEL, 64, 256, 4352) if model_name == "accel"
                                       else (QUICK_ENGINE_MODEL, 4, 32, 128))
        model = init_model(ModelConfig(**shape, max_seq_len=target), seed=0)
        engine = Engine(model, max_concurrent_decodes=rows, max_prefill_length=prompt, max_target_length=target,
                        dtype="bfloat16")
        prompts = [tuple(rng.integers(3, shape["vocab_size"], prompt).tolist()) for _ in range(rows)]
    return engine, engine.prepare_params(engine.params), prompts


def one_step(engine, params, state):
    """One decode step of every live slot (``Engine.generate_steps`` of one step, no stop ids)."""
    b = state.tokens.shape[0]
    (state,), _ = engine.generate_steps([params], [state], steps=1, budgets=[[1] * b], stop_ids=[[()] * b],
                                        filtered=False)
    return state


def profile_steps(engine, params, prompts, position: int, steps: int, top: int) -> dict:
    """Decodes ``prompts`` to ``position``, traces ``steps`` one-step programs, and returns the step's wall time
    under the profiler and its ``top`` ops by time per step."""
    from dora_jax.rollout.engine import RequestSampling
    from dora_jax.rollout.warmup import warmup_plan

    from benchmarks.timing import timed

    b = len(prompts)
    batch, _ = engine.prefill_batch(params=params, prompts=prompts, sample_ids=list(range(b)), version=0,
                                    samplings=[RequestSampling(1.0)] * b)
    state = engine.insert_batch(batch, engine.init_decode_state(), list(range(b)))
    while int(np.max(np.asarray(state.positions))) < position:
        state = one_step(engine, params, state)
    jax.block_until_ready(state)
    # The one-step program as one_step calls it, at these rows and without top-k/top-p filtering.
    name, args = next((n, a) for n, a in warmup_plan(engine, params, decode_steps=1) if n == "generate_steps"
                      and a[1][0].tokens.shape[0] == b and a[-1] is False)
    hlo = engine.compiled.lower(name, *args).compile().as_text()
    # Each op's result shape and the source op it was compiled from (the shape tells which it is: for SmolLM2,
    # [3072, 32] is gate|up for 32 rows, [32, 1, 9, 64] the attention output, ...).
    ops = {m.group(1): (m.group(2), m.group(3))
           for m in re.finditer(r'^\s*%(\S+) = (\S+) .*?op_name="([^"]*)"', hlo, re.M)}

    def run(state):
        for _ in range(steps):
            state = jax.block_until_ready(one_step(engine, params, state))
        return state

    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            state, seconds = timed(lambda: run(state))
        trace = json.load(gzip.open(glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, calls = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in ops:
            total[e["name"]] += e["dur"] / 1e3 / steps
            calls[e["name"]] += 1
    rows = [{"op": name, "ms_per_step": ms, "calls_per_step": calls[name] / steps, "result": ops[name][0],
             "source": ops[name][1].replace("jit(generate)/", "")}
            for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]]
    return {"position": position, "steps": steps, "rows": b, "step_ms": 1e3 * seconds / steps,
            "ops_ms_per_step": sum(total.values()), "top": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.step_profile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "accel", "quick"), default="smollm2")
    ap.add_argument("--position", type=int, help="decode until the rows reach this position (default 100; "
                    "accel 2048)")
    ap.add_argument("--steps", type=int, default=5, help="steps traced")
    ap.add_argument("--top", type=int, default=30, help="ops printed")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    position = args.position or (2048 if args.model == "accel" else 100)
    engine, params, prompts = build(args.model)
    r = profile_steps(engine, params, prompts, position, args.steps, args.top)
    r.update(model=args.model, device=str(jax.devices()[0].device_kind))
    print(f"{r['steps']} steps of {r['rows']} rows from position {position}: {r['step_ms']:.2f} ms a step under the "
          f"profiler, {r['ops_ms_per_step']:.2f} ms of it in traced ops")
    print(f"{'ms/step':>8} {'calls':>5}  op: result  <-  source")
    for o in r["top"]:
        print(f"{o['ms_per_step']:8.3f} {o['calls_per_step']:5.0f}  {o['op']}: {o['result']}  <-  {o['source']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
