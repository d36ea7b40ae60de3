"""Run metrics: :class:`MetricsWriter` writes one JSON line per update (``metrics.jsonl``) and mirrors it to
TensorBoard (``metrics.tensorboard``) and Weights & Biases (``metrics.wandb``); :func:`read_metrics` reads it
back; :func:`plot_run` draws the PNGs (docs/runner.md, "Metrics", defines the figures).

Keys of an update line (per update unless cumulative): ``step``, ``version`` (after the update), ``wall_s``,
``step_s``, ``train_s``, ``rollout_share``, ``trainer_idle_fraction`` (cumulative), ``reward``, ``accuracy``,
``len_mean/p50/p99/max`` (response tokens trained), ``staleness`` (lag -> samples), ``staleness_mean/max``,
``in_flight`` (version -> samples), ``resident_versions``, ``gen_tok_s``, ``train_tok_s``, ``slot_occupancy``,
``slot_utilization`` (cumulative), ``filtered`` (cumulative), and the train step's metrics under ``train/``.
With ``task.eval_every``, an evaluation's line has an ``eval`` key (``accuracy``, ``pass_at_k``, ``k``,
``reward``, ``n``, ``len_mean``, ``score_errors``) beside ``step``, ``version`` (evaluated), ``eval_s`` and
``wall_s``; it is written when its last answer is scored, so it may follow later updates' lines.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from typing import Any, Iterable

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends metrics lines to ``RUN_DIR/metrics.jsonl`` and mirrors them to TensorBoard and W&B (an
    evaluation's line as ``eval/*``: at its version's step, for W&B with ``eval/version`` as x axis).

    Args:
      run_dir: the run directory.
      tensorboard: False turns TensorBoard off whatever the config says.
      config: the run's config as plain data (``Config.to_dict()``; default ``RUN_DIR/config.json`` if there);
        its ``metrics`` section says where else rows go, and W&B records it as the run's config.
      step: the last update's step already in the file (a resumed run's).

    Raises:
      MetricsError: ``metrics.wandb`` is on and W&B cannot start (not installed, not logged in when online).
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, *, config: dict[str, Any] | None = None,
                 step: int = 0):
        os.makedirs(run_dir, exist_ok=True)
        self._step, self._pending = step, False  # pending: an evaluation logged to W&B, not yet committed
        if config is None:
            config = _run_config(run_dir)
        settings = (config or {}).get("metrics") or {}
        self._wandb = _start_wandb(run_dir, config, settings) if settings.get("wandb") else None
        if self._wandb is not None:
            self._wandb.define_metric("eval/version")
            self._wandb.define_metric("eval/*", step_metric="eval/version")
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard and settings.get("tensorboard", True):
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # optional: the [plot] extra
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

    @property
    def wandb_run(self) -> Any:
        """The W&B run the rows go to; None when ``metrics.wandb`` is off or after :meth:`close`."""
        return self._wandb

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()
        if "eval" in row:
            self._write_eval(int(row["version"]), row["eval"])
            return
        self._step, self._pending = max(self._step, int(row.get("step", 0))), False
        if self._tb is not None:
            step = int(row.get("step", 0))
            for k, v in _scalars(row):
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=int(row.get("step", 0)), commit=True)  # a row is complete: send it now

    def _write_eval(self, version: int, result: dict[str, Any]) -> None:
        scalars = {f"eval/{k}": float(v) for k, v in result.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, version)
        if self._wandb is not None:
            self._wandb.log({**scalars, "eval/version": version}, step=self._step + 1, commit=False)
            self._pending = True

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            if self._pending:  # no update followed the last evaluation: its step is committed alone
                self._wandb.log({}, step=self._step + 1, commit=True)
            self._wandb.finish()
            self._wandb = None


def _run_config(run_dir: str) -> dict[str, Any] | None:
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _start_wandb(run_dir: str, config: dict[str, Any] | None, settings: dict[str, Any]) -> Any:
    """A W&B run for ``run_dir``: its id kept in ``RUN_DIR/wandb_run_id`` so a resumed run continues it."""
    try:
        import wandb
    except ImportError:
        raise MetricsError("metrics.wandb is true but wandb is not installed: pip install 'dora-jax[wandb]'") from None
    id_path = os.path.join(run_dir, "wandb_run_id")
    try:
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
    except OSError:
        run_id = ""
    if not run_id:
        run_id = secrets.token_hex(6)  # W&B run ids are short strings of letters and digits
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
    try:
        return wandb.init(project=settings.get("wandb_project") or "dora-jax",
                          entity=settings.get("wandb_entity") or None, name=os.path.basename(os.path.abspath(run_dir)),
                          id=run_id, resume="allow", dir=run_dir, config=config or {})
    except Exception as e:  # noqa: BLE001 - wandb raises its own kinds (no login, no network, bad entity)
        raise MetricsError(f"metrics.wandb: W&B could not start a run for {run_dir} ({type(e).__name__}: {e}); "
                           "log in with `wandb login`, or set WANDB_MODE=offline") from None


def _scalars(row: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for k, v in row.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield prefix + k, float(v)
        elif isinstance(v, dict) and k.startswith("train"):
            yield from _scalars(v, prefix + k + "/")


class MetricsError(ValueError):
    """A run directory's ``metrics.jsonl`` is missing or unreadable, with the file and line named."""


_PLOTTED = ("step", "wall_s", "reward", "accuracy", "staleness", "in_flight")


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The metrics lines of a run directory, in order. A last line cut short is left out with a warning; any
    other line that is not a JSON object raises :class:`MetricsError` naming it."""
    from dora_jax.textfiles import TextFileError, read_text

    if not os.path.isdir(run_dir):
        raise MetricsError(f"{run_dir}: no such run directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise MetricsError(f"{run_dir}: no metrics.jsonl (is this a dora-jax run directory?)")
    try:
        lines = read_text(path).split("\n")
    except TextFileError as e:
        raise MetricsError(str(e)) from None
    rows = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:  # no newline after it: the writer was stopped mid-line
                log.warning("%s:%d: the last line is cut short (was the run killed while writing it?); left out",
                            path, n + 1)
                continue
            raise MetricsError(f"{path}:{n + 1}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise MetricsError(f"{path}:{n + 1}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Writes ``reward.png`` (reward and accuracy per version, held-out accuracy where evaluated), ``staleness.png``
    (lag histogram) and ``versions.png`` (in-flight samples per version over time) into ``out_dir`` (default:
    the run directory); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval" in r]
    rows = [r for r in rows if "eval" not in r]
    if not rows:
        raise MetricsError(f"{run_dir}/metrics.jsonl has no updates to plot")
    for n, r in enumerate(rows):
        missing = [k for k in _PLOTTED if k not in r]
        bad = [k for k in ("staleness", "in_flight") if k in r and not isinstance(r[k], dict)]
        if missing or bad:
            raise MetricsError(f"{run_dir}/metrics.jsonl, update {n + 1}: "
                               + (f"no {', '.join(missing)}" if missing else f"{bad[0]} is not a mapping")
                               + " (not a line written by dora-jax train?)")
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    steps = [r["step"] for r in rows]
    run = os.path.basename(os.path.normpath(run_dir))

    paths.append(_reward_figure(plt, run, steps, rows, evals, out_dir))

    hist: dict[int, int] = {}
    for r in rows:
        for lag, n in r["staleness"].items():
            hist[int(lag)] = hist.get(int(lag), 0) + n
    fig, ax = plt.subplots(figsize=(4, 3))
    lags = sorted(hist)
    ax.bar([str(k) for k in lags], [hist[k] for k in lags])
    ax.set_title(f"{run}: staleness of trained samples")
    ax.set_xlabel("staleness (trainer version - sample version)")
    ax.set_ylabel("trained samples")
    paths.append(save_figure(fig, out_dir, "staleness.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    versions = sorted({int(v) for r in rows for v in r["in_flight"]})
    t = [r["wall_s"] for r in rows]
    for v in versions:
        ax.plot(t, [r["in_flight"].get(str(v), 0) for r in rows], label=f"v{v}")
    ax.set_title(f"{run}: samples in flight per policy version")
    ax.set_xlabel("seconds")
    ax.set_ylabel("samples in flight")
    if len(versions) <= 12:
        ax.legend(fontsize=7, ncol=2)
    paths.append(save_figure(fig, out_dir, "versions.png"))
    return paths


def _reward_figure(plt: Any, run: str, steps: list[int], rows: list[dict[str, Any]], evals: list[dict[str, Any]],
                   out_dir: str) -> str:
    """``reward.png``: reward and accuracy per version; held-out accuracy on a second axis, when evaluated."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lines = ax.plot(steps, [r["reward"] for r in rows], label="reward (trained batch)")
    lines += ax.plot(steps, [r["accuracy"] for r in rows], label="accuracy (trained batch)")
    ax.set_title(f"{run}: " + ("reward and held-out accuracy" if evals else "reward per policy version"),
                 fontsize=10 if evals else None)
    ax.set_xlabel("policy version (one iteration: train.minibatches x train.epochs updates)")
    ax.set_ylabel("mean over the trained batch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if evals:
        points = sorted((r["version"], r["eval"]["accuracy"]) for r in evals)
        held = ax.twinx()
        lines += held.plot([v for v, _ in points], [a for _, a in points], "o--", color="tab:green",
                           label="held-out accuracy")
        held.set_ylabel("held-out accuracy")
        held.set_ylim(-0.02, 1.02)
    ax.legend(lines, [x.get_label() for x in lines], fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, out_dir, "reward.png")


def save_figure(fig, out_dir: str, name: str) -> str:
    """Writes a plot's figure to ``OUT_DIR/name`` and closes it; returns the path (every plot is saved here)."""
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
