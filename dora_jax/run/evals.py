"""Held-out evaluation during training (``task.eval_every``): :class:`HeldOutEvals` decodes a published
version's held-out requests (:func:`~dora_jax.run.evaluation.heldout_requests`) in the run's own rollout driver
within :func:`eval_admits`'s share, scores them in its reward pool, and keeps the version resident until its
last answer (:func:`update_allowed`). docs/runner.md, "Evaluation during training".
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterable

from dora_jax.config import Config
from dora_jax.rewards import RewardPool, RewardResult
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.samples import Request, Trajectory
from dora_jax.run.evaluation import EVAL_IDS, heldout_requests, heldout_result, score
from dora_jax.tasks import Item, Task


def eval_admits(free: int, slots: int, live: int, waiting: int) -> int:
    """How many held-out requests to submit now to a group of ``slots`` slots (``free`` free, ``live`` held by
    held-out requests, ``waiting`` to go): held-out requests never hold more than half the slots (one of one)."""
    return max(0, min(waiting, free, max(1, slots // 2) - live))


def update_allowed(pinned: Iterable[int], version: int, bound: int) -> bool:
    """Whether the update publishing ``version`` may start while evaluations decode the ``pinned`` versions: each
    must stay within the K + 1 (``bound`` K) resident after it."""
    return all(v >= version - bound for v in pinned)


@dataclasses.dataclass
class _Eval:
    """One version's evaluation in flight."""

    version: int
    started: float
    waiting: collections.deque[Request]
    answers: dict[int, Trajectory] = dataclasses.field(default_factory=dict)  # sample id -> every process's
    scores: dict[int, RewardResult] = dataclasses.field(default_factory=dict)


class HeldOutEvals:
    """The evaluations of a run in flight.

    Args:
      cfg: the run's config (``task.eval_*``, ``dora.steps``); task, tokenizer: the run's.
      engine: the first rollout group's engine (held-out prompts are checked against its limits).
      rewards: the run's reward pool (held-out answers keyed by negative numbers).
      generates: whether this process decodes a request, by its index.
    """

    def __init__(self, cfg: Config, task: Task, tokenizer: Any, engine: Any, rewards: RewardPool,
                 generates: Callable[[int], bool]):
        self.cfg, self.task, self.tokenizer, self.engine = cfg, task, tokenizer, engine
        self.rewards, self.generates = rewards, generates
        self._items: list[Item] | None = None
        self._requests: list[Request] = []
        self._evals: dict[int, _Eval] = {}
        # (version, sample id) this process submitted and not yet answered -> the group driver decoding it
        self._live: dict[tuple[int, int], RolloutDriver] = {}

    def due(self, version: int) -> bool:
        """Whether publishing ``version`` starts an evaluation."""
        every = self.cfg.task.eval_every
        return every > 0 and 0 < version < self.cfg.dora.steps and version % every == 0

    def start(self, version: int) -> None:
        """Starts evaluating ``version`` (just published): its requests wait for :meth:`admit`."""
        if self._items is None:
            self._items, self._requests = heldout_requests(self.cfg, self.task, self.tokenizer, self.engine, 0)
        mine = [dataclasses.replace(r, version=version) for i, r in enumerate(self._requests) if self.generates(i)]
        self._evals[version] = _Eval(version, time.perf_counter(), collections.deque(mine))

    @property
    def busy(self) -> bool:
        """Whether an evaluation has answers still to decode or score."""
        return bool(self._evals)

    def waiting(self) -> int:
        """This process's requests not submitted yet."""
        return sum(len(e.waiting) for e in self._evals.values())

    def waiting_by_version(self) -> dict[int, int]:
        """This process's requests not submitted yet, per evaluated version."""
        return {v: len(e.waiting) for v, e in self._evals.items() if e.waiting}

    def admit(self, group_for: Callable[[int], RolloutDriver | None]) -> None:
        """Submits waiting requests (oldest version first) to ``group_for(version)``'s driver (None: none serves the
        version yet, so they wait), within :func:`eval_admits`'s share of its slots."""
        for e in sorted(self._evals.values(), key=lambda e: e.version):
            driver = group_for(e.version) if e.waiting else None
            if driver is None:
                continue
            slots = driver.engine.max_concurrent_decodes
            free = slots - sum(driver.in_flight().values())
            live = sum(d is driver for d in self._live.values())
            for _ in range(eval_admits(free, slots, live, len(e.waiting))):
                req = e.waiting.popleft()
                driver.submit(req)
                self._live[(e.version, req.sample_id)] = driver

    def pins(self) -> dict[int, int]:
        """Answers still to decode per version (every process's): the versions they keep resident."""
        total = len(self._requests)
        return {v: total - len(e.answers) for v, e in self._evals.items() if len(e.answers) < total}

    def _key(self, version: int, sample_id: int) -> int:
        """The reward pool's key of an answer: negative, so never a ledger sample id."""
        return -1 - (version * len(self._requests) + sample_id - EVAL_IDS)

    def answered(self, traj: Trajectory) -> None:
        """Takes a decoded answer (any process's) and sends it to the reward pool."""
        e = self._evals[traj.version]
        e.answers[traj.sample_id] = traj
        self._live.pop((traj.version, traj.sample_id), None)
        item = self._items[(traj.sample_id - EVAL_IDS) % len(self._items)]
        self.rewards.submit(self._key(traj.version, traj.sample_id), score, self.task, item,
                            self.tokenizer.decode(traj.tokens, skip_special_tokens=True))

    def scored(self, result: RewardResult) -> None:
        """Takes an answer's score from the reward pool (its key from :meth:`answered`)."""
        m = -1 - result.key
        version, sample_id = divmod(m, len(self._requests))
        self._evals[version].scores[EVAL_IDS + sample_id] = result

    def finished(self) -> list[tuple[int, dict[str, float], float]]:
        """The evaluations whose every answer is scored, each once: ``(version, result, seconds since start)``, the
        result as :func:`~dora_jax.run.evaluation.evaluate` gives it."""
        out = []
        total = len(self._requests)
        for v in sorted(self._evals):
            e = self._evals[v]
            if total and len(e.scores) < total:
                continue
            answers = [(e.answers[s], e.scores[s]) for s in sorted(e.scores)]
            out.append((v, heldout_result(self.cfg, self.task, v, self._items, answers),
                        time.perf_counter() - e.started))
            del self._evals[v]
        return out
