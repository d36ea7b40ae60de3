"""A sample's records from the rollout driver to the trainer's batch.

A request has three forms, one per change of its data: waiting (:class:`Request`), decoding (the driver's live row)
and finished. A finished trajectory (:class:`Trajectory`, the driver's output) becomes a :class:`Sample` once the
run knows its group and task item; its reward is filled in when scored, and
:func:`~dora_jax.trainer.batch.make_batch` turns samples into arrays. A checkpoint stores the finished samples not
yet trained as :meth:`Sample.to_dict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dora_jax.rollout.engine_api import RequestSampling


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt waiting for a slot, to be sampled by ``version`` (the rollout driver's input)."""

    sample_id: int
    prompt_ids: tuple[int, ...]
    version: int = 0
    max_new_tokens: int = 64
    sampling: RequestSampling = RequestSampling()
    stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Trajectory:
    """A finished sample: every token and log-prob comes from ``version``."""

    sample_id: int
    version: int
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"
    submitted_s: float
    started_s: float
    finished_s: float


@dataclasses.dataclass
class Sample:
    """A finished trajectory with what the trainer needs of it.

    ``logprobs`` are the behaviour log-probs of ``response_ids`` the engine recorded for ``version``. ``item``
    (a task's :class:`~dora_jax.tasks.base.Item`), ``text`` (the decoded response), ``finish_reason`` and
    ``correct`` are the run's, as is ``reason`` (why the reward is what it is, when the task said); research code
    that builds batches needs only the first seven fields.
    """

    sample_id: int
    group_id: int
    version: int
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]
    reward: float = 0.0
    finish_reason: str = ""
    item: Any = None
    text: str = ""
    correct: bool = False
    reason: str = ""

    @classmethod
    def from_trajectory(cls, traj: Any, group_id: int, reward: float = 0.0, *, item: Any = None,
                        text: str = "") -> "Sample":
        """From a :class:`Trajectory`."""
        return cls(traj.sample_id, group_id, traj.version, list(traj.prompt_ids), list(traj.tokens),
                   list(traj.logprobs), float(reward), traj.finish_reason, item, text)

    def to_dict(self) -> dict[str, Any]:
        """The sample as JSON-ready values (a checkpoint's finished samples)."""
        return {"sample_id": self.sample_id, "version": self.version, "prompt_ids": list(self.prompt_ids),
                "tokens": list(self.response_ids), "logprobs": [float(x) for x in self.logprobs],
                "finish_reason": self.finish_reason, "group_id": self.group_id,
                "item": None if self.item is None else dataclasses.asdict(self.item), "text": self.text,
                "reward": float(self.reward), "correct": bool(self.correct), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        item = d.get("item")
        if item is not None:
            from dora_jax.tasks.base import Item

            item = Item(**{**item, "budgets": tuple(item.get("budgets", ()))})  # JSON gives a list
        return cls(d["sample_id"], d["group_id"], d["version"], list(d["prompt_ids"]), list(d["tokens"]),
                   list(d["logprobs"]), d["reward"], d["finish_reason"], item, d["text"], d["correct"],
                   d.get("reason", ""))
