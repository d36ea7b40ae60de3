"""Test setup: 8 fake CPU devices for sharding tests, float32 everywhere, shared fixtures."""

import os
import resource
import shutil
import sys
import tempfile
import time

from dora_jax.xla_flags import cpu_test_flags  # noqa: E402 - imports no JAX

# The benchmarks (benchmarks/ at the repository root) are not an installed package: tests import them from here.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.append(_REPO)

# Must happen before jax is imported anywhere: 8 fake CPU devices (unless XLA_FLAGS asks for another count), with
# the flag that keeps their collectives in one order, and the compiler settings of dora_jax.xla_flags.cpu_test_flags
# (LLVM's optimizations and XLA:CPU's MLIR fusion emitters off, unless XLA_FLAGS sets them): the tests' programs
# are small, so compiling them costs far more than running them. XLA's own HLO passes (fusion, layout,
# scheduling) still run and the matmuls go to the same runtime libraries; results differ from the defaults' by
# float32 rounding, inside every test's tolerance. docs/testing.md ("The suite's time") has the numbers.
os.environ["XLA_FLAGS"] = cpu_test_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# No compilation cache of the user's: tests compile what they run. They share one of their own instead, new
# for every run and removed at its end, so the programs many tests build alike (the tiny model's train step,
# the engine's decode step at the same shapes) compile once per run instead of once per test. The process that
# starts the run makes the directory; pytest-xdist's workers inherit its name. Processes a test starts read it
# when the test passes them child_cache_env(): a run killed and resumed, or two processes of one cluster, then
# compile each program once.
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


def child_cache_env() -> dict[str, str]:
    """Environment variables that make a process a test starts use the run's compilation cache."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ[_CACHE_DIR], "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the relative error used by every numeric test."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


# Two programs that compute one draw (another batch size or slot, a sharded mesh, a shared prefix, several decode
# steps per program) round its logits their own ways, and two machines round one program their own ways too. A
# draw whose uniform lies within that rounding of a CDF boundary, or whose top two logits (greedy) are that
# close, may then go either way. Measured on CPU at XLA optimization levels 0 and 3 over the draws of the engine
# and driver tests (test_engine_api.py, test_driver.py, test_driver_overlap.py; then one file): two programs'
# logits up to 1e-5 apart and their CDF boundaries up to 2e-6, while the nearest draw lay 5e-6 from a boundary.
# Tests that compare two programs' samples therefore compare them up to such a tie, TIE wide: 10x the largest
# logit difference and 50x the largest boundary difference measured.
TIE = 1e-4


def possible_draws(logits, sampling, sample_id: int, position: int, tie: float = TIE) -> set[int]:
    """The tokens that dora_jax.rollout.sampling draws from the float64 ``logits`` [V] of one row when they move
    by up to ``tie``: greedy (temperature 0), every token within ``tie`` of the top logit; sampled, every token
    whose CDF interval comes within ``tie`` of the row's uniform (a function of the seed, ``sample_id`` and the
    ``position`` of the token drawn), under the row's top-k / top-p cut and under any other cut within ``tie``
    of it. ``sampling`` has ``temperature``, ``top_k``, ``top_p`` and ``seed`` (a request's or the rollout
    config's)."""
    import jax.numpy as jnp

    from dora_jax.rollout.sampling import row_keys

    logits = np.asarray(logits, np.float64)
    if sampling.temperature <= 0:
        return set(np.flatnonzero(logits >= logits.max() - tie).tolist())
    key = row_keys(sampling.seed, jnp.asarray([sample_id]), jnp.asarray([position]))
    u = 1.0 - float(jax.vmap(jax.random.uniform)(key)[0])  # the sampler's one uniform per row
    z = logits / sampling.temperature
    desc = np.sort(z)[::-1]
    ks = [sampling.top_k if 0 < sampling.top_k < len(z) else len(z)]
    if ks[0] < len(z) and desc[ks[0] - 1] - desc[ks[0]] <= tie:
        ks.append(ks[0] + 1)
    top_p, out = sampling.top_p, set()
    for k in ks:
        p = np.exp(desc[:k] - desc[0])
        before = np.cumsum(p / p.sum()) - p / p.sum()  # the nucleus keeps the tokens whose mass before is < top_p
        n = max(int(np.sum(before < top_p)), 1)
        ns = {n}
        if top_p < 1 and n > 1 and top_p - before[n - 1] <= tie:
            ns.add(n - 1)
        if top_p < 1 and n < k and before[n] - top_p <= tie:
            ns.add(n + 1)
        for m in ns:
            weight = np.where(z >= max(desc[m - 1], desc[k - 1]), np.exp(z - desc[0]), 0.0)
            cdf = np.cumsum(weight) / weight.sum()
            near = (weight > 0) & (cdf - weight / weight.sum() - tie <= u) & (u <= cdf + tie)
            out |= set(np.flatnonzero(near).tolist())
    return out


def same_updates_up_to_a_tie(a: list[dict], b: list[dict], logits_after, sampling) -> int:
    """``a`` and ``b``: the samples.jsonl rows of two ``sync`` runs of one config and seed by programs that may
    round differently. Update by update: the same samples (ids, groups, versions, prompts) with the same tokens
    and rewards, until an update where some sample's tokens part. There every parted sample's first differing
    token must be a tie (both runs' tokens possible draws, :func:`possible_draws`, on ``logits_after(version,
    token_ids)``: float64 logits [V] after those tokens on one run's weights of that version), and the runs are
    compared no further: the updates after it train on other samples. Returns the number of updates found the
    same (all of them, but where a run met a tie)."""
    steps = sorted({r["trained_at"] for r in a})
    assert steps == sorted({r["trained_at"] for r in b}), "the runs trained at other versions"
    for done, step in enumerate(steps):
        ra, rb = ([r for r in rows if r["trained_at"] == step] for rows in (a, b))
        ids = [[(r["sample_id"], r["group_id"], r["version"], r["prompt_ids"]) for r in rows] for rows in (ra, rb)]
        assert ids[0] == ids[1], f"update at version {step}: other samples"
        parted = False
        for x, y in zip(ra, rb):
            n = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), None)
            if n is None:
                assert (x["tokens"], x["reward"]) == (y["tokens"], y["reward"]), f"sample {x['sample_id']}"
                continue
            seen = x["prompt_ids"] + x["tokens"][:n]
            possible = possible_draws(logits_after(x["version"], seen), sampling, x["sample_id"], len(seen))
            pair = (x["tokens"][n], y["tokens"][n])
            assert set(pair) <= possible, f"sample {x['sample_id']} token {n}: {pair}, not a tie ({sorted(possible)})"
            parted = True
        if parted:
            return done
    return len(steps)


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


@pytest.fixture(scope="module")
def models():
    """Two tiny random models of one config (``engine_helpers.CFG``, seeds 0 and 1): the policy versions of the
    engine and driver tests (test_engine_api.py, test_driver.py, test_driver_overlap.py), a pair per test file."""
    from dora_jax.models.build import init_model
    from engine_helpers import CFG

    return init_model(CFG, seed=0), init_model(CFG, seed=1)


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
            f"{w} {gib:.1f} GiB in {maps} mappings" for w, (gib, maps) in sorted(_PEAKS.items())))
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


# XLA:CPU maps every compiled kernel into memory on its own (code, constants), so each program of the engine or
# the trainer costs the process a few thousand memory mappings, and a test worker that compiles the programs of
# many test files reaches Linux's limit per process (vm.max_map_count, 65530 by default): LLVM then fails with
# "Cannot allocate memory" and the worker dies with several GiB of memory still free. Programs of tests that have
# ended are garbage, but their executables stay in JAX's caches until these are cleared; past MAP_BUDGET mappings
# the worker clears them (a later test recompiles what it needs, mostly from the run's compilation cache).
MAP_BUDGET = 24_000
_MAPS = "/proc/self/maps"
_PEAK_MAPS = 0


def _map_count() -> int:
    with open(_MAPS, "rb") as f:
        return sum(1 for _ in f)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # after the test's own fixtures are torn down
    global _PEAK_MAPS
    if not os.path.exists(_MAPS):
        return
    count = _map_count()
    _PEAK_MAPS = max(_PEAK_MAPS, count)
    if count > MAP_BUDGET:
        import gc

        gc.collect()
        jax.clear_caches()


def pytest_sessionfinish(session):
    # Each worker reports its peak resident memory and memory mappings; the summary prints them (the CI machine
    # has 24 GiB).
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        out["peak_maps"] = _PEAK_MAPS


_PEAKS: dict[str, tuple[float, int]] = {}


def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    if out.get("peak_rss_gib") is not None:
        _PEAKS[node.gateway.id] = (out["peak_rss_gib"], out.get("peak_maps", 0))


def pytest_unconfigure(config):
    directory = os.environ.get(_STDERR_DIR)
    if not hasattr(config, "workerinput") and directory:
        shutil.rmtree(directory, ignore_errors=True)
    if _OWNS_CACHE:
        shutil.rmtree(os.environ.pop(_CACHE_DIR), ignore_errors=True)
