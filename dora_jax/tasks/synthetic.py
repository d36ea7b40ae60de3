"""``longtail``: a synthetic task whose length budgets are long-tailed by construction.

Each item carries its own length budget, drawn from a lognormal clipped to ``[1, max_len]`` with median
``max_len / 16`` and p99 about ten times the median: most trajectories are short and a few run far longer,
the shape of reasoning-model rollouts that stalls synchronous batches. The reward is the fraction of response
characters that are decimal digits, a verifiable signal that a small model learns within a few updates, so
schedules can be compared on the same learning curve. Runs on any tokenizer, including
:class:`~dora_jax.tokenizer.ByteTokenizer` for test-sized models.
"""

from __future__ import annotations

import math
import random

from dora_jax.tasks.base import Item, Score, Task

_SIGMA = math.log(10.0) / 2.326  # p99 / p50 = 10 for a lognormal


class LongTailTask(Task):
    name = "longtail"

    def __init__(self, seed: int = 0, eval_size: int = 16, max_len: int = 64):
        if max_len < 16:
            raise ValueError(f"task.longtail_max_len: {max_len}; must be >= 16 (the median is max_len / 16)")
        self.seed, self.max_len = seed, max_len
        self._eval = [self._item(random.Random(f"longtail/eval/{seed}/{i}")) for i in range(eval_size)]

    def _item(self, rng: random.Random) -> Item:
        budget = int(min(self.max_len, max(1, round(self.max_len / 16 * math.exp(rng.gauss(0.0, _SIGMA))))))
        word = "".join(rng.choice("abcdefgh") for _ in range(4))
        return Item(f"digits for {word}", "", "longtail", budget)

    def train_item(self, index: int) -> Item:
        return self._item(random.Random(f"longtail/train/{self.seed}/{index}"))

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        if not response:
            return Score(0.0, False)
        frac = sum(c.isdigit() for c in response) / len(response)
        return Score(frac, frac >= 0.5)
