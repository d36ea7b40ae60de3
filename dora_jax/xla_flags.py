"""``XLA_FLAGS`` for fake CPU devices; imports nothing heavy, so it can run before JAX starts its backend.

Several CPU devices in one process (``--xla_force_host_platform_device_count=N``) are how this project tests
and demonstrates meshes without accelerators. On them, XLA:CPU's default HLO scheduler (the
concurrency-optimized one) lets one multi-device program reach its collectives in different orders on
different devices. We traced the intermittent aborts of our test runs to exactly that: one execution of the
train step, with device 4 waiting in an all-gather for device 6 while device 6 waited in an all-reduce for
device 4, until XLA's 40 s rendezvous timeout aborted the process ("Termination timeout for `all gather
RendezvousKey{...}`"). With that scheduler off, the same workload never got stuck (docs/scale.md,
"Collectives on fake CPU devices"). The option takes effect only through ``XLA_FLAGS`` read when the backend
starts (a per-program ``compiler_options`` entry leaves the compiled program unchanged), so every entry point
that creates fake CPU devices builds its flags here.
"""

from __future__ import annotations

import os
import warnings

DEVICE_COUNT = "--xla_force_host_platform_device_count"
SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler"
# One order of collectives on every fake device (see the module docstring).
SAFE_COLLECTIVES = f"{SCHEDULER}=false"


def fake_device_count(flags: str | None = None) -> int:
    """The number of CPU devices ``flags`` (default: ``$XLA_FLAGS``) ask for (XLA takes the last; 1 if none).

    Raises:
        ValueError: the count is not an integer >= 1 (XLA would fail to start its CPU backend, or stop the process
            with a list of every flag it knows).
    """
    n = 1
    for flag in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split():
        if flag.startswith(DEVICE_COUNT + "="):
            value = flag.split("=", 1)[1]
            n = int(value) if value.isdigit() else 0
            if n < 1:
                raise ValueError(f"XLA_FLAGS: {flag}: the device count must be an integer >= 1")
    return n


def cpu_device_flags(n: int | None = None, flags: str | None = None) -> str:
    """``XLA_FLAGS`` for ``n`` fake CPU devices (default: the count ``flags`` already ask for), keeping the other
    flags of ``flags`` (default: ``$XLA_FLAGS``). With more than one device, :data:`SAFE_COLLECTIVES` comes first,
    so a scheduler setting of the caller's own (later) still wins: XLA takes the last occurrence of a flag."""
    given = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    n = fake_device_count(given) if n is None else n
    if n < 1:
        raise ValueError(f"cpu_device_flags: {n} devices; need at least 1")
    rest = [f for f in given.split() if not f.startswith(DEVICE_COUNT + "=")]
    lead = [f"{DEVICE_COUNT}={n}"] + ([SAFE_COLLECTIVES] if n > 1 and SAFE_COLLECTIVES not in rest else [])
    return " ".join(lead + rest)


def warn_if_unsafe(num_cpu_devices: int) -> None:
    """Warns when a mesh spans several CPU devices of this process and ``$XLA_FLAGS`` keeps XLA's default
    scheduler: multi-device programs may then abort after a 40 s rendezvous timeout."""
    flags = os.environ.get("XLA_FLAGS", "")
    if num_cpu_devices > 1 and SCHEDULER not in flags:
        warnings.warn(f"a mesh over {num_cpu_devices} CPU devices with XLA_FLAGS={flags!r}: XLA:CPU may run this "
                      "program's collectives in different orders on different devices and abort after 40 s. Start "
                      f"the process with {SAFE_COLLECTIVES} in XLA_FLAGS (dora_jax.xla_flags.cpu_device_flags "
                      "builds them; the dora-jax command and launch/ scripts do it for you)", RuntimeWarning,
                      stacklevel=3)


OPT_LEVEL = "--xla_backend_optimization_level"
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters"
TEST_DEVICES = 8


def cpu_test_flags(flags: str = "", opt_level: int | None = None, devices: int | None = None) -> str:
    """``XLA_FLAGS`` of a CPU test run from ``flags``, for processes that compile many small programs and run each
    briefly (the test suite and the processes its tests start).

    Args:
        flags: flags to keep; a setting of the caller's own for any flag below wins.
        opt_level: XLA's backend optimization level (``None``: 0 unless ``flags`` set one).
        devices: the number of fake devices (``None``: the count ``flags`` ask for, else :data:`TEST_DEVICES`).

    Besides the level, XLA:CPU's MLIR fusion emitters are off (:data:`FUSION_EMITTERS`): the older emitters
    compile the suite's programs in about half the time. Neither setting changes XLA's HLO passes or the
    runtime's matmul libraries: results differ by float32 rounding only (docs/testing.md, "The suite's time").
    """
    if opt_level is not None:
        flags = f"{flags} {OPT_LEVEL}={opt_level}"  # XLA takes the last occurrence
    elif OPT_LEVEL not in flags:
        flags = f"{flags} {OPT_LEVEL}=0"
    if FUSION_EMITTERS not in flags:
        flags = f"{flags} {FUSION_EMITTERS}=false"
    if devices is None:
        devices = None if DEVICE_COUNT in flags else TEST_DEVICES
    return cpu_device_flags(devices, flags)
