"""Multi-host runtime: one process per host (or per GPU) under ``jax.distributed``.

Every process runs the same program (multi-controller SPMD). :func:`initialize` connects the processes before
JAX touches a device, reading the cluster from the environment, in this order:

* ``DORA_CLUSTER`` forces one of ``single``, ``tpu``, ``slurm``, ``env`` (default ``auto``: the first that
  applies below).
* ``env``: ``DORA_COORDINATOR`` (``host:port`` of process 0), ``DORA_NUM_PROCESSES``, ``DORA_PROCESS_ID``; set
  by ``launch/multinode_gpu.sh`` and ``launch/local_cpu.sh``. Chosen when any of them is set.
* ``slurm``: ``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID`` and the node list; the coordinator is the
  first node of the step (or ``DORA_COORDINATOR``). Set by ``srun`` in ``launch/slurm_gpu.sbatch``.
* ``tpu``: a Cloud TPU VM (``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID`` or ``TPU_ACCELERATOR_TYPE``, or a
  ``/dev/accel0`` device): JAX finds the pod's workers itself, so no arguments are passed.
* ``single``: nothing to connect; :func:`initialize` is a no-op.

Control decisions that every host must take identically (which batch trains next, when to stop) are made by
process 0 and sent to all with :func:`broadcast_decision`, or taken on every host and checked to agree with
:func:`gather_decisions`; data is split with :func:`process_shard`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
CLUSTERS = ("auto", "single", "tpu", "slurm", "env")
_ENV_VARS = ("DORA_COORDINATOR", "DORA_NUM_PROCESSES", "DORA_PROCESS_ID")
_TPU_VARS = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE")
DEFAULT_PORT = 8476


class DistributedError(RuntimeError):
    """The environment does not describe a usable cluster; the message names the variable at fault."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How this process joins the cluster. ``None`` fields are left to JAX's own detection (TPU)."""

    kind: str  # single | tpu | slurm | env
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if name not in env or env[name] == "":
        raise DistributedError(f"environment variable {name} is not set")
    try:
        value = int(env[name])
    except ValueError:
        raise DistributedError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if value < minimum:
        raise DistributedError(f"environment variable {name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise DistributedError(f"environment variable {name}={value} must be <= {maximum}")
    return value


def _address(value: str, name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+:\d{1,5}", value):
        raise DistributedError(f"environment variable {name}={value!r} must be host:port, e.g. 10.0.0.1:{DEFAULT_PORT}")
    if not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise DistributedError(f"environment variable {name}={value!r}: the port must be in 1..65535")
    return value


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[03-05,9],gpu1`` -> ``node03``."""
    head = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist.strip())
    if not head or not head.group(1):
        raise DistributedError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    if head.group(3) is None:
        return head.group(1)
    return head.group(1) + re.split(r"[,-]", head.group(3))[0]


def _on_tpu_vm(env: Mapping[str, str]) -> bool:
    return any(v in env for v in _TPU_VARS) or os.path.exists("/dev/accel0")


def detect(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Reads the cluster this process belongs to from ``env`` (default ``os.environ``), without side effects.

    Raises:
      DistributedError: naming the missing or malformed variable, e.g. ``DORA_PROCESS_ID is not set``.
    """
    env = os.environ if env is None else env
    kind = env.get("DORA_CLUSTER", "auto") or "auto"
    if kind not in CLUSTERS:
        raise DistributedError(f"environment variable DORA_CLUSTER={kind!r}: allowed {', '.join(CLUSTERS)}")
    if kind == "auto":
        if any(v in env for v in _ENV_VARS):
            kind = "env"
        elif "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
            kind = "slurm"
        elif _on_tpu_vm(env):
            kind = "tpu"
        else:
            kind = "single"
    local = None
    if env.get("DORA_LOCAL_DEVICE_IDS"):
        try:
            local = tuple(int(x) for x in env["DORA_LOCAL_DEVICE_IDS"].split(","))
            if min(local) < 0:
                raise ValueError
        except ValueError:
            raise DistributedError(f"environment variable DORA_LOCAL_DEVICE_IDS={env['DORA_LOCAL_DEVICE_IDS']!r} "
                                   "must be comma-separated integers >= 0, e.g. 0,1") from None
    if kind == "single":
        return ClusterSpec("single", num_processes=1, process_id=0)
    if kind == "tpu":
        return ClusterSpec("tpu", local_device_ids=local)
    if kind == "env":
        n = _int(env, "DORA_NUM_PROCESSES", minimum=1)
        pid = _int(env, "DORA_PROCESS_ID")
        if pid >= n:
            raise DistributedError(f"environment variable DORA_PROCESS_ID={pid} must be < DORA_NUM_PROCESSES={n}")
        if n == 1:
            return ClusterSpec("single", num_processes=1, process_id=0)
        if not env.get("DORA_COORDINATOR"):
            raise DistributedError("environment variable DORA_COORDINATOR is not set (host:port of process 0)")
        return ClusterSpec("env", _address(env["DORA_COORDINATOR"], "DORA_COORDINATOR"), n, pid, local)
    # slurm
    n = _int(env, "SLURM_NTASKS", minimum=1)
    pid = _int(env, "SLURM_PROCID")
    if pid >= n:
        raise DistributedError(f"environment variable SLURM_PROCID={pid} must be < SLURM_NTASKS={n}")
    if n == 1:
        return ClusterSpec("single", num_processes=1, process_id=0)
    if env.get("DORA_COORDINATOR"):
        coordinator = _address(env["DORA_COORDINATOR"], "DORA_COORDINATOR")
    else:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise DistributedError("environment variable SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) is not set; "
                                   "run under srun or set DORA_COORDINATOR")
        port = _int(env, "DORA_COORDINATOR_PORT", minimum=1, maximum=65535) if env.get("DORA_COORDINATOR_PORT") \
            else DEFAULT_PORT
        coordinator = f"{first_slurm_host(nodes)}:{port}"
    return ClusterSpec("slurm", coordinator, n, pid, local)


_INITIALIZED: ClusterSpec | None = None


def initialize(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Connects this process to the others (``jax.distributed.initialize``); call before any JAX work.

    A single process returns at once. On CPU (``JAX_PLATFORMS`` unset or naming ``cpu``) cross-process
    collectives go through gloo, so that ``jax.distributed`` works on plain hosts and in tests. Calling it
    again returns the first call's result.

    Args:
      env: the environment to read (default ``os.environ``); see the module docstring for the variables.

    Returns:
      The :class:`ClusterSpec` that was used.

    Raises:
      DistributedError: naming the missing or malformed variable, before anything is connected.
    """
    global _INITIALIZED
    if _INITIALIZED is not None:
        return _INITIALIZED
    spec = detect(env)
    if spec.kind == "single":
        _INITIALIZED = spec
        return spec
    import jax

    platforms = (env if env is not None else os.environ).get("JAX_PLATFORMS", "")
    if spec.kind != "tpu" and (not platforms or "cpu" in platforms.split(",")):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, KeyError, ValueError):  # a JAX that has gloo by default or names it otherwise
            pass
    kwargs: dict[str, Any] = {}
    if spec.kind != "tpu":
        kwargs = dict(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id)
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    jax.distributed.initialize(**kwargs)
    _INITIALIZED = dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())
    return _INITIALIZED


def broadcast_decision(obj: Any) -> Any:
    """Process 0's ``obj`` on every process: for control decisions all hosts must take identically.

    ``obj`` must be JSON-serializable; every process receives ``json.loads(json.dumps(obj_of_process_0))``
    (also with one process, so that a program behaves the same on one host and on many: tuples come back as
    lists). Every process must call it at the same point of the program.
    """
    import jax

    payload = json.dumps(obj, sort_keys=True).encode()
    if jax.process_count() == 1:
        return json.loads(payload)
    from jax.experimental import multihost_utils

    is_source = jax.process_index() == 0
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload) if is_source else 0)))
    buf = np.frombuffer(payload, np.uint8) if is_source else np.zeros((n,), np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(data.astype(np.uint8).tobytes().decode())


def gather_decisions(obj: Any) -> list[Any]:
    """Every process's ``obj``, in process order, on every process: to check that a decision each process
    took on its own is the same everywhere (and fail on every process at once when it is not).

    ``obj`` must be JSON-serializable; entries are ``json.loads(json.dumps(obj))`` (also with one process).
    Every process must call it at the same point of the program.
    """
    import jax

    payload = json.dumps(obj, sort_keys=True).encode()
    if jax.process_count() == 1:
        return [json.loads(payload)]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(payload)))).reshape(-1)
    # A power-of-two buffer: the gather is compiled once per size class, not once per payload length.
    size = max(64, 1 << (int(lengths.max()) - 1).bit_length())
    buf = np.zeros((size,), np.uint8)
    buf[:len(payload)] = np.frombuffer(payload, np.uint8)
    data = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(lengths), size)
    return [json.loads(data[i, :n].astype(np.uint8).tobytes().decode()) for i, n in enumerate(lengths)]


def process_shard(items: Sequence[T], *, index: int | None = None, count: int | None = None,
                  even: bool = True) -> list[T]:
    """This process's share of ``items``: every ``count``-th item from ``index`` (defaults: this process).

    Strided rather than contiguous, so long-tailed items spread evenly over the hosts.

    Args:
      items: the whole, identically ordered sequence every process holds.
      index, count: override ``jax.process_index()`` / ``jax.process_count()``.
      even: require ``len(items)`` to be a multiple of ``count``, so that every host feeds the same number of
        rows into a collective step (an uneven split would hang it).

    Raises:
      ValueError: if ``even`` and the items do not split evenly, or the index is out of range.
    """
    if index is None or count is None:
        import jax

        index = jax.process_index() if index is None else index
        count = jax.process_count() if count is None else count
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process_shard: index {index} must lie in [0, count={count})")
    if even and len(items) % count:
        raise ValueError(f"process_shard: {len(items)} items do not split evenly over {count} processes; pad or "
                         "trim them to a multiple, or pass even=False")
    return list(items[index::count])
