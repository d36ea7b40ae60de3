"""Test setup: 8 fake CPU devices for sharding tests, float32 everywhere, shared fixtures."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Many tests build the same tiny programs in fresh jit closures (and in child processes, which inherit this
# environment): JAX's persistent compilation cache turns every repeat into a lookup. Entries are keyed by the
# program, its options, the backend and the JAX version, so a stale entry is never used.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                                   "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the relative error used by every numeric test."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


@pytest.fixture(scope="session")
def torch_threads():
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return torch
