"""Models by Hub name: a Qwen2.5-style snapshot laid out in a temporary Hugging Face cache on disk, loaded as
``ORG/NAME`` with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it. Nothing here touches the network."""

import json
import os

import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.models.hf_io import WeightsError, hf_config_from_model, write_safetensors
from dora_jax.models.weights import is_hub_name, load_model, model_config_from_weights, param_table
from dora_jax.tokenizer import Tokenizer

REV = "0123456789abcdef0123456789abcdef01234567"
QWEN = ModelConfig(family="qwen2", vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, qkv_bias=True, rope_theta=1000000.0, tie_embeddings=True,
                   rms_norm_eps=1e-6, max_seq_len=256)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``HF_HUB_CACHE/models--acme--tiny-qwen/snapshots/REV`` with config, tokenizer and weights; refs/main."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-qwen"
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    rng = np.random.default_rng(0)
    tensors = {}
    for spec in param_table(QWEN):
        for name in ([spec.hf.format(i=i) for i in range(QWEN.num_layers)] if spec.stacked else [spec.hf]):
            tensors[name] = rng.normal(0, 0.3, spec.hf_shape).astype(np.float32)
    write_safetensors(str(snap / "model.safetensors"), tensors)
    (snap / "config.json").write_text(json.dumps(hf_config_from_model(QWEN)))
    tokens = [chr(ord("A") + i) for i in range(26)] + [chr(ord("a") + i) for i in range(26)] + list("0123456789 ?\n")
    tokens += ["<|im_start|>", "<|im_end|>"]
    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                         "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
                         "tokenizer.ggml.eos_token_id": len(tokens) - 1,
                         "tokenizer.chat_template": TEMPLATE}).save_hf(str(snap))
    import huggingface_hub.constants as hc

    # huggingface_hub reads these variables when it is imported: set them, and its copies, for this test.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    return snap, tensors


def test_a_model_loads_by_hub_name_offline(hub_cache):
    snap, tensors = hub_cache
    cfg = model_config_from_weights("acme/tiny-qwen")
    assert cfg.weights == "acme/tiny-qwen"
    assert (cfg.family, cfg.qkv_bias, cfg.tie_embeddings, cfg.num_layers, cfg.vocab_size) == ("qwen2", True, True, 2, 80)
    model, tok = load_model(cfg, progress=False)
    np.testing.assert_array_equal(np.asarray(model.bq[...])[1], tensors["model.layers.1.self_attn.q_proj.bias"].reshape(4, 8))
    np.testing.assert_array_equal(np.asarray(model.embed[...]), tensors["model.embed_tokens.weight"])
    assert tok.vocab_size == 67 and tok.eos_ids[0] == 66
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # a revision by its hash is the same snapshot
    assert model_config_from_weights(f"acme/tiny-qwen@{REV}").num_layers == 2


def test_a_model_missing_from_the_cache_is_named(hub_cache, tmp_path):
    with pytest.raises(WeightsError, match=r"weights 'acme/absent': not in the Hugging Face cache at .*hub, and "
                                           r"HF_HUB_OFFLINE is set"):
        model_config_from_weights("acme/absent")


def test_hub_names_and_paths_are_told_apart(tmp_path):
    assert is_hub_name("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_name("acme/tiny@main")
    assert not is_hub_name("smollm2") and not is_hub_name("./a/b") and not is_hub_name("/abs/path")
    assert not is_hub_name("dir/model.gguf") and not is_hub_name("a/b/c")
    os.makedirs(tmp_path / "org" / "name")
    assert not is_hub_name(str(tmp_path / "org" / "name"))
