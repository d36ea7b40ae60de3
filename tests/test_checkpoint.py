"""Run checkpoints: bit-exact round trip, restore onto another mesh, retention, and every way a checkpoint can
be bad (truncated file, missing metadata, other config, partial write, crash before commit), each reported
with a fallback to the last good checkpoint and nothing good lost."""

import json
import logging
import shutil

import chex
import jax
import numpy as np
import pytest

from dora_jax.run.checkpoint import MARKER, CheckpointError, RunCheckpoints, check_json
from dora_jax.config import MeshConfig, load_config
from dora_jax.sharding import create_mesh
from dora_jax.trainer import Trainer


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("configs/tiny_llama.yaml")
    trainer, state = Trainer.create(cfg)
    return cfg, state


def run_state(step: int) -> dict:
    return {"scheduler": {"version": step, "ledger": {"groups": [[0, 0, 0, [0, 1]]], "entries": []}},
            "data": {"next_prompt": 10 * step}, "rng": {"bit_generator": "PCG64", "state": 2**70 + step},
            "metrics": {"line": step, "loss": 0.5}}


def assert_same_tree(a, b) -> None:
    """The same structure, dtypes and values (chex names the first leaf that differs)."""
    chex.assert_trees_all_equal_dtypes(a, b)
    chex.assert_trees_all_equal(a, b)


def bumped(state, k: int):
    """A state whose every leaf differs from ``state``'s (so a restore from the wrong step is caught)."""
    return _bump(state, k)


@jax.jit
def _bump(state, k):
    return jax.tree.map(lambda x: x + k.astype(x.dtype), state)


@pytest.fixture(scope="module")
def written(setup, tmp_path_factory):
    """Checkpoints of steps 1, 2, 3 (each state distinct), copied fresh into each test's directory."""
    cfg, state = setup
    root = tmp_path_factory.mktemp("ckpts")
    ckpts = RunCheckpoints(root, fingerprint=cfg.fingerprint(), keep_last=5)
    for s in (1, 2, 3):
        ckpts.save(s, bumped(state, s), run_state(s), meta={"version": s})
    return root


@pytest.fixture
def ckpts(setup, written, tmp_path):
    cfg, _ = setup
    shutil.copytree(written, tmp_path / "c")
    return RunCheckpoints(tmp_path / "c", fingerprint=cfg.fingerprint(), keep_last=5)


def test_round_trip_is_bit_exact(setup, ckpts):
    _, state = setup
    found = ckpts.restore_latest(target=state)
    assert found.step == 3 and found.skipped == [] and found.path.name == "step_00000003"
    assert found.run_state == run_state(3)
    assert found.meta["version"] == 3 and found.meta["fingerprint"] == ckpts.fingerprint
    assert_same_tree(found.train_state, bumped(state, 3))
    assert jax.tree.structure(found.train_state) == jax.tree.structure(state)
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(found.train_state), jax.tree.leaves(state)))


def test_relative_directory(setup, tmp_path, monkeypatch):
    """A relative directory is taken from the working directory at creation, for saves and restores alike."""
    cfg, state = setup
    monkeypatch.chdir(tmp_path)
    ckpts = RunCheckpoints("runs/x/checkpoints", fingerprint=cfg.fingerprint())
    ckpts.save(1, bumped(state, 1), run_state(1))
    monkeypatch.chdir(tmp_path.parent)
    assert (tmp_path / "runs/x/checkpoints/step_00000001" / MARKER).is_file()
    found = ckpts.restore_latest(target=state)
    assert found.step == 1
    assert_same_tree(found.train_state, bumped(state, 1))


def test_restore_onto_a_smaller_mesh(setup, ckpts):
    _, state = setup
    mesh = create_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), jax.devices()[:4])
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    found = ckpts.restore_latest(target=state, shardings=target)
    assert_same_tree(found.train_state, bumped(state, 3))
    assert all(x.sharding == target for x in jax.tree.leaves(found.train_state))


def _state_file(path):
    files = json.loads((path / MARKER).read_text())["files"]
    return max((r for r in files if r.startswith("state/")), key=lambda r: files[r]["size"])


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"bytes, COMPLETE records .* \(truncated or corrupt\)"),
    ("flip", r"sha256 differs"),
    ("no_meta", r"meta.json: listed in COMPLETE but missing"),
    ("no_marker", r"no COMPLETE marker; the write did not finish"),
])
def test_damaged_newest_falls_back_to_previous(setup, ckpts, damage, message, caplog):
    _, state = setup
    newest = ckpts.path(3)
    if damage == "truncate":
        f = newest / _state_file(newest)
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "flip":
        f = newest / _state_file(newest)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "no_meta":
        (newest / "meta.json").unlink()
    else:
        (newest / MARKER).unlink()
    with caplog.at_level(logging.WARNING, logger="dora_jax.run.checkpoint"):
        found = ckpts.restore_latest(target=state)
    assert found.step == 2
    assert_same_tree(found.train_state, bumped(state, 2))
    assert found.run_state == run_state(2)
    assert len(found.skipped) == 1 and "step_00000003" in found.skipped[0]
    assert __import__("re").search(message, found.skipped[0]), found.skipped[0]
    assert "falling back" in caplog.text and "step_00000003" in caplog.text


def test_other_config_fingerprint_falls_back(setup, ckpts):
    _, state = setup
    meta_path = ckpts.path(3) / "meta.json"
    other = RunCheckpoints(ckpts.directory, fingerprint="0123456789abcdef")
    with pytest.raises(CheckpointError, match="fingerprint"):
        other.restore_latest(target=state)  # every checkpoint is another config's: none is used
    # a newest checkpoint written by another config (marker consistent with its files) is skipped
    shutil.rmtree(ckpts.path(3))
    other.save(3, bumped(state, 30), run_state(30))
    found = ckpts.restore_latest(target=state)
    assert found.step == 2
    assert "written by config fingerprint 0123456789abcdef, this run's is " + ckpts.fingerprint in found.skipped[0]
    assert meta_path.exists()  # nothing was deleted


def test_crash_before_commit_leaves_previous_usable(setup, ckpts, monkeypatch):
    _, state = setup
    import dora_jax.run.checkpoint as ck

    def crash(root):
        raise KeyboardInterrupt("killed while hashing")

    monkeypatch.setattr(ck, "_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpts.save(4, bumped(state, 4), run_state(4))
    monkeypatch.undo()
    assert (ckpts.directory / ".tmp-step_00000004").is_dir() and not ckpts.path(4).exists()
    found = ckpts.restore_latest(target=state)
    assert found.step == 3
    assert_same_tree(found.train_state, bumped(state, 3))
    assert any(".tmp-step_00000004" in s and "crashed before commit" in s for s in found.skipped)
    # the next save of that step replaces the leftover and commits
    ckpts.save(4, bumped(state, 4), run_state(4))
    assert not (ckpts.directory / ".tmp-step_00000004").exists()
    assert ckpts.restore_latest(target=state).step == 4


def test_retention_keeps_the_newest_n(setup, ckpts):
    _, state = setup
    ckpts.keep_last = 2
    (ckpts.directory / ".tmp-step_00000001").mkdir()  # an old crashed write
    shutil.copytree(ckpts.path(3), ckpts.path(7))
    (ckpts.path(7) / MARKER).unlink()  # a newer partial one: never deleted by an older save
    ckpts.save(4, bumped(state, 4), run_state(4))
    assert ckpts.steps() == [3, 4]
    assert sorted(p.name for p in ckpts.directory.iterdir()) == ["step_00000003", "step_00000004", "step_00000007"]


def test_no_overwrite_and_corrupt_same_step_kept_aside(setup, ckpts):
    _, state = setup
    with pytest.raises(CheckpointError, match=r"complete checkpoint for step 3 already exists .* not overwritten"):
        ckpts.save(3, state, run_state(0))
    assert ckpts.restore_latest(target=state).run_state == run_state(3)
    (ckpts.path(3) / "meta.json").write_text("{}")  # corrupt: a resumed run falls back to 2 and writes 3 again
    ckpts.save(3, bumped(state, 33), run_state(33))
    assert ckpts.restore_latest(target=state).run_state == run_state(33)
    aside = ckpts.directory / "step_00000003.bad-0"
    assert aside.is_dir() and (aside / "meta.json").read_text() == "{}"


def test_bad_run_state_writes_nothing(setup, ckpts):
    _, state = setup
    before = sorted(p.name for p in ckpts.directory.iterdir())
    with pytest.raises(CheckpointError, match=r"run_state\['data'\]\['order'\] is a ndarray"):
        ckpts.save(9, state, {"data": {"order": np.arange(3)}})
    with pytest.raises(CheckpointError, match=r"key 3 is a int"):
        check_json({3: "x"})
    with pytest.raises(CheckpointError, match="non-negative integer"):
        ckpts.save(-1, state, {})
    assert sorted(p.name for p in ckpts.directory.iterdir()) == before


def test_empty_and_all_bad(setup, tmp_path, ckpts):
    _, state = setup
    assert RunCheckpoints(tmp_path / "none", fingerprint="x").restore_latest(target=state) is None
    for s in (1, 2, 3):
        (ckpts.path(s) / MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"no usable run checkpoint(.|\n)*step_00000003(.|\n)*step_00000001"):
        ckpts.restore_latest(target=state)
