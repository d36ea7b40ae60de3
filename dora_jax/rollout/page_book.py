"""The host-side book of one rollout engine's KV page pool: NumPy arrays, no JAX.

:class:`PageBook` keeps one record per live request (an integer >= 1; 0 is none: its shard, page table, covered
and written tokens, limit) and admits, shares, grows and frees pages under the banker's test
(:func:`~dora_jax.rollout.pages.safe_to_grow`). :class:`StateRecords` maps each live decode state's rows to
records. See docs/rollout.md, 'Paged KV cache' and 'The page book's rules'.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from dora_jax.rollout.pages import PageError, HeldPages, pages_for, safe_to_grow

SCRATCH = 0  # the page of each shard's range that no slot holds (dora_jax.models.paged.SCRATCH_PAGE)


class PoolFull(PageError):
    """A request the pool cannot take now (it may later); the message names the sizes."""


def ids_array(ids: Any) -> np.ndarray:
    """Records as an integer array, 0 for an empty slot (``None`` in a list)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.intp, copy=False)
    return np.fromiter((0 if i is None else i for i in ids), np.intp, len(ids))


class PageBook:
    """``num_pages`` pages of ``page_tokens`` tokens over ``shards`` batch shards (each shard ``ceil(num_pages /
    shards)`` of them, plus its scratch page), for slots of at most ``table_width`` pages. Page ids here are
    ``0 .. shard_pages - 2`` within a shard; the device's tables hold them + 1 (0 is the scratch page)."""

    def __init__(self, num_pages: int, page_tokens: int, shards: int, table_width: int):
        for name, value in (("num_pages", num_pages), ("page_tokens", page_tokens), ("shards", shards),
                            ("table_width", table_width)):
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                raise PageError(f"{name} must be an integer >= 1, got {value!r}")
        self.page_tokens, self.shards, self.table_width = int(page_tokens), int(shards), int(table_width)
        self.shard_pages = -(-num_pages // shards) + 1  # device pages per shard, scratch included
        n = self.shard_pages - 1
        self._refs = np.zeros((shards, n), np.int32)  # requests and held heads referencing each page
        # Each shard's free pages as a stack whose top is the lowest id: pages are taken low first.
        self._free = np.tile(np.arange(n - 1, -1, -1, dtype=np.int32), (shards, 1))
        self._nfree = np.full((shards,), n, np.int64)
        self._heads: list[set[HeldPages]] = [set() for _ in range(shards)]
        self.waits = 0  # dispatches of a live slot cut short (or to nothing) to wait for pages
        self._serial = 0
        self._spare: list[int] = []
        self._grow_records(16)

    def _grow_records(self, n: int) -> None:
        """Room for ``n`` records (index 0 is the empty slot's, never live), doubling."""
        old = getattr(self, "_live", np.zeros((0,), bool)).shape[0]

        def grown(name: str, dtype, *tail: int) -> None:
            new = np.zeros((n, *tail), dtype)
            if old:
                new[:old] = getattr(self, name)
            setattr(self, name, new)

        for name in ("_shard", "_length", "_asked", "_limit", "_npages", "_own", "_serials"):
            grown(name, np.int64)
        grown("_live", bool)
        grown("_rows", np.int32, self.table_width)  # page ids + 1 (0: scratch past its pages)
        self._spare += list(range(n - 1, max(old, 1) - 1, -1))

    # -- what the pool holds --------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return int(self._nfree.sum())

    @property
    def held_pages(self) -> int:
        """Pages live requests and held heads hold (shared pages once)."""
        return self.shards * (self.shard_pages - 1) - self.free_pages

    def shard_free(self, shard: int) -> int:
        return int(self._nfree[shard])

    def table(self, ref: int | None) -> list[int]:
        """A request's page ids within its shard, in order (``[]`` for no request)."""
        if not ref:
            return []
        self._check_live(ref)
        return (self._rows[ref, :self._npages[ref]] - 1).tolist()

    def refs(self, shard: int, page: int) -> int:
        """Requests and held heads referencing a page of a shard."""
        return int(self._refs[shard, page])

    def length(self, ref: int) -> int:
        """Tokens the request's pages were taken for (at least what its programs may have written)."""
        self._check_live(ref)
        return int(self._length[ref])

    def dispatched(self, ids: Any) -> np.ndarray:
        """Per slot, the positions its request's dispatched programs may have written (0 for an empty slot):
        its length once they are read."""
        return np.where(self._live[ids_array(ids)], self._asked[ids_array(ids)], 0)

    def serials(self, ids: Any) -> np.ndarray:
        """Per slot, which admission its record comes from (a record is reused once its request ends)."""
        return self._serials[ids_array(ids)]

    def _check_live(self, ref: int) -> None:
        if not (0 < ref < self._live.shape[0] and self._live[ref]):
            raise PageError(f"request record {ref!r} is not live")

    # -- the banker's test ----------------------------------------------------------------------------------

    def _members(self, shard: int) -> np.ndarray:
        return np.flatnonzero(self._live & (self._shard == shard))

    def _safe(self, shard: int, taken: int = 0, grow: tuple[np.ndarray, np.ndarray] | None = None,
              extra: Sequence[tuple[int, int]] = (), lose: tuple[int, int] | None = None) -> bool:
        """Whether the shard stays safe after ``taken`` more pages leave its free pages, live records
        ``grow[0]`` take ``grow[1]`` more pages each (counted in ``taken`` by the caller), ``extra`` requests
        (pages they may still take, pages their end frees) join, and record ``lose[0]`` stops owning
        ``lose[1]`` pages (a fork now shares them)."""
        idx = self._members(shard)
        held, own = self._npages[idx].copy(), self._own[idx].copy()
        if grow is not None and grow[0].size:
            at = np.searchsorted(idx, grow[0])
            held[at] += grow[1]
            own[at] += grow[1]
        if lose is not None:
            at = np.searchsorted(idx, lose[0])
            own[at] = max(own[at] - lose[1], 0)
        need = -(-self._limit[idx] // self.page_tokens) - held
        if len(extra):
            more = np.asarray(extra, np.int64).reshape(-1, 2)
            need, own = np.concatenate([need, more[:, 0]]), np.concatenate([own, more[:, 1]])
        return safe_to_grow(int(self._nfree[shard]) - taken, need, own)

    def _extra(self, requests: Any) -> np.ndarray:
        """Requests of (prompt tokens, limit) not admitted yet as the banker's test counts them: int64 [n, 2] of
        (pages each may still take, pages of its prompt, its own and freed at its end)."""
        req = np.asarray(requests, np.int64).reshape(-1, 2)
        prompt = -(-req[:, 0] // self.page_tokens)
        return np.stack([-(-req[:, 1] // self.page_tokens) - prompt, prompt], axis=1)

    def safe(self, shard: int, extra: Sequence[tuple[int, int]] = ()) -> bool:
        """Whether every live request of the shard (and ``extra`` ones, (prompt tokens, limit), not admitted
        yet, their whole prompts their own) could still reach its limit."""
        pages = self._extra(extra)
        return self._safe(shard, int(pages[:, 1].sum()), extra=pages)

    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int] | None:
        """The batch shard each request of (prompt tokens, limit) would go to if admitted now together (each to
        the shard with the most free pages, every shard staying safe); ``None`` when they do not all fit now."""
        pages = self._extra(requests)
        if self.shards == 1:
            out = [0] * len(pages)
        else:
            free, out = self._nfree.tolist(), []
            for own in pages[:, 1].tolist():
                shard = free.index(max(free))  # the lowest shard among those with the most free pages
                free[shard] -= own
                out.append(shard)
        where = np.asarray(out, np.int64)
        return out if all(self._safe(k, int(pages[where == k, 1].sum()), extra=pages[where == k])
                          for k in sorted(set(out))) else None

    # -- pages ----------------------------------------------------------------------------------------------

    def _take(self, shard: int, k: int) -> np.ndarray:
        """``k`` free pages of the shard, lowest first (the caller checked there are as many)."""
        top = int(self._nfree[shard])
        if k > top:
            raise AssertionError(f"batch shard {shard}: {k} pages taken, {top} free")
        pages = self._free[shard, top - k:top][::-1].copy()
        self._nfree[shard] = top - k
        self._refs[shard, pages] = 1
        return pages

    def _drop(self, shard: int, pages: np.ndarray) -> None:
        """One reference less to each of ``pages`` (distinct); those referenced by nothing now are free."""
        refs = self._refs[shard]
        refs[pages] -= 1
        freed = np.sort(pages[refs[pages] == 0])[::-1]  # the lowest on top
        top = int(self._nfree[shard])
        self._free[shard, top:top + freed.size] = freed
        self._nfree[shard] = top + freed.size

    def _extend(self, refs: np.ndarray, more: np.ndarray) -> None:
        """Records ``refs`` (one shard's, distinct) take ``more[i]`` fresh pages each, appended to their tables."""
        keep = more > 0
        refs, more = refs[keep], more[keep]
        if not refs.size:
            return
        total = int(more.sum())
        pages = self._take(int(self._shard[refs[0]]), total)
        who = np.repeat(refs, more)
        col = np.repeat(self._npages[refs], more) + np.arange(total) - np.repeat(np.cumsum(more) - more, more)
        self._rows[who, col] = pages + 1
        self._npages[refs] += more
        self._own[refs] += more

    # -- admission ------------------------------------------------------------------------------------------

    def hold_prefix(self, shard: int, tokens: int, extra: Sequence[tuple[int, int]] = ()) -> HeldPages | None:
        """Pages for ``tokens`` tokens (whole pages) that requests of ``shard`` will share read-only, held until
        :meth:`release_prefixes`; ``None`` when the shard cannot give them now and stay safe with the ``extra``
        requests, (prompt tokens, limit), admitted after them."""
        if tokens < 1 or tokens % self.page_tokens:
            raise PageError(f"a held head covers whole pages of {self.page_tokens} tokens, got {tokens!r} tokens")
        need = tokens // self.page_tokens
        pages = [(pages_for(limit, self.page_tokens) - pages_for(prompt, self.page_tokens),
                  pages_for(prompt, self.page_tokens)) for prompt, limit in extra]
        if not self._safe(shard, need + sum(own for _, own in pages), extra=pages):
            return None
        held = HeldPages(tuple(self._take(shard, need).tolist()), tokens)
        self._heads[shard].add(held)
        return held

    def release_prefixes(self, held: dict[int, HeldPages]) -> None:
        """Drops the holds of ``held`` (shard -> head), emptying it; each page goes back once no request
        references it."""
        for shard, prefix in held.items():
            if prefix not in self._heads[shard]:
                raise PageError(f"release_prefixes: the head is not held in batch shard {shard}")
            self._heads[shard].remove(prefix)
            self._drop(shard, np.asarray(prefix.pages, np.int32))
        held.clear()

    def admit(self, shard: int, prompt_tokens: int, limit: int, fork: int | None = None, fork_tokens: int = 0,
              prefix: HeldPages | None = None) -> int:
        """A request of ``prompt_tokens`` (written now) growing up to ``limit`` tokens, in ``shard``; with
        ``fork`` (a live record of the same shard), sharing its first ``fork_tokens`` tokens (whole pages); else
        with ``prefix`` (held in this shard by :meth:`hold_prefix`), sharing its pages. Returns its record.
        Raises PageError for a request that could never fit or an inconsistent fork or head, PoolFull for one
        that does not fit now (nothing changed)."""
        p, where = self.page_tokens, f" in batch shard {shard} of {self.shards}" if self.shards > 1 else ""
        if not 1 <= prompt_tokens <= limit:
            raise PageError(f"a request needs 1 <= prompt tokens ({prompt_tokens}) <= its limit ({limit})")
        if pages_for(limit, p) > self.table_width:
            raise PageError(f"a request of up to {limit} tokens needs {pages_for(limit, p)} pages of {p} tokens; "
                            f"a slot's table holds {self.table_width}")
        if pages_for(limit, p) > self.shard_pages - 1:
            raise PageError(f"a request of up to {limit} tokens needs {pages_for(limit, p)} pages of {p} tokens; "
                            f"the pool has {self.shard_pages - 1} pages ({(self.shard_pages - 1) * p} tokens){where}")
        if fork is not None and (not fork_tokens or self._shard[fork] != shard):
            fork = None
        lose = None
        if fork is not None:
            self._check_live(fork)
            if not (fork_tokens % p == 0 and 0 < fork_tokens <= min(prompt_tokens, self._length[fork])):
                raise PageError(f"admit: fork_tokens {fork_tokens!r} must be whole pages of {p} tokens within the "
                                f"prompt ({prompt_tokens}) and the forked request ({self._length[fork]})")
            shared = self._rows[fork, :fork_tokens // p] - 1
            lose = (int(fork), int((self._refs[shard, shared] == 1).sum()))  # pages only the fork held so far
        elif prefix is not None:
            if prefix not in self._heads[shard]:
                raise PageError(f"admit: the head is not held in batch shard {shard}")
            if prefix.tokens > prompt_tokens:
                raise PageError(f"admit: a prompt of {prompt_tokens} tokens cannot start with a head of "
                                f"{prefix.tokens}")
            shared = np.asarray(prefix.pages, np.int32)
        else:
            shared = np.zeros((0,), np.int32)
        fresh = pages_for(prompt_tokens, p) - shared.size
        need = pages_for(limit, p) - pages_for(prompt_tokens, p)
        if fresh > self._nfree[shard] or not self._safe(shard, fresh, extra=[(need, fresh)], lose=lose):
            raise PoolFull(f"the page pool has no room now{where} for a request of {prompt_tokens} prompt tokens "
                           f"growing to {limit} ({pages_for(limit, p)} pages of {p} tokens): "
                           f"{self._nfree[shard]} of {self.shard_pages - 1} pages are free, and with it the live "
                           "requests could not all reach their limits; free slots first, or give the engine more "
                           "pages (rollout.kv_pages)")
        if not self._spare:
            self._grow_records(2 * self._live.shape[0])
        ref = self._spare.pop()
        self._refs[shard, shared] += 1
        if lose is not None:
            self._own[lose[0]] = max(self._own[lose[0]] - lose[1], 0)
        self._serial += 1
        self._shard[ref], self._limit[ref], self._serials[ref] = shard, limit, self._serial
        self._length[ref] = self._asked[ref] = prompt_tokens
        self._rows[ref, :shared.size] = shared + 1
        self._npages[ref], self._own[ref], self._live[ref] = shared.size, 0, True
        self._extend(np.array([ref]), np.array([fresh]))
        return ref

    def release(self, ref: int) -> None:
        """A request ends: its pages go back once nothing else holds them."""
        self._check_live(ref)
        shard = int(self._shard[ref])
        self._drop(shard, self._rows[ref, :self._npages[ref]] - 1)
        self._rows[ref] = SCRATCH
        self._npages[ref] = self._own[ref] = 0
        self._live[ref] = False
        self._spare.append(ref)

    # -- growth ---------------------------------------------------------------------------------------------

    def grant(self, ids_seq: Sequence[Any], tokens_seq: Sequence[Any]) -> list[np.ndarray]:
        """Takes the pages for ``tokens_seq[g][b]`` more tokens of each live slot (``ids_seq[g][b]``, 0 or None:
        none) where the pool can serve them safely (else slot by slot, closest to their limits first). Returns
        the tokens each slot's pages cover past what is already dispatched, at most what was asked. Idempotent
        until the next dispatch."""
        ids = [ids_array(x) for x in ids_seq]
        asks = [np.asarray(t, np.int64).reshape(-1) for t in tokens_seq]
        refs, n = np.concatenate(ids), np.concatenate(asks)
        keep = (refs > 0) & (n > 0)
        refs, n = refs[keep], n[keep]
        if refs.size and not self._live[refs].all():
            raise PageError(f"request record {int(refs[~self._live[refs]][0])} is not live")
        p = self.page_tokens
        wants = np.maximum(0, np.minimum(self._asked[refs] + n, self._limit[refs]) - self._length[refs])
        growth = -(-(self._length[refs] + wants) // p) - self._npages[refs]
        for shard in np.unique(self._shard[refs]).tolist() if growth.any() else []:
            at = np.flatnonzero(self._shard[refs] == shard)
            members, more = refs[at], growth[at]
            total = int(more.sum())
            if total <= self._nfree[shard] and self._safe(shard, total, grow=(members, more)):
                self._extend(members, more)
                continue
            # Slot by slot, in order of need; one the pool cannot serve gets what its last page still holds.
            order = np.argsort(-(-self._limit[members] // p) - self._npages[members], kind="stable")
            for i in order.tolist():
                ref, g = members[i:i + 1], more[i:i + 1]
                if g[0] == 0 or (g[0] <= self._nfree[shard] and self._safe(shard, int(g[0]), grow=(ref, g))):
                    self._extend(ref, g)
                else:
                    wants[at[i]] = self._npages[ref[0]] * p - self._length[ref[0]]
        self._length[refs] += wants
        out = []
        for x, t in zip(ids, asks):
            got = np.zeros(x.shape, np.int32)
            live = np.flatnonzero((x > 0) & (t > 0))
            got[live] = np.minimum(t[live], self._length[x[live]] - self._asked[x[live]])
            out.append(got)
        return out

    def dispatch(self, ids_seq: Sequence[Any], tokens_seq: Sequence[Any]) -> list[np.ndarray]:
        """:meth:`grant`, then books the granted tokens as dispatched (and a slot granted less as a wait)."""
        granted = self.grant(ids_seq, tokens_seq)
        for ids, got, wanted in zip(ids_seq, granted, tokens_seq):
            x = ids_array(ids)
            live = x > 0
            self._asked[x[live]] += got[live]
            self.waits += int((got[live] < np.asarray(wanted).reshape(-1)[live]).sum())
        return granted

    def settle(self, refs: np.ndarray, serials: np.ndarray, granted: np.ndarray, produced: np.ndarray) -> None:
        """A program's results are read: its row of record ``refs[i]`` (from admission ``serials[i]``), granted
        ``granted[i]`` tokens, produced ``produced[i]``, so it wrote that many positions, not what it was granted
        (a request that has ended since, or whose record another request holds now, is left alone)."""
        same = self._live[refs] & (self._serials[refs] == serials)
        self._asked[refs[same]] -= granted[same] - produced[same]

    # -- what the device reads ------------------------------------------------------------------------------

    def tables(self, ids_seq: Sequence[Any]) -> list[np.ndarray]:
        """Per state, fresh int32 ``[B, table_width]``: each slot's page ids within its shard + 1, scratch (0)
        past its pages and for an empty slot."""
        return [self._rows[ids_array(ids)] for ids in ids_seq]

    def live_pages(self, ids_seq: Sequence[Any]) -> list[np.ndarray]:
        """Per state, int32 ``[B]``: how many pages each slot's table holds now (0 for an empty slot)."""
        return [self._npages[ids_array(ids)].astype(np.int32) for ids in ids_seq]

    def prompt_pages(self, ref: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Pool-wide page ids and rows for positions ``start .. length - 1`` of a request (its prompt's, to
        write at insertion)."""
        pos = np.arange(start, length)
        return (self._shard[ref] * self.shard_pages + self._rows[ref, pos // self.page_tokens]).astype(np.int32), \
            (pos % self.page_tokens).astype(np.int32)

    # -- invariants -----------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError unless the book is consistent: each page's count is the number of tables and
        held heads referencing it, the free pages are exactly the unreferenced ones, each table covers its
        request's length (and nothing past it), shared pages lead every table, each record's ``own`` count is
        at most the pages only it references, and written <= covered <= limit."""
        counts = np.zeros_like(self._refs)
        live = np.flatnonzero(self._live)
        for ref in live.tolist():
            s, k = int(self._shard[ref]), int(self._npages[ref])
            assert k == pages_for(self._length[ref], self.page_tokens), (ref, k, self._length[ref])
            assert 0 <= self._asked[ref] <= self._length[ref] <= self._limit[ref], ref
            assert (self._rows[ref, k:] == SCRATCH).all() and (self._rows[ref, :k] > 0).all(), ref
            np.add.at(counts[s], self._rows[ref, :k] - 1, 1)
        for s, heads in enumerate(self._heads):
            for h in heads:
                np.add.at(counts[s], np.asarray(h.pages, np.intp), 1)
        assert (counts == self._refs).all(), "reference counts differ from the references"
        for ref in live.tolist():
            shared = self._refs[self._shard[ref], self._rows[ref, :self._npages[ref]] - 1] > 1
            assert (np.diff(shared.astype(np.int8)) <= 0).all(), f"record {ref} shares a page after one of its own"
            assert self._own[ref] <= (~shared).sum(), f"record {ref} counts {self._own[ref]} pages as its own"
        assert not (self._rows[~self._live] != SCRATCH).any(), "a free record keeps a table"
        for s in range(self.shards):
            free = self._free[s, :self._nfree[s]]
            assert np.unique(free).size == free.size, "a page is free twice"
            assert set(free.tolist()) == set(np.flatnonzero(self._refs[s] == 0).tolist()), \
                "free pages differ from the unreferenced ones"


class _Rows:
    """The request record each row of one decode state holds (0: empty)."""

    __slots__ = ("ids",)

    def __init__(self, n: int):
        self.ids = np.zeros((n,), np.int64)


class StateRecords:
    """The engine's records over its :class:`PageBook`, keyed by live decode state (its token array): which
    request each row holds, and the pages each shared prefix holds per shard. :meth:`handoff` passes a record
    to the state a call returns; a state dropped without that, or an unreferenced prefix, returns its pages
    when garbage collected."""

    def __init__(self, book: PageBook):
        self.book = book
        self._states: dict[int, tuple[_Rows, weakref.finalize]] = {}
        self._heads: weakref.WeakKeyDictionary[Any, dict[int, HeldPages]] = weakref.WeakKeyDictionary()

    def track(self, state: Any, rows: _Rows | None = None) -> Any:
        """Starts the record of ``state`` (empty rows unless given); returns ``state``."""
        rows = _Rows(state.tokens.shape[0]) if rows is None else rows
        key = id(state.tokens)
        fin = weakref.finalize(state.tokens, self._drop, key, rows)
        fin.atexit = False
        self._states[key] = (rows, fin)
        return state

    def of(self, state: Any) -> _Rows:
        entry = self._states.get(id(state.tokens))
        if entry is None:
            raise PageError("a decode state this engine does not know: pass the state its last call returned "
                            "(each call donates the state it is given), made by init_decode_state")
        return entry[0]

    def handoff(self, old: Any, new: Any) -> Any:
        """Moves the record of ``old`` to ``new`` (what a call returns for the state it was given)."""
        rows, fin = self._states.pop(id(old.tokens))
        fin.detach()
        return self.track(new, rows)

    def release(self, rows: _Rows, row: int) -> None:
        """Ends the request ``row`` holds, if any: its pages return to the pool."""
        ref = int(rows.ids[row])
        if ref:
            rows.ids[row] = 0
            self.book.release(ref)

    def _drop(self, key: int, rows: _Rows) -> None:
        self._states.pop(key, None)
        for r in range(len(rows.ids)):
            self.release(rows, r)

    def hold_head(self, head: Any, wanted: dict[int, list[tuple[int, int]]]) -> tuple[dict[int, HeldPages], set[int]]:
        """The pages holding the full pages of ``head`` (a shared prefix) in each shard of ``wanted`` (shard ->
        its requests' (prompt tokens, limit)), taken now where safe, and the shards where they were taken now
        (the caller writes them). They return once ``head`` is garbage collected and no slot references them."""
        full = 0 if head is None else len(head.tokens) // self.book.page_tokens * self.book.page_tokens
        if not full:
            return {}, set()
        held = self._heads.get(head)
        if held is None:
            held = self._heads[head] = {}
            weakref.finalize(head, self.book.release_prefixes, held).atexit = False
        fresh = set()
        for shard in wanted.keys() - held.keys():
            pages = self.book.hold_prefix(shard, full, wanted[shard])
            if pages is not None:
                held[shard] = pages
                fresh.add(shard)
        return held, fresh

    def admit(self, rows: _Rows, host: tuple, slots: Sequence[int | None], shards: Sequence[int | None],
              limits: Sequence[int], nb: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Admits request ``i`` of a prefilled batch (``host``: its prompt lengths, cache rows and shared head)
        into row ``slots[i]`` (``None``: not inserted) of a state, in batch shard ``shards[i]``, growing to
        ``limits[i]`` tokens; what a row held before ends. Requests with the same prompt, or after a shared
        head, share its full pages.

        Returns the (pool page, page row) each request's prompt tokens are written at, int32 [nb, t] (scratch
        for what it does not write). Raises :class:`PageError` when the pool has no room for them all now
        (nothing is admitted)."""
        lengths, prompt_rows, head = host
        for slot in slots:  # a slot's previous request ends here (JetStream's insert overwrites)
            if slot is not None:
                self.release(rows, slot)
        p = self.book.page_tokens
        page_nt, row_nt = np.zeros((nb, t), np.int32), np.zeros((nb, t), np.int32)  # scratch
        first: dict[tuple[int, int], int] = {}  # (cache row, shard) -> the request writing its pages
        wanted: dict[int, list[tuple[int, int]]] = {}
        for i, shard in enumerate(shards):
            if shard is not None:
                wanted.setdefault(shard, []).append((int(lengths[i]), int(limits[i])))
        held, fresh = self.hold_head(head, wanted)
        unwritten = set(fresh)
        done: list[int] = []
        try:
            for i, (slot, shard) in enumerate(zip(slots, shards)):
                if slot is None:
                    continue
                n, src, pre = int(lengths[i]), first.get((int(prompt_rows[i]), shard)), held.get(shard)
                shared = (n // p) * p if src is not None else 0
                ref = self.book.admit(shard, n, int(limits[i]), fork=src if shared else None, fork_tokens=shared,
                                      prefix=pre)
                done.append(slot)
                rows.ids[slot] = ref
                first.setdefault((int(prompt_rows[i]), shard), ref)
                # The head's pages are written once, by the first request holding them: its cache row holds the
                # head first, so its positions 0 .. head - 1 are the head's.
                start = max(shared, 0 if pre is None or shard in unwritten else pre.tokens)
                unwritten.discard(shard)
                page_nt[i, start:n], row_nt[i, start:n] = self.book.prompt_pages(ref, start, n)
        except PageError:
            for slot in done:
                self.release(rows, slot)
            self.book.release_prefixes({k: held.pop(k) for k in fresh})  # never written: the scatter did not run
            raise
        return page_nt, row_nt

    def regather(self, rows: _Rows, idx: np.ndarray, old_shards: Sequence[int], new_shards: Sequence[int]
                 ) -> np.ndarray:
        """The records of a state resized so that new row ``i`` holds old row ``idx[i]`` (-1: empty): the
        requests of rows left out end. Raises :class:`PageError` when a live row would change batch shard (its
        pages stay in its shard); nothing changes then."""
        for i, r in enumerate(idx.tolist()):
            if r >= 0 and rows.ids[r] and old_shards[r] != new_shards[i]:
                raise PageError(f"slot {r} would move from batch shard {old_shards[r]} to {new_shards[i]}; a "
                                "slot's pages stay in its shard")
        kept = set(idx[idx >= 0].tolist())
        for r in np.flatnonzero(rows.ids).tolist():
            if r not in kept:
                self.release(rows, r)
        return np.where(idx >= 0, rows.ids[np.maximum(idx, 0)], 0)
