"""Evaluation during training (``task.eval_every``), the parts that need no model: the held-out requests' share of
the slots, the residency rule an update waits on, the resume fingerprint, and the metrics lines' way to
TensorBoard, W&B and the reward plot. The runs themselves: tests/test_runner.py (test_each_mode_keeps_the_promises,
test_a_warmed_up_run_compiles_nothing_after_its_first_update)."""

import sys
import types

import pytest

from dora_jax.config import Config, load_config
from dora_jax.metrics import MetricsWriter, plot_run, read_metrics
from dora_jax.run.evals import eval_admits, update_allowed
from dora_jax.run.resume import run_fingerprint


@pytest.mark.parametrize("free,slots,live,waiting,want", [
    (8, 8, 0, 10, 4),  # at most half of the slots
    (8, 8, 3, 10, 1),  # counting the ones already decoding
    (8, 8, 4, 10, 0),
    (2, 8, 0, 10, 2),  # no more than are free
    (8, 8, 0, 3, 3),  # no more than wait
    (1, 1, 0, 5, 1),  # a one-slot group still evaluates
    (1, 1, 1, 5, 0),
    (0, 8, 0, 5, 0),
    (16, 32, 0, 64, 16),
])
def test_held_out_requests_take_at_most_half_the_slots(free, slots, live, waiting, want):
    assert eval_admits(free, slots, live, waiting) == want


def test_an_update_waits_while_it_would_push_an_evaluated_version_out_of_the_window():
    # K = 2: after publishing version 5, versions 3, 4, 5 may be resident.
    assert update_allowed([], 5, 2)
    assert update_allowed([3, 4], 5, 2)
    assert not update_allowed([2], 5, 2)
    # K = 0 (sync): version 2's evaluation must have decoded its answers before version 3 is published.
    assert update_allowed([3], 3, 0) and not update_allowed([2], 3, 0)


def test_eval_every_is_not_part_of_the_resume_fingerprint(monkeypatch):
    """A checkpoint written without evaluation during training, or before the field existed, resumes with it."""
    off, on = load_config("tiny_llama"), load_config("tiny_llama", ["task.eval_every=3"])
    now = run_fingerprint(on)
    assert run_fingerprint(off) == now
    assert run_fingerprint(load_config("tiny_llama", ["task.eval_size=3"])) != now
    to_dict = Config.to_dict

    def before_the_field(cfg):
        d = to_dict(cfg)
        del d["task"]["eval_every"]
        return d

    monkeypatch.setattr(Config, "to_dict", before_the_field)
    assert run_fingerprint(off) == now


def _update(step):
    return {"step": step, "wall_s": float(step), "reward": step / 10, "accuracy": step / 20, "staleness": {"0": 4},
            "in_flight": {str(step): 8}, "train": {"loss": 0.5}}


def _eval(version, accuracy):
    return {"step": version, "version": version, "eval_s": 0.5, "wall_s": float(version),
            "eval": {"accuracy": accuracy, "pass_at_k": accuracy, "k": 1, "reward": accuracy, "n": 4,
                     "len_mean": 7.0, "score_errors": 0}}


class _Recorder:
    """Stands in for W&B's run and tensorboardX's writer: records what they are given."""

    def __init__(self, *args, **kwargs):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_evaluation_lines_go_to_tensorboard_wandb_and_the_reward_plot(tmp_path, monkeypatch):
    run = _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: run))
    tb = _Recorder()
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=lambda path: tb))
    w = MetricsWriter(str(tmp_path), config={"metrics": {"wandb": True, "tensorboard": True}})
    w.write(_eval(0, 0.25))
    for step in (1, 2, 3):
        w.write(_update(step))
    w.write(_eval(2, 0.5))  # an evaluation during training ends after a later update
    w.write(_eval(3, 0.75))  # the final one: no update follows
    w.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 2, 3]
    assert ("define_metric", ("eval/*",), {"step_metric": "eval/version"}) in run.calls
    logs = [(args[0], kw) for name, args, kw in run.calls if name == "log"]
    # Evaluations are logged with the next update's step (W&B's steps only increase), uncommitted; the last is
    # committed alone before the run finishes.
    assert [(row.get("eval/version"), row.get("step"), kw["step"], kw["commit"]) for row, kw in logs] == [
        (0, None, 1, False), (None, 1, 1, True), (None, 2, 2, True), (None, 3, 3, True), (2, None, 4, False),
        (3, None, 4, False), (None, None, 4, True)]
    assert logs[4][0]["eval/accuracy"] == 0.5 and "eval/score_errors" in logs[4][0]
    assert [name for name, *_ in run.calls][-1] == "finish"
    scalars = {(args[0], args[2]): args[1] for name, args, _ in tb.calls if name == "add_scalar"}
    assert scalars[("eval/accuracy", 2)] == 0.5 and scalars[("eval/accuracy", 0)] == 0.25
    assert ("wall_s", 2) in scalars and scalars[("wall_s", 2)] == 2.0  # the update's, not the evaluation's
    paths = plot_run(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["reward.png", "staleness.png", "versions.png"]
