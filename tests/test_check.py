"""``dora-jax check``: every shipped preset fits its target; a too-big setup fails with a clear message.

Shipped presets go through ``--no-compile`` (lowering only: shapes, shardings, state memory); compiling an 8B
model for 256 fake devices takes minutes on a CPU. The full compile (with XLA's activation sizes) runs on
the tiny model, where XLA's argument sizes are checked against the per-device accounting.
"""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from dora_jax.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["qwen2_5_1_5b_1gpu", "qwen2_5_7b_8gpu", "llama3_1_8b_v5p64", "llama3_1_8b_v5p64_32k", "qwen3_8b_v5e256",
           "qwen2_5_32b_64h100"]


# `dora-jax check` as the command runs it, then a line saying whether the command's own process imported JAX (the
# check runs in a child process with the target's device count; its parent only reads the config).
_COMMAND = ("import sys; from dora_jax.cli import main; code = main(sys.argv[1:]); "
            "print('parent imported jax:', 'jax' in sys.modules); sys.exit(code)")


def _check(*args: str) -> subprocess.CompletedProcess:
    """``dora-jax check ARGS``. A target of this process's device count is checked here, by the command's child
    entry point (its output and exit status are the command's; starting a Python and JAX for it costs more than
    the check); any other count in a child of its own, as the command does."""
    import jax

    from dora_jax.check import main

    argv = list(args)
    config, rest = argv[argv.index("--config") + 1], [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        here = load_config(config, rest).target.num_devices == jax.device_count()
    except ConfigError:  # the command's own handling of a bad config is under test
        here = False
    if not here:
        return subprocess.run([sys.executable, "-c", _COMMAND, "check", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=600)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(["dora-jax", "check", *args], code, out.getvalue(), err.getvalue())


def _gib(out: str, label: str) -> float:
    m = re.search(rf"^  {re.escape(label)}\s+([0-9.]+) GiB", out, re.M)
    assert m, f"no '{label}' line in:\n{out}"
    return float(m.group(1))


def test_presets_exist_with_targets():
    for name in PRESETS:
        cfg = load_config(name)
        # float32 master weights and optimizer moments, bf16 compute
        assert cfg.target.memory_gib > 0 and (cfg.model.param_dtype, cfg.model.compute_dtype) == ("float32", "bfloat16")
    assert {load_config(n).target.num_devices for n in PRESETS} == {1, 8, 32, 64, 256}


# The 32B preset's check: test_split_placement_compares_one_version_per_group_with_k_plus_1.
@pytest.mark.parametrize("name", [p for p in PRESETS if p != "qwen2_5_32b_64h100"])
def test_preset_fits_without_compiling(name):
    r = _check("--config", name, "--no-compile")
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = load_config(name)
    assert f"target {cfg.target.num_devices} x {cfg.target.device_kind}" in r.stdout
    assert "OK: fits" in r.stdout and "not compiled" in r.stdout
    if cfg.target.num_devices != 8:  # checked in a child: only the child starts JAX, with the target's device count
        assert "parent imported jax: False" in r.stdout
    # The parameter count printed is the model card's (within rounding) and the per-device share of the
    # parameters is that count x 4 bytes (float32) / fsdp x tensor (every weight matrix is sharded).
    billions = float(re.search(r"([0-9.]+)B parameters", r.stdout).group(1))
    expected = {"qwen2_5_1_5b_1gpu": 1.54, "qwen2_5_7b_8gpu": 7.62, "llama3_1_8b_v5p64": 8.03,
                "llama3_1_8b_v5p64_32k": 8.03, "qwen3_8b_v5e256": 8.19, "qwen2_5_32b_64h100": 32.76}[name]
    assert abs(billions - expected) < 0.01, billions
    shards = cfg.mesh.fsdp * cfg.mesh.tensor
    train = "train " if cfg.roles.placement == "shared" else ""  # split placement: the trainer's table of its own
    assert _gib(r.stdout, f"{train}params") == pytest.approx(billions * 1e9 * 4 / shards / 2**30, rel=0.02)
    assert _gib(r.stdout, f"{train}optimizer") == pytest.approx(2 * _gib(r.stdout, f"{train}params"), rel=0.01)


def test_32k_preset_fits_with_its_training_activations_compiled():
    """Rows of 32768 tokens for an 8B model: the train step compiled at that length (remat, blockwise
    attention, chunked log-probs) on 32 fake devices, XLA's scratch counted, fits the v5p's 95 GiB; the
    materialized attention scores alone would take 32 heads x 32768^2 x 4 bytes = 128 GiB per layer and row."""
    r = _check("--config", "llama3_1_8b_v5p64_32k")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert ("train step: 64 rows of 32768 tokens per update (32 per micro-batch, 1 per device); float32 weights, "
            "bfloat16 compute; remat full, attention blockwise (blocks of 512), log-probs in chunks of 2048") in out
    scratch = _gib(out, "activations + scratch (XLA)")
    assert 0 < scratch < 95 - _gib(out, "rollout kv cache") and "OK: fits in 95 GiB" in out


def test_rollout_dtype_sizes_the_rollout_alone():
    """``rollout.dtype=bfloat16`` on a float32 model: the resident versions and the KV cache take half the
    bytes they take in float32 (the default, the model's compute dtype); the trainer's share is unchanged."""
    base = ("--config", "smollm2_135m", "--no-compile", "target.num_devices=1")
    f32, bf16 = _check(*base), _check(*base, "rollout.dtype=bfloat16")
    assert f32.returncode == 0 and bf16.returncode == 0, f32.stdout + f32.stderr + bf16.stdout + bf16.stderr
    assert "(float32; rollout float32)" in f32.stdout and "(float32; rollout bfloat16)" in bf16.stdout
    for label in ("rollout params x2 versions", "rollout kv cache"):
        assert _gib(bf16.stdout, label) == pytest.approx(_gib(f32.stdout, label) / 2, abs=0.002), label
    assert _gib(bf16.stdout, "train params") == _gib(f32.stdout, "train params") > 0.4


def test_too_big_fails_with_a_clear_message():
    r = _check("--config", "qwen2_5_7b_8gpu", "--no-compile", "target.num_devices=1", "target.memory_gib=16",
               "target.device_kind=T4 16GB", "mesh.fsdp=1", "mesh.tensor=1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "needs" in r.stderr and "more than target.memory_gib = 16 GiB of T4 16GB" in r.stderr
    assert _gib(r.stdout, "total") > 16


def test_mesh_that_does_not_fit_the_target_names_it():
    r = _check("--config", "qwen2_5_7b_8gpu", "--no-compile", "target.num_devices=6")
    assert r.returncode == 2 and "mesh" in r.stderr and "needs 8 devices, but 6" in r.stderr, r.stderr


def test_full_compile_on_the_tiny_model_split_roles():
    r = _check("--config", "tiny_llama", "target.num_devices=8", "target.memory_gib=1", "mesh.data=1",
               "mesh.fsdp=2", "mesh.tensor=2", "roles.placement=split", "roles.trainer_devices=4",
               "roles.rollout_groups=2", "rollout.max_prompt_len=32", "rollout.max_new_tokens=32",
               "train.length_buckets=[64]", "train.max_response_tokens=32")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "2 rollout groups of mesh {'data': 1, 'fsdp': 1, 'tensor': 2}" in out
    assert "per device, trainer (4 devices)" in out and "per device, rollout (2 devices)" in out
    m = re.findall(r"compiled (\w+) step: ([0-9.]+) MiB scratch, ([0-9.]+) MiB arguments", out)
    assert [x[0] for x in m] == ["trainer", "rollout"], out
    assert all(float(x[1]) > 0 for x in m)


def test_roles_laid_out_per_process_with_processes():
    """``--processes 2``: split placement gives each process's rollout engine its own non-trainer devices (2 of a
    host's 4, where one process would decode on all 4 of them); ``roles.rollout_span=all`` spans every device."""
    # The tiny model widened, so that a device's share of the weights shows in the printed GiB.
    base = ("--config", "tiny_llama", "--no-compile", "target.num_devices=8", "model.hidden_size=512",
            "model.intermediate_size=2048", "model.num_layers=8", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1",
            "roles.placement=split", "roles.trainer_devices=4")
    one, two = _check(*base), _check(*base, "--processes", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stdout + one.stderr + two.stdout + two.stderr
    assert "1 rollout groups of mesh {'data': 1, 'fsdp': 1, 'tensor': 4}" in one.stdout
    assert ("roles: split, 2 processes; trainer mesh {'data': 1, 'fsdp': 4, 'tensor': 1}; rollout mesh "
            "{'data': 1, 'fsdp': 1, 'tensor': 2} per process") in two.stdout
    assert "per device, rollout (2 devices)" in two.stdout
    # Half the devices for the engine's tensor axis: each holds twice the share of every resident version.
    label = "params x2 versions"
    assert _gib(two.stdout, label) == pytest.approx(2 * _gib(one.stdout, label), rel=0.05)
    span = _check(*base[:-2], "mesh.fsdp=8", "roles.rollout_span=all", "roles.rollout_data=2", "--processes", "2")
    assert span.returncode == 0, span.stdout + span.stderr
    assert "rollout mesh {'data': 2, 'fsdp': 1, 'tensor': 4} over every process" in span.stdout
    bad = _check(*base, "roles.rollout_span=all", "--processes", "2")
    assert bad.returncode == 2 and "roles.rollout_span=all with roles.placement='split'" in bad.stderr, bad.stderr


def test_bad_config_fails_before_starting_jax():
    r = _check("--config", "qwen2_5_7b_8gpu", "roles.placement=everywhere")
    assert r.returncode == 2 and "roles.placement" in r.stderr


def test_check_prints_the_paged_pool_next_to_the_dense_cache():
    """The page pool a config's rollout would need (dora_jax.rollout.pages.plan_pool), its bytes at the dense
    cache's cost per token, printed after the dense cache's."""
    from dora_jax.rollout.pages import plan_pool

    r = _check("--config", "smollm2_135m", "--no-compile", "target.num_devices=1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rollout groups:" not in r.stdout  # shared placement: no layouts of rollout groups to compare
    plan = plan_pool(load_config("smollm2_135m", ["target.num_devices=1"]))
    dense = re.search(rf"dense KV cache: {plan.slots} slots x {plan.dense_tokens_per_slot} tokens = "
                      rf"{plan.dense_tokens} tokens \(([0-9.]+) GiB\)", r.stdout)
    paged = re.search(rf"paged KV cache \(16-token pages\): {plan.pages} pages = {plan.pool_tokens} tokens "
                      rf"\(([0-9.]+) GiB\) for {plan.slots} sequences of up to {plan.sequence_tokens} tokens", r.stdout)
    assert dense and paged, r.stdout
    # The rollout holds the pool (its pages and one scratch page): the paged line's bytes.
    assert float(paged.group(1)) * (plan.pages + 1) / plan.pages == pytest.approx(_gib(r.stdout, "rollout kv cache"),
                                                                                abs=0.001)
    assert float(dense.group(1)) == pytest.approx(float(paged.group(1)) * plan.dense_tokens / plan.pool_tokens,
                                                  abs=0.001)


_LAYOUTS = re.compile(r"^rollout groups: (\d+) of (\d+) devices; weights per device: ([0-9.]+) GiB at 1 version per "
                      r"group, ([0-9.]+) GiB at K \+ 1 = (\d+) \(roles.versions_per_group: (\w+)\)(.*)$", re.M)


def test_split_placement_compares_one_version_per_group_with_k_plus_1():
    """The 32B preset (K = 3, 8 groups of 4 H100s, one version per group): the layouts line's weights per device
    are the parameter count x 2 bytes (bf16) / the group's 4 tensor shards, once and K + 1 = 4 times; the rollout
    table holds the one version. At 60 GiB a group of 4 cannot hold 4 versions beside its KV cache: 8 devices per
    group can (4 groups of the 32 rollout GPUs)."""
    r = _check("--config", "qwen2_5_32b_64h100", "--no-compile")
    assert r.returncode == 0, r.stdout + r.stderr
    billions = float(re.search(r"([0-9.]+)B parameters", r.stdout).group(1))
    assert abs(billions - 32.76) < 0.01 and "OK: fits" in r.stdout, billions  # Qwen2.5-32B's model card: 32.8B
    # The trainer's share: float32 parameters over fsdp 32, Adam's two moments twice that.
    assert _gib(r.stdout, "params") == pytest.approx(billions * 1e9 * 4 / 32 / 2**30, rel=0.02)
    assert _gib(r.stdout, "optimizer") == pytest.approx(2 * _gib(r.stdout, "params"), rel=0.01)
    m = _LAYOUTS.search(r.stdout)
    assert m, r.stdout
    one = billions * 1e9 * 2 / 4 / 2**30
    assert (int(m.group(1)), int(m.group(2)), int(m.group(5)), m.group(6), m.group(7)) == (8, 4, 4, "1", "")
    assert float(m.group(3)) == pytest.approx(one, abs=0.06) and float(m.group(4)) == pytest.approx(4 * one, abs=0.2)
    assert _gib(r.stdout, "params x1 versions") == pytest.approx(one, rel=0.01)
    # Without room for K + 1 versions: the devices per group that would hold them, and the groups left.
    kv = _gib(r.stdout, "kv cache")
    assert kv + 4 * one > 60 > kv + 2 * one
    tight = _check("--config", "qwen2_5_32b_64h100", "--no-compile", "target.memory_gib=60")
    assert tight.returncode == 0, tight.stdout + tight.stderr
    assert _LAYOUTS.search(tight.stdout).group(7) == (
        "; K + 1 versions per group need 8 devices per group to fit 60 GiB (4 groups)"), tight.stdout



def test_the_elastic_group_s_page_pool_is_counted_on_the_trainer_s_devices():
    """``roles.elastic_group``: the trainer's table holds the elastic group's KV pool beside the optimizer state,
    and its total grows by it."""
    args = ["--config", "tiny_llama", "--no-compile", "target.num_devices=8", "mesh.data=1", "mesh.fsdp=2",
            "mesh.tensor=1", "roles.placement=split", "roles.trainer_devices=2", "roles.rollout_groups=3",
            "roles.versions_per_group=1"]
    without, with_ = _check(*args), _check(*args, "roles.elastic_group=true")
    assert without.returncode == with_.returncode == 0, with_.stdout + with_.stderr
    assert "per device, trainer + elastic group (2 devices)" in with_.stdout
    pool = _gib(with_.stdout, "elastic group kv cache")
    assert pool > 0 and "elastic group" not in without.stdout
    totals = [float(x) for x in re.findall(r"total\s+([0-9.]+) GiB", without.stdout + with_.stdout)]
    assert totals[2] == pytest.approx(totals[0] + pool, abs=2e-3), totals  # the trainer's tables, in order
