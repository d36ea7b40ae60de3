"""``longtail``: a synthetic task whose length budgets are long-tailed by construction.

Each member of a prompt's group has its own length budget: 85% lognormal with median ``max_len / 32`` (clipped
to ``[1, max_len]``), 15% uniform in ``[max_len / 2, max_len]``. The reward is the fraction of response
characters that are decimal digits (correct at half or more). Runs on any tokenizer, including
:class:`~dora_jax.tokenizer.ByteTokenizer`. Why this shape: docs/runner.md, "Tasks".
"""

from __future__ import annotations

import math
import random

from dora_jax.tasks.base import Item, Score, Task

_SIGMA = math.log(10.0) / 2.326  # p99 / p50 = 10 for a lognormal
MEMBERS = 64  # budgets drawn per item; a group of more members reuses them in turn


class LongTailTask(Task):
    name = "longtail"

    def __init__(self, seed: int = 0, eval_size: int = 16, max_len: int = 64):
        if max_len < 2:
            raise ValueError(f"task.longtail_max_len: {max_len}; must be >= 2 tokens")
        self.seed, self.max_len = seed, max_len
        self._eval = [self._item(random.Random(f"longtail/eval/{seed}/{i}")) for i in range(eval_size)]

    def _budget(self, rng: random.Random) -> int:
        if rng.random() < 0.15:
            return rng.randint(self.max_len // 2, self.max_len)
        return int(min(self.max_len, max(1, round(self.max_len / 32 * math.exp(rng.gauss(0.0, _SIGMA))))))

    def _item(self, rng: random.Random) -> Item:
        word = "".join(rng.choice("abcdefgh") for _ in range(4))
        return Item(f"digits for {word}", "", "longtail", budgets=tuple(self._budget(rng) for _ in range(MEMBERS)))

    def train_item(self, index: int) -> Item:
        return self._item(random.Random(f"longtail/train/{self.seed}/{index}"))

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        if not response:
            return Score(0.0, False)
        frac = sum(c.isdigit() for c in response) / len(response)
        return Score(frac, frac >= 0.5)
