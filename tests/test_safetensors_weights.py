"""Safetensors weights through the ``safetensors`` library: bad files and bad tensors refused naming the tensor
(or the header) and the file, shapes checked in the Hugging Face layout before any change of layout, fp8 loaded."""

import json
import os
import re

import ml_dtypes
import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.models.hf_io import WeightsError, hf_config_from_model, write_safetensors
from dora_jax.models.weights import load_model, model_config_from_weights, param_table

# q_proj is [num_heads * head_dim, hidden] = [64, 32] in the Hugging Face layout.
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16)
Q = "model.layers.0.self_attn.q_proj.weight"


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for spec in param_table(CFG):
        names = [spec.hf.format(i=i) for i in range(CFG.num_layers)] if spec.stacked else [spec.hf]
        for n in names:
            out[n] = rng.normal(0, 0.5, spec.hf_shape).astype(np.float32)
    return out


def _write_dir(d, tensors, config=None) -> str:
    os.makedirs(d, exist_ok=True)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config or hf_config_from_model(CFG), f)
    return str(d)


def _load(d):
    return load_model(model_config_from_weights(d), progress=False)[0]


def test_good_directory_loads(tmp_path):
    t = _tensors()
    model = _load(_write_dir(tmp_path / "ok", t))
    np.testing.assert_array_equal(np.asarray(model.wq[...])[0], t[Q].T.reshape(32, 4, 16))


@pytest.mark.parametrize("shape", [(32, 64), (2, 32, 32), (64,)], ids=["transposed", "3-D", "1-D"])
def test_wrong_shape_is_named_in_the_hf_layout(tmp_path, shape):
    t = _tensors()
    t[Q] = np.zeros(shape, np.float32)
    d = _write_dir(tmp_path / "bad", t)
    path = os.path.join(d, "model.safetensors")
    with pytest.raises(WeightsError, match=rf"{path} \(tensor '{Q}'\): shape {re.escape(str(tuple(shape)))}, but the config expects "
                                           rf"\(64, 32\) \(Hugging Face layout"):
        _load(d)


def test_wrong_dtype_is_named(tmp_path):
    t = _tensors()
    t[Q] = np.zeros((64, 32), np.int32)
    d = _write_dir(tmp_path / "bad", t)
    with pytest.raises(WeightsError, match=rf"model.safetensors \(tensor '{Q}'\): dtype I32, but weights must be "
                                           r"floating point"):
        _load(d)


def test_missing_tensor_is_named(tmp_path):
    t = _tensors()
    del t[Q]
    d = _write_dir(tmp_path / "bad", t)
    with pytest.raises(WeightsError, match=rf"{d}: tensor '{Q}' is missing \(needed for parameter 'wq'\)"):
        _load(d)


def test_truncated_body_names_the_tensor_and_file(tmp_path):
    d = _write_dir(tmp_path / "bad", _tensors())
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(WeightsError, match=rf"{path}: tensor '[\w.]+' runs past the end of the file .* the file is "
                                           r"truncated"):
        _load(d)


@pytest.mark.parametrize("blob", [b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......", b"\x01\x02",
                                  b"\xff" * 8 + b"{}"], ids=["json", "short", "length"])
def test_corrupt_header_is_named(tmp_path, blob):
    d = _write_dir(tmp_path / "bad", _tensors())
    path = os.path.join(d, "model.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    with pytest.raises(WeightsError, match=rf"{path}: corrupt safetensors header"):
        _load(d)


def test_write_is_atomic_and_refuses_unknown_dtypes(tmp_path):
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, {"a": np.ones(3, np.float32)})
    with pytest.raises(WeightsError, match="cannot write tensor 'b' of dtype complex64"):
        write_safetensors(path, {"b": np.ones(3, np.complex64)})
    assert os.listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.parametrize("code,dtype", [("BF16", ml_dtypes.bfloat16), ("F16", np.float16),
                                        ("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E5M2", ml_dtypes.float8_e5m2)])
def test_low_precision_files_load(tmp_path, code, dtype):
    t = {k: v.astype(dtype) for k, v in _tensors().items()}
    d = _write_dir(tmp_path / code, t)
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        f.seek(8)
        assert f'"dtype":"{code}"' in f.read(400).decode(errors="replace")
    model = _load(d)
    np.testing.assert_array_equal(np.asarray(model.wq[...])[0], t[Q].astype(np.float32).T.reshape(32, 4, 16))


def test_fp8_with_block_scales_loads_dequantized(tmp_path):
    """Hugging Face's fine-grained FP8: ``<name>_scale_inv`` holds one scale per 16 x 16 block here (the last
    block of the 48-wide MLP weights is whole; of the 64-row vocab too)."""
    t = _tensors()
    stored = dict(t)
    block = 16
    for name in [n for n in t if n.endswith("proj.weight")]:
        w = t[name]
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        scale = np.full((rows, cols), 0.25, np.float32)
        scale[0, 0] = 0.5
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
        stored[name] = (w / full).astype(ml_dtypes.float8_e4m3fn)
        stored[name + "_scale_inv"] = scale
        t[name] = stored[name].astype(np.float32) * full
    config = hf_config_from_model(CFG)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    model = _load(_write_dir(tmp_path / "fp8", stored, config))
    np.testing.assert_allclose(np.asarray(model.wq[...])[0], t[Q].T.reshape(32, 4, 16), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.w_down[...])[0],
                               t["model.layers.0.mlp.down_proj.weight"].T, rtol=1e-6)


def test_other_quantization_is_refused(tmp_path):
    config = hf_config_from_model(CFG)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    d = _write_dir(tmp_path / "gptq", _tensors(), config)
    with pytest.raises(WeightsError, match=r"config.json: quantization_config with quant_method 'gptq' is not "
                                           r"supported"):
        _load(d)
