"""The built-in task: arithmetic questions of mixed difficulty (one-digit sums to two-digit products and
three-term sums), answered with the number only. A response earns reward 1 when the last number it writes is
the answer (``17 + 25 = 42`` counts).
"""

from __future__ import annotations

import random

from dora_jax.tasks.base import Item, Score, Task, last_number, same_number

LEVELS = ("add1", "add2", "sub2", "mul1", "mul21", "add3")


def _question(rng: random.Random, level: str) -> tuple[str, int]:
    r = rng.randint
    if level == "add1":
        a, b = r(1, 9), r(1, 9)
        return f"{a} + {b}", a + b
    if level == "add2":
        a, b = r(10, 99), r(10, 99)
        return f"{a} + {b}", a + b
    if level == "sub2":
        a, b = r(10, 99), r(10, 99)
        a, b = max(a, b), min(a, b)
        return f"{a} - {b}", a - b
    if level == "mul1":
        a, b = r(2, 9), r(2, 9)
        return f"{a} * {b}", a * b
    if level == "mul21":
        a, b = r(11, 49), r(2, 9)
        return f"{a} * {b}", a * b
    if level == "add3":
        a, b, c = r(10, 60), r(10, 60), r(2, 9)
        return f"{a} + {b} + {c}", a + b + c
    raise ValueError(f"unknown arithmetic level {level!r}; allowed: {', '.join(LEVELS)}")


class ArithmeticTask(Task):
    """Arithmetic questions; item ``i`` is a pure function of ``(seed, i)``; no training item repeats a held-out
    question."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, eval_size: int = 64, levels: tuple[str, ...] = LEVELS):
        for lv in levels:
            if lv not in LEVELS:
                raise ValueError(f"task.levels: unknown level {lv!r}; allowed: {', '.join(LEVELS)}")
        self.seed, self.levels = seed, tuple(levels)
        self._eval = [self._item(random.Random(f"arithmetic/eval/{seed}/{i}"), i) for i in range(eval_size)]
        self._held_out = {it.prompt for it in self._eval}

    def _item(self, rng: random.Random, i: int) -> Item:
        level = self.levels[i % len(self.levels)]
        q, ans = _question(rng, level)
        return Item(f"What is {q}? Answer with the number only.", str(ans), level)

    def train_item(self, index: int) -> Item:
        for attempt in range(1000):
            item = self._item(random.Random(f"arithmetic/train/{self.seed}/{index}/{attempt}"), index)
            if item.prompt not in self._held_out:
                return item
        raise RuntimeError(f"arithmetic: no training question outside the held-out set for index {index}")

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        ok = same_number(last_number(response), item.answer)
        return Score(1.0 if ok else 0.0, ok)
