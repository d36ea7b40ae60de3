"""Bad weights and configs stop with a clear message naming the file, tensor or field."""

import json
import os
import shutil

import pytest
import torch
import transformers

from dora_jax.config import ConfigError, MeshConfig, load_config
from dora_jax.models.hf_io import WeightsError
from dora_jax.models.weights import load_model, model_config_from_weights
from dora_jax.sharding import create_mesh


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


def _copy(src, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_files(tmp_path, hf_dir):
    with pytest.raises(WeightsError, match="nowhere.*not found"):
        model_config_from_weights(str(tmp_path / "nowhere"))
    d = _copy(hf_dir, tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(WeightsError, match=f"{d}: no \\*.safetensors"):
        load_model(model_config_from_weights(d), progress=False)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(WeightsError, match=f"{d}: no config.json"):
        model_config_from_weights(d)


def test_truncated_safetensors(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(WeightsError, match="model.safetensors: tensor .* runs past the end of the file"):
        load_model(model_config_from_weights(d), progress=False)
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(WeightsError, match="model.safetensors: corrupt safetensors header"):
        load_model(model_config_from_weights(d), progress=False)


def test_unsupported_architecture(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(WeightsError, match="config.json: unsupported architecture .*GPT2LMHeadModel"):
        model_config_from_weights(d)


def test_tensor_shape_mismatch_names_tensor(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["intermediate_size"] = 40  # the file's MLP tensors are 48 wide
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(WeightsError, match=r"model.layers.0.mlp.gate_proj.weight.*shape \(48, 32\).*intermediate_size"):
        load_model(model_config_from_weights(d), progress=False)


def test_config_disagreeing_with_weights_names_fields(hf_dir):
    cfg = model_config_from_weights(hf_dir)
    import dataclasses

    bad = dataclasses.replace(cfg, num_layers=3, num_kv_heads=4)
    with pytest.raises(ConfigError, match=r"model.num_layers = 3 but the weights have 2[\s\S]*model.num_kv_heads = 4"):
        load_model(bad, progress=False)


def test_mesh_axis_not_dividing(hf_dir):
    cfg = model_config_from_weights(hf_dir)  # 2 kv heads
    mesh = create_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    with pytest.raises(ConfigError, match=r"param wk: dimension 2 \(logical axis 'kv_heads'\) of size 2"):
        load_model(cfg, mesh, progress=False)


def test_bad_config_files(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  num_heads: 6\n  num_kv_heads: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: config field 'model.num_kv_heads' = 4: must divide num_heads"):
        load_config(str(p))
    p.write_text("model:\n  hidden_sise: 6\n")
    with pytest.raises(ConfigError, match="unknown config field 'model.hidden_sise'"):
        load_config(str(p))
    p.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="c.yaml: not valid YAML"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="config file 'no_such' not found"):
        load_config("no_such")


def _edit_config(d, **changes):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        c = json.load(f)
    for k, v in changes.items():
        if v is KeyError:
            del c[k]
        else:
            c[k] = v
    with open(path, "w") as f:
        json.dump(c, f)


@pytest.mark.parametrize("changes,message", [
    (dict(vocab_size=KeyError), r"config.json: no 'vocab_size'"),
    (dict(num_attention_heads="4"), r"config.json: 'num_attention_heads' = '4' must be an integer > 0"),
    (dict(num_attention_heads=0), r"config.json: 'num_attention_heads' = 0 must be an integer > 0"),
    (dict(rms_norm_eps="small"), r"config.json: 'rms_norm_eps' = 'small' must be a number > 0"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), r"config.json: no rope scaling 'low_freq_factor'"),
    (dict(rope_parameters=[1, 2]), r"config.json: 'rope_parameters' = \[1, 2\] must be a mapping"),
    (dict(rope_parameters=KeyError, rope_scaling={"type": "linear", "factor": "x"}),
     r"config.json: rope scaling 'factor' = 'x' must be a number > 0"),
    (dict(num_attention_heads=3), r"copy: the weights describe a model dora-jax cannot build: config field "
                                  r"'model.num_kv_heads' = 2: must divide num_heads \(3\)"),
])
def test_bad_hf_config_fields_are_named(tmp_path, hf_dir, changes, message):
    d = _copy(hf_dir, tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(WeightsError, match=message):
        model_config_from_weights(d)


def test_unreadable_hf_json_files(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path)
    with open(os.path.join(d, "config.json"), "ab") as f:
        f.write(b'\n"\xff"')
    with pytest.raises(WeightsError, match=r"config.json: line \d+ is not UTF-8 text"):
        model_config_from_weights(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(WeightsError, match=r"config.json: expected a JSON object, got list"):
        model_config_from_weights(d)
    d2 = _copy(hf_dir, tmp_path / "2")
    with open(os.path.join(d2, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": ["model.safetensors"]}, f)
    with pytest.raises(WeightsError, match=r"index.json: expected \{\"weight_map\""):
        model_config_from_weights(d2)


def test_generation_without_a_tokenizer_is_named(hf_dir):
    from dora_jax.config import load_config
    from dora_jax.rollout.chat import load_chat_model

    one = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]
    with pytest.raises(WeightsError, match=r"model.weights is not set \(random init\): generation needs the "
                                           r"tokenizer"):
        load_chat_model(load_config("tiny_llama", one + ["model.num_layers=1"]), progress=False)
    cfg = load_config("tiny_llama", one)
    import dataclasses

    cfg = dataclasses.replace(cfg, model=model_config_from_weights(hf_dir))  # save_pretrained wrote no tokenizer
    with pytest.raises(WeightsError, match=r"carries no tokenizer \(a Hugging Face directory needs tokenizer.json"):
        load_chat_model(cfg, progress=False)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, hf_dir):
    """Token ids past the embedding table would be clamped by the lookup: garbage output, no error."""
    from dora_jax.tokenizer import Tokenizer

    d = _copy(hf_dir, tmp_path)  # vocab_size 64
    tokens = [chr(ord("A") + i) for i in range(70)]
    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}).save_hf(d)
    with pytest.raises(WeightsError, match=r"copy: the tokenizer has 70 tokens but the model's vocabulary "
                                           r"\(model.vocab_size\) is 64"):
        load_model(model_config_from_weights(d), progress=False)
    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens[:64]}).save_hf(d)
    assert load_model(model_config_from_weights(d), progress=False)[1].vocab_size == 64
