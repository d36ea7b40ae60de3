"""Competition math (MATH, DAPO-Math, NuminaMath and the like), graded by ``math-verify``.

``math-verify`` extracts a response's final answer (``\\boxed{...}`` first), parses it with SymPy and compares
values, so equal answers in other forms count (``\\frac{1}{2}`` and ``0.5``). The same check is the
``task.reward: math`` reward (:func:`math_reward`). Rows (:mod:`dora_jax.tasks.data`): prompt ``problem``,
``question`` or ``prompt``; reference ``answer``, ``solution`` (its ``\\boxed{}``), ``reward_model.ground_truth``
or ``ground_truth``.
"""

from __future__ import annotations

import threading

from dora_jax.tasks.base import Item, Score, Task
from dora_jax.tasks.data import TaskDataError, load_rows
from dora_jax.tasks.gsm8k import split_items

__all__ = ["MathTask", "math_reward", "verify_answer"]

PROMPT_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "solution", "reward_model.ground_truth", "ground_truth")


def _as_latex(reference: str) -> str:
    """A bare reference (``3/4``, ``\\frac{3}{4}``) wrapped in ``$...$`` so math-verify reads it as LaTeX."""
    return reference if ("\\boxed" in reference or "$" in reference) else f"${reference}$"


def verify_answer(response: str, reference: str) -> bool:
    """Whether ``response``'s final answer equals ``reference`` (math-verify).

    Raises:
      ValueError: the reference itself cannot be parsed (a bad data row, not a wrong answer).
    """
    from math_verify import parse, verify

    # math-verify limits its own time with signal.alarm, which only the main thread may set; in the reward pool's
    # worker processes calls run there, and the pool's time limit covers any other caller.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(str(reference)), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"the reference answer {str(reference)[:60]!r} cannot be parsed by math-verify")
    pred = parse(response, parsing_timeout=limit)
    return bool(pred) and bool(verify(gold, pred, timeout_seconds=limit))


def math_reward(prompt: str, response: str, answer: str) -> float:
    """``task.reward: math``: 1.0 when the response's final answer is mathematically equal to ``answer``."""
    return 1.0 if verify_answer(response, answer) else 0.0


class MathTask(Task):
    name = "math"

    def __init__(self, path: str, eval_size: int = 64, seed: int = 0, *, prompt_field: str = "",
                 answer_field: str = "", split: str = "train", subset: str = ""):
        items = []
        for where, prompt, answer in load_rows(path, prompt_field=prompt_field, answer_field=answer_field,
                                               prompt_defaults=PROMPT_FIELDS, answer_defaults=ANSWER_FIELDS,
                                               split=split, subset=subset):
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise TaskDataError(f"{where}: the answer must be a string or a number, got {type(answer).__name__}")
            items.append(Item(prompt, str(answer).strip()))
        self._train, self._eval = split_items(items, path, eval_size, seed)

    def train_item(self, index: int) -> Item:
        return self._train[index % len(self._train)]

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        ok = verify_answer(response, item.answer)
        return Score(1.0 if ok else 0.0, ok)
