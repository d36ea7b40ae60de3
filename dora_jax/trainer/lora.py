"""Low-rank adapters on the stacked projection weights.

For a target weight ``W`` stored ``[layers, in..., out...]`` the adapter is ``a [layers, in, r]`` and
``b [layers, r, out]`` (``in``/``out`` flattened) and the merged weight is ``W + (alpha / r) * a @ b``; in the
HF ``[out, in]`` convention that is ``W^T + scale * B @ A`` with ``B = b^T`` and ``A = a^T``. ``b`` starts at
zero, so training starts from the base policy exactly. Only the adapters are differentiated, optimized and
(in the version store) kept per version; the base weights stay frozen and shared.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.config import LoraConfig

# target name -> (parameter name, number of leading "in" dims after the layer axis)
TARGETS = {"q": ("wq", 1), "k": ("wk", 1), "v": ("wv", 1), "o": ("wo", 2),
           "gate": ("w_gate", 1), "up": ("w_up", 1), "down": ("w_down", 1)}

LoraParams = dict[str, dict[str, jax.Array]]


def _split(shape: tuple[int, ...], n_in: int) -> tuple[int, int, int]:
    return shape[0], math.prod(shape[1:1 + n_in]), math.prod(shape[1 + n_in:])


def init_lora(base: nnx.State, cfg: LoraConfig, key: jax.Array) -> LoraParams:
    """Adapters for ``cfg.targets``: ``a`` ~ N(0, 1/in), ``b`` = 0 (float32)."""
    out: LoraParams = {}
    for i, target in enumerate(cfg.targets):
        name, n_in = TARGETS[target]
        layers, d_in, d_out = _split(tuple(base[name][...].shape), n_in)
        a = jax.random.normal(jax.random.fold_in(key, i), (layers, d_in, cfg.rank), jnp.float32) / math.sqrt(d_in)
        out[name] = {"a": a, "b": jnp.zeros((layers, cfg.rank, d_out), jnp.float32)}
    return out


def lora_delta(weight_shape: tuple[int, ...], a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * a @ b`` per layer, reshaped to the weight's shape."""
    return (scale * jnp.einsum("lir,lro->lio", a, b)).reshape(weight_shape)


def merge(base: nnx.State, lora: LoraParams, cfg: LoraConfig) -> nnx.State:
    """The policy's full parameters: ``base`` with every adapter folded in (same structure and dtypes)."""
    scale = cfg.alpha / cfg.rank

    def fold(path: tuple[Any, ...], w: jax.Array) -> jax.Array:
        name = path[0].key
        if name not in lora:
            return w
        delta = lora_delta(w.shape, lora[name]["a"], lora[name]["b"], scale)
        return (w.astype(jnp.float32) + delta).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(fold, base)
