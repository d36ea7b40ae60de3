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
    ("rollout.attention_impl=triton", "'rollout.attention_impl' = 'triton': allowed: 'xla', 'pallas_gpu', 'pallas_tpu', 'pallas_tpu_ragged', 'auto'"),
    ("rollout.attention_impl=pallas", "'pallas' was the dense cache's kernel; the paged cache uses JAX's shipped kernels"),
    ("rollout.kv_pages=3", "'rollout.kv_pages' = 3: a pool of 3 pages cannot hold one page per slot"),
    ("rollout.pallas_interpret=1", "'rollout.pallas_interpret' = 1: must be true or false"),
    ("rollout.dtype=int8", "'rollout.dtype' = 'int8': allowed: auto, float32, bfloat16, float16 "
                           "(auto: model.compute_dtype)"),
    ("model.rope_scaling.type=yarn", "'model.rope_scaling.type' = 'yarn': allowed: 'llama3', 'linear'"),
    ("mesh.tensor=0", "'mesh.tensor' = 0: must be a positive integer or -1"),
    ("mesh.logical_axis_rules.embed=model", "unknown mesh axis 'model'"),
    ("generate.top_p=0", "'generate.top_p' = 0.0: must be in (0, 1]"),
    ("generate.max_new_tokens=4096", "must be < model.max_seq_len"),
    ("run.name=a/b", "'run.name' = 'a/b'"),
    ("run.name=..", "'run.name' = '..': must be a non-empty name without '/', not '.' or '..'"),
    ("run.keep_checkpoints=0", "'run.keep_checkpoints' = 0: must be >= 1: the newest checkpoint is what"),
    ("train.length_buckets=[8]", "'train.length_buckets' = [8]: the largest must hold the longest sample: "
                                 "rollout.max_prompt_len + rollout.max_new_tokens = 192"),
    ("model.nope=1", "unknown config field 'model.nope'"),
    ("train.learning_rate=.nan", "'train.learning_rate' = nan: must be a finite number"),
    ("target.memory_gib=.inf", "'target.memory_gib' = inf: must be a finite number"),
    ("task.reward_timeout_s=-.inf", "'task.reward_timeout_s' = -inf: must be a finite number"),
    ("task.eval_every=-1", "'task.eval_every' = -1: must be >= 0 (0: evaluate before and after training only)"),
    ("train.is_low=1.5", "'train.is_low/is_high' = (1.5, 2.0): need 0 <= is_low < 1 < is_high"),
    ("train.learning_rate=1e-6x", "'train.learning_rate' = '1e-6x': must be a number"),
    ("roles.versions_per_group=2", "'roles.versions_per_group' = 2: allowed: 'all' (every live version in every "
                                   "group) or 1"),
    ("roles.versions_per_group=1", "'roles.versions_per_group' = 1: one version per group needs "
                                   "roles.rollout_groups >= train.max_staleness + 1 = 2 (the live versions), and "
                                   "roles.rollout_groups is 1: set roles.rollout_groups to at least 2, "
                                   "train.max_staleness to at most 0, or roles.versions_per_group to 'all'"),
    ("model", "expected key=value"),
])
def test_validation_messages(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_llama", [override])
    assert message in str(e.value)
    # The value came from the override, not the file: the message says so.
    assert str(e.value).startswith(f"override {override!r}: ") or "expected key=value" in message


@pytest.mark.parametrize("key,value,why", [
    ("rollout.decode_weights", "out_in", "decode has one weight layout on every platform"),
    ("rollout.cache_read_buckets", 8, "decode reads each slot's pages up to the longest live slot on every platform"),
    ("model.decode_weights", "in_out", "decode has one weight layout on every platform"),
])
def test_removed_decode_settings_are_refused_naming_the_removal(tmp_path, key, value, why):
    """The decode settings that chose CPU-only layouts are refused, from an override or a file, with a message
    that names the key and says it was removed, not as an unknown field."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny_llama", [f"{key}={value}"])
    assert str(e.value).startswith(f"override '{key}={value}': config field '{key}' = {value!r}: was removed: ")
    assert why in str(e.value) and "delete the key" in str(e.value) and e.value.field == key
    section, name = key.split(".")
    p = tmp_path / "old.yaml"
    p.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"old.yaml: config field '{key}' = .*: was removed: "):
        load_config(str(p))


@pytest.mark.parametrize("name,value", [("attention_impl", "pallas_gpu"), ("pallas_interpret", True)])
def test_engine_settings_under_model_point_to_rollout(tmp_path, name, value):
    """The rollout engine's settings are refused under ``model``, from an override or a file, with the key
    that holds them; under ``rollout`` the same value loads."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny_llama", [f"model.{name}={value}"])
    assert str(e.value).startswith(f"override 'model.{name}={value}': config field 'model.{name}' = {value!r}: ")
    assert f"set 'rollout.{name}' instead" in str(e.value) and e.value.field == f"model.{name}"
    p = tmp_path / "old.yaml"
    p.write_text(f"model:\n  num_layers: 2\n  {name}: {str(value).lower()}\n")
    with pytest.raises(ConfigError, match=rf"old.yaml: config field 'model.{name}' = .*set 'rollout.{name}' instead"):
        load_config(str(p))
    assert getattr(load_config("tiny_llama", [f"rollout.{name}={value}"]).rollout, name) == value


def test_rollout_dtype_defaults_to_the_compute_dtype():
    """``rollout.dtype`` is ``auto`` unless set, which the engine resolves to ``model.compute_dtype``: float32 in
    the CPU presets (the demo's), bfloat16 in the accelerator presets that compute in it."""
    from flax import nnx

    from dora_jax.models.decoder import Decoder
    from dora_jax.rollout.engine import Engine

    for name, want in (("smollm2_arith", "float32"), ("smollm2_135m", "float32"), ("tiny_llama", "float32"),
                       ("qwen2_5_1_5b_1gpu", "bfloat16")):
        cfg = load_config(name)
        assert cfg.rollout.dtype == "auto" and cfg.model.compute_dtype == want, name
        shell = nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))
        engine = Engine(shell, max_concurrent_decodes=1, max_prefill_length=8, max_target_length=16)
        assert engine.dtype == want and engine.cfg.compute_dtype == want, name
    assert load_config("tiny_llama", ["rollout.dtype=bfloat16"]).model.compute_dtype == "float32"


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


def test_decoupled_ppo_with_one_update_an_iteration_is_advised_against():
    """With one update an iteration the proximal policy is the current one: decoupled PPO's clip never acts
    (measured to learn worse than correction none); the runner logs what to change."""
    from dora_jax.run.setup import advice

    said = advice(load_config("tiny_llama", ["train.correction=decoupled"]))
    assert len(said) == 1 and "train.minibatches" in said[0] and "'none'" in said[0]
    assert advice(load_config("tiny_llama", ["train.correction=decoupled", "train.epochs=2"])) == []
    assert advice(load_config("tiny_llama", ["train.correction=none"])) == []


@pytest.mark.parametrize("name", ["attention_impl", "pallas_interpret"])
def test_a_rollout_setting_under_model_is_refused_with_where_it_lives(name):
    with pytest.raises(ConfigError, match=rf"model.{name}.*set 'rollout.{name}' instead"):
        load_config(None, [f"model.{name}=xla"])


def test_to_dict_reads_back_to_the_same_config():
    """A saved config (run directories keep ``to_dict``) is read back field for field, the logical axis rules
    written as a mapping of lists."""
    from dora_jax.schema import from_dict

    cfg = load_config("tiny_llama", ["mesh.logical_axis_rules.batch=[data, fsdp]", "train.correction=decoupled",
                                     "train.decoupled_cap=5"])
    plain = cfg.to_dict()
    assert plain["mesh"]["logical_axis_rules"]["batch"] == ["data", "fsdp"]
    assert from_dict(Config, plain) == cfg


def test_one_version_per_group_is_checked_and_refused_where_the_runner_cannot_drive_it():
    """``roles.versions_per_group: 1`` loads with enough groups for the live versions; the runner drives it under
    split placement and refuses it under shared placement, saying why; the default leaves a run's fingerprint as
    it was."""
    from dora_jax.run.resume import run_fingerprint
    from dora_jax.run.evaluation import RunError
    from dora_jax.run.setup import check_placement

    with pytest.raises(ConfigError, match=r"rollout_groups >= train.max_staleness \+ 1 = 3 .* roles.rollout_groups "
                                          "is 2"):
        load_config("tiny_llama", ["roles.versions_per_group=1", "roles.rollout_groups=2", "train.max_staleness=2"])
    cfg = load_config("tiny_llama", ["roles.versions_per_group=1", "roles.rollout_groups=2"])
    assert cfg.roles.versions_per_group == 1
    with pytest.raises(RunError, match="roles.versions_per_group = 1 with roles.placement='shared': shared placement "
                                       "has one rollout group, on the trainer's own devices"):
        check_placement(cfg, None)
    split = load_config("tiny_llama", ["roles.versions_per_group=1", "roles.rollout_groups=2", "roles.placement=split",
                                       "roles.trainer_devices=4", "target.num_devices=8", "mesh.data=1"])
    check_placement(split, None)
    default = load_config("tiny_llama")
    assert default.roles.versions_per_group == "all"
    check_placement(default, None)
    assert run_fingerprint(load_config("tiny_llama", ["roles.versions_per_group=all"])) == run_fingerprint(default)
    assert run_fingerprint(cfg) != run_fingerprint(load_config("tiny_llama", ["roles.rollout_groups=2"]))
