"""Export round trip: our params -> Hugging Face directory -> transformers -> same logits."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from conftest import rel_err
from dora_jax.config import ModelConfig, RopeScaling
from dora_jax.models.build import init_model
from dora_jax.models.hf_io import WeightsError
from dora_jax.models.weights import export_hf, load_model, model_config_from_weights

CASES = {
    "llama_untied_llama3": ModelConfig(family="llama", vocab_size=100, hidden_size=32, intermediate_size=48,
                                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, init_std=0.1,
                                       rope_scaling=RopeScaling(original_max_position_embeddings=16)),
    "qwen2_tied": ModelConfig(family="qwen2", vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2,
                              num_heads=4, num_kv_heads=1, head_dim=8, qkv_bias=True, tie_embeddings=True,
                              init_std=0.1),
    "qwen3": ModelConfig(family="qwen3", vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, init_std=0.1),
}


def _perturb(model, seed=0):
    """Random biases and norm scales, so that a mix-up of them would show."""
    rng = np.random.default_rng(seed)
    for name in ("attn_norm", "mlp_norm", "final_norm", "bq", "bk", "bv", "q_norm", "k_norm"):
        if hasattr(model, name):
            p = getattr(model, name)
            p[...] = p[...] + jnp.asarray(rng.normal(size=p[...].shape) * 0.2, p[...].dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_loads_in_transformers(tmp_path, torch_threads, name):
    cfg = CASES[name]
    model = init_model(cfg, seed=0)
    _perturb(model)
    out = export_hf(model, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[cfg.family]
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert rel_err(ours, ref) <= 1e-4
    # ...and back: our loader reads the exported directory into identical params.
    back, _ = load_model(model_config_from_weights(out), progress=False)
    np.testing.assert_array_equal(np.asarray(back.wq[...]), np.asarray(model.wq[...]))


def test_export_bfloat16_and_sharded_files(tmp_path, torch_threads):
    cfg = CASES["qwen3"]
    model = init_model(cfg, seed=0)
    out = export_hf(model, str(tmp_path / "hf"), dtype="bfloat16", max_shard_bytes=20_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert next(hf.parameters()).dtype == torch.bfloat16
    back, _ = load_model(model_config_from_weights(out), progress=False)
    np.testing.assert_allclose(np.asarray(back.w_up[...]), np.asarray(model.w_up[...]), rtol=1 / 128)


def test_export_never_overwrites(tmp_path, monkeypatch):
    model = init_model(CASES["qwen3"], seed=0)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("do not lose me")
    with pytest.raises(WeightsError, match=r"exists and is not empty.*overwrite=True \(--overwrite"):
        export_hf(model, str(target))
    # overwrite replaces only an earlier export, never other data (a run directory, say) or a file
    with pytest.raises(WeightsError, match=r"is not an earlier export .* it holds keep.txt"):
        export_hf(model, str(target), overwrite=True)
    (tmp_path / "file").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(WeightsError, match="is a file, not a directory"):
            export_hf(model, str(tmp_path / "file"), overwrite=overwrite)
    assert (target / "keep.txt").read_text() == "do not lose me" and (tmp_path / "file").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["file", "precious"]  # no temporary leftovers
    first = export_hf(model, str(tmp_path / "hf"))
    # An earlier export with anything else in it (notes, an eval folder) is not replaced either.
    (tmp_path / "hf" / "NOTES.md").write_text("mine")
    (tmp_path / "hf" / "eval").mkdir()
    with pytest.raises(WeightsError, match=r"holds files an export does not write \(NOTES.md, eval/\)"):
        export_hf(model, str(tmp_path / "hf"), overwrite=True)
    assert (tmp_path / "hf" / "NOTES.md").read_text() == "mine"
    (tmp_path / "hf" / "NOTES.md").unlink()
    (tmp_path / "hf" / "eval").rmdir()
    # Nor the directory the process runs in.
    monkeypatch.chdir(tmp_path / "hf")
    with pytest.raises(WeightsError, match=r"is the current directory \(or holds it\), so it is not replaced"):
        export_hf(model, ".", overwrite=True)
    monkeypatch.chdir(tmp_path)
    old_config = (tmp_path / "hf" / "config.json").read_text()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert export_hf(model, str(tmp_path / "hf"), overwrite=True) == first  # an export is replaced whole
    assert (tmp_path / "hf" / "config.json").read_text() == old_config
    assert sorted(os.listdir(tmp_path)) == ["file", "hf", "precious"]  # no temporary leftovers
