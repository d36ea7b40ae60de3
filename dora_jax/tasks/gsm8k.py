"""Question/answer data checked by the final number: GSM8K and anything shaped like it.

Rows (:mod:`dora_jax.tasks.data`): prompt ``question`` or ``prompt``, answer ``answer``. The reference is the
number after ``####``, else the answer's last number; a response is correct when its last number equals it.
The last ``eval_size`` rows after a seeded shuffle are held out; training items cycle over the rest.
"""

from __future__ import annotations

import random

from dora_jax.tasks.base import Item, Score, Task, last_number, same_number
from dora_jax.tasks.data import TaskDataError, load_rows

__all__ = ["GSM8KTask", "JsonlTask", "TaskDataError", "split_items"]


def _reference(answer: str) -> str | None:
    if "####" in answer:
        return last_number(answer.split("####")[-1])
    return last_number(answer)


def split_items(items: list[Item], path: str, eval_size: int, seed: int) -> tuple[list[Item], list[Item]]:
    """``(train, held_out)``: a seeded shuffle, the last ``eval_size`` held out."""
    if len(items) <= eval_size:
        raise TaskDataError(f"{path}: {len(items)} usable lines; need more than task.eval_size={eval_size} "
                            "(the held-out set) to have anything to train on")
    items = list(items)
    random.Random(seed).shuffle(items)
    return (items[:-eval_size] if eval_size else items), items[len(items) - eval_size:]


class GSM8KTask(Task):
    name = "gsm8k"

    def __init__(self, path: str, eval_size: int = 64, seed: int = 0, *, prompt_field: str = "",
                 answer_field: str = "", split: str = "train", subset: str = ""):
        items = []
        for where, prompt, answer in load_rows(path, prompt_field=prompt_field, answer_field=answer_field,
                                               prompt_defaults=("question", "prompt"), answer_defaults=("answer",),
                                               split=split, subset=subset):
            ref = _reference(str(answer))
            if ref is None:
                raise TaskDataError(f"{where}: the answer {str(answer)[-40:]!r} has no number to check against")
            items.append(Item(prompt, ref))
        self._train, self._eval = split_items(items, path, eval_size, seed)

    def train_item(self, index: int) -> Item:
        return self._train[index % len(self._train)]

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        ok = same_number(last_number(response), item.answer)
        return Score(1.0 if ok else 0.0, ok)


JsonlTask = GSM8KTask  # the name this task had when it read JSONL files only
