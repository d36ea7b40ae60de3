"""Run metrics: one JSON line per update (``metrics.jsonl``), the same scalars to TensorBoard when
tensorboardX is installed, and ``plot_run`` for the PNGs a reader looks at first.

Keys of a metrics line (all per update unless named cumulative):
``step``, ``version`` (the trainer's version after the update), ``wall_s`` (since the run started),
``step_s`` (since the previous update), ``train_s``, ``rollout_share`` (the part of ``step_s`` not spent in
the train step), ``trainer_idle_fraction`` (cumulative: wall time not spent training), ``reward``,
``accuracy``, ``len_mean/p50/p99/max`` (response tokens of the trained batch), ``staleness`` (lag -> samples
in the batch), ``staleness_mean/max``, ``in_flight`` (version -> samples), ``resident_versions``,
``gen_tok_s`` and ``train_tok_s`` (since the previous update), ``slot_occupancy`` (live rows / slots over the
decode steps since the previous update), ``slot_utilization`` (cumulative: live rows / computed rows),
``filtered`` (cumulative), and the train step's own metrics under ``train/``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable


class MetricsWriter:
    """Appends metrics lines to ``RUN_DIR/metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str, tensorboard: bool = True):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # optional: the [plot] extra
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = int(row.get("step", 0))
            for k, v in _scalars(row):
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _scalars(row: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for k, v in row.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield prefix + k, float(v)
        elif isinstance(v, dict) and k.startswith("train"):
            yield from _scalars(v, prefix + k + "/")


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a dora-jax run directory?)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Writes ``reward.png`` (reward and accuracy per step), ``staleness.png`` (histogram of trained samples'
    lag) and ``versions.png`` (in-flight samples per version over time) into ``out_dir`` (default: the run
    directory). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no updates to plot")
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    steps = [r["step"] for r in rows]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward"] for r in rows], label="reward (trained batch)")
    ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (trained batch)")
    ax.set_xlabel("update")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir, "reward.png"))

    hist: dict[int, int] = {}
    for r in rows:
        for lag, n in r["staleness"].items():
            hist[int(lag)] = hist.get(int(lag), 0) + n
    fig, ax = plt.subplots(figsize=(4, 3))
    lags = sorted(hist)
    ax.bar([str(k) for k in lags], [hist[k] for k in lags])
    ax.set_xlabel("staleness (trainer version - sample version)")
    ax.set_ylabel("trained samples")
    paths.append(_save(fig, out_dir, "staleness.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    versions = sorted({int(v) for r in rows for v in r["in_flight"]})
    t = [r["wall_s"] for r in rows]
    for v in versions:
        ax.plot(t, [r["in_flight"].get(str(v), 0) for r in rows], label=f"v{v}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("samples in flight")
    if len(versions) <= 12:
        ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out_dir, "versions.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
