"""Hugging Face checkpoint files: safetensors (read lazily through mmap, written atomically) and
``config.json`` <-> :class:`~dora_jax.config.ModelConfig`.

Plain numpy; bfloat16 comes from ``ml_dtypes``. Every error names the file and, where relevant, the tensor.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from dora_jax.config import ModelConfig, RopeScaling


class WeightsError(ValueError):
    """Weight files are missing, corrupt, or do not match the model configuration."""


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped; tensors are read only when asked for."""

    def __init__(self, path: str):
        self.path = path
        try:
            f = open(path, "rb")
        except OSError as e:
            raise WeightsError(f"cannot open safetensors file {path}: {e.strerror}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise WeightsError(f"{path}: corrupt safetensors header (claims {n} header bytes, file has "
                                   f"{size - 8})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise WeightsError(f"{path}: corrupt safetensors header ({e})") from None
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        self._info: dict[str, dict[str, Any]] = header
        for name, info in header.items():
            begin, end = info.get("data_offsets", (0, -1))
            if info.get("dtype") not in _ST_DTYPES:
                raise WeightsError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            if self._base + end > size:
                raise WeightsError(f"{path}: tensor {name!r} runs past the end of the file (truncated file?)")
            want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
            if end - begin != want:
                raise WeightsError(f"{path}: tensor {name!r} has {end - begin} bytes, expected {want} for shape "
                                   f"{info['shape']} {info['dtype']}")

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array backed by the file mapping."""
        info = self._info[name]
        begin, end = info["data_offsets"]
        arr = np.frombuffer(self._mm, dtype=_ST_DTYPES[info["dtype"]], count=(end - begin) //
                            np.dtype(_ST_DTYPES[info["dtype"]]).itemsize, offset=self._base + begin)
        return arr.reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` to ``path`` (via a temporary file and rename, so a crash leaves no partial file)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise WeightsError(f"cannot write tensor {name!r} of dtype {arr.dtype} to safetensors")
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    from dora_jax.textfiles import TextFileError, read_text

    try:
        return json.loads(read_text(path))
    except TextFileError as e:
        raise WeightsError(str(e)) from None
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None


class HFCheckpoint:
    """A Hugging Face model directory: ``config.json`` plus one or many ``*.safetensors`` files."""

    def __init__(self, directory: str):
        self.directory = directory
        cfg_path = os.path.join(directory, "config.json")
        if not os.path.isfile(cfg_path):
            raise WeightsError(f"{directory}: no config.json (expected a Hugging Face model directory)")
        self.config = _read_json(cfg_path)
        if not isinstance(self.config, dict):
            raise WeightsError(f"{cfg_path}: expected a JSON object, got {type(self.config).__name__}")
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = _read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise WeightsError(f"{index}: expected {{\"weight_map\": {{tensor name: file name}}}}")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise WeightsError(f"{directory}: no *.safetensors files")
        self._files = {}
        for name in files:
            p = os.path.join(directory, name)
            if not os.path.isfile(p):
                raise WeightsError(f"{index}: lists {name}, which is missing from {directory}")
            self._files[name] = SafetensorsFile(p)
        self._where = {}
        for fname, sf in self._files.items():
            for key in sf.keys():
                self._where[key] = sf
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in self._where:
                    raise WeightsError(f"{index}: tensor {key!r} should be in {fname} but is not")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in its safetensors files")
        return self._where[name].get(name)

    def where(self, name: str) -> str:
        return self._where[name].path if name in self._where else self.directory


# ----------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

_FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MistralForCausalLM": "llama"}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


REQUIRED = object()


def typed_field(c: dict[str, Any], key: str, kind: type, where: str, default: Any = REQUIRED,
                positive: bool = False, path: str = "") -> Any:
    """``c[key]`` checked to be a ``kind`` (int, float or dict), else a WeightsError naming the file and key."""
    if key not in c or (c[key] is None and default is not REQUIRED):
        if default is REQUIRED:
            raise WeightsError(f"{where}: no {path}{key!r}, which the model needs")
        return default
    v = c[key]
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    else:
        ok = isinstance(v, kind) and not isinstance(v, bool)
    if ok and positive:
        ok = v > 0
    if not ok:
        what = {int: "an integer", float: "a number", dict: "a mapping"}[kind]
        raise WeightsError(f"{where}: {path}{key!r} = {v!r} must be {what}{' > 0' if positive else ''}")
    return float(v) if kind is float else v


def model_fields_from_hf_config(c: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig fields described by a Hugging Face ``config.json``.

    Raises:
      WeightsError: for a missing or mistyped field, or an unsupported architecture or feature, naming
        ``where``.
    """
    if not isinstance(c, dict):
        raise WeightsError(f"{where}: expected a JSON object, got {type(c).__name__}")
    archs = c.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    family = next((_FAMILIES[a] for a in archs if isinstance(a, str) and a in _FAMILIES), None)
    if family is None:
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(str(c.get("model_type", "")))
    if family is None:
        raise WeightsError(f"{where}: unsupported architecture {archs or c.get('model_type')!r}; supported: "
                           f"{', '.join(_ARCH.values())}")
    if c.get("use_sliding_window") or (family == "llama" and c.get("sliding_window")):
        raise WeightsError(f"{where}: sliding-window attention is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
    if c.get("mlp_bias"):
        raise WeightsError(f"{where}: mlp_bias is not supported")

    def size(key: str, default: Any = REQUIRED) -> int:
        return typed_field(c, key, int, where, default, positive=True)

    heads, hidden = size("num_attention_heads"), size("hidden_size")
    rope = typed_field(c, "rope_parameters", dict, where, {})
    scaling = typed_field(c, "rope_scaling", dict, where, {})
    rope_theta = typed_field(rope, "rope_theta", float, where, None, positive=True, path="rope_parameters.")
    if rope_theta is None:
        rope_theta = typed_field(c, "rope_theta", float, where, 10000.0, positive=True)
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    params = {**scaling, **rope}

    def scale(key: str, kind: type = float) -> Any:
        return typed_field(params, key, kind, where, positive=True, path="rope scaling ")

    rs = None
    if rope_type == "llama3":
        rs = RopeScaling(type="llama3", factor=scale("factor"), low_freq_factor=scale("low_freq_factor"),
                         high_freq_factor=scale("high_freq_factor"),
                         original_max_position_embeddings=scale("original_max_position_embeddings", int))
    elif rope_type == "linear":
        rs = RopeScaling(type="linear", factor=scale("factor"))
    elif rope_type not in ("default", None):
        raise WeightsError(f"{where}: rope type {rope_type!r} is not supported (default, linear, llama3)")
    if hidden % heads and "head_dim" not in c:
        raise WeightsError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                           "there is no head_dim")
    return dict(
        family=family,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size"),
        num_layers=size("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=size("num_key_value_heads", heads),
        head_dim=size("head_dim", hidden // heads),
        rope_theta=rope_theta,
        rope_scaling=rs,
        rms_norm_eps=typed_field(c, "rms_norm_eps", float, where, 1e-6, positive=True),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get("attention_bias", False)) or family == "qwen2",
        o_bias=bool(c.get("attention_bias", False)) and family != "qwen2",
        qk_norm=family == "qwen3",
        max_seq_len=size("max_position_embeddings", 2048),
    )


def hf_config_from_model(cfg: ModelConfig, tokenizer_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` that ``transformers`` loads into the matching ``*ForCausalLM``.

    Raises:
      WeightsError: if the bias settings cannot be expressed (Llama/Qwen3 tie q/k/v/o biases together; Qwen2
        always has q/k/v biases and no o bias).
    """
    expressible = (cfg.qkv_bias and not cfg.o_bias) if cfg.family == "qwen2" else cfg.qkv_bias == cfg.o_bias
    if not expressible:
        raise WeightsError(f"model.family={cfg.family!r} with qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias} has "
                           f"no Hugging Face equivalent")
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope = {"rope_theta": cfg.rope_theta, "rope_type": rs.type, "factor": rs.factor}
        if rs.type == "llama3":
            rope.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                        original_max_position_embeddings=rs.original_max_position_embeddings)
    out = {
        "architectures": [_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.o_bias,
        "torch_dtype": cfg.param_dtype,
        "use_sliding_window": False,
    }
    if tokenizer_ids:
        out.update({k: v for k, v in tokenizer_ids.items() if v is not None})
    return out
