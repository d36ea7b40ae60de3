"""Stress check for collectives on fake CPU devices: P processes at once, each a tiny synchronous run of S updates
on 8 CPU devices (2x2x2 mesh), with XLA's stuck-collective warning at 5 s and its abort at 15 s.

    python tests/stress_cpu_collectives.py --steps 300 --processes 2            # the flags dora_jax builds
    python tests/stress_cpu_collectives.py --steps 300 --processes 2 --unsafe   # XLA's default scheduler
    python tests/stress_cpu_collectives.py --steps 300 dora.mode=dora train.max_staleness=2 dora.rollout_batch=24

Prints, per process, the updates it finished, its exit status and the first stuck-collective line; exits 1
if any process got stuck. Not part of the test suite (minutes, and a failure is a matter of chance): see
docs/scale.md, "Collectives on fake CPU devices".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_RUN = """
import sys
from dora_jax.config import load_config
from dora_jax.run import Runner
steps, out = int(sys.argv[1]), sys.argv[2]
cfg = load_config("tiny_llama", [f"dora.steps={steps}", "dora.mode=sync", "dora.train_batch=8",
    "dora.rollout_batch=16", "train.max_staleness=0", "train.group_size=4", "rollout.slots=8",
    "rollout.max_new_tokens=24", "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=24",
    "task.eval_size=4", "train.length_buckets=[64]", "train.max_response_tokens=24", "run.checkpoint_every=0",
    *sys.argv[3:]])
Runner(cfg, out, progress=False).run()
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--unsafe", action="store_true", help="leave XLA's concurrency-optimized scheduler on")
    p.add_argument("overrides", nargs="*", help="key=value config overrides of the tiny sync run")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dora_jax.xla_flags import SAFE_COLLECTIVES, cpu_device_flags

    watch = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5 --xla_cpu_collective_call_terminate_timeout_seconds=15"
    flags = cpu_device_flags(8, watch)
    if args.unsafe:
        flags = " ".join(f for f in flags.split() if f != SAFE_COLLECTIVES)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    with tempfile.TemporaryDirectory(prefix="dora-jax-stress-") as tmp:
        procs, t0 = [], time.perf_counter()
        for i in range(args.processes):
            log = open(os.path.join(tmp, f"{i}.log"), "w+")
            procs.append((subprocess.Popen([sys.executable, "-c", _RUN, str(args.steps), os.path.join(tmp, f"run{i}"),
                                            *args.overrides],
                                           env=env, stdout=log, stderr=subprocess.STDOUT), log))
        rows = []
        for i, (proc, log) in enumerate(procs):
            rc = proc.wait()
            log.seek(0)
            lines = log.read().splitlines()
            stuck = next((line.strip() for line in lines if "may be stuck" in line), "")
            metrics = os.path.join(tmp, f"run{i}", "metrics.jsonl")
            done = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
            rows.append({"process": i, "updates": done, "exit": rc, "stuck": stuck[:300],
                         **({"last_lines": lines[-8:]} if rc else {})})
        wall = time.perf_counter() - t0
    print(json.dumps({"XLA_FLAGS": flags, "steps": args.steps, "overrides": args.overrides, "wall_s": round(wall, 1), "processes": rows}, indent=1))
    return 1 if any(r["stuck"] or r["exit"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
