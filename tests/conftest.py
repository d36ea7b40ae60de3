"""Test setup: 8 fake CPU devices for sharding tests, float32 everywhere, shared fixtures."""

import os
import resource
import shutil
import sys
import tempfile
import time

from dora_jax.xla_flags import DEVICE_COUNT, cpu_device_flags  # noqa: E402 - imports no JAX

# The benchmarks (benchmarks/ at the repository root) are not an installed package: tests import them from here.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.append(_REPO)

# Must happen before jax is imported anywhere: 8 fake CPU devices (unless XLA_FLAGS asks for another count), with
# the flag that keeps their collectives in one order (dora_jax.xla_flags). LLVM's optimizations off (unless
# XLA_FLAGS sets a level): the tests' programs are small, so compiling them costs far more than running them
# (the suite takes about half the time). XLA's own HLO passes (fusion, layout, scheduling) still run and the
# matmuls go to the same runtime libraries; results differ from the default level's by float32 rounding, inside
# every test's tolerance (the suite passes at either level). docs/performance.md ("Test suite") has the numbers.
_FLAGS = os.environ.get("XLA_FLAGS", "")
OPT_LEVEL = "--xla_backend_optimization_level"
if OPT_LEVEL not in _FLAGS:
    _FLAGS = f"{_FLAGS} {OPT_LEVEL}=0"
os.environ["XLA_FLAGS"] = cpu_device_flags(None if DEVICE_COUNT in _FLAGS else 8, _FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# No compilation cache of the user's: tests compile what they run. They share one of their own instead, new
# for every run and removed at its end, so the programs many tests build alike (the tiny model's train step,
# the engine's decode step at the same shapes) compile once per run instead of once per test. The process that
# starts the run makes the directory; pytest-xdist's workers inherit its name. Processes a test starts do not
# read it (only this file does), so multi-process tests compile on their own.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
_CACHE_DIR = "DORA_JAX_TEST_COMPILATION_CACHE"
_OWNS_CACHE = _CACHE_DIR not in os.environ
if _OWNS_CACHE:
    os.environ[_CACHE_DIR] = tempfile.mkdtemp(prefix="dora-jax-test-xla-cache-")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the many small programs add up


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the relative error used by every numeric test."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


@pytest.fixture
def published(monkeypatch):
    """``published(store)``: every version published through that :class:`~dora_jax.run.versions.VersionStore`
    during the test, ``{version: params}`` (a copy each), so a test can recompute a trajectory's log-probs on the
    version that generated it after the store let the version go."""
    from dora_jax.run.versions import VersionStore

    seen: dict[int, dict[int, object]] = {}
    publish = VersionStore.publish

    def recording(self, version, params, **kw):
        seen.setdefault(id(self), {})[int(version)] = jax.tree.map(lambda x: x.copy(), params)
        return publish(self, version, params, **kw)

    monkeypatch.setattr(VersionStore, "publish", recording)
    return lambda store: seen.get(id(store), {})


@pytest.fixture(scope="session")
def torch_threads():
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return torch


# -- a crashed worker's last words ------------------------------------------------------------------------------
# A pytest-xdist worker killed by a signal (an XLA runtime abort, a segfault) prints its fatal-error report on its
# own stderr, interleaved with everything else and far above the summary a CI log keeps. Each worker writes its
# stderr to a file instead, and the summary repeats what a worker said from its fatal error on (and the first
# stuck-collective warnings before it).

_STDERR_DIR = "DORA_JAX_TEST_WORKER_STDERR"
_REPORT_FD = pytest.StashKey[int]()
_FATAL = ("Fatal Python error", "Termination timeout", "may be stuck", "Check failed", "terminate called",
          "Timeout +++")


@pytest.hookimpl(tryfirst=True)  # before pytest's faulthandler plugin duplicates fd 2 for its reports
def pytest_configure(config):
    worker = getattr(config, "workerinput", None)
    if worker is None:
        if config.getoption("numprocesses", None):
            os.environ[_STDERR_DIR] = tempfile.mkdtemp(prefix="dora-jax-test-stderr-")
        return
    directory = os.environ.get(_STDERR_DIR)
    if directory:
        fd = os.open(os.path.join(directory, f"{worker['workerid']}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
        config.stash[_REPORT_FD] = os.dup(2)  # fd 2 itself is swapped by pytest's output capture during tests


def pytest_sessionstart(session):
    # In a worker, report only the thread that received the fatal signal: with XLA's rendezvous abort several
    # threads abort at once, and the all-thread dump pytest sets up was cut off midway.
    fd = session.config.stash.get(_REPORT_FD, None)
    if fd is not None:
        import faulthandler

        faulthandler.enable(file=fd, all_threads=False)


def pytest_terminal_summary(terminalreporter, config):
    if _PEAKS:
        terminalreporter.write_line("peak memory of the test workers: " + ", ".join(
            f"{w} {gib:.1f} GiB" for w, gib in sorted(_PEAKS.items())))
    directory = os.environ.get(_STDERR_DIR)
    if hasattr(config, "workerinput") or not directory or not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        for _ in range(50):  # a dying worker may still be writing its report: wait until the file stops growing
            size = os.path.getsize(path)
            time.sleep(0.1)
            if os.path.getsize(path) == size:
                break
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        hits = [i for i, line in enumerate(lines) if any(m in line for m in _FATAL)]
        if not hits:
            continue
        terminalreporter.section(f"stderr of worker {name.removesuffix('.txt')} from its fatal error", sep="-")
        # The runtime's own last lines, the error, and the stack of the thread it hit (not the idle ones).
        start = next((i for i in hits if lines[i].startswith("Fatal Python error")), hits[0])
        # faulthandler heads the signalled thread's stack "Stack (most recent call first)" (one thread) or
        # "Current thread ..." (all threads); a native thread (XLA's rendezvous abort) has no Python stack.
        current = next((i for i in range(start, len(lines))
                        if lines[i].startswith(("Stack (most recent call first)", "Current thread"))), start)
        shown = sorted(set(hits[:10]) | set(range(max(start - 5, 0), start + 2))
                       | set(range(current, min(current + 30, len(lines)))))
        for i in shown:
            terminalreporter.write_line(lines[i][:400])


def pytest_sessionfinish(session):
    # Each worker reports its peak resident memory; the summary prints them (the CI machine has 24 GiB).
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


_PEAKS: dict[str, float] = {}


def pytest_testnodedown(node, error):
    peak = getattr(node, "workeroutput", {}).get("peak_rss_gib")
    if peak is not None:
        _PEAKS[node.gateway.id] = peak


def pytest_unconfigure(config):
    directory = os.environ.get(_STDERR_DIR)
    if not hasattr(config, "workerinput") and directory:
        shutil.rmtree(directory, ignore_errors=True)
    if _OWNS_CACHE:
        shutil.rmtree(os.environ.pop(_CACHE_DIR), ignore_errors=True)
