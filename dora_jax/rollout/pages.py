"""Sizes and rules of a paged KV cache (pages per token count, the banker's test :func:`safe_to_grow`, a pool
planned for a config with :func:`plan_pool`), shared by the engine's page book, the checks and the simulator.
Token ``i`` of a slot sits in page ``table[i // page_tokens]`` at row ``i % page_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

DEFAULT_PAGE_TOKENS = 16


class PageError(ValueError):
    """A pool or a request the page allocator cannot serve; the message names the sizes."""


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pages_for(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-int(tokens) // int(page_tokens))


@dataclasses.dataclass(frozen=True, eq=False)
class HeldPages:
    """Whole pages holding tokens that many requests start with (a chat template's head), held by the page book
    until :meth:`~dora_jax.rollout.page_book.PageBook.release_prefixes`; requests admitted with it reference
    them read-only."""

    pages: tuple[int, ...]
    tokens: int


def safe_to_grow(free: int, need: Any, frees: Any) -> bool:
    """The banker's test for one resource: whether requests that may still take ``need[i]`` pages and free
    ``frees[i]`` for certain at their end can all reach their limits one after another from ``free`` free
    pages (checked in order of need, which finds a way whenever there is one)."""
    need, frees = np.asarray(need, np.int64).reshape(-1), np.asarray(frees, np.int64).reshape(-1)
    if free < 0:
        return False
    order = np.argsort(need, kind="stable")
    before = free + np.cumsum(frees[order]) - frees[order]  # free pages when each one's turn comes
    return bool((need[order] <= before).all())


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """A page pool sized for a config: ``slots`` sequences of ``sequence_tokens`` (the longest prompt plus
    the most new tokens) against the dense cache's ``slots x dense_tokens_per_slot``."""

    page_tokens: int
    slots: int
    sequence_tokens: int
    dense_tokens_per_slot: int
    pages: int  # every slot at the longest sequence, nothing shared
    group_size: int
    grouped_pages: int  # the same with each prompt's full pages shared by its group's samples

    @property
    def live_tokens(self) -> int:
        """Tokens the sequences hold at most: what a cache must store."""
        return self.slots * self.sequence_tokens

    @property
    def pool_tokens(self) -> int:
        return self.pages * self.page_tokens

    @property
    def dense_tokens(self) -> int:
        return self.slots * self.dense_tokens_per_slot

    def lines(self, bytes_per_dense_cache: int | None = None) -> list[str]:
        """The plan in words; with the dense cache's bytes, each figure's bytes at the same cost per token."""
        def size(tokens: int) -> str:
            return "" if bytes_per_dense_cache is None else \
                f" ({tokens * bytes_per_dense_cache / self.dense_tokens / 2 ** 30:.3f} GiB)"

        return [f"dense KV cache: {self.slots} slots x {self.dense_tokens_per_slot} tokens = {self.dense_tokens} "
                f"tokens{size(self.dense_tokens)}",
                f"paged KV cache ({self.page_tokens}-token pages): {self.pages} pages = {self.pool_tokens} tokens"
                f"{size(self.pool_tokens)} for {self.slots} sequences of up to {self.sequence_tokens} tokens "
                f"({self.live_tokens} live tokens at most)",
                f"  with each prompt's pages shared by its group of {self.group_size}: {self.grouped_pages} pages"
                f"{size(self.grouped_pages * self.page_tokens)}"]


def dense_tokens_per_slot(prompt_tokens: int, new_tokens: int, max_seq_len: int) -> int:
    """The engine's dense cache length for these lengths: the sequence rounded up to a power of two (at least
    16), at most the model's ``max_seq_len`` (``Engine(max_target_length=...)`` as the runner sizes it)."""
    n = prompt_tokens + new_tokens
    return min(max(16, 1 << max(0, n - 1).bit_length()), max_seq_len)


def plan_pool(cfg: Any, page_tokens: int = DEFAULT_PAGE_TOKENS) -> PoolPlan:
    """The page pool a config's rollout would need (``rollout.slots`` sequences of ``rollout.max_prompt_len +
    rollout.max_new_tokens`` tokens) and the same with each prompt shared by the ``train.group_size`` samples
    drawn from it (a sample's own pages start at its prompt's partial last page, which it copies)."""
    r = cfg.rollout
    seq = r.max_prompt_len + r.max_new_tokens
    per_seq = pages_for(seq, page_tokens)
    g = max(1, min(cfg.train.group_size, r.slots))
    groups = -(-r.slots // g)
    full_prompt = r.max_prompt_len // page_tokens  # shared by a group; the partial page is each sample's own
    grouped = groups * full_prompt + r.slots * (per_seq - full_prompt)
    return PoolPlan(page_tokens, r.slots, seq, dense_tokens_per_slot(r.max_prompt_len, r.max_new_tokens,
                                                                     cfg.model.max_seq_len),
                    r.slots * per_seq, g, grouped)

