"""Multi-host runtime: cluster detection from the environment, data shards, and a real two-process run of
``jax.distributed`` on localhost (gloo CPU collectives) where process 0's decision reaches process 1."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from dora_jax.distributed import DistributedError, detect, first_slurm_host, process_shard
from dora_jax.xla_flags import cpu_device_flags


def test_single_process_when_nothing_is_set():
    spec = detect({})
    assert (spec.kind, spec.num_processes, spec.process_id) == ("single", 1, 0)


def test_explicit_env():
    spec = detect({"DORA_COORDINATOR": "10.0.0.1:1234", "DORA_NUM_PROCESSES": "4", "DORA_PROCESS_ID": "3",
                   "DORA_LOCAL_DEVICE_IDS": "0,1"})
    assert spec == type(spec)("env", "10.0.0.1:1234", 4, 3, (0, 1))
    # One process is a no-op even with the variables set.
    assert detect({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "1", "DORA_PROCESS_ID": "0"}).kind == "single"


@pytest.mark.parametrize("env, missing", [
    ({"DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"}, "DORA_COORDINATOR"),
    ({"DORA_COORDINATOR": "h:1", "DORA_PROCESS_ID": "0"}, "DORA_NUM_PROCESSES"),
    ({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "2"}, "DORA_PROCESS_ID"),
    ({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "2"}, "DORA_PROCESS_ID=2"),
    ({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "two", "DORA_PROCESS_ID": "0"}, "DORA_NUM_PROCESSES"),
    ({"DORA_COORDINATOR": "nohostport", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"}, "DORA_COORDINATOR"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, "SLURM_PROCID"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, "SLURM_STEP_NODELIST"),
    ({"DORA_CLUSTER": "mpi"}, "DORA_CLUSTER"),
    ({"DORA_COORDINATOR": "h:70000", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"},
     r"DORA_COORDINATOR='h:70000': the port must be in 1..65535"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1",
      "DORA_COORDINATOR_PORT": "abc"}, r"DORA_COORDINATOR_PORT='abc' is not an integer"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1",
      "DORA_COORDINATOR_PORT": "0"}, r"DORA_COORDINATOR_PORT=0 must be >= 1"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n1",
      "DORA_COORDINATOR_PORT": "65536"}, r"DORA_COORDINATOR_PORT=65536 must be <= 65535"),
    ({"DORA_LOCAL_DEVICE_IDS": "0,-1"}, r"DORA_LOCAL_DEVICE_IDS='0,-1' must be comma-separated integers >= 0"),
])
def test_fails_fast_naming_the_variable(env, missing):
    with pytest.raises(DistributedError, match=missing):
        detect(env)


def test_slurm():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[003-004,9]"}
    spec = detect(env)
    assert (spec.kind, spec.coordinator, spec.num_processes, spec.process_id) == ("slurm", "gpu003:8476", 16, 5)
    assert detect({**env, "DORA_CLUSTER": "slurm", "DORA_COORDINATOR_PORT": "99"}).coordinator == "gpu003:99"
    assert first_slurm_host("a1,b2") == "a1" and first_slurm_host("n[7]") == "n7"


def test_tpu_leaves_detection_to_jax():
    spec = detect({"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"})
    assert spec.kind == "tpu" and spec.coordinator is None and spec.num_processes is None


def test_process_shard():
    items = list(range(10))
    assert process_shard(items, index=1, count=2) == [1, 3, 5, 7, 9]
    shards = [process_shard(items, index=i, count=5) for i in range(5)]
    assert sorted(x for s in shards for x in s) == items
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        process_shard(items, index=0, count=3)
    assert process_shard(items, index=2, count=3, even=False) == [2, 5, 8]
    assert process_shard(items) == items  # one process here


_WORKER = textwrap.dedent("""
    import json, sys
    from dora_jax.distributed import broadcast_decision, gather_decisions, initialize, process_shard
    spec = initialize()
    import jax, jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    pid = jax.process_index()
    decision = broadcast_decision({"train": [pid, 10 + pid], "stop": pid == 0})
    shard = process_shard(list(range(8)))
    gathered = gather_decisions({"pid": pid, "text": "x" * (100 * pid)})  # payloads of different lengths
    # A global reduction over every device of both processes.
    total = multihost_utils.process_allgather(np.int32(sum(shard)))
    print("RESULT " + json.dumps({"pid": pid, "count": jax.process_count(), "devices": jax.device_count(),
          "kind": spec.kind, "decision": decision, "gathered": gathered, "shard": shard,
          "total": np.asarray(total).tolist()}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_on_process_zeros_decision(tmp_path):
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_device_flags(2, ""),
               "DORA_COORDINATOR": f"127.0.0.1:{port}", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        results.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    for pid, r in enumerate(results):
        assert (r["pid"], r["count"], r["devices"], r["kind"]) == (pid, 2, 4, "env")
        assert r["decision"] == {"train": [0, 10], "stop": True}  # process 0's, on both
        assert r["gathered"] == [{"pid": 0, "text": ""}, {"pid": 1, "text": "x" * 100}]  # every process's, in order
        assert r["shard"] == list(range(pid, 8, 2))
        assert r["total"] == [12, 16]
