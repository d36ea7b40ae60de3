"""The learning test's outcome over many seeds, outside the suite.

``tests/test_trainer.py::test_grpo_learns_a_verifiable_task`` runs GRPO on a ten-prompt digit task and asserts
that learning ends well above chance. Sampled trajectories at temperature 1 turn a CPU's rounding differences
into different runs, so its thresholds must sit well below the worst seed on any machine: this script runs the
same function over many seeds and prints the spread the thresholds are set against.

    .venv/bin/python benchmarks/learning_seeds.py --seeds 24 [--opt-level 0|3] [--steps N --lr X] [--json OUT]

The suite compiles at XLA's backend optimization level 0 (tests/conftest.py); ``--opt-level 3`` runs the
same seeds at the default level, whose different rounding stands in for another machine's.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


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
    # The suite's environment, set before JAX is imported: tests/conftest.py reads these.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level={args.opt_level}"
    os.environ["DORA_JAX_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="dora-jax-seeds-xla-cache-")
    import conftest  # noqa: F401 - sets the suite's XLA flags before test_trainer imports JAX
    import test_trainer as tt

    args.steps = tt.STEPS if args.steps is None else args.steps
    args.lr = tt.LEARNING_RATE if args.lr is None else args.lr
    rows = []
    for seed in tqdm(range(args.first, args.first + args.seeds), desc="seeds"):
        t0 = time.perf_counter()
        rewards, greedy = tt.learn_digit_task(seed, args.steps, args.lr)
        rows.append(dict(seed=seed, first3=float(np.mean(rewards[:3])), last5=float(np.mean(rewards[-5:])),
                         greedy_acc=greedy, seconds=round(time.perf_counter() - t0, 1)))
        tqdm.write(json.dumps(rows[-1]))
    first3, last5, greedy = (np.array([r[k] for r in rows]) for k in ("first3", "last5", "greedy_acc"))
    summary = dict(steps=args.steps, lr=args.lr, seeds=len(rows), opt_level=args.opt_level, cpu=_cpu(),
                   first3_max=float(first3.max()), last5_min=float(last5.min()), last5_median=float(np.median(last5)),
                   greedy_min=float(greedy.min()), greedy_median=float(np.median(greedy)),
                   thresholds=dict(first3_below=tt.START_BELOW, last5_at_least=tt.REWARD_AT_LEAST,
                                   greedy_at_least=tt.GREEDY_AT_LEAST))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, runs=rows), f, indent=1)


if __name__ == "__main__":
    main()
