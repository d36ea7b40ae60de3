"""The host-side book of one rollout engine's KV page pool: plain Python and NumPy, no JAX.

The engine's pool is split into one range of pages per batch shard of its mesh (one range without a mesh), each
with its scratch page (page 0 of the range) and its own :class:`~dora_jax.rollout.pages.PagePool` allocator,
used without reservation. A live request is a *ref*, ``(shard, allocator slot)``. The book decides:

- **Admission** (:meth:`PageBook.admit`, :meth:`PageBook.admissible`): a request takes its prompt's pages and
  is admitted only while every live request of its shard could still reach its limit one after another
  (:func:`~dora_jax.rollout.pages.safe_to_grow`, the banker's test for one resource).
- **Shared heads** (:meth:`PageBook.hold_prefix`): the full pages of a head many prompts start with, held
  once per shard and shared read-only by the requests admitted with them; no request's end frees them, so the
  banker's test never counts them as freed.
- **Growth** (:meth:`PageBook.grant`, :meth:`PageBook.dispatch`): before a program, each slot gets the pages
  for the tokens its budget lets it produce where that stays safe; a slot the pool cannot serve safely gets
  what its held pages still cover, maybe nothing, and waits. In a safe state the request closest to its limit
  can always take every page it may need, so some slot always progresses.
- **What was written**: the positions each request's programs may have written (``asked``); a program that
  ends early wrote fewer, and :meth:`PageBook.settle` sets the count back from what its rows produced.
- **Tables** (:meth:`PageBook.tables`, :meth:`PageBook.live_pages`): each slot's page ids within its shard at
  the full table width, as the device reads them, and how many of them the slot holds.

Host time per call grows with the live requests and the slots asked about, not with the pool (whose allocators
have one slot per page): every program's launch goes through :meth:`PageBook.dispatch` and
:meth:`PageBook.tables`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dora_jax.rollout.pages import PageError, PagePool, SharedPrefix, pages_for, safe_to_grow

Ref = tuple[int, int]  # (batch shard, allocator slot)
SCRATCH = 0  # the page of each shard's range that no slot holds (dora_jax.models.paged.SCRATCH_PAGE)


class PoolFull(PageError):
    """A request the pool cannot take now (it may later); the message names the sizes."""


class PageBook:
    """``num_pages`` pages of ``page_tokens`` tokens over ``shards`` batch shards (each shard ``ceil(num_pages /
    shards)`` of them, plus its scratch page), for slots of at most ``table_width`` pages."""

    def __init__(self, num_pages: int, page_tokens: int, shards: int, table_width: int):
        self.page_tokens, self.shards, self.table_width = page_tokens, shards, table_width
        self.shard_pages = -(-num_pages // shards) + 1  # device pages per shard, scratch included
        self.allocators = [PagePool(self.shard_pages - 1, page_tokens, self.shard_pages - 1, reserve=False)
                           for _ in range(shards)]
        self._free_ids = [list(range(self.shard_pages - 2, -1, -1)) for _ in range(shards)]
        # Positions each request's dispatched programs may have written: what its pages must cover.
        self._asked: dict[Ref, int] = {}
        self._serials: dict[Ref, int] = {}  # which request holds an allocator slot now
        self._serial = 0
        self.waits = 0  # dispatches of a live slot cut short (or to nothing) to wait for pages
        # What the device reads, kept up to date as pages are taken so that tables() only gathers rows: each
        # live request's table row (page ids + 1, scratch past its pages) and page count. Row 0 is no request's.
        self._rows = np.zeros((1, table_width), np.int32)
        self._row_pages = np.zeros((1,), np.int32)
        self._row_of: dict[Ref, int] = {}
        self._free_rows: list[int] = []

    # -- what the pool holds --------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self.allocators)

    @property
    def held_pages(self) -> int:
        """Pages live requests and held prefixes hold (shared pages once)."""
        return sum(a.num_pages - a.free_pages for a in self.allocators)

    def shard_free(self, shard: int) -> int:
        return self.allocators[shard].free_pages

    def table(self, ref: Ref | None) -> list[int]:
        return [] if ref is None else self.allocators[ref[0]].table(ref[1])

    def dispatched(self, ref: Ref) -> int:
        """Positions the request's dispatched programs may have written (its length once they are read)."""
        return self._asked[ref]

    def serial(self, ref: Ref) -> int:
        return self._serials[ref]

    # -- admission ------------------------------------------------------------------------------------------

    def admit(self, shard: int, prompt_tokens: int, limit: int, fork: Ref | None = None, fork_tokens: int = 0,
              prefix: SharedPrefix | None = None) -> Ref:
        """A request of ``prompt_tokens`` (written now) growing up to ``limit`` tokens, in ``shard``; with
        ``fork``, sharing that request's first ``fork_tokens`` (full pages); else with ``prefix`` (held in this
        shard by :meth:`hold_prefix`), sharing its pages. A fork's full pages already include its request's
        prefix pages.

        Raises:
          PageError: a request that could never fit (naming its pages and the pool's, or the table width).
          PoolFull: one that does not fit now.
        """
        if pages_for(limit, self.page_tokens) > self.table_width:
            raise PageError(f"a request of up to {limit} tokens needs {pages_for(limit, self.page_tokens)} pages of "
                            f"{self.page_tokens} tokens; a slot's table holds {self.table_width}")
        if fork is not None and fork[0] != shard:
            fork, fork_tokens = None, 0  # pages are shared within a shard only
        alloc, rid = self.allocators[shard], self._free_ids[shard].pop()
        where = f" in batch shard {shard} of {self.shards}" if self.shards > 1 else ""
        try:
            copies = alloc.admit(rid, prompt_tokens=prompt_tokens, max_tokens=limit,
                                 prefix=prefix if fork is None else None,
                                 fork=None if fork is None else fork[1], fork_tokens=fork_tokens or None)
        except PageError as e:
            self._free_ids[shard].append(rid)
            raise PageError(f"{e}{where}") from None
        if copies is None or not self.safe(shard):
            if copies is not None:
                alloc.finish(rid)
            self._free_ids[shard].append(rid)
            raise PoolFull(f"the page pool has no room now{where} for a request of {prompt_tokens} prompt tokens "
                           f"growing to {limit} ({pages_for(limit, self.page_tokens)} pages of {self.page_tokens} "
                           f"tokens): {alloc.free_pages} of {alloc.num_pages} pages are free, and with it the live "
                           "requests could not all reach their limits; free slots first, or give the engine more "
                           "pages (rollout.kv_pages)")
        assert not copies, "only full pages are shared: nothing to copy"
        ref = (shard, rid)
        self._asked[ref] = prompt_tokens
        self._serial += 1
        self._serials[ref] = self._serial
        self._row_of[ref] = self._take_row()
        self._write_row(ref, 0)
        return ref

    def hold_prefix(self, shard: int, tokens: int, extra: Sequence[tuple[int, int]] = ()) -> SharedPrefix | None:
        """Pages for ``tokens`` tokens (whole pages) that requests of ``shard`` will share read-only, held until
        :meth:`release_prefixes`; ``None`` when the shard cannot give them now and stay safe with the ``extra``
        requests, (prompt tokens, limit), admitted after them.

        The ``extra`` requests count their whole prompts as their own, as :meth:`admissible` counts them: the
        held pages are never freed by a request's end, so without them in the check the requests
        :meth:`admissible` let through could fail to fit behind the hold."""
        alloc = self.allocators[shard]
        if pages_for(tokens, self.page_tokens) > alloc.free_pages:
            return None
        held = alloc.hold_prefix(tokens)
        if held is not None and not self.safe(shard, extra):
            alloc.release_prefix(held)
            return None
        return held

    def release_prefixes(self, held: dict[int, SharedPrefix]) -> None:
        """Drops the holds of ``held`` (shard -> prefix), emptying it; each page goes back once no request
        references it."""
        for shard, prefix in held.items():
            self.allocators[shard].release_prefix(prefix)
        held.clear()

    def release(self, ref: Ref) -> None:
        """A request ends: its pages go back once nothing else holds them."""
        self.allocators[ref[0]].finish(ref[1])
        self._free_ids[ref[0]].append(ref[1])
        self._asked.pop(ref, None)
        self._serials.pop(ref, None)
        row = self._row_of.pop(ref, None)
        if row is not None:
            self._rows[row] = SCRATCH
            self._row_pages[row] = 0
            self._free_rows.append(row)

    def safe(self, shard: int, extra: Sequence[tuple[int, int]] = ()) -> bool:
        """Whether every live request of the shard (and ``extra`` ones, (prompt tokens, limit), not admitted yet)
        could still reach its limit."""
        alloc = self.allocators[shard]
        free = alloc.free_pages
        live = alloc.prospects()
        for prompt, limit in extra:
            own = pages_for(prompt, self.page_tokens)
            free -= own
            live.append((pages_for(limit, self.page_tokens) - own, own))
        return free >= 0 and safe_to_grow(free, live)

    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int] | None:
        """The batch shard each request of (prompt tokens, limit) would go to if admitted now together: each to
        the shard with the most free pages, as long as every shard stays safe; ``None`` when they do not all fit
        now (a sample's prompt pages shared with its group count as its own: the check errs on the side of
        waiting)."""
        free = [a.free_pages for a in self.allocators]
        placed: list[list[tuple[int, int]]] = [[] for _ in range(self.shards)]
        out = []
        for prompt, limit in requests:
            shard = max(range(self.shards), key=lambda k: (free[k], -k))
            placed[shard].append((prompt, limit))
            free[shard] -= pages_for(prompt, self.page_tokens)
            out.append(shard)
        return out if all(self.safe(k, placed[k]) for k in range(self.shards) if placed[k]) else None

    # -- growth ---------------------------------------------------------------------------------------------

    def grant(self, ids_seq: Sequence[Sequence[Ref | None]], tokens_seq: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Takes the pages for ``tokens_seq[g][b]`` more tokens of each live slot where the pool can serve them
        safely, every slot at once when that is safe (the common case), else slot by slot, those closest to
        their limits first (they free their pages soonest). Returns the tokens each slot's pages cover past
        what is already dispatched, at most what was asked: what a program may run. Asking twice before a
        dispatch grants the same and takes nothing more."""
        rows = [(g, b, ref, int(n)) for g, (ids, ns) in enumerate(zip(ids_seq, tokens_seq))
                for b, (ref, n) in enumerate(zip(ids, ns)) if ref is not None and n > 0]
        wants = {}
        by_shard: dict[int, list[tuple[tuple[int, int], Ref]]] = {}
        for g, b, ref, n in rows:
            alloc = self.allocators[ref[0]]
            wants[(g, b)] = max(0, min(self._asked[ref] + n, alloc.limit(ref[1])) - alloc.length(ref[1]))
            by_shard.setdefault(ref[0], []).append(((g, b), ref))
        for shard, members in by_shard.items():
            alloc = self.allocators[shard]
            growth = {key: alloc.growth(ref[1], wants[key]) for key, ref in members}
            # No new page (the dispatch after the driver's own grant, or tokens within held pages): nothing
            # to check, and the banker's test sorts every live request of the shard.
            if not any(growth.values()) or self._safe_after(shard, {ref[1]: growth[key] for key, ref in members}):
                for key, ref in members:
                    self._append(ref, wants[key])
                continue
            for key, ref in sorted(members, key=lambda m: alloc.need(m[1][1])):
                if self._safe_after(shard, {ref[1]: growth[key]}):
                    self._append(ref, wants[key])
                else:  # what its last page still holds costs no page
                    length = alloc.length(ref[1])
                    self._append(ref, min(wants[key], pages_for(length, self.page_tokens) * self.page_tokens - length))
        out = []
        for ids, ns in zip(ids_seq, tokens_seq):
            got = [0] * len(ids)
            for b, (ref, n) in enumerate(zip(ids, ns)):
                if ref is not None and n > 0:
                    got[b] = min(int(n), self.allocators[ref[0]].length(ref[1]) - self._asked[ref])
            out.append(np.asarray(got, np.int32))
        return out

    def dispatch(self, ids_seq: Sequence[Sequence[Ref | None]], tokens_seq: Sequence[Sequence[int]]
                 ) -> list[np.ndarray]:
        """:meth:`grant`, then books the granted tokens as dispatched (and a slot granted less as a wait)."""
        granted = self.grant(ids_seq, tokens_seq)
        for ids, got, wanted in zip(ids_seq, granted, tokens_seq):
            for ref, n, w in zip(ids, got.tolist(), wanted):
                if ref is not None:
                    self._asked[ref] += int(n)
                    self.waits += int(n < w)
        return granted

    def settle(self, booked: Sequence[tuple[Ref, int, int]], produced: Sequence[int]) -> None:
        """A program's results are read: each of its rows, (ref, serial, tokens granted), produced
        ``produced[i]`` tokens, so it wrote that many positions, not what it was granted (a request that has
        ended since, or whose slot another request holds now, is left alone)."""
        for (ref, serial, granted), n in zip(booked, produced):
            if self._serials.get(ref) == serial:
                self._asked[ref] -= granted - int(n)

    def _safe_after(self, shard: int, extra: dict[int, int]) -> bool:
        """:meth:`safe` after giving allocator slot ``i`` ``extra[i]`` more pages."""
        alloc = self.allocators[shard]
        if sum(extra.values()) > alloc.free_pages:
            return False
        return safe_to_grow(alloc.free_pages - sum(extra.values()), alloc.prospects(extra))

    def _append(self, ref: Ref, tokens: int) -> None:
        if tokens > 0:
            length = self.allocators[ref[0]].length(ref[1])
            copies = self.allocators[ref[0]].append(ref[1], tokens)
            assert not copies, "only full pages are shared: nothing to copy"
            held = pages_for(length, self.page_tokens)
            if pages_for(length + tokens, self.page_tokens) > held:
                self._write_row(ref, held)

    def _take_row(self) -> int:
        if not self._free_rows:  # doubling: never more than twice the rows of the most requests live at once
            n = len(self._rows)
            self._rows = np.concatenate([self._rows, np.full_like(self._rows, SCRATCH)])
            self._row_pages = np.concatenate([self._row_pages, np.zeros_like(self._row_pages)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _write_row(self, ref: Ref, start: int) -> None:
        """Copies the request's table entries from ``start`` on into its row (its earlier ones never change:
        nothing is ever copied on write here)."""
        pages = self.allocators[ref[0]].table(ref[1], start)
        row = self._row_of[ref]
        self._rows[row, start:start + len(pages)] = np.asarray(pages, np.int32) + 1
        self._row_pages[row] = start + len(pages)

    def _row_index(self, ids: Sequence[Ref | None]) -> np.ndarray:
        try:
            return np.fromiter((0 if ref is None else self._row_of[ref] for ref in ids), np.intp, len(ids))
        except KeyError as e:
            raise PageError(f"slot {e.args[0][1]!r} is not live") from None

    # -- what the device reads ------------------------------------------------------------------------------

    def tables(self, ids_seq: Sequence[Sequence[Ref | None]]) -> list[np.ndarray]:
        """Per state, int32 ``[B, table_width]``: each slot's page ids within its shard (the allocator's + 1),
        scratch past its pages and for an empty slot (``None``). Always the full width, so the programs' shapes
        do not follow the longest slot; :meth:`live_pages` says how far each row is live. Fresh arrays."""
        return [self._rows[self._row_index(ids)] for ids in ids_seq]

    def live_pages(self, ids_seq: Sequence[Sequence[Ref | None]]) -> list[np.ndarray]:
        """Per state, int32 ``[B]``: how many pages each slot's table holds now (0 for an empty slot), the
        entries of :meth:`tables` before its scratch."""
        return [self._row_pages[self._row_index(ids)] for ids in ids_seq]

    def prompt_pages(self, ref: Ref, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Pool-wide page ids and rows for positions ``start .. length - 1`` of a request (its prompt's, to
        write at insertion)."""
        table = np.asarray(self.table(ref), np.int32)
        pos = np.arange(start, length)
        return ref[0] * self.shard_pages + table[pos // self.page_tokens] + 1, pos % self.page_tokens
