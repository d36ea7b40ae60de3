"""Config loading, overrides and validation."""

import os

import pytest

from dora_jax.config import DEFAULT_RULES, Config, ConfigError, configs_dir, load_config


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(configs_dir()) if f.endswith(".yaml")))
def test_shipped_configs_load(name):
    if name.startswith("sim_"):  # simulator presets: the sections of dora_jax.sim.config.SimFile
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
    # YAML 1.1 (PyYAML) needs a decimal point in a float; 1e-6 is a number here too, as in YAML 1.2.
    for text, value in (("1e-6", 1e-6), ("+2E+3", 2000.0), ("3.0e-5", 3e-5), ("5", 5.0)):
        assert load_config("tiny_llama", [f"train.learning_rate={text}"]).train.learning_rate == value
    from dora_jax.textfiles import parse_yaml_value
    assert parse_yaml_value("-2E+3") == -2000.0 and parse_yaml_value("1e-6x") == "1e-6x"
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
    ("run.name=..", "'run.name' = '..': must be a non-empty name without '/', not '.' or '..'"),
    ("train.length_buckets=[8]", "'train.length_buckets' = [8]: the largest must hold the longest sample: "
                                 "rollout.max_prompt_len + rollout.max_new_tokens = 192"),
    ("model.nope=1", "unknown config field 'model.nope'"),
    ("train.learning_rate=.nan", "'train.learning_rate' = nan: must be a finite number"),
    ("target.memory_gib=.inf", "'target.memory_gib' = inf: must be a finite number"),
    ("task.reward_timeout_s=-.inf", "'task.reward_timeout_s' = -inf: must be a finite number"),
    ("train.is_low=1.5", "'train.is_low/is_high' = (1.5, 2.0): need 0 <= is_low < 1 < is_high"),
    ("train.learning_rate=1e-6x", "'train.learning_rate' = '1e-6x': must be a number"),
    ("model", "expected key=value"),
])
def test_validation_messages(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_llama", [override])
    assert message in str(e.value)
    # The value came from the override, not the file: the message says so.
    assert str(e.value).startswith(f"override {override!r}: ") or "expected key=value" in message


def test_config_file_problems_name_the_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    # A repeated section would silently replace the earlier one (PyYAML keeps the last key): refused.
    p.write_text("model:\n  num_layers: 2\ndora:\n  steps: 3\nmodel:\n  hidden_size: 64\n")
    with pytest.raises(ConfigError, match=r"c.yaml: .*key 'model' appears twice in one mapping \(first on line 1\)"
                                          r"[\s\S]*line 5"):
        load_config(str(p))
    p.write_text("train:\n  group_size: 4\n  learning_rate: 1.0e-6\n  group_size: 8\n")
    with pytest.raises(ConfigError, match=r"key 'group_size' appears twice .*first on line 2"):
        load_config(str(p))
    p.write_bytes("run:\n  name: caf".encode() + b"\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"c.yaml: line 2 is not UTF-8 text"):
        load_config(str(p))
    with pytest.raises(ConfigError, match=r"is a directory; name a YAML file in it"):
        load_config(str(tmp_path))


def test_errors_blame_the_override_or_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("dora:\n  steps: 0\ntrain:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match=r"^.*c.yaml: config field 'dora.steps' = 0"):
        load_config(str(p), ["train.group_size=8"])
    # The override replaces the file's good value: the override is named, not the file.
    p.write_text("train:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match=r"^override 'train.group_size=-1': config field 'train.group_size'"):
        load_config(str(p), ["train.group_size=-1"])
    with pytest.raises(ConfigError, match=r"^override 'train=3': config field 'train' = 3: must be a mapping"):
        load_config(str(p), ["train=3"])
    # An empty section in the file takes overrides.
    p.write_text("dora:\n")
    assert load_config(str(p), ["dora.steps=7"]).dora.steps == 7
    p.write_text("train:\n  learning_rate: 2e-6\n  eps: 1E-8\n")
    cfg = load_config(str(p))
    assert (cfg.train.learning_rate, cfg.train.eps) == (2e-6, 1e-8)
