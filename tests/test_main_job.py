"""The main job end to end: ``dora-jax train --config smollm2_arith`` (what ``make demo`` runs) through the
command line, with the preset's schedule, task, evaluation and mesh, on a tiny random model instead of
SmolLM2's weights (a 135M-parameter model trains far too slowly for a test on two CPU cores) and two updates.

What the README promises a run leaves in its directory is checked: every ``summary.json`` field (present, in
its range, consistent with the other files), ``metrics.jsonl``, ``samples.jsonl``, ``ledger.json``, the run's
``config.json``, checkpoints and version snapshots, and the three plots, by the figures' own content (axes
labels, lines, points, bars) before they are saved and by the pixels of the PNGs after.
"""

import json
import math

import numpy as np
import pytest

from dora_jax.cli import main
from dora_jax.dora.ledger import Ledger
from invariants import check_trained_samples

TINY_MODEL = ['model.weights=""', "model.vocab_size=256", "model.hidden_size=64", "model.intermediate_size=128",
              "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
              "model.max_seq_len=256"]
# Two groups an iteration: the preset's 4 minibatches become 2, still several updates a version.
SHORT = ["dora.steps=2", "dora.train_batch=8", "dora.rollout_batch=16", "rollout.slots=16", "task.eval_size=4",
         "run.checkpoint_every=1", "train.minibatches=2"]
K, STEPS, TBS, EVAL_N = 1, 2, 8, 4 * 2  # the preset's K = 1 and two samples per held-out question


def _in(lo, hi):
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


def _count(n):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v == n


FRACTION, POSITIVE, SECONDS = _in(0.0, 1.0), _in(1e-12, math.inf), _in(0.0, math.inf)
# Every summary.json field with its range; a field missing here fails the test until it gets a check.
SUMMARY = {
    "mode": lambda v: v == "dora", "max_staleness": _count(K), "task": lambda v: v == "arithmetic",
    "accuracy_before": FRACTION, "accuracy_after": FRACTION, "reward_before": FRACTION, "reward_after": FRACTION,
    "eval_n": _count(EVAL_N), "steps": _count(STEPS), "samples": _count(STEPS * TBS), "filtered": _in(0, math.inf),
    "filtered_reasons": lambda v: isinstance(v, list) and all(isinstance(r, str) and r for r in v),
    # On a CPU rollout.warmup defaults to off: nothing compiled ahead of the first update.
    "warmup_s": lambda v: v == 0.0, "warmup_programs": _count(0),
    "wall_s": POSITIVE, "eval_s": POSITIVE, "train_s": POSITIVE, "checkpoint_s": POSITIVE,
    # One kept checkpoint (the demo's run.keep_checkpoints) in a directory that also holds snapshots and files.
    "checkpoint_bytes": lambda v: isinstance(v, int) and v > 0, "run_dir_bytes": lambda v: isinstance(v, int) and v > 0,
    "samples_per_s": POSITIVE, "gen_tok_s": POSITIVE, "trainer_idle_fraction": FRACTION,
    "max_resident_versions": _in(1, K + 1), "max_versions_per_group": _in(1, K + 1), "placement": lambda v: v == "shared", "rollout_groups": _count(1),
    "sync_s": lambda v: v == 0.0, "slot_utilization": _in(1e-12, 1.0),
    "config_fingerprint": lambda v: isinstance(v, str) and len(v) >= 8, "resumed": lambda v: v is False,
    "processes": _count(1),
    "decode_batch_steps": POSITIVE, "decode_batch_steps_per_sample": POSITIVE,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The main job's run directory, and what its plots drew before they were saved."""
    from dora_jax import metrics

    run_dir = tmp_path_factory.mktemp("smollm2_arith")
    figures, save = {}, metrics.save_figure

    def recording(fig, out_dir, name):
        figures[name] = [{"xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(), "title": ax.get_title(),
                          "lines": [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                                    for line in ax.get_lines()],
                          "bars": [(p.get_x(), p.get_height()) for p in ax.patches],
                          "xticks": [t.get_text() for t in ax.get_xticklabels()],
                          "inches": tuple(fig.get_size_inches())} for ax in fig.axes]
        return save(fig, out_dir, name)

    metrics.save_figure = recording
    try:
        assert main(["train", "--config", "smollm2_arith", "--run-dir", str(run_dir), *TINY_MODEL, *SHORT]) == 0
    finally:
        metrics.save_figure = save
    return run_dir, figures


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_summary_fields_are_all_there_and_in_range(run):
    run_dir, _ = run
    summary = json.load(open(run_dir / "summary.json"))
    unchecked = sorted(set(summary) - set(SUMMARY))
    assert not unchecked, f"summary.json fields without a range check in this test: {unchecked}"
    missing = sorted(set(SUMMARY) - set(summary))
    assert not missing, f"summary.json lacks {missing}"
    bad = {k: v for k, v in summary.items() if not SUMMARY[k](v)}
    assert not bad, bad
    assert summary["train_s"] < summary["wall_s"] and summary["samples_per_s"] == pytest.approx(
        summary["samples"] / summary["wall_s"])
    assert summary["trainer_idle_fraction"] == pytest.approx(1 - summary["train_s"] / summary["wall_s"])
    with open(run_dir / "config.json") as f:
        config = json.load(f)
    assert config["dora"]["mode"] == "dora" and config["task"]["name"] == "arithmetic" and config["dora"]["steps"] == 2


def test_the_files_the_readme_names_are_written_and_agree(run):
    run_dir, _ = run
    for name in ("summary.json", "metrics.jsonl", "samples.jsonl", "ledger.json", "config.json", "reward.png",
                 "staleness.png", "versions.png"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    # The demo keeps one checkpoint (run.keep_checkpoints: 1), and the snapshots it or residency needs.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_00000002"]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["run_dir_bytes"] > summary["checkpoint_bytes"] > 0
    assert (run_dir / "versions" / "v_00000002").is_dir()
    metrics = _lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0 <= m["reward"] <= 1 and 0 <= m["accuracy"] <= 1 and m["staleness_max"] <= K
        assert sum(m["staleness"].values()) == TBS and 1 <= m["resident_versions"] <= K + 1
        assert m["train"]["updates"] == m["train"]["applied"] == 2  # one version: both minibatches' updates
    ledger = Ledger.from_dict(json.load(open(run_dir / "ledger.json"))["ledger"])
    ledger.check(K)
    samples = _lines(run_dir / "samples.jsonl")
    assert len(samples) == STEPS * TBS
    check_trained_samples(samples, ledger, K)
    assert all(r["reward"] in (0.0, 1.0) for r in samples)  # arithmetic: right or wrong


def test_the_plots_show_the_run(run):
    """Each figure as drawn (labels, one point per update, every trained sample in the histogram), and each
    PNG as written: the figure's shape, a readable size, and ink on it."""
    from matplotlib import image

    run_dir, figures = run
    metrics = _lines(run_dir / "metrics.jsonl")
    assert sorted(figures) == ["reward.png", "staleness.png", "versions.png"]
    (reward,) = figures["reward.png"]
    title = run_dir.name + ": "
    assert (reward["title"], reward["xlabel"], reward["ylabel"]) == (
        title + "reward per policy version", "policy version (one iteration: train.minibatches x train.epochs updates)",
        "mean over the trained batch")
    assert [(label, x) for label, x, _ in reward["lines"]] == [("reward (trained batch)", [1, 2]),
                                                              ("accuracy (trained batch)", [1, 2])]
    assert reward["lines"][0][2] == [m["reward"] for m in metrics]
    assert reward["lines"][1][2] == [m["accuracy"] for m in metrics]
    (stale,) = figures["staleness.png"]
    assert (stale["title"], stale["xlabel"], stale["ylabel"]) == (
        title + "staleness of trained samples", "staleness (trainer version - sample version)", "trained samples")
    lags = sorted({int(lag) for m in metrics for lag in m["staleness"]})
    assert stale["xticks"] == [str(lag) for lag in lags] and sum(h for _, h in stale["bars"]) == STEPS * TBS
    (versions,) = figures["versions.png"]
    assert (versions["title"], versions["xlabel"], versions["ylabel"]) == (
        title + "samples in flight per policy version", "seconds", "samples in flight")
    in_flight = sorted({int(v) for m in metrics for v in m["in_flight"]})
    assert [label for label, _, _ in versions["lines"]] == [f"v{v}" for v in in_flight] and in_flight
    assert all(x == [m["wall_s"] for m in metrics] for _, x, _ in versions["lines"])
    for name, (fig,) in figures.items():
        pixels = image.imread(run_dir / name)
        (height, width), (w_in, h_in) = pixels.shape[:2], fig["inches"]
        assert width >= 400 and abs(width / height - w_in / h_in) < 0.01, (name, pixels.shape)
        ink = np.any(pixels[..., :3] < 0.9, axis=-1).mean()  # not white
        colours = len(np.unique(pixels[..., :3].reshape(-1, 3).round(2), axis=0))
        assert 0.01 < ink < 0.6 and colours > 10, (name, ink, colours)
