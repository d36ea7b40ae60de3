"""The host side of a paged KV cache: a pool of fixed-size pages, a page table per decode slot, reference counts.

Plain Python, no JAX: it decides which page each token's keys and values go to; the device side (attention
that reads a slot's cache through its page table, and the copies this module asks for) is separate.

- A pool of ``num_pages`` pages of ``page_tokens`` tokens each. A slot's page table lists the pages holding
  its tokens in order: token ``i`` of the slot sits in page ``table[i // page_tokens]`` at row
  ``i % page_tokens``.
- Pages are shared read-only by reference count: the G samples of a GRPO group start from one copy of their
  prompt (:meth:`PagePool.admit` with ``fork=``), and every prompt that starts with the chat template's head
  starts from one copy of it (:meth:`PagePool.hold_prefix`, then ``admit(prefix=)``).
- A slot only ever writes a page it alone references. Appending into a shared, partly filled last page first
  copies it (copy on write): :meth:`PagePool.append` returns the copies the device must make before it writes.
- Admission reserves what a request may still need: a slot's pages up to its ``max_tokens`` and one copy of a
  shared partial last page. So a live slot's appends never fail and nothing is ever evicted: a request that
  does not fit now is not admitted (:meth:`PagePool.admit` returns ``None`` and changes nothing) and waits
  for slots to finish. A request that could not fit even in an empty pool is refused with
  :class:`PageError`, as is a pool that cannot hold one page per slot.

:func:`plan_pool` sizes a pool for a config (``dora-jax check`` prints it next to the dense cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_PAGE_TOKENS = 16


class PageError(ValueError):
    """A pool or a request the page allocator cannot serve; the message names the sizes."""


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pages_for(tokens: int, page_tokens: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-int(tokens) // int(page_tokens))


@dataclasses.dataclass(frozen=True)
class Copy:
    """Before a slot writes, rows ``0 .. tokens - 1`` of page ``src`` are copied into page ``dst`` (copy on
    write of a shared partial page)."""

    src: int
    dst: int
    tokens: int


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPrefix:
    """Pages holding tokens that many slots start with (a chat template's head), held by the pool until
    :meth:`PagePool.release_prefix`; slots admitted with it reference them read-only."""

    pages: tuple[int, ...]
    tokens: int


@dataclasses.dataclass
class _Slot:
    table: list[int]
    length: int  # tokens written
    limit: int  # the most tokens it may hold (prompt + max_new_tokens)


class PagePool:
    """Page allocator for ``slots`` decode slots over a pool of ``num_pages`` pages of ``page_tokens`` tokens.

    With ``reserve=False`` admission takes only the prompt's pages and reserves nothing: the caller decides
    when a slot may grow (:func:`safe_to_grow`, the engine's rule), and :meth:`append` raises
    :class:`PageError` on an exhausted pool instead of drawing on a reservation.

    Host time of everything but :meth:`check` grows with the live slots (and a slot's own pages), not with
    the pool: a pool may have as many slots as pages.

    Raises:
      PageError: when the pool cannot hold one page per slot.
    """

    def __init__(self, num_pages: int, page_tokens: int, slots: int, reserve: bool = True):
        for name, value in (("num_pages", num_pages), ("page_tokens", page_tokens), ("slots", slots)):
            if not (isinstance(value, int) and value >= 1):
                raise PageError(f"{name} must be an integer >= 1, got {value!r}")
        if num_pages < slots:
            raise PageError(f"a pool of {num_pages} pages of {page_tokens} tokens cannot hold one page per slot "
                            f"({slots} slots): give it at least {slots} pages")
        self.num_pages, self.page_tokens, self.slots, self.reserve = num_pages, page_tokens, slots, reserve
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() takes the lowest page first
        self._slots: dict[int, _Slot] = {}  # the live slots, in order of admission
        self._prefixes: set[SharedPrefix] = set()

    # -- what the pool holds ------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages no slot or prefix references."""
        return len(self._free)

    @property
    def reserved_pages(self) -> int:
        """Free pages that live slots may still take (their growth up to their limits, copies on write); none
        without reservation."""
        if not self.reserve:
            return 0
        live = self._slots.values()
        shared = {s.table[-1] for s in live if self._writes_shared(s)}
        return sum(self.pages_for(s.limit) - len(s.table) for s in live) + sum(self._copies(x) for x in shared)

    @property
    def available_pages(self) -> int:
        """Free pages that admission may give out."""
        return self.free_pages - self.reserved_pages

    def live_slots(self) -> list[int]:
        """The live slots, in order of admission."""
        return list(self._slots)

    def table(self, slot: int, start: int = 0) -> list[int]:
        """The slot's page table from entry ``start`` on (a copy)."""
        return self._live(slot).table[start:]

    def length(self, slot: int) -> int:
        """Tokens written to the slot."""
        return self._live(slot).length

    def limit(self, slot: int) -> int:
        """The most tokens the slot may hold (its ``max_tokens``)."""
        return self._live(slot).limit

    def refs(self, page: int) -> int:
        """Slots and prefixes referencing ``page``."""
        return self._refs[page]

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_tokens)

    # -- prefixes ------------------------------------------------------------------------------------------

    def hold_prefix(self, tokens: int) -> SharedPrefix | None:
        """Pages for ``tokens`` tokens that slots will share read-only (the device writes them once), or
        ``None`` when the pool cannot give them now without taking pages live slots may need."""
        if tokens < 1:
            raise PageError(f"a shared prefix holds at least one token, got {tokens!r}")
        need = self.pages_for(tokens)
        if need > self.num_pages:
            raise PageError(f"a shared prefix of {tokens} tokens needs {need} pages of {self.page_tokens} tokens; "
                            f"the pool has {self.num_pages}")
        if need > self.available_pages:
            return None
        prefix = SharedPrefix(tuple(self._take() for _ in range(need)), tokens)
        self._prefixes.add(prefix)
        return prefix

    def release_prefix(self, prefix: SharedPrefix) -> None:
        """Drops the pool's hold on a prefix; its pages are freed once no slot references them."""
        if prefix not in self._prefixes:
            raise PageError("release_prefix: the prefix is not held by this pool")
        self._prefixes.remove(prefix)
        for page in prefix.pages:
            self._release(page)

    # -- slots ---------------------------------------------------------------------------------------------

    def admit(self, slot: int, *, prompt_tokens: int, max_tokens: int, prefix: SharedPrefix | None = None,
              fork: int | None = None, fork_tokens: int | None = None) -> list[Copy] | None:
        """Places a request in an empty slot: its prompt's pages and a reservation for the rest.

        Args:
          slot: an empty slot.
          prompt_tokens: tokens the prefill writes (the whole prompt, shared part included).
          max_tokens: the most tokens the slot will hold (prompt + max_new_tokens).
          prefix: a held prefix the prompt starts with: its pages are shared, only the rest is written (a
            partial last page of the prefix is copied first).
          fork: a live slot whose first ``prompt_tokens`` tokens are this prompt (a GRPO group's first
            member): those pages are shared, nothing is written.
          fork_tokens: with ``fork``, share only the fork's first ``fork_tokens`` tokens (a multiple of the page
            size: its full pages); the slot writes the rest of its prompt into pages of its own, so no page is
            ever copied. Default: the whole prompt.

        Returns:
          The copies the device makes before the prefill writes (a prefix's partial last page, when the prompt
          goes on past it), or ``None`` when the free pages not reserved by live slots are too few now
          (nothing changed: the request waits).

        Raises:
          PageError: a request that could not fit even in an empty pool (naming its sizes), a slot that is
            live or out of range, or an inconsistent prompt / prefix / fork.
        """
        if not 0 <= slot < self.slots:
            raise PageError(f"slot {slot!r} does not exist (slots 0..{self.slots - 1})")
        if slot in self._slots:
            raise PageError(f"slot {slot} is live")
        if not 1 <= prompt_tokens <= max_tokens:
            raise PageError(f"a request needs 1 <= prompt_tokens ({prompt_tokens}) <= max_tokens ({max_tokens})")
        if self.pages_for(max_tokens) > self.num_pages:
            raise PageError(f"a request of up to {max_tokens} tokens needs {self.pages_for(max_tokens)} pages of "
                            f"{self.page_tokens} tokens; the pool has {self.num_pages} pages "
                            f"({self.num_pages * self.page_tokens} tokens)")
        if prefix is not None and fork is not None:
            raise PageError("admit: a prefix or a fork, not both")
        p = self.page_tokens
        if prefix is not None:
            if prefix not in self._prefixes:
                raise PageError("admit: the prefix is not held by this pool")
            if prefix.tokens > prompt_tokens:
                raise PageError(f"admit: a prompt of {prompt_tokens} tokens cannot start with a prefix of "
                                f"{prefix.tokens}")
            shared, shared_tokens = list(prefix.pages), prefix.tokens
        elif fork is not None:
            src = self._live(fork)
            if prompt_tokens > src.length:
                raise PageError(f"admit: slot {fork} holds {src.length} tokens, fewer than the prompt's "
                                f"{prompt_tokens}")
            shared_tokens = prompt_tokens if fork_tokens is None else fork_tokens
            if fork_tokens is not None and not (0 < fork_tokens <= prompt_tokens and fork_tokens % p == 0):
                raise PageError(f"admit: fork_tokens {fork_tokens!r} must be a multiple of the page size "
                                f"({p}) in [1, prompt_tokens = {prompt_tokens}]")
            shared = src.table[:self.pages_for(shared_tokens)]
        else:
            shared, shared_tokens = [], 0
        copies_now = 1 if shared_tokens % p and prompt_tokens > shared_tokens else 0
        now = self.pages_for(prompt_tokens) - len(shared) + copies_now
        later = self.pages_for(max_tokens) - self.pages_for(prompt_tokens)
        if shared_tokens % p and prompt_tokens == shared_tokens:
            # The slot holds the shared partial page as its last: the copies that page will need change.
            x = shared[-1]
            r, w = self._refs[x], self._writers(x)
            w_after = w + (prompt_tokens < max_tokens)
            later += (w_after - (r + 1 == w_after)) - (w - (r == w))
        if now + (later if self.reserve else 0) > self.available_pages:
            return None
        for page in shared:
            self._refs[page] += 1
        self._slots[slot] = _Slot(shared, shared_tokens, max_tokens)
        return self._grow(slot, prompt_tokens - shared_tokens)

    def append(self, slot: int, tokens: int = 1) -> list[Copy]:
        """Makes room for ``tokens`` more tokens of a live slot; returns the copies the device makes before
        writing them (a shared partial last page is copied into a page of the slot's own).

        Never fails within the slot's ``max_tokens`` when the pool reserves: admission reserved the pages.
        Without reservation it raises :class:`PageError` when the pool has too few free pages (nothing changes)."""
        s = self._live(slot)
        if tokens < 0 or s.length + tokens > s.limit:
            raise PageError(f"slot {slot}: {s.length} + {tokens} tokens exceeds its max_tokens ({s.limit})")
        if not self.reserve and self.growth(slot, tokens) > self.free_pages:
            raise PageError(f"slot {slot}: {tokens} more tokens need {self.growth(slot, tokens)} pages; "
                            f"{self.free_pages} are free")
        return self._grow(slot, tokens)

    def growth(self, slot: int, tokens: int) -> int:
        """Pages :meth:`append` of ``tokens`` would take for the slot (a copy of a shared partial last page
        included)."""
        s, p = self._live(slot), self.page_tokens
        copy = 1 if tokens and s.length % p and self._refs[s.table[-1]] > 1 else 0
        return -(-(s.length + tokens) // p) - len(s.table) + copy  # pages_for, inline: once per slot and program

    def need(self, slot: int) -> int:
        """Pages the slot may still take, up to its limit."""
        s = self._live(slot)
        return self.pages_for(s.limit) - len(s.table)

    def own_pages(self, slot: int) -> int:
        """Pages only this slot references: what its end frees for certain."""
        table = self._live(slot).table
        return len(table) - self._shared_run(table)

    def prospects(self, extra: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """Each live slot's (pages it may still take, pages its end frees for certain), as :func:`safe_to_grow`
        takes them; with ``extra``, as they would be once slot ``i`` took ``extra[i]`` more pages of its own."""
        p, extra = self.page_tokens, extra or {}
        out = []
        for i, s in self._slots.items():
            more, held = extra.get(i, 0), len(s.table)
            out.append((-(-s.limit // p) - held - more, held - self._shared_run(s.table) + more))
        return out

    def finish(self, slot: int) -> None:
        """Frees a finished slot: its pages go back to the pool once nothing else references them."""
        s = self._live(slot)
        del self._slots[slot]
        for page in s.table:
            self._release(page)

    # -- invariants ----------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError unless the bookkeeping is consistent: each page's count is the number of
        tables and prefixes referencing it, the free pages are exactly the unreferenced ones, each table
        covers its slot's tokens, the pages it shares lead its table (what :meth:`own_pages` counts on), and
        the reservation fits the free pages."""
        counts = [0] * self.num_pages
        for i, s in self._slots.items():
            assert 0 <= i < self.slots, i
            assert len(s.table) == self.pages_for(s.length), (s.table, s.length)
            for page in s.table:
                counts[page] += 1
        for prefix in self._prefixes:
            for page in prefix.pages:
                counts[page] += 1
        assert counts == self._refs, "reference counts differ from the references"
        for i, s in self._slots.items():
            shared = [self._refs[page] > 1 for page in s.table]
            assert shared == sorted(shared, reverse=True), f"slot {i} shares pages after one of its own: {s.table}"
            assert self.own_pages(i) == shared.count(False), i
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert set(self._free) == {i for i, c in enumerate(counts) if c == 0}, "free list differs from unreferenced pages"
        assert self.available_pages >= 0, "live slots reserve more pages than are free"

    # -- internals -----------------------------------------------------------------------------------------

    def _live(self, slot: int) -> _Slot:
        s = self._slots.get(slot)
        if s is None:
            raise PageError(f"slot {slot!r} is not live")
        return s

    def _writes_into_last(self, s: _Slot) -> bool:
        """Whether the slot's next token goes into its last page (partial, and the slot not at its limit)."""
        return s.length < s.limit and s.length % self.page_tokens != 0

    def _writes_shared(self, s: _Slot) -> bool:
        return self._writes_into_last(s) and self._refs[s.table[-1]] > 1

    def _writers(self, page: int) -> int:
        """Live slots whose next token goes into ``page``."""
        return sum(1 for s in self._slots.values() if s.table and s.table[-1] == page and self._writes_into_last(s))

    def _shared_run(self, table: list[int]) -> int:
        """How many pages of ``table`` something else references too: always its first ones.

        Pages are only ever shared as leading runs at the same positions: a fork shares its source's first
        pages, a prefix's pages are the first of every table holding it, a copy on write replaces a table's
        last page, and every other page a slot takes is fresh. So a page that is shared has only shared
        pages before it, and a binary search over the table finds where its own pages start."""
        refs = self._refs
        if not table or refs[table[0]] == 1:  # nothing shared: the common case
            return 0
        lo, hi = 1, len(table)
        while lo < hi:
            mid = (lo + hi) // 2
            if refs[table[mid]] > 1:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _copies(self, page: int) -> int:
        """Copies a shared partial page may still cost: one per slot that will write into it, except that
        when every holder is such a slot the last of them writes in place."""
        w = self._writers(page)
        return w - (1 if self._refs[page] == w else 0)

    def _take(self) -> int:
        if not self._free:  # admission reserved, or the caller checked, every page a live slot takes
            raise AssertionError("page pool exhausted inside a reservation")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _grow(self, slot: int, tokens: int) -> list[Copy]:
        s = self._slots[slot]
        copies = []
        if tokens and s.length % self.page_tokens and self._refs[s.table[-1]] > 1:
            old, new = s.table[-1], self._take()
            copies.append(Copy(old, new, s.length % self.page_tokens))
            self._release(old)
            s.table[-1] = new
        s.length += tokens
        held = self.pages_for(s.length)
        while len(s.table) < held:
            s.table.append(self._take())
        return copies


def safe_to_grow(free: int, live: list[tuple[int, int]]) -> bool:
    """Whether every live request can still reach its limit, one after another, with no page taken back (the
    banker's test, for one kind of resource): ``live`` holds each request's (pages it may still take, pages its
    end frees for certain). Requests are taken in order of need: any request that can finish can go first,
    and finishing only adds free pages, so this order finds a way through whenever there is one."""
    for need, frees in sorted(live):
        if need > free:
            return False
        free += frees
    return True


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

