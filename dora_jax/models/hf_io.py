"""Hugging Face checkpoint files: safetensors (through the ``safetensors`` library: headers checked by it, tensors
memory-mapped, files written atomically) and ``config.json`` <-> :class:`~dora_jax.config.ModelConfig`.

bfloat16 and fp8 come from ``ml_dtypes``. Every error names the file and, where relevant, the tensor.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, Iterator

import ml_dtypes
import numpy as np
import safetensors

from dora_jax.config import ModelConfig, RopeScaling


class WeightsError(ValueError):
    """Weight files are missing, corrupt, or do not match the model configuration."""


# Safetensors dtype codes -> numpy dtypes (bfloat16 and the fp8 types from ml_dtypes). Weights must be floating
# point; the integer and bool codes are read so that a tensor of the wrong kind is named, not misread.
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
# What ``safetensors.TensorSpec`` calls each dtype when writing.
_SPEC_NAMES = {np.dtype(np.float64): "float64", np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
               np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
               np.dtype(ml_dtypes.float8_e5m2): "float8_e5m2", np.dtype(np.int64): "int64",
               np.dtype(np.int32): "int32", np.dtype(np.int16): "int16", np.dtype(np.int8): "int8",
               np.dtype(np.uint8): "uint8", np.dtype(np.bool_): "bool"}


def _diagnose(path: str, size: int, error: Exception) -> str:
    """Why ``safetensors`` refused ``path``, naming the tensor where the header can still be read."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError, MemoryError, OverflowError):
        header = None
    if not isinstance(header, dict):
        return f"{path}: corrupt safetensors header ({error})"
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        begin, end = (info.get("data_offsets") or (0, 0))[:2]
        if isinstance(end, int) and 8 + n + end > size:
            return (f"{path}: tensor {name!r} runs past the end of the file (needs bytes up to {8 + n + end}, the "
                    f"file has {size}); the file is truncated")
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is not None and isinstance(begin, int) and isinstance(end, int):
            want = int(np.prod(info.get("shape", []), dtype=np.int64)) * np.dtype(dt).itemsize
            if end - begin != want:
                return (f"{path}: tensor {name!r} has {end - begin} bytes, expected {want} for shape "
                        f"{info.get('shape')} {info.get('dtype')}")
    return f"{path}: corrupt safetensors header ({error})"


class SafetensorsFile:
    """One ``.safetensors`` file: its header checked by the ``safetensors`` library, tensors read lazily as
    read-only numpy arrays over a memory map of the file (bfloat16 and fp8 through ``ml_dtypes``)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with safetensors.safe_open(path, framework="numpy") as f:
                self.metadata = f.metadata() or {}
                self._info = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                              for name in f.keys()}
        except OSError as e:
            raise WeightsError(f"cannot open safetensors file {path}: {e.strerror}") from None
        except safetensors.SafetensorError as e:
            raise WeightsError(_diagnose(path, size, e)) from None
        for name, (code, _) in self._info.items():
            if code not in _ST_DTYPES:
                raise WeightsError(f"{path}: tensor {name!r} has dtype {code}, which dora-jax cannot read "
                                   f"(weights: {', '.join(FLOAT_CODES)})")
        # The library checked that every tensor's bytes lie inside the file and match its dtype and shape;
        # their offsets come from the (now known good) JSON header.
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offsets = {name: 8 + n + header[name]["data_offsets"][0] for name in self._info}

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype code (``"BF16"``, ``"F8_E4M3"``, ...)."""
        return self._info[name][0]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array backed by the file mapping."""
        code, shape = self._info[name]
        dt = np.dtype(_ST_DTYPES[code])
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mm, dtype=dt, count=count, offset=self._offsets[name]).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` to ``path`` with the ``safetensors`` library (via a temporary file and rename, so a crash
    leaves no partial file)."""
    specs, keep = {}, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _SPEC_NAMES:
            raise WeightsError(f"cannot write tensor {name!r} of dtype {arr.dtype} to safetensors")
        keep.append(arr)  # the library reads through the pointer: the array must outlive the call
        specs[name] = safetensors.TensorSpec(dtype=_SPEC_NAMES[arr.dtype], shape=list(arr.shape),
                                             data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    tmp = path + ".tmp"
    safetensors.serialize_file(specs, tmp, dict(metadata or {"format": "pt"}))
    del keep
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
        quant = self.config.get("quantization_config")
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "fp8"):
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise WeightsError(f"{cfg_path}: quantization_config with quant_method {method!r} is not supported "
                               "(supported: unquantized float weights, and 'fp8' with or without block scales)")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as the header records it (nothing is read)."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in its safetensors files")
        return self._where[name].shape(name)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype code (``"BF16"``, ``"F8_E4M3"``, ...)."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in its safetensors files")
        return self._where[name].dtype(name)

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored, except that an fp8 weight with a ``<name>_scale_inv`` beside it (Hugging Face's
        fine-grained FP8: one scale per block of ``quantization_config.weight_block_size``) comes back as float32
        multiplied by its block scales."""
        if name not in self._where:
            raise WeightsError(f"{self.directory}: tensor {name!r} not found in its safetensors files")
        sf = self._where[name]
        w = sf.get(name)
        scale_name = name + "_scale_inv"
        if not sf.dtype(name).startswith("F8_") or scale_name not in self._where:
            return w
        scale = np.asarray(self._where[scale_name].get(scale_name), np.float32)
        if scale.ndim == 0 or scale.size == 1:
            return w.astype(np.float32) * scale.reshape(())
        if scale.ndim != w.ndim:
            raise WeightsError(f"{self.where(scale_name)}: tensor {scale_name!r} has shape {scale.shape}, which "
                               f"does not give block scales for {name!r} of shape {w.shape}")
        quant = self.config.get("quantization_config") or {}
        blocks = quant.get("weight_block_size")  # the last block along an axis may be partial
        if not (isinstance(blocks, list) and len(blocks) == w.ndim and all(isinstance(b, int) and b > 0
                                                                           for b in blocks)):
            blocks = [n // s if s and n % s == 0 else 0 for n, s in zip(w.shape, scale.shape)]
        if any(b <= 0 or -(-n // b) != s for n, b, s in zip(w.shape, blocks, scale.shape)):
            raise WeightsError(f"{self.where(scale_name)}: tensor {scale_name!r} has shape {scale.shape}, which "
                               f"does not give block scales for {name!r} of shape {w.shape}")
        full = scale
        for axis, b in enumerate(blocks):
            full = np.repeat(full, b, axis=axis)
        return w.astype(np.float32) * full[tuple(slice(0, n) for n in w.shape)]

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
