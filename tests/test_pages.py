"""The paged KV cache's host side (dora_jax/rollout/page_book.py) against a plain reference: each request's tokens
as a list. A simulated device memory (one list of rows per page) is written through the page tables; every live
request must read back exactly its own tokens, every held head its own, and nothing is ever written to a page
that anything else references."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dora_jax.config import load_config
from dora_jax.rollout.page_book import PageBook, PoolFull
from dora_jax.rollout.pages import PageError, dense_tokens_per_slot, pages_for, plan_pool


class Device:
    """Page contents as the device would hold them: ``rows[shard][page][i]`` is the token written to row i."""

    def __init__(self, book: PageBook):
        self.book = book
        self.rows = [[[None] * book.page_tokens for _ in range(book.shard_pages - 1)] for _ in range(book.shards)]

    def write(self, shard, table, start, tokens):
        """Writes tokens at positions start.. of a sequence laid out by ``table``; each page written must be
        referenced by its writer alone."""
        p = self.book.page_tokens
        for i, tok in enumerate(tokens, start):
            page = table[i // p]
            assert self.book.refs(shard, page) == 1, f"page {page} written while {self.book.refs(shard, page)} hold it"
            self.rows[shard][page][i % p] = tok

    def read(self, shard, table, n):
        p = self.book.page_tokens
        return [self.rows[shard][table[i // p]][i % p] for i in range(n)]


class BookSchedule(RuleBasedStateMachine):
    """Random schedules over two batch shards of admit (alone, after a held head, or forked from a live request
    as a GRPO group's next member), decode programs, ends, and heads held and released."""

    @initialize(num_pages=st.integers(4, 40), page_tokens=st.integers(1, 5))
    def make(self, num_pages, page_tokens):
        self.book = PageBook(num_pages, page_tokens, 2, table_width=64)
        self.dev = Device(self.book)
        self.want: dict[int, list[int]] = {}  # record -> its tokens
        self.shard: dict[int, int] = {}
        self.prompts: dict[int, int] = {}
        self.limits: dict[int, int] = {}
        self.heads: list[tuple[int, object, list[int]]] = []  # (shard, head, its tokens)
        self.counter = 0

    def tokens(self, n):
        self.counter += n
        return list(range(self.counter - n, self.counter))

    def try_admit(self, shard, prompt, limit, **shared):
        """The book's answer, checked: refused only when larger than a shard, and a request that waits changes
        nothing. Returns the record, or None."""
        before = self.snapshot()
        try:
            return self.book.admit(shard, prompt, limit, **shared)
        except PoolFull:
            assert self.snapshot() == before
            return None
        except PageError as e:
            assert pages_for(limit, self.book.page_tokens) > self.book.shard_pages - 1, e
            assert f"needs {pages_for(limit, self.book.page_tokens)} pages" in str(e)
            return None

    def admitted(self, ref, shard, tokens, start, prompt, limit):
        """Books an admission the book accepted and writes the prompt's tokens after the shared part."""
        assert ref not in self.want and self.book.length(ref) == prompt
        self.dev.write(shard, self.book.table(ref), start, tokens[start:])
        self.want[ref], self.shard[ref], self.prompts[ref], self.limits[ref] = tokens, shard, prompt, limit

    @rule(shard=st.integers(0, 1), prompt=st.integers(1, 12), extra=st.integers(0, 12))
    def admit(self, shard, prompt, extra):
        ref = self.try_admit(shard, prompt, prompt + extra)
        if ref is not None:
            self.admitted(ref, shard, self.tokens(prompt), 0, prompt, prompt + extra)

    @rule(data=st.data(), extra=st.integers(0, 12))
    def fork(self, data, extra):
        """The next sample of a group: the same prompt as a live request, its full pages shared."""
        if not self.want:
            return
        src = data.draw(st.sampled_from(sorted(self.want)))
        prompt, p = self.prompts[src], self.book.page_tokens
        if prompt < p:
            return
        shared = p * data.draw(st.integers(1, prompt // p))
        ref = self.try_admit(self.shard[src], prompt, prompt + extra, fork=src, fork_tokens=shared)
        if ref is not None:
            assert self.book.table(ref)[:shared // p] == self.book.table(src)[:shared // p]
            self.admitted(ref, self.shard[src], self.want[src][:prompt], shared, prompt, prompt + extra)

    @rule(shard=st.integers(0, 1), pages=st.integers(1, 3))
    def hold_prefix(self, shard, pages):
        n = pages * self.book.page_tokens
        head = self.book.hold_prefix(shard, n)
        if head is not None:
            tokens = self.tokens(n)
            for page in head.pages:
                assert self.book.refs(shard, page) == 1
            self.dev.write(shard, list(head.pages), 0, tokens)  # the device prefills the head once
            self.heads.append((shard, head, tokens))

    @rule(data=st.data(), more=st.integers(0, 6), extra=st.integers(0, 8))
    def admit_after_prefix(self, data, more, extra):
        if not self.heads:
            return
        shard, head, tokens = data.draw(st.sampled_from(self.heads))
        prompt = len(tokens) + more
        ref = self.try_admit(shard, prompt, prompt + extra, prefix=head)
        if ref is not None:
            self.admitted(ref, shard, tokens + self.tokens(more), len(tokens), prompt, prompt + extra)

    @rule(data=st.data())
    def release_prefix(self, data):
        if self.heads:
            shard, head, _ = self.heads.pop(data.draw(st.integers(0, len(self.heads) - 1)))
            self.book.release_prefixes({shard: head})

    @rule(data=st.data(), n=st.integers(1, 4))
    def decode(self, data, n):
        """A decode program of up to n steps over some live requests in two decode states: each writes the
        tokens it was granted, never past its limit, and some request progresses while none has reached its
        limit (one that has ends before anything it holds is needed)."""
        refs = data.draw(st.permutations(sorted(self.want)))
        cut = data.draw(st.integers(0, len(refs)))
        states = [list(refs[:cut]) + [None], list(refs[cut:])]
        asks = [[0 if r is None else min(n, self.limits[r] - len(self.want[r])) for r in s] for s in states]
        granted = self.book.dispatch(states, asks)
        for ids, ask, got in zip(states, asks, granted):
            for ref, a, g in zip(ids, ask, got.tolist()):
                assert 0 <= g <= a
                if ref is not None and g:
                    new = self.tokens(g)
                    self.dev.write(self.shard[ref], self.book.table(ref), len(self.want[ref]), new)
                    self.want[ref] = self.want[ref] + new
        if self.want and all(self.limits[r] > len(self.want[r]) for r in self.want):
            assert sum(int(g.sum()) for g in granted) > 0, "no request could progress"

    @rule(data=st.data())
    def finish(self, data):
        if self.want:
            ref = data.draw(st.sampled_from(sorted(self.want)))
            self.book.release(ref)
            del self.want[ref], self.shard[ref], self.prompts[ref], self.limits[ref]

    @precondition(lambda self: hasattr(self, "book"))
    @invariant()
    def consistent(self):
        self.book.check()
        # What the device reads: full-width int32 rows, scratch (0) past each request's pages and for an empty
        # slot; through them, no live request was ever overwritten by another.
        refs = sorted(self.want)
        (tables,), (pages,) = self.book.tables([refs + [None]]), self.book.live_pages([refs + [None]])
        assert tables.dtype == pages.dtype == np.int32 and tables.shape == (len(refs) + 1, 64)
        assert not tables[-1].any() and pages[-1] == 0
        for ref, row, n in zip(refs, tables, pages.tolist()):
            tokens = self.want[ref]
            assert n == pages_for(self.book.length(ref), self.book.page_tokens) and not row[n:].any()
            assert self.dev.read(self.shard[ref], (row[:n] - 1).tolist(), len(tokens)) == tokens, ref
            assert self.book.dispatched([ref]).tolist() == [len(tokens)]
        for shard, head, tokens in self.heads:  # nor a held head
            assert self.dev.read(shard, list(head.pages), len(tokens)) == tokens
        for shard in range(2):  # every shard stays safe
            assert self.book.safe(shard)

    def snapshot(self):
        return ([self.book.table(r) for r in sorted(self.want)], self.book.free_pages, self.book.held_pages,
                [[self.book.refs(s, i) for i in range(self.book.shard_pages - 1)] for s in range(2)])

    def teardown(self):
        if not hasattr(self, "book"):
            return
        for ref in list(self.want):
            self.book.release(ref)
        for shard, head, _ in self.heads:
            self.book.release_prefixes({shard: head})
        self.book.check()
        assert self.book.held_pages == 0  # no page leaked


TestBookSchedule = BookSchedule.TestCase
TestBookSchedule.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_a_full_pool_makes_admission_wait_and_never_evicts():
    """A 4-page pool (4-token pages): a request growing to 12 tokens takes 1 page and may need 2 more; a
    second of 8 growing to 16 would take 2 and leave 1 free, with each needing 2: neither could finish first,
    so it waits (nothing changes); the first grows to its limit, and once it ends the second fits."""
    book = PageBook(4, 4, 1, table_width=8)
    first = book.admit(0, 4, 12)
    assert book.free_pages == 3
    with pytest.raises(PoolFull, match="no room now for a request of 8 prompt tokens growing to 16"):
        book.admit(0, 8, 16)
    assert book.free_pages == 3 and book.held_pages == 1
    assert book.dispatch([[first]], [[8]])[0].tolist() == [8] and len(book.table(first)) == 3
    book.release(first)
    second = book.admit(0, 8, 16)
    assert book.table(second) == [0, 1]  # lowest pages first
    book.check()


def test_a_group_shares_its_prompts_full_pages_and_waits_for_what_would_deadlock():
    """Four samples of one 6-token prompt (pages of 4): the first holds a full and a partial page, each other
    shares the full one and writes its partial page itself (nothing is copied). Each grows to 10 tokens: one
    more page. In a pool of 6 pages all four fit (1 + 4 pages taken, and the first to finish frees 2); in a
    pool of 5 the fourth would leave no page for any of them, so it waits. Every admitted one reaches its
    limit, and every page comes back."""
    for pages, admitted in ((6, 4), (5, 3)):
        book = PageBook(pages, 4, 1, table_width=4)
        first = book.admit(0, 6, 10)
        refs = [first]
        for _ in range(3):
            try:
                refs.append(book.admit(0, 6, 10, fork=first, fork_tokens=4))
            except PoolFull:
                pass
        assert len(refs) == admitted
        full = book.table(first)[0]
        assert all(book.table(r)[0] == full for r in refs) and book.refs(0, full) == admitted
        assert len({book.table(r)[1] for r in refs}) == admitted  # each its own partial page
        left = {r: 4 for r in refs}
        while left:
            ids = list(left)
            (got,) = book.dispatch([ids], [[left[r] for r in ids]])
            assert got.sum() > 0
            for r, g in zip(ids, got.tolist()):
                left[r] -= g
                if not left[r]:
                    del left[r]
                    book.release(r)
            book.check()
        assert book.held_pages == 0


def test_heads_are_shared_and_bad_requests_refused():
    book = PageBook(8, 4, 1, table_width=16)
    head = book.hold_prefix(0, 8)  # the chat template's head: 2 full pages
    ref = book.admit(0, 9, 12, prefix=head)
    assert book.table(ref)[:2] == list(head.pages) and book.refs(0, head.pages[0]) == 2
    book.release_prefixes({0: head})
    assert book.refs(0, head.pages[0]) == 1  # still the request's
    book.release(ref)
    assert book.free_pages == 8
    with pytest.raises(PageError, match=r"up to 40 tokens needs 10 pages of 4 tokens; the pool has 8 pages \(32 tokens\)"):
        book.admit(0, 8, 40)
    with pytest.raises(PageError, match="a held head covers whole pages of 4 tokens, got 6"):
        book.hold_prefix(0, 6)
    with pytest.raises(PageError, match="request record 3 is not live"):
        book.release(3)


def test_plan_pool_sizes_a_config():
    """Pages for rollout.slots sequences of the longest length, against the dense cache of the engine."""
    cfg = load_config("tiny_llama", ["rollout.slots=8", "rollout.max_prompt_len=20", "rollout.max_new_tokens=30",
                                     "train.group_size=4"])
    plan = plan_pool(cfg, page_tokens=16)
    assert plan.sequence_tokens == 50 and plan.pages == 8 * 4 and plan.live_tokens == 400
    assert plan.dense_tokens_per_slot == dense_tokens_per_slot(20, 30, cfg.model.max_seq_len) == 64
    # Each group of 4 shares its prompt's one full page; each sample holds the partial prompt page onward.
    assert plan.grouped_pages == 2 * 1 + 8 * (4 - 1)
    assert "32 pages = 512 tokens" in "\n".join(plan.lines())


def test_safe_to_grow_is_the_bankers_test():
    """Hand-worked cases of the banker's test for one resource: (pages it may still take, pages its end frees)."""
    from dora_jax.rollout.pages import safe_to_grow as bank

    def safe_to_grow(free, pairs):
        return bank(free, [n for n, _ in pairs], [f for _, f in pairs])

    assert safe_to_grow(2, [(2, 1), (2, 1)])  # the first finishes on the 2 free pages, frees 1 + 2: 3 >= 2
    assert not safe_to_grow(1, [(2, 1), (2, 1)])  # neither can finish first
    assert safe_to_grow(1, [(4, 4), (1, 3)])  # in need order: the small one takes 1, then frees 3 + 1: 4 free
    assert not safe_to_grow(0, [(1, 0)]) and safe_to_grow(0, [(0, 0), (0, 0)]) and safe_to_grow(0, [])
    # A request freeing nothing of its own (all its pages shared) still lets the next one use what it took.
    assert safe_to_grow(3, [(3, 0), (3, 0)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 50)), min_size=1, max_size=12), st.integers(2, 24),
       st.integers(1, 6))
def test_page_book_admits_and_grows_safely_and_always_progresses(requests, pages, per_program):
    """Random requests (prompt tokens, tokens to write) through a PageBook of a few 4-token pages, in
    programs of up to ``per_program`` tokens each: admission only where safe, every program grants some slot a
    token while any is live (no deadlock), the allocator stays consistent, the granted tokens never pass a
    request's limit, and every request that fits the pool at all finishes with every page back."""
    book = PageBook(pages, 4, 1, table_width=64)
    waiting = [(p, p + n) for p, n in requests if pages_for(p + n, 4) <= book.shard_pages - 1]
    left: dict = {}  # ref -> positions still to write
    for _ in range(10_000):
        while waiting and book.admissible([waiting[0]]) is not None:
            prompt, limit = waiting.pop(0)
            ref = book.admit(0, prompt, limit)
            left[ref] = limit - prompt
        if not left:
            break
        refs = list(left)
        (granted,) = book.dispatch([refs], [[min(per_program, left[r]) for r in refs]])
        assert granted.sum() > 0, "no slot could progress"
        for ref, n in zip(refs, granted):
            assert 0 <= n <= left[ref]
            left[ref] -= int(n)
            if left[ref] == 0:
                del left[ref]
                book.release(ref)
        book.check()
    assert not waiting and not left and book.held_pages == 0


def _python_lines(fn):
    """Lines of pages.py and page_book.py that ``fn()`` executes (loop iterations included)."""
    import sys

    from dora_jax.rollout import page_book, pages

    files, count = {pages.__file__, page_book.__file__}, [0]

    def line(frame, event, arg):
        count[0] += event == "line"
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename in files else None

    before = sys.gettrace()
    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(before)
    return count[0]


def test_page_book_host_work_follows_the_live_requests_not_the_pool():
    """The same few requests (a group forked from one prompt, one after a held head) admitted, dispatched
    across page boundaries, read and released run exactly the same Python lines in a pool of 2,000 pages as in
    one of 200,000 (whose allocator has 200,000 slots): nothing per call walks the pool."""
    def run(num_pages):
        book = PageBook(num_pages, 16, 1, table_width=272)  # building the pool may take time of its size

        def work():
            first = book.admit(0, 1000, 4352)
            refs = [first] + [book.admit(0, 1000, 4352, fork=first, fork_tokens=992) for _ in range(3)]
            head = book.hold_prefix(0, 64, [(100, 4000)])
            refs.append(book.admit(0, 100, 4000, prefix=head))
            ids = [refs[:3] + [None], refs[3:]]
            for n in (1, 20, 40):
                book.dispatch(ids, [[n] * len(s) for s in ids])
                book.tables(ids), book.live_pages(ids)
                assert book.safe(0) and book.admissible([(500, 4352)]) == [0]
            for ref in refs:
                book.release(ref)
            book.release_prefixes({0: head})

        lines = _python_lines(work)
        assert book.held_pages == 0
        return lines

    small, huge = run(2_000), run(200_000)
    assert small == huge, (small, huge)


def test_page_book_refuses_a_request_longer_than_a_table():
    book = PageBook(64, 4, 1, table_width=8)
    with pytest.raises(PageError, match=r"up to 33 tokens needs 9 pages of 4 tokens; a slot's table holds 8"):
        book.admit(0, 4, 33)
    book.admit(0, 4, 32)
