"""What every benchmark result carries: the command that produced it, the device, the date and the machine.

``dora-jax bench`` stamps each result with :func:`stamp` before printing it and writes it with
:func:`write_json`; the benchmark functions put :func:`machine` under ``"machine"`` themselves.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import jax


def today() -> str:
    """The local date as ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d")


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo``, where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def device() -> str:
    """The devices JAX runs on, in words.

    Returns:
      An accelerator's kind (``"NVIDIA H100 80GB HBM3"``), prefixed by the count when there are several; on
      the CPU backend the core count and model (and how many XLA host devices share them, if more than one).
    """
    devices = jax.devices()
    if devices[0].platform == "cpu":
        text = f"CPU, {os.cpu_count()} cores, {_cpu_model() or platform.machine()}"
        return text + (f" ({len(devices)} XLA host devices)" if len(devices) > 1 else "")
    kind = str(devices[0].device_kind)
    return kind if len(devices) == 1 else f"{len(devices)} x {kind}"


def machine() -> dict[str, Any]:
    """The software and hardware a result was measured with.

    Returns:
      Platform, Python and JAX versions, JAX's backend and devices, the CPU count and the date.
    """
    return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count(), "date": today()}


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The shell command ``prog argv...``, quoted so that it can be pasted back."""
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


def stamp(result: dict[str, Any], command: str) -> dict[str, Any]:
    """``result`` with ``command``, ``device`` and ``date`` in front.

    Args:
      result: a benchmark's JSON-able dict.
      command: the command line that produced it (:func:`command_line`).

    Returns:
      A new dict: the three keys first, then every other key of ``result`` in its order.
    """
    head = {"command": command, "device": device(), "date": today()}
    return {**head, **{k: v for k, v in result.items() if k not in head}}


def write_json(result: Any, path: str) -> str:
    """Writes ``result`` to ``path`` as indented JSON.

    Args:
      result: anything ``json.dump`` takes.
      path: the file to write (replaced if it exists).

    Returns:
      ``path``.
    """
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return path


def source_version() -> dict[str, Any]:
    """The commit the library ran at, and the library files that differed from it (a working tree's edits)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "changed": [x for x in git("status", "--porcelain", "--", "dora_jax").splitlines() if x]}
