"""Multi-host runtime: the explicit settings read from the environment, data shards, and real two-process runs
of ``jax.distributed`` on localhost (gloo CPU collectives) where process 0's decision reaches process 1: joined
by explicit settings, and by JAX's own detection of a SLURM step."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from dora_jax.distributed import ClusterSpec, DistributedError, detect, process_shard
from dora_jax.xla_flags import cpu_device_flags


def test_nothing_set_leaves_the_cluster_to_jax():
    assert detect({}) == ClusterSpec("auto")


def test_explicit_env():
    spec = detect({"DORA_COORDINATOR": "10.0.0.1:1234", "DORA_NUM_PROCESSES": "4", "DORA_PROCESS_ID": "3",
                   "DORA_LOCAL_DEVICE_IDS": "0,1"})
    assert spec == ClusterSpec("env", "10.0.0.1:1234", 4, 3, (0, 1))
    # One process is a no-op even with the variables set, and DORA_CLUSTER=single forces one.
    assert detect({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "1", "DORA_PROCESS_ID": "0"}).kind == "single"
    assert detect({"DORA_CLUSTER": "single", "SLURM_JOB_ID": "7"}).kind == "single"


def test_partial_settings_and_a_named_method_go_to_jax():
    assert detect({"DORA_COORDINATOR": "gpu003:99"}) == ClusterSpec("auto", "gpu003:99")
    assert detect({"DORA_CLUSTER": "slurm", "DORA_LOCAL_DEVICE_IDS": "0"}) == ClusterSpec(
        "auto", local_device_ids=(0,), method="slurm")


@pytest.mark.parametrize("env, missing", [
    ({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "2"}, "DORA_PROCESS_ID=2"),
    ({"DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "two", "DORA_PROCESS_ID": "0"}, "DORA_NUM_PROCESSES"),
    ({"DORA_NUM_PROCESSES": "0"}, "DORA_NUM_PROCESSES=0 must be >= 1"),
    ({"DORA_PROCESS_ID": "-1"}, "DORA_PROCESS_ID=-1 must be >= 0"),
    ({"DORA_COORDINATOR": "nohostport", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"}, "DORA_COORDINATOR"),
    ({"DORA_CLUSTER": "mpi!"}, "DORA_CLUSTER"),
    ({"DORA_CLUSTER": "slurm", "DORA_COORDINATOR": "h:1", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"},
     "nothing is left to detect"),
    ({"DORA_COORDINATOR": "h:70000", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "0"},
     r"DORA_COORDINATOR='h:70000': the port must be in 1..65535"),
    ({"DORA_LOCAL_DEVICE_IDS": "0,-1"}, r"DORA_LOCAL_DEVICE_IDS='0,-1' must be comma-separated integers >= 0"),
])
def test_fails_fast_naming_the_variable(env, missing):
    with pytest.raises(DistributedError, match=missing):
        detect(env)


_ALONE = textwrap.dedent("""
    import json
    from dora_jax.distributed import initialize
    spec = initialize()
    import jax
    print("RESULT " + json.dumps({"kind": spec.kind, "count": jax.process_count()}))
""")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DORA_", "SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_device_flags(2, ""), **extra}


def _result(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_no_cluster_runs_alone_and_a_partial_one_is_named():
    proc = subprocess.run([sys.executable, "-c", _ALONE], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _result(proc.stdout) == {"kind": "single", "count": 1}
    # A coordinator alone, where JAX finds no cluster to supply the rest: refused, naming what was set.
    proc = subprocess.run([sys.executable, "-c", _ALONE], env=_clean_env(DORA_COORDINATOR="127.0.0.1:1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "DistributedError: DORA_COORDINATOR=127.0.0.1:1: jax.distributed.initialize failed" in proc.stderr


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


@pytest.mark.parametrize("launcher", ["dora_env", "slurm"])
def test_two_processes_agree_on_process_zeros_decision(launcher):
    port = _free_port()
    procs = []
    for pid in range(2):
        if launcher == "dora_env":
            env = _clean_env(DORA_COORDINATOR=f"127.0.0.1:{port}", DORA_NUM_PROCESSES="2", DORA_PROCESS_ID=str(pid))
        else:  # the variables srun sets for a two-task step on one node; JAX's own detection reads them
            env = _clean_env(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                             SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid), JAX_COORDINATOR_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        results.append(_result(out))
    kind = "env" if launcher == "dora_env" else "auto"
    for pid, r in enumerate(results):
        assert (r["pid"], r["count"], r["devices"], r["kind"]) == (pid, 2, 4, kind)
        assert r["decision"] == {"train": [0, 10], "stop": True}  # process 0's, on both
        assert r["gathered"] == [{"pid": 0, "text": ""}, {"pid": 1, "text": "x" * 100}]  # every process's, in order
        assert r["shard"] == list(range(pid, 8, 2))
        assert r["total"] == [12, 16]
