"""VersionStore residency and refcounts against a simple model; LoRA storage; Orbax snapshots: bit-exact round
trip, restore onto other meshes, metadata, retention, bad snapshots."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from dora_jax.run.checkpoint import CheckpointError
from dora_jax.config import LoraConfig, MeshConfig, load_config
from dora_jax.models.build import abstract_model, init_model, state_shardings
from dora_jax.sharding import create_mesh
from dora_jax.trainer import lora as lora_lib
from dora_jax.run.versions import Snapshots, VersionError, VersionStore, retained
from flax import nnx


def tiny(v: float) -> dict:
    return {"w": jnp.full((2, 3), v, jnp.float32)}


def assert_same_tree(a, b) -> None:
    """The same structure, dtypes and values (chex names the first leaf that differs)."""
    chex.assert_trees_all_equal_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tiny_llama.yaml")


@pytest.fixture(scope="module")
def params8(cfg):
    """Tiny model params sharded over the 8-device mesh of the config (data 2, fsdp 2, tensor 2)."""
    mesh = create_mesh(cfg.mesh)
    return nnx.state(init_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=3))


@pytest.fixture(scope="module")
def params1(params8):
    """The same params on one device (eager adapter set-up stays cheap)."""
    return jax.device_put(params8, jax.devices()[0])


def random_adapters(base, lcfg, seed):
    """Adapters of the shapes ``init_lora`` makes, filled with numpy normals (``b`` nonzero, unlike init)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: lora_lib.init_lora(base, lcfg, jax.random.key(0)))
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), shapes)


# -- residency and refcounts ------------------------------------------------------------------------------------


ops = st.lists(st.tuples(st.sampled_from(["publish", "acquire", "release", "evict_drained", "evict"]),
                         st.integers(0, 12), st.integers(1, 3)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 4), seq=ops)
def test_residency_matches_model_and_never_exceeds_cap(cap, seq):
    store = VersionStore(cap)
    refs: dict[int, int] = {}  # the model: resident version -> refcount
    newest = None
    next_version = 0
    for op, v, n in seq:
        if op == "publish":
            version = next_version
            drained = {u for u, r in refs.items() if r == 0}
            fits = len(refs) - len(drained) + 1 <= cap
            if fits:
                store.publish(version, tiny(version))
                refs = {u: r for u, r in refs.items() if u not in drained}
                refs[version], newest = 0, version
                next_version += 1 + n % 2  # versions may skip
            else:
                with pytest.raises(VersionError, match="cap"):
                    store.publish(version, tiny(version))
        elif op == "acquire":
            if v in refs:
                store.acquire(v, n)
                refs[v] += n
            else:
                with pytest.raises(VersionError, match="not resident"):
                    store.acquire(v, n)
        elif op == "release":
            if v in refs and refs[v] >= n:
                store.release(v, n)
                refs[v] -= n
            else:
                with pytest.raises(VersionError):
                    store.release(v, n)
        elif op == "evict":
            if v in refs and v != newest and refs[v] == 0:
                store.evict(v)
                del refs[v]
            else:
                with pytest.raises(VersionError):
                    store.evict(v)
        else:
            expected = sorted(u for u, r in refs.items() if r == 0 and u != newest)
            assert store.evict_drained() == expected
            refs = {u: r for u, r in refs.items() if u not in expected}
        assert store.resident() == set(refs)
        assert len(store.resident()) <= cap
        assert store.newest == newest
        for u, r in refs.items():
            assert store.refcount(u) == r
            assert float(store.stored(u)["w"][0, 0]) == u


def test_refcount_errors_are_clear():
    store = VersionStore(2)
    store.publish(0, tiny(0))
    with pytest.raises(VersionError, match=r"release of 1 from version 0 would take its refcount below zero "
                                           r"\(refcount is 0\)"):
        store.release(0)
    store.publish(1, tiny(1))  # version 0 drained: evicted
    with pytest.raises(VersionError, match=r"policy version 0 is not resident: it was evicted; resident: v1"):
        store.acquire(0)
    with pytest.raises(VersionError, match="never published"):
        store.acquire(7)
    with pytest.raises(VersionError, match=r"versions must increase \(newest is 1\)"):
        store.publish(1, tiny(1))
    with pytest.raises(VersionError, match="it is the newest"):
        store.evict(1)


def test_cap_error_names_versions_and_refcounts_and_changes_nothing():
    store = VersionStore(2)
    store.publish(3, tiny(3))
    store.acquire(3, 2)
    store.publish(4, tiny(4))
    store.acquire(4)
    with pytest.raises(VersionError, match=r"v3 \(refcount 2\), v4 \(refcount 1, newest\)"):
        store.publish(5, tiny(5))
    assert store.resident() == {3, 4} and store.newest == 4 and store.refcount(3) == 2


def test_publish_copies_and_rejects_another_structure():
    store = VersionStore(2)
    p = tiny(1.5)
    store.publish(0, p)
    p["w"].delete()  # the trainer donates its state at the next step
    assert float(store.stored(0)["w"].sum()) == 9.0
    with pytest.raises(VersionError, match="differ in structure"):
        store.publish(1, {"w": jnp.zeros((3, 2))})
    assert store.resident() == {0}


def test_reinstate_for_resume():
    store = VersionStore(3)
    with pytest.raises(VersionError, match="publish the newest first"):
        store.reinstate(4, tiny(4))
    store.publish(5, tiny(5))
    store.reinstate(4, tiny(4))
    store.acquire(4, 2)
    assert store.resident() == {4, 5}
    with pytest.raises(VersionError, match="already resident"):
        store.reinstate(4, tiny(4))


def test_publish_places_versions_in_given_shardings():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    target = NamedSharding(mesh, P("x"))
    store = VersionStore(2, shardings=target)
    store.publish(0, {"w": jnp.arange(8.0)})
    assert store.stored(0)["w"].sharding == target


# -- LoRA ----------------------------------------------------------------------------------------------------------


def test_lora_versions_store_adapters_and_merge_exactly(cfg, params1):
    lcfg = LoraConfig(rank=4, alpha=8.0, targets=("q", "down"))
    store = VersionStore(2, lora=lcfg, base=params1)
    adapters = random_adapters(params1, lcfg, 1)
    store.publish(0, adapters)
    merged = store.params(0)
    # float64 reference of W + (alpha / r) a @ b in the weight's layout
    for name in ("wq", "w_down"):
        w = np.asarray(params1[name][...], np.float64)
        a, b = (np.asarray(adapters[name][k], np.float64) for k in ("a", "b"))
        ref = w + 2.0 * np.einsum("lir,lro->lio", a, b).reshape(w.shape)
        np.testing.assert_allclose(np.asarray(merged[name][...]), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(merged["wk"][...]), np.asarray(params1["wk"][...]))
    m = cfg.model
    per_version = 4 * m.num_layers * 4 * ((m.hidden_size + m.num_heads * m.head_dim)
                                          + (m.intermediate_size + m.hidden_size))
    assert store.resident_bytes() == {0: per_version}
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params1))
    assert store.shared_bytes() == full
    assert VersionStore(2).shared_bytes() == 0
    with pytest.raises(VersionError, match="base"):
        VersionStore(2, lora=lcfg)


# -- snapshots -----------------------------------------------------------------------------------------------------


def test_retained_hand_cases():
    assert retained(range(10), 3) == {7, 8, 9}
    assert retained(range(10), 2, 4) == {0, 4, 8, 9}
    assert retained([1, 2, 5, 6], 1, 0, protect=[2, 99]) == {2, 6}


def test_snapshot_round_trip_is_bit_exact_with_metadata(tmp_path, cfg, params8):
    snaps = Snapshots(tmp_path, fingerprint=cfg.fingerprint(), keep_last=3)
    store = VersionStore.from_config(cfg, snapshots=snaps)
    store.publish(0, params8, step=0)
    bumped = jax.tree.map(lambda x: x + 1, params8)
    store.publish(1, bumped, step=7)
    snaps.wait()
    assert snaps.versions() == [0, 1]
    meta = snaps.metadata(1)
    assert {k: meta[k] for k in ("version", "step", "parent", "fingerprint", "kind")} == \
        {"version": 1, "step": 7, "parent": 0, "fingerprint": cfg.fingerprint(), "kind": "full"}
    assert meta["time"] > 0
    back = snaps.restore(1, target=params8)
    assert_same_tree(back, bumped)
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params8)))
    assert snaps.save(1, params8) is False  # an existing snapshot is never overwritten
    assert_same_tree(snaps.restore(1, target=params8), bumped)
    snaps.close()


@pytest.mark.parametrize("devices", [4, 1])
def test_snapshot_restores_onto_another_mesh(tmp_path, cfg, params8, devices):
    snaps = Snapshots(tmp_path, fingerprint=cfg.fingerprint())
    snaps.save(2, params8, step=2)
    mesh = create_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), jax.devices()[:devices])
    _, abstract = abstract_model(cfg.model)
    target = state_shardings(abstract, mesh, cfg.mesh.logical_axis_rules)
    back = snaps.restore(2, target=params8, shardings=target)
    assert_same_tree(back, params8)
    for x, s in zip(jax.tree.leaves(back), jax.tree.leaves(target)):
        assert x.sharding == s and len(x.sharding.device_set) == devices
    snaps.close()


def test_retention_keeps_exactly_expected_set(tmp_path):
    snaps = Snapshots(tmp_path, fingerprint="f", keep_last=2, keep_every=4)
    store = VersionStore(3, snapshots=snaps)
    for v in range(10):
        store.publish(v, tiny(v))
        if v == 5:
            store.acquire(5)  # in flight: resident, so its snapshot is protected
    snaps.wait()
    assert snaps.versions() == [0, 4, 5, 8, 9]
    store.release(5)
    store.publish(10, tiny(10))
    store.pin([8])
    store.publish(11, tiny(11))
    snaps.wait()
    assert snaps.versions() == [0, 4, 8, 10, 11]
    assert float(snaps.restore(4, target=tiny(0))["w"][0, 0]) == 4.0
    snaps.close()


def test_snapshots_under_a_relative_directory(tmp_path, monkeypatch):
    """A relative directory (the CLI's default run directory is ``runs/NAME``) is taken from the working
    directory at creation; changing directory afterwards does not move it."""
    monkeypatch.chdir(tmp_path)
    snaps = Snapshots("runs/x/versions", fingerprint="f")
    snaps.save(2, tiny(2))
    snaps.wait()
    monkeypatch.chdir(tmp_path.parent)
    assert snaps.versions() == [2] and (tmp_path / "runs/x/versions/v_00000002").is_dir()
    assert float(snaps.restore(2, target=tiny(0))["w"][0, 0]) == 2.0
    snaps.close()


def test_bad_snapshots_are_reported(tmp_path):
    snaps = Snapshots(tmp_path, fingerprint="aaaa")
    snaps.save(3, tiny(3))
    snaps.wait()
    with pytest.raises(CheckpointError, match=r"no snapshot at .*v_00000007.*versions \[3\]"):
        snaps.restore(7, target=tiny(0))
    with pytest.raises(CheckpointError, match=r"fingerprint aaaa, this run's is bbbb"):
        Snapshots(tmp_path, fingerprint="bbbb").restore(3, target=tiny(0))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(CheckpointError, match="shardings tree has 2 leaves, the arrays tree 1"):
        snaps.restore(3, target=tiny(0), shardings=[one, one])
    with pytest.raises(CheckpointError, match="do not restore onto the target"):
        snaps.restore(3, target={"w": jnp.zeros((5,))})
    import shutil
    shutil.rmtree(tmp_path / "v_00000003" / "meta")
    with pytest.raises(CheckpointError, match=r"v_00000003/meta/\S+: missing from the snapshot"):
        snaps.restore(3, target=tiny(0))
    (tmp_path / "v_00000003" / "dora_sizes.json").unlink()  # no size record: Orbax's own read fails
    with pytest.raises(CheckpointError, match=r"v_00000003: snapshot metadata missing"):
        snaps.restore(3, target=tiny(0))
    snaps.close()


def test_truncated_or_missing_snapshot_files_are_named_before_orbax_reads(tmp_path):
    """Each committed snapshot records its files' sizes; a file cut short or gone stops the restore with its
    name (Orbax itself would fail with an opaque tensorstore error, and print tracebacks from its threads)."""
    import json
    import os

    from dora_jax.run.versions import SIZES

    snaps = Snapshots(tmp_path, fingerprint="aaaa")
    many = {f"w{i}": jnp.full((64, 64), float(i)) for i in range(8)}
    for v in (1, 2, 3, 4):
        snaps.save(v, many)
    snaps.wait()
    for v in (1, 2, 3, 4):
        record = json.loads((snaps.path(v) / SIZES).read_text())
        files = sorted(f.relative_to(snaps.path(v)).as_posix() for f in snaps.path(v).rglob("*") if f.is_file())
        assert sorted(record) == [f for f in files if f != SIZES] and any(f.startswith("params/") for f in record)
    assert_same_tree(snaps.restore(1, target=many), many)  # the record does not disturb Orbax

    data = max((f for f in snaps.path(2).rglob("*") if f.is_file() and "params/d/" in f.as_posix()),
               key=lambda f: f.stat().st_size)
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with pytest.raises(CheckpointError, match=rf"{data.name}: {size // 2} bytes, {SIZES} records {size} \(trunc"):
        snaps.restore(2, target=many)
    gone = next(f for f in snaps.path(3).rglob("*") if f.name == "manifest.ocdbt")
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"{gone.parent.name}/manifest.ocdbt: missing from the snapshot"):
        snaps.restore(3, target=many)
    (snaps.path(4) / SIZES).write_text("[1, 2")
    with pytest.raises(CheckpointError, match=rf"v_00000004/{SIZES}: unreadable size record"):
        snaps.restore(4, target=many)
    (snaps.path(4) / SIZES).unlink()  # as if the writer died between Orbax's commit and the record
    assert_same_tree(snaps.restore(4, target=many), many)
    snaps.close()


def test_lora_snapshots_hold_adapters_and_base_once(tmp_path, cfg, params1):
    lcfg = LoraConfig(rank=2, alpha=4.0, targets=("v",))
    snaps = Snapshots(tmp_path, fingerprint=cfg.fingerprint())
    run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lora=lcfg, max_staleness=2))
    store = VersionStore.from_config(run_cfg, base=params1, snapshots=snaps)
    assert store.max_resident == 3
    adapters = random_adapters(params1, lcfg, 5)
    store.publish(6, adapters, step=6)
    snaps.wait()
    assert snaps.metadata(6)["kind"] == "lora"
    assert_same_tree(snaps.restore(6, target=adapters), adapters)
    assert_same_tree(snaps.restore_base(target=params1), params1)
    # resume: a fresh store over the restored base brings the version back with the same merged params
    again = VersionStore.from_config(run_cfg, base=snaps.restore_base(target=params1), snapshots=snaps)
    again.publish(7, adapters)
    again.reinstate(6, snaps.restore(6, target=adapters))
    assert_same_tree(again.params(6), store.params(6))
    snaps.close()
