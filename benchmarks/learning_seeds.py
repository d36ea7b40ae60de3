"""The learning test's outcome over many seeds, outside the suite.

``tests/test_trainer.py::test_grpo_learns_a_verifiable_task`` runs GRPO on a ten-prompt digit task and asserts
that learning ends well above chance. Sampled trajectories at temperature 1 turn a CPU's rounding differences
into different runs, so its thresholds must sit well below the worst seed on any machine: this script runs the
same function over many seeds and prints the spread the thresholds are set against.

    .venv/bin/python benchmarks/learning_seeds.py --seeds 24 [--opt-level 0|3] [--steps N --lr X] [--json OUT]

The task and the test's thresholds are :mod:`benchmarks.digit_task`'s. The runs compile as the suite's do
(tests/conftest.py: XLA's backend optimization level 0 on 8 fake CPU devices); ``--opt-level 3`` runs the same
seeds at the default level, whose different rounding stands in for another machine's.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

# Run as a script, this folder is on sys.path but not the repository root that holds the benchmarks package.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from dora_jax.xla_flags import cpu_test_flags  # noqa: E402 - imports no JAX


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--steps", type=int, default=None, help="default: the test's")
    ap.add_argument("--lr", type=float, default=None, help="default: the test's")
    ap.add_argument("--json", default=None, help="write every seed's outcome here")
    ap.add_argument("--opt-level", type=int, default=0, help="XLA:CPU backend optimization level (suite: 0)")
    args = ap.parse_args(argv)
    # The suite's environment (tests/conftest.py), set before JAX is imported: XLA reads it when its backend
    # starts.
    os.environ["XLA_FLAGS"] = cpu_test_flags(os.environ.get("XLA_FLAGS", ""), args.opt_level)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    import jax

    from benchmarks import digit_task as task

    steps = task.STEPS if args.steps is None else args.steps
    lr = task.LEARNING_RATE if args.lr is None else args.lr
    rows = []
    # A compilation cache of the run's own, as the suite has: every seed compiles the same programs.
    with tempfile.TemporaryDirectory(prefix="dora-jax-seeds-xla-cache-") as cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        for seed in tqdm(range(args.first, args.first + args.seeds), desc="seeds"):
            t0 = time.perf_counter()
            rewards, greedy = task.learn_digit_task(seed, steps, lr)
            rows.append(dict(seed=seed, first3=float(np.mean(rewards[:3])), last5=float(np.mean(rewards[-5:])),
                             greedy_acc=greedy, seconds=round(time.perf_counter() - t0, 1)))
            tqdm.write(json.dumps(rows[-1]))
    first3, last5, greedy = (np.array([r[k] for r in rows]) for k in ("first3", "last5", "greedy_acc"))
    summary = dict(steps=steps, lr=lr, seeds=len(rows), opt_level=args.opt_level, cpu=_cpu(),
                   first3_max=float(first3.max()), last5_min=float(last5.min()), last5_median=float(np.median(last5)),
                   greedy_min=float(greedy.min()), greedy_median=float(np.median(greedy)),
                   thresholds=dict(first3_below=task.START_BELOW, last5_at_least=task.REWARD_AT_LEAST,
                                   greedy_at_least=task.GREEDY_AT_LEAST))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, runs=rows), f, indent=1)


if __name__ == "__main__":
    main()
