"""The trainer side of a run: a batch of whole groups, its train step in flight, and what it reports."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.rollout.samples import Sample
from dora_jax.trainer import Trainer, make_batch


@dataclasses.dataclass
class TrainInFlight:
    """A dispatched train step: its outputs are futures until the step completes."""

    version: int  # the version the step produces
    group_ids: list[int]
    done: list[Sample]
    metrics: Any  # device arrays
    row: dict[str, Any]  # everything about the batch known at dispatch
    dispatched: float

    def ready(self) -> bool:
        """Whether the step has finished (its metrics are computed)."""
        return all(x.is_ready() for x in jax.tree.leaves(self.metrics))


def _percentile(xs: list[int], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def build_batch(trainer: Trainer, done: list[Sample], params_of: Any, state: Any) -> Any:
    """The device batch of ``done`` (whole groups), with recomputed behaviour log-probs (each row on its own
    version, ``params_of(version)``) and reference log-probs where the config asks for them."""
    t = trainer.cfg.train
    host = make_batch(done, group_size=t.group_size, length_buckets=t.length_buckets,
                      row_multiple=trainer.row_multiple)
    batch = trainer.put(host)
    if t.behaviour_logprobs == "recompute" or t.correction == "decoupled":
        batch = trainer.with_recomputed_behaviour(batch, params_of, host)
    if t.kl_coef > 0:
        batch = trainer.with_reference(state, batch)
    return batch


def batch_row(done: list[Sample], version: int, in_flight: dict[str, int]) -> dict[str, Any]:
    """The metrics of a batch known when it is dispatched: reward, accuracy, lengths, staleness."""
    lags: dict[str, int] = {}
    for d in done:
        lag = str(version - d.version)
        lags[lag] = lags.get(lag, 0) + 1
    lengths = [len(d.response_ids) for d in done]
    return {"samples": len(done), "reward": float(np.mean([d.reward for d in done])),
            "accuracy": float(np.mean([d.correct for d in done])),
            "len_mean": float(np.mean(lengths)), "len_p50": _percentile(lengths, 50),
            "len_p99": _percentile(lengths, 99), "len_max": int(max(lengths)),
            "trained_tokens": int(sum(len(d.response_ids) + len(d.prompt_ids) for d in done)),
            "staleness": lags, "staleness_mean": float(np.mean([int(k) for k, n in lags.items() for _ in range(n)])),
            "staleness_max": max(int(k) for k in lags), "in_flight": in_flight}


def write_samples(path: str, done: list[Sample], trained_at: int) -> None:
    """Appends the trained samples to ``samples.jsonl``, one line each."""
    with open(path, "a", encoding="utf-8") as f:
        for d in done:
            f.write(json.dumps({"sample_id": d.sample_id, "group_id": d.group_id, "version": d.version,
                                "trained_at": trained_at, "reward": d.reward, "correct": d.correct,
                                "prompt_ids": list(d.prompt_ids), "tokens": list(d.response_ids),
                                "logprobs": list(d.logprobs), "finish_reason": d.finish_reason,
                                "text": d.text, "reason": d.reason}) + "\n")
