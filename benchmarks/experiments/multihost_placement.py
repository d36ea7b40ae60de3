"""Split against shared placement under several processes: the trainer's idle fraction on one workload.

PROCESSES processes on this host (``jax.distributed``, gloo), each with DEVICES fake CPU devices, run the same
``dora`` K = 2 workload (tiny Llama, ``longtail`` prompts, a reward that varies within groups) under both
placements, alternated ROUNDS times:

* ``shared``: the trainer's mesh spans all PROCESSES x DEVICES devices, each process decodes on all of its own, and
  the two take turns;
* ``split``: each process gives DEVICES / 2 of its devices to the trainer (whose mesh spans every process)
  and decodes on the others while the trainer trains; a new version moves by one program over both roles'
  devices.

Run from the repository root: ``.venv/bin/python -m benchmarks.experiments.multihost_placement [ROUNDS [STEPS
[DEVICES [PROCESSES]]]]`` (default 2 rounds, 8 updates, 2 devices per process, 2 processes). Prints and writes
``benchmarks/results/multihost_placement_cpu_DATE[_pN].json`` (``_pN`` for N processes other than 2): per
placement and round, process 0's ``trainer_idle_fraction`` (1 - train time / wall time), wall time, train time,
samples/s and the time spent moving versions (``sync_s``); the command, the machine and the date. The fake devices share this host's cores,
so the figures show the schedule (what the trainer waits for), not an accelerator's speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

from benchmarks.record import machine, write_json
from dora_jax.xla_flags import cpu_device_flags

TBS = 8


def workload(steps: int, devices: int, processes: int) -> tuple[list[str], dict[str, list[str]]]:
    """The run's settings, and each placement's."""
    common = ["dora.mode=dora", f"dora.steps={steps}", f"dora.train_batch={TBS}", f"dora.rollout_batch={3 * TBS}",
              "train.max_staleness=2", "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8",
              "rollout.max_new_tokens=48", "rollout.max_prompt_len=32", "task.name=longtail",
              "task.longtail_max_len=48", "task.eval_size=0", "train.length_buckets=[96]",
              "train.max_response_tokens=48", "run.checkpoint_every=0", f"target.num_devices={processes * devices}",
              "task.reward=benchmarks.experiments.multihost_placement:digit_share"]
    placements = {
        "shared": ["mesh.data=1", f"mesh.fsdp={processes * devices}", "mesh.tensor=1", f"roles.rollout_data={devices}",
                   "roles.rollout_tensor=1"],
        "split": ["roles.placement=split", f"roles.trainer_devices={processes * devices // 2}", "mesh.data=1",
                  f"mesh.fsdp={processes * devices // 2}", "mesh.tensor=1", f"roles.rollout_data={devices // 2}",
                  "roles.rollout_tensor=1"],
    }
    return common, placements


_WORKER = textwrap.dedent("""
    import json, sys
    from dora_jax.distributed import initialize
    initialize()
    from dora_jax.config import load_config
    from dora_jax.run import Runner
    summary = Runner(load_config("tiny_llama", json.loads(sys.argv[2])), sys.argv[1], progress=False).run()
    with open(sys.argv[3], "w") as f:
        json.dump(summary, f)
""")


def digit_share(prompt: str, response: str, answer: str) -> float:
    """A reward that differs between a group's responses (the tiny model's answers are rarely right)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(overrides: list[str], devices: int, processes: int) -> dict:
    """One run of ``processes`` processes; process 0's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        port, procs = _free_port(), []
        for pid in range(processes):
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_device_flags(devices),
                   "DORA_COORDINATOR": f"127.0.0.1:{port}", "DORA_NUM_PROCESSES": str(processes),
                   "DORA_PROCESS_ID": str(pid)}
            procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, os.path.join(tmp, "run"),
                                           json.dumps(overrides), os.path.join(tmp, f"s{pid}.json")],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate()[0] for p in procs]
        for pid, p in enumerate(procs):
            if p.returncode:
                raise RuntimeError(f"process {pid} failed:\n{outs[pid][-4000:]}")
        with open(os.path.join(tmp, "s0.json")) as f:
            return json.load(f)


def main() -> None:
    rounds, steps, devices, processes = (int(a) for a in (sys.argv[1:] + ["2", "8", "2", "2"][len(sys.argv) - 1:])[:4])
    common, placements = workload(steps, devices, processes)
    results: dict[str, list[dict]] = {name: [] for name in placements}
    for r in range(rounds):
        for name, placement in placements.items():
            t0 = time.perf_counter()
            s = run(common + placement, devices, processes)
            row = {k: s[k] for k in ("trainer_idle_fraction", "wall_s", "train_s", "samples_per_s", "sync_s",
                                     "samples", "max_resident_versions")}
            results[name].append(row)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in row.items())
                  + f" ({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    out = {"command": " ".join([".venv/bin/python -m benchmarks.experiments.multihost_placement"] + sys.argv[1:]),
           "processes": processes, "devices_per_process": devices, "workload": common, "placements": placements,
           "results": results, "machine": machine()}
    suffix = "" if processes == 2 else f"_p{processes}"
    path = os.path.join("benchmarks", "results", f"multihost_placement_cpu_{time.strftime('%Y-%m-%d')}{suffix}.json")
    print(write_json(out, path))


if __name__ == "__main__":
    main()
