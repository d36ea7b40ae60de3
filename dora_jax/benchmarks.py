"""Benchmarks behind ``dora-jax bench``. Each returns a JSON-able dict; ratios are measured side by side in
one run, because the machines this runs on are shared and noisy.

References (transformers + torch) are optional: when absent, only our side is measured.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import jax


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def bench_load(config: str = "smollm2_135m", repeats: int = 2) -> dict[str, Any]:
    """Time to load the config's weights (GGUF dequantization included) and run one forward, ours vs
    transformers' own GGUF loader, best of ``repeats``."""
    import jax.numpy as jnp

    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model

    cfg = load_config(config)
    ours = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model, _ = load_model(cfg.model, progress=False)
        jax.block_until_ready(model.embed[...])
        ours.append(time.perf_counter() - t0)
        del model
    out: dict[str, Any] = {"config": config, "weights": cfg.model.weights, "ours_load_s": min(ours)}
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return {**out, "hf_load_s": None, "machine": machine()}
    from dora_jax.models.weights import open_weights

    path = open_weights(cfg.model.weights).path
    if not path.endswith(".gguf"):
        path_kw = dict(pretrained_model_name_or_path=path)
    else:
        path_kw = dict(pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = transformers.AutoModelForCausalLM.from_pretrained(**path_kw)
        hf.append(time.perf_counter() - t0)
        del m
    return {**out, "hf_load_s": min(hf), "speedup": min(hf) / min(ours), "machine": machine()}
