"""The command line parses, calls the library and reports bad input with exit code 2."""

import json
import os
import subprocess
import sys

from dora_jax.cli import main
from dora_jax.xla_flags import FUSION_EMITTERS, OPT_LEVEL, SAFE_COLLECTIVES


def test_bad_override_exits_2(capsys):
    assert main(["generate", "--config", "tiny_llama", "model.num_heads=3"]) == 2
    err = capsys.readouterr().err
    assert "tiny_llama.yaml" in err and "'model.num_kv_heads' = 8: must divide num_heads (3)" in err


def test_missing_weights_exits_2(capsys, tmp_path):
    assert main(["export", "--config", "tiny_llama", "--out", str(tmp_path / "o"),
                 f"model.weights={tmp_path}/nope"]) == 2
    assert "not found" in capsys.readouterr().err


def test_a_run_directory_that_cannot_be_continued_exits_2(capsys, tmp_path):
    """Saved state the run cannot continue from is bad input too: the message, exit code 2, nothing touched."""
    from dora_jax.config import load_config

    saved = json.dumps(load_config("tiny_llama", ["train.group_size=2"]).to_dict())  # another run's
    (tmp_path / "config.json").write_text(saved)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(tmp_path), "--no-plot"]) == 2
    assert "error: " in (err := capsys.readouterr().err) and "no checkpoint to continue from" in err
    assert "train.group_size" in err
    assert (tmp_path / "config.json").read_text() == saved and sorted(os.listdir(tmp_path)) == [
        "config.json", "metrics.jsonl"]


def test_export_random_model_on_fake_devices(tmp_path, capsys):
    """`dora-jax export` of the sharded tiny config (2x2x2 mesh) in a fresh process with 8 fake devices, asked
    for the way a user would (the device count only): the command adds the collective-order flag before JAX
    starts, so create_mesh has nothing to warn about."""
    out = tmp_path / "hf"
    # The suite's compiler settings besides (tests/conftest.py): they leave the collectives' order to the command.
    flags = f"--xla_force_host_platform_device_count=8 {OPT_LEVEL}=0 {FUSION_EMITTERS}=false"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "dora_jax.cli", "export", "--config", "tiny_llama", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr and SAFE_COLLECTIVES not in proc.stderr, proc.stderr
    with open(out / "config.json") as f:
        assert json.load(f)["num_attention_heads"] == 8
    # Refuses to overwrite what is there (before any work: here, in the test's process).
    before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["export", "--config", "tiny_llama", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_overrides_may_follow_options(capsys, tmp_path):
    # Parsed as an override after --no-plot and --run-dir: the error is the override's, not argparse's.
    assert main(["train", "--config", "tiny_llama", "--no-plot", "dora.steps=-1", "--run-dir", str(tmp_path / "r"),
                 "train.group_size=4"]) == 2
    assert "error: override 'dora.steps=-1': config field 'dora.steps' = -1" in capsys.readouterr().err
    # Anything else left over is still refused by argparse.
    for argv in (["train", "--config", "tiny_llama", "dora.steps=1", "--bogus"], ["plot", str(tmp_path), "a=1"]):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert "unrecognized arguments: " + argv[-1] in capsys.readouterr().err


def test_bad_paths_are_refused_before_any_work(capsys, tmp_path, monkeypatch):
    from benchmarks import decode

    def never(*a, **k):
        raise AssertionError("the benchmark ran although its --json file cannot be written")

    monkeypatch.setattr(decode, "bench_decode", never)
    assert main(["bench", "decode", "--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert f"--json {tmp_path}/missing/out.json: the directory {tmp_path}/missing does not exist" in \
        capsys.readouterr().err
    assert main(["bench", "decode", "--json", str(tmp_path)]) == 2
    assert "is a directory; name a file" in capsys.readouterr().err
    for flag, value in (("--batch", "-2"), ("--repeats", "0"), ("--new-tokens", "x")):
        try:
            main(["bench", "decode", flag, value])
        except SystemExit as e:
            assert e.code == 2
        assert f"argument {flag}: " in capsys.readouterr().err
    # A run directory that is a file: refused, the file untouched.
    f = tmp_path / "a_file"
    f.write_text("keep me")
    for run_dir in (f, f / "sub"):
        assert main(["train", "--config", "tiny_llama", "--run-dir", str(run_dir), "--no-plot",
                     "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]) == 2
        assert f"{f} is a file, not a directory" in capsys.readouterr().err
    assert f.read_text() == "keep me"
    # A directory whose config.json is not a run's (a Hugging Face model's): a run would overwrite it.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 256}')
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(hf), "--no-plot",
                 "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]) == 2
    assert f"{hf}/config.json is a Hugging Face model's config.json, which a run would overwrite" in \
        capsys.readouterr().err
    assert (hf / "config.json").read_text().startswith('{"architectures"') and os.listdir(hf) == ["config.json"]
    # Output directories under a file: refused before the work (simulate's plots came after the whole run).
    for argv in (["plot", str(tmp_path), "--out", str(f)],
                 ["simulate", "--config", "sim_small", "--plot", str(f / "p")],
                 ["export", "--config", "tiny_llama", "--out", str(f / "hf")]):
        assert main(argv) == 2
        assert f"{argv[-2]} {argv[-1]}: {f} is a file, not a directory" in capsys.readouterr().err
    assert f.read_text() == "keep me"
    # The demo runs the built-in default; a --config would be silently ignored, so it is refused.
    assert main(["demo", "--config", "tiny_llama"]) == 2
    assert "for another config run 'dora-jax generate --config tiny_llama'" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such run directory" in capsys.readouterr().err


def test_a_run_that_fails_at_start_up_leaves_no_empty_run_directory(capsys, tmp_path):
    """The run directory is made before the task is loaded: a task file that is not there fails after it, and
    the directories made for the run go again; one that existed before stays."""
    one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "task.name=gsm8k",
                  f"task.path={tmp_path}/missing.jsonl"]
    run_dir = tmp_path / "runs" / "a" / "run"
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(run_dir), "--no-plot", *one_device]) == 2
    assert "missing.jsonl' does not exist" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(kept), "--no-plot", *one_device]) == 2
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(kept) == []


def test_a_preempted_run_exits_0_naming_its_checkpoint(capsys, tmp_path, monkeypatch):
    """A run the loop stopped on a signal (tests/test_resume.py stops real ones) ends the command with exit
    code 0, the signal, the update and the checkpoint to continue from, and no summary."""
    import dora_jax.run

    checkpoint = str(tmp_path / "checkpoints" / "3")

    class Preempted:
        def __init__(self, cfg, run_dir):
            pass

        def run(self):
            return {"preempted": True, "signal": "SIGTERM", "step": 3, "checkpoint": checkpoint, "checkpoint_s": 1.25}

    monkeypatch.setattr(dora_jax.run, "Runner", Preempted)
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(tmp_path), "--no-plot", "dora.steps=8"]) == 0
    out = capsys.readouterr().out
    assert f"stopped on SIGTERM at update 3 of 8; checkpoint {checkpoint} written in 1.2 s" in out, out
    assert "Run the same command to continue" in out and "held-out answers" not in out
