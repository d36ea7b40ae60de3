"""TensorStore's thread pool under the run's checkpoint and snapshot writes stays within the limits the project sets
(:data:`dora_jax.run.checkpoint.TENSORSTORE_THREADS`).

TensorStore (0.1.86) has one pool of worker threads per process, shared by every context; a context's
``data_copy_concurrency`` and ``file_io_concurrency`` bound only its own tasks, and Orbax makes a new context for
every save (file I/O limit 128). Back-to-back and overlapping saves then grow the pool with their timing (10
workers for the writes below). The writes run in a fresh process: the pool is process-wide and keeps idle threads
20 s."""

import json
import os
import subprocess
import sys

from dora_jax.run.checkpoint import TENSORSTORE_THREADS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every step: three version snapshots written in the background while a checkpoint is written, then a restore.
WRITES = r"""
import json, os, sys, threading, time
import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils
from dora_jax.run import checkpoint

root, limited = sys.argv[1], sys.argv[2] == "limited"
if not limited:
    checkpoint.limit_tensorstore_threads = lambda: None
store = checkpoint.RunCheckpoints(os.path.join(root, "checkpoints"), fingerprint="x", keep_last=2)
made = []  # every TensorStore context Orbax makes for these writes
make = tensorstore_utils.get_ts_context
def recording(**kw):
    made.append(make(**kw))
    return made[-1]
recording.shared = getattr(make, "shared", None)
tensorstore_utils.get_ts_context = recording

def ts_pool_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("ts_pool")
        except OSError:  # ended meanwhile
            pass
    return n

peak, done = [0], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], ts_pool_threads())
        time.sleep(0.0005)
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
state = {f"w{i}": jnp.full((64, 1024), float(i)) for i in range(24)}
for step in range(1, 11):
    snaps = [ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler()) for _ in range(3)]
    for j, snap in enumerate(snaps):
        snap.save(os.path.join(root, "versions", f"v_{step:08d}_{j}"), args=ocp.args.Composite(
            params=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"version": step})))
    store.save(step, state, {"step": step})
    for snap in snaps:
        snap.wait_until_finished()
        snap.close()
store.restore_latest(state)
done.set()
watcher.join()
metrics = {m["name"].rsplit("/", 1)[1]: m["values"][0]
           for m in ts.experimental_collect_matching_metrics("/tensorstore/thread_pool/")}
print(json.dumps({
    "workers_started": metrics["started"]["value"], "ts_pool_threads_peak": peak[0],
    "contexts": len(made),
    "own_limits": sum(any(k in c.spec.to_json() for k in checkpoint.TENSORSTORE_THREADS) for c in made),
    "shared_parent": sum(c.parent is recording.shared for c in made) if recording.shared is not None else 0}))
"""


def writes(tmp_path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path / mode), mode], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkpoint_and_snapshot_writes_start_no_more_tensorstore_threads_than_the_run_allows(tmp_path):
    limit = sum(TENSORSTORE_THREADS.values())
    got = writes(tmp_path, "limited")
    # Every context Orbax made takes both limits from the one shared context.
    assert got["contexts"] > 30 and got["shared_parent"] == got["contexts"] and got["own_limits"] == 0, got
    # Workers TensorStore started in the whole process (its own count, names aside), and threads named as its
    # pool's: the workers, and at most two threads named after the worker that started them (TensorStore's
    # overseer, whose 16-character name Linux refuses, and riegeli's background cleaner, which names none).
    # TensorStore starts a worker whenever a task has waited 5 ms with no idle worker, so on a machine whose cores
    # are all busy (the suite's parallel workers) a worker waiting for a core can count as busy and one or two
    # more start: 6 in quiet runs, up to 8 with two CPU-bound processes beside it, against 10-12 without limits.
    busy_cores = 2
    assert got["workers_started"] <= limit + busy_cores, got
    assert got["ts_pool_threads_peak"] <= limit + busy_cores + 2, got


def test_without_the_limit_the_same_writes_grow_the_pool_past_it(tmp_path):
    """What the test above would see if the run set no limit: it would fail."""
    got = writes(tmp_path, "unlimited")
    assert got["shared_parent"] == 0 and got["own_limits"] == got["contexts"], got
    # The limited test's first assertion fails here whatever the timing; the pool, left to Orbax's per-save
    # contexts, passes the run's limit too (10-12 workers on a quiet machine, 8 with the suite's workers beside it).
    assert got["workers_started"] > sum(TENSORSTORE_THREADS.values()), got
