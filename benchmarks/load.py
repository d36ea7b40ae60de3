"""``dora-jax bench load``: loading a config's weights, ours against transformers' own loader."""

from __future__ import annotations

import os
from typing import Any

import jax

from benchmarks.record import machine
from benchmarks.timing import best_of


def bench_load(config: str = "smollm2_135m", repeats: int = 2, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Time to load the config's weights (GGUF dequantization included) and place them on the device, ours
    against transformers' ``from_pretrained`` (its own GGUF loader), best of ``repeats`` each.

    Args:
      config: a shipped preset or YAML file.
      repeats: loads per side.
      overrides: ``key=value`` config overrides.

    Returns:
      ``ours_load_s``, ``hf_load_s`` (None without torch and transformers) and ``speedup``.
    """
    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model

    cfg = load_config(config, overrides)

    def ours():  # returns nothing: the model is freed before the next load
        model, _ = load_model(cfg.model, progress=False)
        jax.block_until_ready(model.embed[...])

    ours_s = best_of(ours, repeats=repeats, warmup=0)
    out: dict[str, Any] = {"config": config, "weights": cfg.model.weights, "ours_load_s": ours_s}
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

    def theirs():
        transformers.AutoModelForCausalLM.from_pretrained(**path_kw)

    hf_s = best_of(theirs, repeats=repeats, warmup=0)
    return {**out, "hf_load_s": hf_s, "speedup": hf_s / ours_s, "machine": machine()}
