"""Meshes, logical rules and sharded execution on 8 fake CPU devices."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from dora_jax.config import DEFAULT_RULES, ConfigError, MeshConfig, ModelConfig, configs_dir, load_config
from dora_jax.models.build import abstract_model, init_model, state_shardings
from dora_jax.models.decoder import init_cache
from dora_jax.sharding import activate, create_mesh, logical_to_spec, mesh_shape, named_sharding, settle
from dora_jax.xla_flags import SAFE_COLLECTIVES, cpu_device_flags, cpu_test_flags, fake_device_count

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def test_eight_fake_devices():
    assert jax.device_count() == 8
    assert SAFE_COLLECTIVES in os.environ["XLA_FLAGS"].split()  # tests/conftest.py builds the flags


N8 = "--xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("n,given,expected", [
    (8, "", f"{N8} {SAFE_COLLECTIVES}"),
    (1, "--xla_dump_to=/d", "--xla_force_host_platform_device_count=1 --xla_dump_to=/d"),  # one device: nothing to order
    # the count is replaced, other flags kept after ours
    (2, f"{N8} --xla_dump_to=/d", f"--xla_force_host_platform_device_count=2 {SAFE_COLLECTIVES} --xla_dump_to=/d"),
    (None, f"--x=1 {N8}", f"{N8} {SAFE_COLLECTIVES} --x=1"),  # None: the count already asked for
    (8, f"{N8} {SAFE_COLLECTIVES}", f"{N8} {SAFE_COLLECTIVES}"),  # not twice
    # the caller's own setting comes later, so it wins (XLA takes the last occurrence)
    (8, "--xla_cpu_enable_concurrency_optimized_scheduler=true",
     f"{N8} {SAFE_COLLECTIVES} --xla_cpu_enable_concurrency_optimized_scheduler=true"),
])
def test_cpu_device_flags(n, given, expected):
    assert cpu_device_flags(n, given) == expected


FE = "--xla_cpu_use_fusion_emitters=false"


@pytest.mark.parametrize("given,opt,devices,expected", [
    ("", None, None, f"{N8} {SAFE_COLLECTIVES} --xla_backend_optimization_level=0 {FE}"),  # the test run's defaults
    ("--xla_backend_optimization_level=2", None, None,
     f"{N8} {SAFE_COLLECTIVES} --xla_backend_optimization_level=2 {FE}"),
    ("--xla_backend_optimization_level=2", 3, None,  # asked for: it comes last, so it wins
     f"{N8} {SAFE_COLLECTIVES} --xla_backend_optimization_level=2 --xla_backend_optimization_level=3 {FE}"),
    ("--xla_force_host_platform_device_count=1", None, None,
     f"--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 {FE}"),  # the caller's count
    ("--xla_cpu_use_fusion_emitters=true", None, 2,  # the caller's emitters kept; the count asked for
     f"--xla_force_host_platform_device_count=2 {SAFE_COLLECTIVES} --xla_cpu_use_fusion_emitters=true "
     "--xla_backend_optimization_level=0"),
])
def test_cpu_test_flags(given, opt, devices, expected):
    assert cpu_test_flags(given, opt, devices) == expected


def test_fake_device_count_takes_the_last_and_rejects_zero():
    assert fake_device_count("") == 1
    assert fake_device_count(f"{N8} --xla_force_host_platform_device_count=3") == 3
    with pytest.raises(ValueError, match="at least 1"):
        cpu_device_flags(0, "")
    for bad in ("0", "abc", "-2", ""):
        with pytest.raises(ValueError, match=rf"XLA_FLAGS: --xla_force_host_platform_device_count={bad}: the device "
                                             "count must be an integer >= 1"):
            fake_device_count(f"{N8} --xla_force_host_platform_device_count={bad}")


def test_cli_names_a_bad_device_count_flag(monkeypatch, capsys):
    from dora_jax.cli import main

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=0")
    assert main(["simulate", "--config", "sim_small"]) == 2
    assert "error: XLA_FLAGS: --xla_force_host_platform_device_count=0: the device count must be an integer >= 1" \
        in capsys.readouterr().err


def test_mesh_over_cpu_devices_warns_without_the_flag(monkeypatch):
    """XLA reads the flags when its backend starts, so this process keeps its safe setting; what is checked is
    that create_mesh names the missing flag when XLA_FLAGS lacks it, and is silent when it is there."""
    monkeypatch.setenv("XLA_FLAGS", N8)
    with pytest.warns(RuntimeWarning, match="xla_cpu_enable_concurrency_optimized_scheduler=false"):
        create_mesh(MeshConfig(2, 2, 2))
    monkeypatch.setenv("XLA_FLAGS", cpu_device_flags(8, ""))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_mesh(MeshConfig(2, 2, 2))
        create_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])  # one device: no warning whatever the flags
    monkeypatch.setenv("XLA_FLAGS", N8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


@pytest.mark.parametrize("sizes,n,expected", [
    ((1, -1, 1), 8, (1, 8, 1)), ((2, 2, -1), 8, (2, 2, 2)), ((-1, 1, 4), 8, (2, 1, 4)), ((1, 1, 1), 1, (1, 1, 1)),
])
def test_mesh_shape(sizes, n, expected):
    assert mesh_shape(MeshConfig(*sizes), n) == expected


@pytest.mark.parametrize("sizes,n,msg", [((3, -1, 1), 8, "do not divide"), ((2, 2, 1), 8, "needs 4 devices")])
def test_mesh_shape_errors(sizes, n, msg):
    with pytest.raises(ConfigError, match=msg):
        mesh_shape(MeshConfig(*sizes), n)


def test_settle_waits_for_multi_device_cpu_results_only():
    """On CPU a result spanning several devices comes back finished (one multi-device program in flight at a
    time); a single-device result is returned as dispatched. Either way the same object comes back."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    @jax.jit
    def slow(a):  # ~0.1-1 s on a 2-core machine: long enough to still be running when dispatch returns
        return jax.lax.fori_loop(0, 30, lambda i, m: jnp.tanh(m @ m.T / 512.0), a).sum(axis=1)

    a = jax.device_put(jnp.ones((512, 512)), sharded)
    out = slow(a)
    assert settle(out) is out and out.is_ready()
    tree = {"x": slow(a), "n": 3}  # non-array leaves are passed through
    assert settle(tree) is tree and tree["x"].is_ready()
    one = jax.device_put(jnp.ones((512, 512)), jax.devices()[0])
    out1 = slow(one)
    assert settle(out1) is out1
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out), rtol=1e-5)
    # Traced (dora-jax check traces the engine and trainer with abstract inputs): passed through.
    assert jax.eval_shape(lambda x: settle(slow(x)), a).shape == (512,)


def test_logical_rules():
    rules = (("batch", ("data", "fsdp")), ("embed", ("fsdp",)), ("mlp", ("tensor",)), ("norm", ()))
    assert logical_to_spec(("batch", "mlp"), rules) == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")
    # A mesh axis is used once: embed wants fsdp but batch already took it.
    assert logical_to_spec(("batch", "embed"), rules) == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert logical_to_spec(("norm", None), rules) == jax.sharding.PartitionSpec(None, None)
    with pytest.raises(ConfigError, match="'heads' .* no entry"):
        logical_to_spec(("heads",), rules)


def test_indivisible_dimension_names_the_param():
    mesh = create_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    cfg = ModelConfig(num_heads=8, num_kv_heads=2, head_dim=8)  # 2 kv heads over tensor=4
    _, abstract = abstract_model(cfg)
    with pytest.raises(ConfigError, match=r"param wk.*'kv_heads'.*size 2.*\('tensor',\)"):
        state_shardings(abstract, mesh, DEFAULT_RULES)
    with pytest.raises(ConfigError, match="x: dimension 0"):
        named_sharding(mesh, ("mlp",), DEFAULT_RULES, (6,), where="x")


def _forward_and_decode(model, mesh, tokens):
    graphdef, state = nnx.split(model)
    cfg = model.cfg

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        logits = m(tokens)
        cache = init_cache(cfg, tokens.shape[0], 32)
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        step_logits, cache = m.decode(tokens, pos, cache)
        return logits, step_logits, cache

    if mesh is None:
        return run(state, tokens)
    with activate(mesh, DEFAULT_RULES):
        return run(state, tokens)


MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4), (1, 1, 8)]
# Every mesh with MHA (8 kv heads); GQA (4 kv heads) on the meshes whose tensor axis divides it.
CASES = [(m, 8) for m in MESHES] + [(m, 4) for m in MESHES if 4 % m[2] == 0]


@pytest.mark.parametrize("sizes,kv_heads", CASES)
def test_sharded_forward_equals_unsharded(sizes, kv_heads):
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=kv_heads, head_dim=8, qkv_bias=True, qk_norm=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 12)))
    ref_logits, ref_step, _ = _forward_and_decode(init_model(cfg, seed=3), None, tokens)

    mesh = create_mesh(MeshConfig(*sizes))
    model = init_model(cfg, mesh, DEFAULT_RULES, seed=3)
    wq = nnx.state(model)["wq"].get_value()
    assert wq.sharding.spec == logical_to_spec(("layers", "embed", "q_heads", "head_dim"), DEFAULT_RULES)
    assert len(wq.sharding.device_set) == 8
    logits, step, cache = _forward_and_decode(model, mesh, tokens)
    assert rel_err(logits, ref_logits) <= 1e-5
    assert rel_err(step, ref_step) <= 1e-5
    # The cache is sharded over batch on (data, fsdp) as the rules say.
    assert cache.k.sharding.shard_shape(cache.k.shape)[1] == 8 // (sizes[0] * sizes[1])


def _regenerate_module():
    """tests/golden/regenerate.py, the script that writes the golden files (loaded by path: not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden_regenerate", os.path.join(GOLDEN, "regenerate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGENERATE = _regenerate_module()
# Simulator presets have no model; presets sized for accelerators (target.device_kind) are built on their own
# device count by `dora-jax check` (tests/test_check.py), not on this process's 8 fake devices.
SHIPPED = REGENERATE.names()


def decoder_param_axes(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The decoder's parameters and their logical axes, written out from the architecture (docs/models.md)."""
    attn = {"wq": ("layers", "embed", "q_heads", "head_dim"), "wk": ("layers", "embed", "kv_heads", "head_dim"),
            "wv": ("layers", "embed", "kv_heads", "head_dim"), "wo": ("layers", "q_heads", "head_dim", "embed")}
    mlp = {"w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"), "w_down": ("layers", "mlp", "embed")}
    out = {"embed": ("vocab", "embed"), "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"),
           "final_norm": ("norm",), **attn, **mlp}
    if model.qkv_bias:
        out.update(bq=("layers", "q_heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                   bv=("layers", "kv_heads", "head_dim"))
    if model.o_bias:
        out["bo"] = ("layers", "norm")
    if model.qk_norm:
        out.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
    if not model.tie_embeddings:
        out["lm_head"] = ("embed", "vocab")
    return out


def expected_spec(axes, rules) -> list:
    """A parameter's partition spec from the rules table: each dimension takes the mesh axes its logical axis
    maps to, less those an earlier dimension took; one axis is written as its name, several as a list, none
    as null (the dump's JSON form)."""
    table, taken, out = dict(rules), set(), []
    for name in axes:
        free = [a for a in table[name] if a not in taken]
        taken.update(free)
        out.append(free[0] if len(free) == 1 else (free or None))
    return out


def expected_shardings(cfg, devices: int = 8) -> dict:
    """The golden dump of ``cfg`` derived from its mesh sizes and rules table alone."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    fixed = int(np.prod([n for n in sizes.values() if n != -1]))
    mesh = {axis: devices // fixed if n == -1 else n for axis, n in sizes.items()}
    rules = cfg.mesh.logical_axis_rules
    return {"mesh": mesh, "params": {p: expected_spec(a, rules) for p, a in decoder_param_axes(cfg.model).items()}}


@pytest.mark.parametrize("name", SHIPPED)
def test_param_shardings_match_golden_and_the_rules(name):
    """The golden file is what the preset's rules table says (derived here independently) and what the code
    builds. After an intended change, regenerate the files with tests/golden/regenerate.py and review the diff."""
    cfg = load_config(os.path.join(configs_dir(), name))
    if cfg.target.device_kind != "cpu":
        pytest.skip(f"{name} is sized for accelerators: dora-jax check covers it (tests/test_check.py)")
    with open(REGENERATE.path(name)) as f:
        golden = json.load(f)
    assert golden == expected_shardings(cfg)
    assert REGENERATE.dump(name) == golden


def test_a_layout_the_rules_do_not_give_fails_even_when_regenerated(monkeypatch):
    """Code that lays out one parameter against the rules table (w_down's axes swapped): the dump, as the
    regeneration script would write it, differs from the derivation in that parameter only."""
    from dora_jax.models import build

    real = build.param_axes

    def swapped(state):
        axes = real(state)
        axes["w_down"] = ("layers", "embed", "mlp")
        return axes

    monkeypatch.setattr(build, "param_axes", swapped)
    cfg = load_config(os.path.join(configs_dir(), "tiny_llama.yaml"))
    derived, dumped = expected_shardings(cfg), REGENERATE.dump("tiny_llama.yaml")
    assert [p for p in derived["params"] if derived["params"][p] != dumped["params"][p]] == ["w_down"]
