"""Test setup: 8 fake CPU devices for sharding tests, float32 everywhere, shared fixtures."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# No persistent compilation cache: with jaxlib 0.10 on CPU, a program loaded back from it (rather than compiled
# in the process) aborted a runner test now and then. Tests compile what they run.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

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
