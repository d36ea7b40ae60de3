"""``dora-jax bench soak``: a long run watched for leaks.

The tiny Llama on the ``longtail`` task under ``dora.mode=dora`` at K = 2, on one device, with what a real job
has: a checkpoint every 5 updates under the default retention, a held-out evaluation every 10, and one preemption
at a seeded random update in the middle third. Training runs as ``dora-jax train`` in a child process, started
twice with the same command as a user's job would be: the first is stopped by SIGTERM (it writes a checkpoint
and exits 0), the second resumes from that checkpoint and runs to the end. The rollout programs are compiled
before the first update (``rollout.warmup=true``, the default except on CPU), so any later compile is one too many.

The child samples itself (:func:`child_main`): a thread watches the run's ``metrics.jsonl`` and, after every
``every``-th update but the last (after its checkpoint, with no snapshot being written), records the process's
resident memory, live device arrays, compiled programs and persistent-cache loads since the process started
(:func:`dora_jax.compiles.compile_count`), open files, threads and child processes, and the run directory's
size. Live arrays and compile counts are only readable inside the process, hence the thread rather than the
parent reading ``/proc/<pid>``.

Targets (:func:`check_targets`), with windows scaled to the run's length N (100 and 200 at N = 300):
* resident memory grows by at most 2% of its value at update N/3 over the last 2N/3 updates; the growth is the
  slope of a line fitted to the samples in that window (one intercept per process: the resumed process starts
  from its own baseline) times the window's length, each process's first N/6 updates left out (its start-up:
  the resumed process compiles and warms up again, and gives that memory back later, as the first one does);
* compiled programs and persistent-cache loads are constant within each process after its first sample: the
  resumed process compiles and loads its programs again once, before its first sample, and is compared with its
  own first sample; live device arrays, open files, threads and child processes (each the least of a few
  readings in 0.2 s) are flat within each process: the median of the later half of its samples is within the
  earlier half's range. TensorStore's worker pool (``/tensorstore/thread_pool/active``, its own count) is left out
  of the threads: it starts threads on demand and lets them go after 20 s idle, so its size depends on how the
  run's writes fall; it is held instead to never exceed the limit the run sets
  (:data:`dora_jax.run.checkpoint.TENSORSTORE_THREADS`, tested in ``tests/test_tensorstore_threads.py``);
* checkpoints and version snapshots take at most what retention allows
  (:meth:`dora_jax.run.resume.RunStore.disk_estimate`, with the largest checkpoint and snapshot written as its
  units); the logs (``metrics.jsonl``, ``samples.jsonl``, TensorBoard's events) grow with the run by design and
  are reported apart, in bytes per update.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks.record import machine, source_version

CONFIG = "tiny_llama"
K = 2
CHECKPOINT_EVERY = 5
EVAL_EVERY = 10
SAMPLE_EVERY = 10
RSS_GROWTH = 0.02  # of the resident memory at update N/3
SETTINGS = ["dora.mode=dora", f"train.max_staleness={K}", "dora.train_batch=8", f"dora.rollout_batch={(K + 1) * 8}",
            "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8", "rollout.max_new_tokens=24",
            "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=24", "task.eval_size=8",
            f"task.eval_every={EVAL_EVERY}", "train.length_buckets=[64]", "train.max_response_tokens=24",
            "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", f"run.checkpoint_every={CHECKPOINT_EVERY}",
            "rollout.warmup=true"]
FLAT = ("live_arrays", "compiles", "cache_loads", "open_files", "threads", "children")
TS_POOL = "tensorstore_threads"  # TensorStore's pool workers, out of "threads"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the child: dora-jax train, sampling itself ------------------------------------------------------------------

def process_counts(pid: str = "self") -> dict[str, int]:
    """A process's resident bytes, open files, threads and child processes, from ``/proc``."""
    base = f"/proc/{pid}"
    with open(f"{base}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    tasks = os.listdir(f"{base}/task")
    children = set()
    for t in tasks:
        try:
            with open(f"{base}/task/{t}/children") as f:
                children.update(f.read().split())
        except OSError:  # the thread ended meanwhile
            pass
    # The listing's own descriptor is open while /proc/self/fd is read: counted once, every time alike.
    return {"rss_bytes": rss, "open_files": len(os.listdir(f"{base}/fd")), "threads": len(tasks),
            "children": len(children)}


def tensorstore_pool_threads() -> int:
    """Worker threads of this process's TensorStore pool, by TensorStore's own count (the threads' names do not
    tell: a thread TensorStore or riegeli starts without a name it can set takes its starter's, a worker's too)."""
    if "tensorstore" not in sys.modules:
        return 0
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/thread_pool/active")
    return int(found[0]["values"][0]["value"]) if found and found[0]["values"] else 0


class Sampler(threading.Thread):
    """Samples this process after every ``every``-th update it writes to ``RUN_DIR/metrics.jsonl`` before the
    last of ``updates``, appending one JSON line per sample to ``out``. Rows already in the file when it starts
    are an earlier process's."""

    def __init__(self, run_dir: str, out: str, every: int, checkpoint_every: int, updates: int, keep: int):
        super().__init__(name="soak-sampler", daemon=True)
        from dora_jax.run.checkpoint import RunCheckpoints

        self.run_dir, self.out, self.every, self.checkpoint_every = run_dir, out, every, checkpoint_every
        self.updates, self.keep = updates, keep
        self.metrics = os.path.join(run_dir, "metrics.jsonl")
        self.checkpoints = RunCheckpoints(os.path.join(run_dir, "checkpoints"), fingerprint="")
        self.offset = os.path.getsize(self.metrics) if os.path.exists(self.metrics) else 0
        steps = self.checkpoints.steps()
        self._write({"start": True, "pid": os.getpid(), "resumes_from": steps[-1] if steps else None,
                     **process_counts()})

    def _write(self, rec: dict[str, Any]) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _rows(self) -> list[dict[str, Any]]:
        """Update rows appended since the last call (whole lines only)."""
        try:
            size = os.path.getsize(self.metrics)
        except OSError:
            return []
        # A resumed run cuts the file back to its checkpoint's lines first: what follows is new.
        self.offset = min(self.offset, size)
        with open(self.metrics, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return [r for r in rows if "eval" not in r]

    def _settled(self, step: int) -> bool:
        """Update ``step``'s checkpoint (when one is due) is complete, retention has run and no snapshot is being
        written."""
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            steps = self.checkpoints.steps()
            if step not in steps or len(steps) > self.keep or any(
                    p.startswith(".tmp-") for p in os.listdir(self.checkpoints.directory)):
                return False
        versions = os.path.join(self.run_dir, "versions")
        return not (os.path.isdir(versions) and any("tmp" in p for p in os.listdir(versions)))

    def _wait_settled(self, step: int) -> None:
        """Samples are taken at one point of an update's cycle, so that what is in flight is alike in each: after
        its checkpoint and retention, with no snapshot being written (open files and threads of a write would
        count otherwise). At most 5 minutes."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not self._settled(step):
            time.sleep(0.02)

    def sample(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        import jax

        from dora_jax.compiles import compile_count
        from dora_jax.run.resume import dir_bytes

        # Counts are each the least of a few readings 0.04 s apart: what the process holds, not a write or a
        # decode step passing through (a leak raises the least reading too).
        reads = []
        for _ in range(5):
            reads.append({**process_counts(), "live_arrays": len(jax.live_arrays())})
            time.sleep(0.04)
        counts = {k: min(r[k] for r in reads) for k in reads[0]}
        # Read once a sample (each read leaks its result in tensorstore 0.1.86): the pool's workers, at a settled
        # point, live 20 s past their last task.
        counts[TS_POOL] = tensorstore_pool_threads()
        counts["threads"] -= counts[TS_POOL]
        counts["rss_bytes"] = reads[-1]["rss_bytes"]
        # Where memory growth would be: Python's own heap (pymalloc's blocks) or outside it (XLA, the C heap).
        counts["python_blocks"] = sys.getallocatedblocks()
        c = compile_count()
        ckpts = os.path.join(self.run_dir, "checkpoints")
        versions = os.path.join(self.run_dir, "versions")
        held = {name: [p for p in os.listdir(d) if not p.startswith(".")] if os.path.isdir(d) else []
                for name, d in (("checkpoint", ckpts), ("snapshot", versions))}
        units = {f"{name}_max_bytes": max((dir_bytes(os.path.join(d, p)) for p in held[name]), default=0)
                 for name, d in (("checkpoint", ckpts), ("snapshot", versions))}
        units.update(checkpoints=len(held["checkpoint"]), snapshots=len(held["snapshot"]))
        return {"update": step, "pid": os.getpid(), "time": time.time(), **counts,
                "compiles": c.compiles, "cache_loads": c.cache_loads,
                "resident_versions": row.get("resident_versions"), "run_dir_bytes": dir_bytes(self.run_dir),
                "store_bytes": dir_bytes(ckpts) + dir_bytes(versions), **units}

    def run(self) -> None:
        while True:
            for row in self._rows():
                step = int(row["step"])
                # Not the last update: the run is winding down then (its final evaluation, closing its pools).
                if step % self.every == 0 and step < self.updates:
                    self._wait_settled(step)
                    self._write(self.sample(step, row))
            time.sleep(0.02)


def child_main(argv: list[str]) -> int:
    """``python -m benchmarks.soak OUT EVERY dora-jax-arguments...``: runs ``dora-jax`` with those arguments
    (``train --run-dir RUN ...``), sampling itself into OUT every EVERY updates."""
    out, every, args = argv[0], int(argv[1]), argv[2:]
    from dora_jax import cli
    from dora_jax.config import load_config

    run_dir = args[args.index("--run-dir") + 1]
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    cfg = load_config(args[args.index("--config") + 1], overrides)
    os.makedirs(run_dir, exist_ok=True)
    from dora_jax.compiles import compile_count

    compile_count()  # counting from here, warm-up included (the listeners need no backend yet)
    Sampler(run_dir, out, every, cfg.run.checkpoint_every, cfg.dora.steps, cfg.run.keep_checkpoints).start()
    return cli.main(args)


# -- the parent: two attempts, one preempted --------------------------------------------------------------------

def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_step(metrics: str) -> int:
    """The newest update in ``metrics``, from the file's tail (read often: not the whole file each time)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, os.path.getsize(metrics) - 65536))
            tail = f.read()
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:  # cut by the seek, or still being written
            continue
        if isinstance(row, dict) and "eval" not in row and "step" in row:
            return int(row["step"])
    return 0


def _attempt(cmd: list[str], log_path: str, metrics: str, stop_at: int | None, timeout_s: float) -> dict[str, Any]:
    """Runs ``cmd`` to its end, or sends it SIGTERM once ``metrics`` holds update ``stop_at``."""
    t0 = time.perf_counter()
    sent = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_child_env())
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"bench soak: {' '.join(cmd)} ran past {timeout_s:.0f} s (log: {log_path})")
                if stop_at is not None and sent is None and _last_step(metrics) >= stop_at:
                    sent = _last_step(metrics)
                    proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"bench soak: the run exited {proc.returncode} (log: {log_path}):\n{tail}")
    return {"pid": proc.pid, "exit_code": proc.returncode, "sigterm_after_update": sent,
            "wall_s": time.perf_counter() - t0, "log": log_path}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def preemption_update(updates: int, seed: int) -> int:
    """The update after which the run is preempted: seeded, uniform over the middle third of the run."""
    lo, hi = max(1, updates // 3), max(1, (2 * updates) // 3)
    return random.Random(f"soak/{seed}").randint(lo, min(hi, updates - 1))


def bench_soak(updates: int = 300, every: int = SAMPLE_EVERY, preempt_at: int | None = None, seed: int = 0,
               overrides: tuple[str, ...] = (), config: str = CONFIG, out_dir: str | None = None,
               timeout_s: float = 7200.0) -> dict[str, Any]:
    """Trains ``updates`` updates in two processes, the first preempted by SIGTERM, and checks for leaks.

    Args:
      updates: the run's length N (``dora.steps``).
      every: updates between samples.
      preempt_at: the update after which SIGTERM is sent (default: :func:`preemption_update` of ``seed``).
      seed: draws the preemption update.
      overrides: ``key=value`` settings after :data:`SETTINGS` (e.g. ``run.checkpoint_every=3``).
      config: the model's config.
      out_dir: where the run directory, the samples and the logs go (default: a new temporary directory).
      timeout_s: the most either process may run.

    Returns:
      The settings, both attempts, every sample, the per-update time, the disk estimate and the targets.
    """
    from dora_jax.config import load_config
    from dora_jax.run.resume import RunStore

    if preempt_at is None:
        preempt_at = preemption_update(updates, seed)
    if not 1 <= preempt_at < updates:
        raise ValueError(f"bench soak: --preempt-at {preempt_at} must be in [1, {updates - 1}]")
    out_dir = out_dir or tempfile.mkdtemp(prefix="dora_soak_")
    run_dir, samples_path = os.path.join(out_dir, "run"), os.path.join(out_dir, "samples.jsonl")
    settings = [f"dora.steps={updates}", *SETTINGS, *overrides]
    cfg = load_config(config, settings)
    train = ["train", "--config", config, "--run-dir", run_dir, "--no-plot", *settings]
    cmd = [sys.executable, "-m", "benchmarks.soak", samples_path, str(every), *train]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    attempts = []
    for i, stop_at in enumerate((preempt_at, None)):
        a = _attempt(cmd, os.path.join(out_dir, f"attempt{i + 1}.log"), metrics, stop_at, timeout_s)
        a["last_update"] = _last_step(metrics)
        attempts.append(a)
        print(f"attempt {i + 1}: exit {a['exit_code']} after update {a['last_update']} in {a['wall_s']:.0f} s",
              flush=True)
    recs = read_jsonl(samples_path)
    starts = [r for r in recs if r.get("start")]
    for a, s in zip(attempts, starts):
        a["resumed_from"] = s["resumes_from"]
        a["start_rss_bytes"] = s["rss_bytes"]
    pids = [s["pid"] for s in starts]
    samples = [dict(r, attempt=pids.index(r["pid"]) + 1) for r in recs if not r.get("start")]
    rows = [r for r in read_jsonl(metrics) if "eval" not in r]
    for a, (lo, hi) in zip(attempts, ((0, attempts[0]["last_update"]), (attempts[0]["last_update"], updates))):
        mine = [r for r in rows if lo < r["step"] <= hi]
        a["first_update"] = mine[0]["step"] if mine else None
    step_s = [r["step_s"] for r in rows]
    first, second = attempts
    preemption = {"sigterm_after_update": first["sigterm_after_update"], "stopped_at": first["last_update"],
                  "resumed_from": second["resumed_from"], "resumed_first_update": second["first_update"],
                  "every_update_once": [r["step"] for r in rows] == list(range(1, updates + 1))}
    preemption["ok"] = bool(first["sigterm_after_update"] is not None and first["last_update"] < updates
                            and second["resumed_from"] == first["last_update"]
                            and second["first_update"] == first["last_update"] + 1
                            and preemption["every_update_once"])
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    units = {k: max((s[k] for s in samples), default=0) for k in ("checkpoint_max_bytes", "snapshot_max_bytes")}
    bound = RunStore(run_dir, cfg).disk_estimate(units["checkpoint_max_bytes"], units["snapshot_max_bytes"], K)
    logs = _logs_bytes(run_dir)
    targets = check_targets(samples, updates, bound, {1: 0, 2: second["resumed_from"] or first["last_update"]})
    print(f"preempted after update {first['last_update']}, resumed from checkpoint {second['resumed_from']} "
          f"({'ok' if preemption['ok'] else 'NOT as expected'}); {np.median(step_s):.3f} s per update (median)\n"
          + describe(targets), flush=True)
    return {"machine": machine(), "source": source_version(), "config": config, "updates": updates,
            "sample_every": every, "seed": seed, "preempt_at": preempt_at, "settings": settings,
            "train_command": "dora-jax " + " ".join(train), "attempts": attempts, "preemption": preemption,
            "seconds_per_update": {"median": float(np.median(step_s)), "mean": float(np.mean(step_s)),
                                   "loop_wall_s": float(sum(step_s))},
            "wall_s": sum(a["wall_s"] for a in attempts),
            "disk": {"estimate_bytes": bound, "units": units, "keep_checkpoints": cfg.run.keep_checkpoints,
                     "logs_bytes": logs, "logs_bytes_per_update": logs / updates,
                     "run_dir_bytes_end": summary.get("run_dir_bytes")},
            "accuracy": [summary.get("accuracy_before"), summary.get("accuracy_after")],
            "samples": samples, "targets": targets,
            "run_dir": run_dir, "out_dir": out_dir}


def _logs_bytes(run_dir: str) -> int:
    from dora_jax.run.resume import dir_bytes

    return sum(dir_bytes(os.path.join(run_dir, n)) if os.path.isdir(os.path.join(run_dir, n))
               else os.path.getsize(os.path.join(run_dir, n))
               for n in os.listdir(run_dir) if n not in ("checkpoints", "versions"))


# -- the targets -------------------------------------------------------------------------------------------------

def rss_window(updates: int) -> tuple[int, int]:
    """The update whose resident memory is the reference (N/3: 100 at N = 300) and the window's end (N)."""
    return max(1, round(updates / 3)), updates


def settling(updates: int) -> int:
    """Updates a process is given to settle after it starts (N/6: 50 at N = 300): its memory is left out of the
    fit until then. A process here gives back the memory of its start-up some 25-30 updates in."""
    return max(1, round(updates / 6))


def pooled_slope(x: list[float], y: list[float], group: list[int]) -> float:
    """The slope of y against x fitted with one intercept per group (0 when x does not vary within any)."""
    x_, y_, g = np.asarray(x, float), np.asarray(y, float), np.asarray(group)
    num = den = 0.0
    for k in np.unique(g):
        xs, ys = x_[g == k], y_[g == k]
        num += float(((xs - xs.mean()) * (ys - ys.mean())).sum())
        den += float(((xs - xs.mean()) ** 2).sum())
    return num / den if den else 0.0


def check_targets(samples: list[dict[str, Any]], updates: int, disk_bound: int,
                  starts: dict[int, int]) -> dict[str, Any]:
    """Whether each target of the module docstring is met by ``samples`` (each: ``update``, ``attempt`` and the
    figures :class:`Sampler` records) of a run of ``updates`` updates.

    Args:
      starts: each attempt's first update less one (0 for a fresh start; a resumed one's checkpoint).

    Returns:
      Per target: the figures it compares and ``met``; ``all_met``.
    """
    out: dict[str, Any] = {}
    ref_update, end = rss_window(updates)
    settle = settling(updates)
    ref = min(samples, key=lambda s: (abs(s["update"] - ref_update), s["attempt"]), default=None)
    firsts = {}
    for s in sorted(samples, key=lambda s: s["update"]):
        firsts.setdefault(s["attempt"], s)
    window = [s for s in samples if s["update"] >= max(ref_update, starts[s["attempt"]] + settle)]
    slope = pooled_slope([s["update"] for s in window], [s["rss_bytes"] for s in window],
                         [s["attempt"] for s in window])
    growth = slope * (end - ref_update)
    ref_rss = ref["rss_bytes"] if ref else 0
    each = {}
    for a in sorted(firsts):
        mine = [s for s in window if s["attempt"] == a]
        xs = [s["update"] for s in mine]
        each[str(a)] = {"from_update": max(ref_update, starts[a] + settle), "samples": len(mine),
                        "slope_bytes_per_update": pooled_slope(xs, [s["rss_bytes"] for s in mine], [a] * len(mine))}
        if all("python_blocks" in s for s in mine):  # not a target: where growth would be
            each[str(a)]["python_blocks_per_update"] = pooled_slope(xs, [s["python_blocks"] for s in mine],
                                                                    [a] * len(mine))
    out["rss"] = {"reference_update": ref["update"] if ref else None, "reference_bytes": ref_rss,
                  "window": [ref_update, end], "settling_updates": settle, "per_attempt": each,
                  "samples_in_fit": len(window), "slope_bytes_per_update": slope,
                  "growth_bytes": growth, "growth_fraction": growth / ref_rss if ref_rss else None,
                  "limit_fraction": RSS_GROWTH,
                  "met": bool(window) and bool(ref_rss) and growth <= RSS_GROWTH * ref_rss}
    for key in FLAT:
        per = {}
        for a, first in sorted(firsts.items()):
            mine = [s[key] for s in samples if s["attempt"] == a]
            half = (len(mine) + 1) // 2  # the first sample always in the earlier half
            later = mine[half:] or mine[-1:]
            per[str(a)] = {"first": first[key], "last": mine[-1], "max": max(mine), "max_earlier": max(mine[:half]),
                           "max_later": max(later), "median_later": float(np.median(later)), "samples": len(mine)}
        # Compiles are counted exactly: any after the first sample is a program compiled late. The other counts
        # move with what is in flight when a sample is taken (an evaluation, a snapshot written in the
        # background): flat means the later half of a process's samples stays, in its median, within the range
        # of the earlier half, which a bounded fluctuation passes and growth beyond that range does not.
        exact = key in ("compiles", "cache_loads")
        out[key] = {"per_attempt": per, "rule": "constant" if exact else "later half's median <= earlier half's max",
                    "growth": max((p["max"] - p["first"] for p in per.values()), default=0),
                    "met": bool(per) and all(p["max"] == p["first"] if exact else p["median_later"] <= p["max_earlier"]
                                             for p in per.values())}
    from dora_jax.run.checkpoint import TENSORSTORE_THREADS

    pool = [s[TS_POOL] for s in samples]
    out["tensorstore_pool"] = {"max": max(pool, default=0), "first": pool[0] if pool else None,
                               "last": pool[-1] if pool else None, "limit": sum(TENSORSTORE_THREADS.values()),
                               "met": bool(pool) and max(pool) <= sum(TENSORSTORE_THREADS.values())}
    peak = max((s["store_bytes"] for s in samples), default=0)
    out["disk"] = {"peak_store_bytes": peak, "estimate_bytes": disk_bound, "met": bool(samples) and peak <= disk_bound}
    out["all_met"] = all(v["met"] for v in out.values())
    return out


def describe(targets: dict[str, Any]) -> str:
    """The targets in a few lines, each with its figures and whether it is met."""
    def met(t: dict[str, Any]) -> str:
        return "met" if t["met"] else "NOT met"

    r = targets["rss"]
    frac = "n/a" if r["growth_fraction"] is None else f"{r['growth_fraction']:+.2%}"
    lines = [f"RSS growth over updates {r['window'][0]}-{r['window'][1]} (each process's first "
             f"{r['settling_updates']} updates left out): {r['growth_bytes'] / 2**20:+.1f} MiB = "
             f"{frac} of {r['reference_bytes'] / 2**20:.0f} MiB at update {r['reference_update']} "
             f"(limit {r['limit_fraction']:.0%}): {met(r)}; per process, bytes an update: "
             + ", ".join(f"{p['slope_bytes_per_update']:.0f}"
                         + (f" (Python heap blocks {p['python_blocks_per_update']:+.0f})"
                            if "python_blocks_per_update" in p else "") for p in r["per_attempt"].values())]
    for key in FLAT:
        t = targets[key]
        per = "; ".join(f"process {a}: first {p['first']}, earlier half's max {p['max_earlier']}, later half's "
                        f"median {p['median_later']:g} and max {p['max_later']}" for a, p in t["per_attempt"].items())
        lines.append(f"{key.replace('_', ' ')} flat, {t['rule']} ({per}): {met(t)}")
    t = targets["tensorstore_pool"]
    lines.append(f"TensorStore's pool (not in threads) at most {t['max']} workers (first {t['first']}, last "
                 f"{t['last']}), the run's limit {t['limit']}: {met(t)}")
    d = targets["disk"]
    lines.append(f"checkpoints + snapshots at most {d['peak_store_bytes'] / 2**20:.1f} MiB, retention estimate "
                 f"{d['estimate_bytes'] / 2**20:.1f} MiB: {met(d)}")
    return "\n".join(lines)


def plot_soak(result: dict[str, Any], path: str) -> str:
    """Four panels against the update: resident memory; live arrays and compiles; open files, threads and child
    processes; the run directory and its checkpoints and snapshots against the retention estimate. Each process
    is drawn apart, the preemption marked.

    Args:
      result: what :func:`bench_soak` returned.
      path: the PNG to write.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax, bx), (cx, dx)) = plt.subplots(2, 2, figsize=(14, 9))
    samples, t = result["samples"], result["targets"]
    attempts = sorted({s["attempt"] for s in samples})

    def series(a: int, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        mine = [s for s in samples if s["attempt"] == a]
        return [s["update"] for s in mine], [s[key] / scale for s in mine]

    cx2 = bx.twinx()
    for a in attempts:
        tag, color = f"process {a}", f"C{a - 1}"
        ax.plot(*series(a, "rss_bytes", 2**20), marker=".", color=color, label=tag)
        bx.plot(*series(a, "live_arrays"), marker=".", color=color, label=f"live device arrays, {tag}")
        cx2.plot(*series(a, "compiles"), marker="x", linestyle="--", color=color, label=f"compiled programs, {tag}")
        for key, m, ls in (("open_files", ".", "-"), ("threads", "x", "--"), ("children", "^", ":")):
            cx.plot(*series(a, key), marker=m, linestyle=ls, color=color, label=f"{key.replace('_', ' ')}, {tag}")
        if any(TS_POOL in s for s in samples):  # results from before the pool was counted apart have none
            cx.plot(*series(a, TS_POOL), marker="+", linestyle="-.", color=color, label=f"TensorStore pool, {tag}")
        dx.plot(*series(a, "run_dir_bytes", 2**20), marker=".", color=color, label=f"run directory, {tag}")
        dx.plot(*series(a, "store_bytes", 2**20), marker="x", linestyle="--", color=color,
                label=f"checkpoints + snapshots, {tag}")
    dx.axhline(result["disk"]["estimate_bytes"] / 2**20, color="red", linestyle="--", linewidth=1,
               label="retention estimate (checkpoints + snapshots)")
    cx2.set_ylabel("compiled programs since start (dashed)")
    cx2.set_ylim(bottom=0)
    cx2.legend(fontsize=7, loc="lower right")
    r = t["rss"]
    for a, p in r["per_attempt"].items():
        ax.axvline(p["from_update"], color=f"C{int(a) - 1}", linestyle=":", linewidth=1,
                   label=f"process {a}'s samples in the fit from here")
    for x in (ax, bx, cx, dx):
        x.axvline(result["attempts"][0]["last_update"], color="black", linestyle=":", linewidth=1,
                  label="SIGTERM, resumed")
        x.set_xlabel("update")
        x.legend(fontsize=7, loc="lower left" if x is bx else "best")
    growth = "n/a" if r["growth_fraction"] is None else f"{r['growth_fraction']:+.2%}"
    ax.set_title(f"resident memory: growth over the window {growth} (limit {r['limit_fraction']:.0%})", fontsize=10)
    ax.set_ylabel("RSS, MiB")
    bx.set_title("live device arrays and compiled programs (flat within a process)", fontsize=10)
    bx.set_ylabel("live device arrays (solid)")
    cx.set_title("open files, threads, child processes (flat within a process); TensorStore's pool", fontsize=10)
    cx.set_ylabel("count")
    dx.set_title("disk", fontsize=10)
    dx.set_ylabel("MiB")
    fig.suptitle(f"bench soak: {result['updates']} updates, dora K = {K}, checkpoint every {CHECKPOINT_EVERY}, "
                 f"eval every {EVAL_EVERY}, preempted after update {result['attempts'][0]['last_update']} "
                 f"({result['device'] if 'device' in result else result['machine']['backend']}, "
                 f"{result['machine']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
