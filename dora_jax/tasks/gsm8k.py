"""GSM8K-style data from the user's own JSONL file, checked by the final number.

Each line is an object with a question and an answer: keys ``question``/``answer`` (GSM8K's own, whose answer
ends in ``#### 42``), or ``prompt``/``answer``. The reference is the number after ``####`` when present,
otherwise the answer's last number; a response is correct when its last number equals it. The last
``eval_size`` lines (after a seeded shuffle) are held out for evaluation; training items cycle over the rest.
"""

from __future__ import annotations

import os
import random

from dora_jax.tasks.base import Item, Score, Task, last_number, same_number
from dora_jax.textfiles import TextFileError, read_jsonl


class TaskDataError(ValueError):
    """A data file that cannot be used, with the file and line named."""


def _reference(answer: str) -> str | None:
    if "####" in answer:
        return last_number(answer.split("####")[-1])
    return last_number(answer)


class JsonlTask(Task):
    name = "gsm8k"

    def __init__(self, path: str, eval_size: int = 64, seed: int = 0):
        if not path:
            raise TaskDataError("task.path: the gsm8k task needs a JSONL file (task.path=/path/to/train.jsonl)")
        if not os.path.isfile(path):
            raise TaskDataError(f"task.path: {path!r} does not exist or is not a file")
        items = []
        try:
            rows = read_jsonl(path)
        except TextFileError as e:
            raise TaskDataError(str(e)) from None
        for n, row in rows:
            where = f"{path}:{n}"
            if not isinstance(row, dict):
                raise TaskDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            prompt = row.get("question", row.get("prompt"))
            answer = row.get("answer")
            if not isinstance(prompt, str) or not prompt.strip():
                raise TaskDataError(f"{where}: needs a non-empty string 'question' (or 'prompt')")
            if answer is None:
                raise TaskDataError(f"{where}: needs an 'answer'")
            ref = _reference(str(answer))
            if ref is None:
                raise TaskDataError(f"{where}: the answer {str(answer)[-40:]!r} has no number to check against")
            items.append(Item(prompt.strip(), ref))
        if len(items) <= eval_size:
            raise TaskDataError(f"{path}: {len(items)} usable lines; need more than task.eval_size={eval_size} "
                                "(the held-out set) to have anything to train on")
        random.Random(seed).shuffle(items)
        self._train, self._eval = items[:-eval_size] if eval_size else items, items[len(items) - eval_size:]

    def train_item(self, index: int) -> Item:
        return self._train[index % len(self._train)]

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        ok = same_number(last_number(response), item.answer)
        return Score(1.0 if ok else 0.0, ok)
