"""Logits of our decoder equal transformers' on tiny random Llama / Qwen2 / Qwen3 models.

The reference is torch + transformers on the CPU in float32. Each model is written by transformers'
``save_pretrained`` and read back by our Hugging Face loader, so the layout mapping is checked too.
"""


import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import rel_err
from dora_jax.models.weights import load_model, model_config_from_weights

VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 128, 64, 4, 16, 2


def make_hf(family: str, kv_heads: int, tied: bool, bias: bool = False, llama3: bool = False):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, head_dim=HEAD_DIM)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if llama3 else \
            {"rope_type": "default", "rope_theta": 10000.0}
        cfg = transformers.LlamaConfig(**common, attention_bias=bias, rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random norms and biases, so that a mix-up of them cannot go unnoticed
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


CASES = [
    # family, kv_heads (GQA ratio 1, 2, all heads), tied, qkv bias, llama3 rope
    ("llama", 4, False, False, False),
    ("llama", 2, True, False, False),
    ("llama", 1, False, False, True),
    ("llama", 2, False, True, True),
    ("qwen2", 2, True, True, False),
    ("qwen2", 1, False, True, False),
    ("qwen3", 4, True, False, False),
    ("qwen3", 2, False, False, False),
]


@pytest.mark.parametrize("family,kv_heads,tied,bias,llama3", CASES)
def test_logits_match_transformers(tmp_path, torch_threads, family, kv_heads, tied, bias, llama3):
    hf = make_hf(family, kv_heads, tied, bias, llama3)
    hf.save_pretrained(tmp_path)
    cfg = model_config_from_weights(str(tmp_path))
    assert (cfg.family, cfg.num_kv_heads, cfg.tie_embeddings, cfg.qkv_bias or family == "qwen2") == \
        (family, kv_heads, tied, bias or family == "qwen2")
    assert (cfg.rope_scaling is not None) == llama3
    model, _ = load_model(cfg, progress=False)

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (2, 100))  # past original_max_position_embeddings, where llama3 scaling bites
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert rel_err(ours, ref) <= 1e-4


def test_padding_and_packing_masks(tmp_path, torch_threads):
    """Two sequences packed in one row (segments 1, 2, then padding) equal each run alone in transformers."""
    hf = make_hf("llama", 2, False)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(model_config_from_weights(str(tmp_path)), progress=False)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, VOCAB, 7), rng.integers(0, VOCAB, 5)
    packed = np.concatenate([a, b, np.zeros(4, int)])[None]
    seg = np.array([[1] * 7 + [2] * 5 + [0] * 4])
    pos = np.array([list(range(7)) + list(range(5)) + [0] * 4])
    ours = np.asarray(model(jnp.asarray(packed), jnp.asarray(pos), jnp.asarray(seg)))[0]
    with torch.no_grad():
        ref_a = hf(torch.tensor(a[None])).logits.numpy()[0]
        ref_b = hf(torch.tensor(b[None])).logits.numpy()[0]
    assert rel_err(ours[:7], ref_a) <= 1e-4
    assert rel_err(ours[7:12], ref_b) <= 1e-4
    assert np.all(np.isfinite(ours))
