"""The task interface and the answer extraction shared by the built-in tasks."""

from __future__ import annotations

import abc
import dataclasses
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclasses.dataclass(frozen=True)
class Item:
    """One question: the user turn, its reference answer, and a difficulty label for the metrics."""

    prompt: str
    answer: str
    level: str = ""
    max_new_tokens: int = 0  # a length budget of this item's own; 0: the run's rollout.max_new_tokens
    # Length budgets per group member (member m takes budgets[m % len(budgets)]), for workloads whose samples of
    # one prompt differ in length, as reasoning rollouts do; empty: every member takes max_new_tokens.
    budgets: tuple[int, ...] = ()

    def budget(self, member: int, cap: int) -> int:
        """Group member ``member``'s length budget in tokens, at most ``cap`` (``rollout.max_new_tokens``, also the
        budget of an item without one)."""
        own = self.budgets[member % len(self.budgets)] if self.budgets else self.max_new_tokens
        return min(own or cap, cap)


@dataclasses.dataclass(frozen=True)
class Score:
    """What a response earned: the reward, whether it is correct (for accuracy), and optionally why (recorded in
    ``samples.jsonl``)."""

    reward: float
    correct: bool
    reason: str = ""


class Task(abc.ABC):
    """Training items by index, a fixed held-out set, and a reward."""

    name: str = "task"

    @abc.abstractmethod
    def train_item(self, index: int) -> Item:
        """The ``index``-th training item: a pure function of the task's seed and ``index``."""

    @abc.abstractmethod
    def eval_items(self) -> list[Item]:
        """The held-out evaluation set (disjoint from every training item)."""

    @abc.abstractmethod
    def score(self, item: Item, response: str) -> Score:
        """The reward of ``response`` to ``item``."""


def score_answer(task: Task, item: Item, text: str) -> tuple[float, bool, str]:
    """``(reward, correct, reason)`` of one answer: what the reward pool's worker processes run for every sample."""
    s = task.score(item, text)
    return s.reward, s.correct, s.reason


def last_number(text: str) -> str | None:
    """The last number in ``text``, as written (a trailing ``.0`` kept, thousands separators dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def same_number(a: str | None, b: str) -> bool:
    """Numeric equality of two written numbers (``"42"``, ``"42.0"``, ``"1,000"``)."""
    if a is None:
        return False
    try:
        return abs(float(a.replace(",", "")) - float(b.replace(",", ""))) < 1e-9
    except ValueError:
        return False
