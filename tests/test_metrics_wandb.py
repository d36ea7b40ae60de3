"""metrics.wandb: the rows of metrics.jsonl and the run's config go to Weights & Biases, here in offline mode
(nothing leaves the machine); skipped where the wandb extra is not installed."""

import glob
import json
import os
import time

import pytest

from dora_jax.config import ConfigError, load_config
from dora_jax.metrics import MetricsWriter, read_metrics


def test_wandb_offline_gets_the_rows_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (pip install 'dora-jax[wandb]') is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["metrics.wandb=true", "metrics.wandb_project=dora-test", "run.name=wb"])
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:  # what the run writes when it starts
        json.dump(cfg.to_dict(), f)
    w = MetricsWriter(run_dir, tensorboard=False)
    for step in (1, 2):
        w.write({"step": step, "reward": step / 4, "accuracy": 0.5, "staleness": {"0": 3}, "train": {"loss": 0.1 * step}})
    run = w.wandb_run
    assert run.config["metrics"]["wandb_project"] == "dora-test" and run.config["task"]["reward_timeout_s"] == 10.0
    assert run.summary["reward"] == 0.5 and run.summary["train"]["loss"] == pytest.approx(0.2)
    w.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]  # JSONL as always
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1
    run_id = open(os.path.join(run_dir, "wandb_run_id")).read().strip()
    assert runs[0].endswith(run_id)
    record, t0 = b"", time.perf_counter()
    while b"staleness" not in record and time.perf_counter() - t0 < 20:  # W&B's own process writes it
        record = open(glob.glob(os.path.join(runs[0], "run-*.wandb"))[0], "rb").read()  # what `wandb sync` uploads
        time.sleep(0.1)
    assert b"reward_timeout_s" in record and b"dora-test" in record and b"staleness" in record
    # A resumed run continues the same W&B run.
    w = MetricsWriter(run_dir, tensorboard=False)
    w.write({"step": 3, "reward": 1.0})
    w.close()
    assert open(os.path.join(run_dir, "wandb_run_id")).read().strip() == run_id


def test_wandb_config_is_checked():
    with pytest.raises(ConfigError, match=r"'metrics.wandb_project' = '': must name the W&B project"):
        load_config(None, ["metrics.wandb=true", "metrics.wandb_project=''"])
    with pytest.raises(ConfigError, match=r"unknown config field 'metrics.wandb_projct'"):
        load_config(None, ["metrics.wandb_projct=x"])
