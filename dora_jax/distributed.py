"""Multi-host runtime: one process per host (or per GPU) under ``jax.distributed``, every process running the
same program. :func:`initialize` connects the processes (JAX's detection plus the ``DORA_*`` variables:
docs/scale.md, 'The multi-host model'); :func:`broadcast_decision` and :func:`gather_decisions` keep control
decisions identical on every process; :func:`process_shard` splits data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Mapping, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
log = logging.getLogger(__name__)
DEFAULT_PORT = 8476


class DistributedError(RuntimeError):
    """The environment does not describe a usable cluster; the message names the variable at fault."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How this process joins the cluster; ``None`` fields are left to JAX's detection. ``kind``: ``single`` (one
    process), ``env`` (every ``DORA_*`` setting given) or ``auto`` (JAX detects the rest; ``method``: the one
    detection method, ``None`` for all). After :func:`initialize`, ``num_processes`` and ``process_id`` are JAX's."""

    kind: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    method: str | None = None


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    if env.get(name, "") == "":
        return None
    try:
        value = int(env[name])
    except ValueError:
        raise DistributedError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if value < minimum:
        raise DistributedError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def _address(value: str, name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+:\d{1,5}", value):
        raise DistributedError(f"environment variable {name}={value!r} must be host:port, e.g. 10.0.0.1:{DEFAULT_PORT}")
    if not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:
        raise DistributedError(f"environment variable {name}={value!r}: the port must be in 1..65535")
    return value


def detect(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """The explicit settings of ``env`` (default ``os.environ``), checked, without side effects.

    Raises:
      DistributedError: naming the malformed or inconsistent variable.
    """
    env = os.environ if env is None else env
    method = env.get("DORA_CLUSTER", "auto") or "auto"
    if not re.fullmatch(r"[a-z0-9_]+", method):
        raise DistributedError(f"environment variable DORA_CLUSTER={method!r}: allowed auto, single, or a JAX "
                               "cluster detection method (slurm, ompi, mpi4py, gce_tpu, gke_tpu, k8s)")
    local = None
    if env.get("DORA_LOCAL_DEVICE_IDS"):
        try:
            local = tuple(int(x) for x in env["DORA_LOCAL_DEVICE_IDS"].split(","))
            if min(local) < 0:
                raise ValueError
        except ValueError:
            raise DistributedError(f"environment variable DORA_LOCAL_DEVICE_IDS={env['DORA_LOCAL_DEVICE_IDS']!r} "
                                   "must be comma-separated integers >= 0, e.g. 0,1") from None
    n = _int(env, "DORA_NUM_PROCESSES", minimum=1)
    pid = _int(env, "DORA_PROCESS_ID")
    coordinator = _address(env["DORA_COORDINATOR"], "DORA_COORDINATOR") if env.get("DORA_COORDINATOR") else None
    if n is not None and pid is not None and pid >= n:
        raise DistributedError(f"environment variable DORA_PROCESS_ID={pid} must be < DORA_NUM_PROCESSES={n}")
    if method == "single" or n == 1:
        return ClusterSpec("single", num_processes=1, process_id=0)
    if None not in (coordinator, n, pid):
        if method != "auto":
            raise DistributedError(f"environment variable DORA_CLUSTER={method!r} with DORA_COORDINATOR, "
                                   "DORA_NUM_PROCESSES and DORA_PROCESS_ID all set: nothing is left to detect; "
                                   "unset DORA_CLUSTER or some of them")
        return ClusterSpec("env", coordinator, n, pid, local)
    return ClusterSpec("auto", coordinator, n, pid, local, None if method == "auto" else method)


_INITIALIZED: ClusterSpec | None = None


def _connect(jax: Any, spec: ClusterSpec) -> None:
    """``jax.distributed.initialize`` with the given settings; JAX detects the others."""
    kwargs: dict[str, Any] = {"coordinator_address": spec.coordinator, "num_processes": spec.num_processes,
                              "process_id": spec.process_id}
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    if spec.kind == "env":
        # Everything is given. JAX would still detect the local devices under SLURM or Open MPI (one per
        # process); a process started by the launch scripts drives every device it sees.
        kwargs["cluster_detection_method"] = "deactivate"
    elif spec.method is not None:
        kwargs["cluster_detection_method"] = spec.method
    jax.distributed.initialize(**kwargs)


def initialize(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Connects this process to the others (``jax.distributed.initialize``); call before any JAX work. Returns
    at once as a single process for ``DORA_CLUSTER=single`` or ``DORA_NUM_PROCESSES=1``, or when nothing is set and
    JAX finds no cluster or its backend already runs; takes a connection the caller made as it is. Later calls
    return the first call's result.

    Returns:
      The :class:`ClusterSpec` used, with JAX's process count and index.

    Raises:
      DistributedError: a malformed variable, or a cluster that cannot be joined as set, before connecting.
    """
    global _INITIALIZED
    if _INITIALIZED is not None:
        return _INITIALIZED
    spec = detect(env)
    if spec.kind == "single":
        _INITIALIZED = spec
        return spec
    import jax

    if jax.distributed.is_initialized():  # connected by the caller: take it as it is
        _INITIALIZED = dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())
        return _INITIALIZED
    platforms = (env if env is not None else os.environ).get("JAX_PLATFORMS", "")
    if not platforms or "cpu" in platforms.split(","):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, KeyError, ValueError):  # a JAX that has gloo by default or names it otherwise
            pass
    given = [f"{k}={v}" for k, v in (("DORA_COORDINATOR", spec.coordinator), ("DORA_NUM_PROCESSES",
             spec.num_processes), ("DORA_PROCESS_ID", spec.process_id)) if v is not None]
    try:
        _connect(jax, spec)
    except (ValueError, RuntimeError) as e:
        started = "must be called before any JAX" in str(e)  # the backend runs already: too late to join
        if isinstance(e, RuntimeError) and not started:
            raise
        if spec.kind == "auto" and not given and spec.method is None:  # no cluster found, or too late to join
            log.debug("jax.distributed.initialize: %s; running as one process", e)
            _INITIALIZED = ClusterSpec("single", num_processes=1, process_id=0)
            return _INITIALIZED
        asked = ", ".join(given + ([f"DORA_CLUSTER={spec.method}"] if spec.method else []))
        why = ("call dora_jax.distributed.initialize() before any JAX work" if started else
               "set the DORA_* variables missing here, or start the processes where JAX detects the cluster "
               "(srun, mpirun, a Cloud TPU VM)")
        raise DistributedError(f"{asked}: jax.distributed.initialize failed ({e}); {why}") from None
    _INITIALIZED = dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())
    return _INITIALIZED


def broadcast_decision(obj: Any) -> Any:
    """Process 0's ``obj`` (JSON-serializable) on every process, as ``json.loads(json.dumps(obj))`` even with one
    process (tuples come back as lists). Every process must call it at the same point."""
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


_GATHERS = [0]  # gather_decisions calls so far: every process makes the same calls in the same order
GATHER_TIMEOUT_S = 3600  # a process that never comes (a crash) stops the others after this long


def gather_decisions(obj: Any) -> list[Any]:
    """Every process's ``obj`` (JSON-serializable, round-tripped through JSON), in process order, on every
    process. Every process must call it at the same point; it goes through the coordinator's key-value store, so
    it never waits behind device work."""
    import jax

    payload = json.dumps(obj, sort_keys=True)
    if jax.process_count() == 1:
        return [json.loads(payload)]
    from jax._src import distributed as jax_distributed

    client, me, n = jax_distributed.global_state.client, jax.process_index(), jax.process_count()
    call = _GATHERS[0]
    _GATHERS[0] += 1
    client.key_value_set(f"dora_jax/decisions/{call}/{me}", payload)
    client.wait_at_barrier(f"dora_jax/decisions/{call}", GATHER_TIMEOUT_S * 1000)
    values = dict(client.key_value_dir_get(f"dora_jax/decisions/{call}/"))
    if call:  # every process has read the previous call's values (it set this call's only after)
        client.key_value_delete(f"dora_jax/decisions/{call - 1}/{me}")
    return [json.loads(values[f"dora_jax/decisions/{call}/{p}"]) for p in range(n)]


def process_shard(items: Sequence[T], *, index: int | None = None, count: int | None = None,
                  even: bool = True) -> list[T]:
    """This process's share of ``items`` (identically ordered everywhere): every ``count``-th item from ``index``
    (defaults: ``jax.process_index()`` / ``jax.process_count()``). ``even`` requires ``len(items)`` to be a
    multiple of ``count``.

    Raises:
      ValueError: ``even`` and the items do not split evenly, or the index is out of range.
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
