"""Config loading, overrides and validation."""

import os

import pytest

from dora_jax.config import DEFAULT_RULES, Config, ConfigError, configs_dir, load_config


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(configs_dir()) if f.endswith(".yaml")))
def test_shipped_configs_load(name):
    if name.startswith("sim_"):  # simulator presets have their own schema (dora_jax.sim.config)
        from dora_jax.sim.config import load_sim_config

        load_sim_config(os.path.join(configs_dir(), name))
        return
    cfg = load_config(name.removesuffix(".yaml"))
    assert isinstance(cfg, Config)


def test_overrides_and_types():
    cfg = load_config("tiny_llama", ["model.num_layers=3", "generate.temperature=0.7", "generate.prompts=[a, b]",
                                     "mesh.logical_axis_rules.batch=data"])
    assert cfg.model.num_layers == 3
    assert cfg.generate.temperature == 0.7 and isinstance(cfg.generate.temperature, float)
    assert cfg.generate.prompts == ("a", "b")
    assert dict(cfg.mesh.logical_axis_rules)["batch"] == ("data",)
    assert load_config(None).mesh.logical_axis_rules == DEFAULT_RULES
    assert load_config(None).fingerprint() != cfg.fingerprint()


@pytest.mark.parametrize("override,message", [
    ("model.num_layers=two", "'model.num_layers' = 'two': must be an integer"),
    ("model.num_layers=0", "'model.num_layers' = 0: must be a positive integer"),
    ("model.tie_embeddings=1", "'model.tie_embeddings' = 1: must be true or false"),
    ("model.family=gpt2", "'model.family' = 'gpt2': allowed: 'llama', 'qwen2', 'qwen3'"),
    ("model.compute_dtype=int8", "'model.compute_dtype' = 'int8': allowed: float32, bfloat16, float16"),
    ("model.head_dim=7", "'model.head_dim' = 7: must be even"),
    ("model.cache_read_buckets=9", "'model.cache_read_buckets' = 9: must be 0 (auto) .. 8"),
    ("model.rope_scaling.type=yarn", "'model.rope_scaling.type' = 'yarn': allowed: 'llama3', 'linear'"),
    ("mesh.tensor=0", "'mesh.tensor' = 0: must be a positive integer or -1"),
    ("mesh.logical_axis_rules.embed=model", "unknown mesh axis 'model'"),
    ("generate.top_p=0", "'generate.top_p' = 0.0: must be in (0, 1]"),
    ("generate.max_new_tokens=4096", "must be < model.max_seq_len"),
    ("run.name=a/b", "'run.name' = 'a/b'"),
    ("model.nope=1", "unknown config field 'model.nope'"),
    ("train.learning_rate=.nan", "'train.learning_rate' = nan: must be a number, not NaN"),
    ("model", "expected key=value"),
])
def test_validation_messages(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_llama", [override])
    assert message in str(e.value)
    assert "tiny_llama.yaml" in str(e.value) or "expected key=value" in message
