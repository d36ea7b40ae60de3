"""The paged KV cache's host side (dora_jax/rollout/pages.py) against a plain reference: each slot's tokens as a
list. A simulated device memory (one list of rows per page) is written through the page tables, with the
copies the pool asks for made first; every live slot must read back exactly its own tokens."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dora_jax.config import load_config
from dora_jax.rollout.pages import PageError, PagePool, dense_tokens_per_slot, pages_for, plan_pool


class Device:
    """Page contents as the device would hold them: ``rows[page][i]`` is the token written to row i."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.rows = [[None] * pool.page_tokens for _ in range(pool.num_pages)]

    def copy(self, copies):
        for c in copies:
            self.rows[c.dst][:c.tokens] = self.rows[c.src][:c.tokens]

    def write(self, table, start, tokens):
        """Writes tokens at positions start.. of a sequence laid out by ``table``; each page written must be
        referenced by its writer alone."""
        p = self.pool.page_tokens
        for i, tok in enumerate(tokens, start):
            page = table[i // p]
            assert self.pool.refs(page) == 1, f"page {page} written while {self.pool.refs(page)} hold it"
            self.rows[page][i % p] = tok

    def read(self, table, n):
        p = self.pool.page_tokens
        return [self.rows[table[i // p]][i % p] for i in range(n)]


class PoolSchedule(RuleBasedStateMachine):
    """Random schedules of admit (alone, after a held prefix, or forked from a live slot as a GRPO group's
    next member), append, finish, and prefixes held and released."""

    @initialize(num_pages=st.integers(4, 40), page_tokens=st.integers(1, 5), slots=st.integers(1, 6))
    def make(self, num_pages, page_tokens, slots):
        slots = min(slots, num_pages)
        self.pool = PagePool(num_pages, page_tokens, slots)
        self.dev = Device(self.pool)
        self.want: dict[int, list[int]] = {}  # slot -> its tokens
        self.prompts: dict[int, int] = {}  # slot -> prompt length
        self.limits: dict[int, int] = {}
        self.prefixes: list[tuple[object, list[int]]] = []
        self.counter = 0

    def tokens(self, n):
        self.counter += n
        return list(range(self.counter - n, self.counter))

    def empty_slot(self, data):
        free = [s for s in range(self.pool.slots) if s not in self.want]
        return data.draw(st.sampled_from(free)) if free else None

    def try_admit(self, slot, prompt, limit, **shared):
        """The pool's answer, checked: refused only when larger than the whole pool, and a request that waits
        changes nothing. Returns the copies, or None."""
        before = self.snapshot()
        try:
            copies = self.pool.admit(slot, prompt_tokens=prompt, max_tokens=limit, **shared)
        except PageError as e:
            assert pages_for(limit, self.pool.page_tokens) > self.pool.num_pages, e
            assert f"needs {pages_for(limit, self.pool.page_tokens)} pages" in str(e)
            return None
        if copies is None:
            assert self.snapshot() == before
        return copies

    def admitted(self, slot, copies, tokens, start, prompt, limit):
        """Books an admission the pool accepted and writes the prompt's tokens after the shared part."""
        self.dev.copy(copies)
        self.dev.write(self.pool.table(slot), start, tokens[start:])
        self.want[slot], self.prompts[slot], self.limits[slot] = tokens, prompt, limit

    @rule(data=st.data(), prompt=st.integers(1, 12), extra=st.integers(0, 12))
    def admit(self, data, prompt, extra):
        slot = self.empty_slot(data)
        if slot is None:
            return
        copies = self.try_admit(slot, prompt, prompt + extra)
        if copies is not None:
            self.admitted(slot, copies, self.tokens(prompt), 0, prompt, prompt + extra)

    @rule(data=st.data(), extra=st.integers(0, 12))
    def fork(self, data, extra):
        """The next sample of a group: the same prompt as a live slot, its pages shared."""
        slot = self.empty_slot(data)
        if slot is None or not self.want:
            return
        src = data.draw(st.sampled_from(sorted(self.want)))
        prompt = self.prompts[src]
        copies = self.try_admit(slot, prompt, prompt + extra, fork=src)
        if copies is None:
            return
        assert copies == []  # nothing is written: the prompt is already there
        self.admitted(slot, copies, self.want[src][:prompt], prompt, prompt, prompt + extra)

    @rule(data=st.data(), prompt=st.integers(1, 12), extra=st.integers(1, 8), size=st.integers(2, 4))
    def group(self, data, prompt, extra, size):
        """A GRPO group: one prompt admitted, then forked for the group's other samples while slots and pages
        last."""
        first = self.empty_slot(data)
        if first is None or self.try_admit(first, prompt, prompt + extra) is None:
            return
        self.admitted(first, [], self.tokens(prompt), 0, prompt, prompt + extra)
        for _ in range(size - 1):
            slot = self.empty_slot(data)
            if slot is None or self.try_admit(slot, prompt, prompt + extra, fork=first) is None:
                return
            self.admitted(slot, [], self.want[first], prompt, prompt, prompt + extra)

    @rule(n=st.integers(1, 9))
    def hold_prefix(self, n):
        prefix = self.pool.hold_prefix(n) if pages_for(n, self.pool.page_tokens) <= self.pool.num_pages else None
        if prefix is not None:
            tokens = self.tokens(n)
            for page in prefix.pages:
                assert self.pool.refs(page) == 1
            p = self.pool.page_tokens
            for i, tok in enumerate(tokens):  # the device prefills the prefix once
                self.dev.rows[prefix.pages[i // p]][i % p] = tok
            self.prefixes.append((prefix, tokens))

    @rule(data=st.data(), more=st.integers(0, 6), extra=st.integers(0, 8))
    def admit_after_prefix(self, data, more, extra):
        slot = self.empty_slot(data)
        if slot is None or not self.prefixes:
            return
        prefix, head = data.draw(st.sampled_from(self.prefixes))
        prompt = len(head) + more
        copies = self.try_admit(slot, prompt, prompt + extra, prefix=prefix)
        if copies is not None:
            self.admitted(slot, copies, head + self.tokens(more), len(head), prompt, prompt + extra)

    @rule(data=st.data())
    def release_prefix(self, data):
        if self.prefixes:
            i = data.draw(st.integers(0, len(self.prefixes) - 1))
            self.pool.release_prefix(self.prefixes.pop(i)[0])

    @rule(data=st.data(), n=st.integers(1, 5))
    def append(self, data, n):
        """Tokens appended to one slot: never refused within the slot's limit."""
        if self.want:
            self.grow(data.draw(st.sampled_from(sorted(self.want))), n)

    @rule(n=st.integers(1, 4))
    def decode(self, n):
        """A decode program of n steps: every live slot appends up to n tokens."""
        for slot in sorted(self.want):
            self.grow(slot, n)

    def grow(self, slot, n):
        n = min(n, self.limits[slot] - len(self.want[slot]))
        start = len(self.want[slot])
        copies = self.pool.append(slot, n)
        new = self.tokens(n)
        self.dev.copy(copies)
        self.dev.write(self.pool.table(slot), start, new)
        self.want[slot] = self.want[slot] + new

    @rule(data=st.data())
    def finish(self, data):
        if self.want:
            slot = data.draw(st.sampled_from(sorted(self.want)))
            self.pool.finish(slot)
            del self.want[slot], self.prompts[slot], self.limits[slot]

    @precondition(lambda self: hasattr(self, "pool"))
    @invariant()
    def consistent(self):
        self.pool.check()
        for slot, tokens in self.want.items():  # no live slot was ever overwritten by another
            assert self.dev.read(self.pool.table(slot), len(tokens)) == tokens, slot
            assert self.pool.length(slot) == len(tokens)
        for prefix, head in self.prefixes:  # nor a held prefix
            p = self.pool.page_tokens
            assert [self.dev.rows[prefix.pages[i // p]][i % p] for i in range(len(head))] == head

    def snapshot(self):
        return ([self.pool.table(s) for s in self.pool.live_slots()], [self.pool.refs(i) for i in
                range(self.pool.num_pages)], self.pool.free_pages)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for slot in list(self.want):
            self.pool.finish(slot)
        for prefix, _ in self.prefixes:
            self.pool.release_prefix(prefix)
        self.pool.check()
        assert self.pool.free_pages == self.pool.num_pages  # no page leaked
        assert self.pool.reserved_pages == 0


TestPoolSchedule = PoolSchedule.TestCase
TestPoolSchedule.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_full_pool_makes_admission_wait_and_never_evicts():
    """A request admitted reserves its pages to its limit: a later one that would need them waits, the live
    slot grows to its limit, and once it finishes the waiting request fits."""
    pool = PagePool(num_pages=4, page_tokens=4, slots=2)
    assert pool.admit(0, prompt_tokens=4, max_tokens=12) == []  # 1 page now, 2 reserved
    assert pool.free_pages == 3 and pool.available_pages == 1
    assert pool.admit(1, prompt_tokens=4, max_tokens=8) is None  # needs 2: waits
    assert pool.live_slots() == [0]
    assert pool.append(0, 8) == [] and len(pool.table(0)) == 3
    with pytest.raises(PageError, match=r"slot 0: 12 \+ 1 tokens exceeds its max_tokens \(12\)"):
        pool.append(0)
    pool.finish(0)
    assert pool.admit(1, prompt_tokens=4, max_tokens=8) == []
    pool.check()


def test_group_shares_prompt_pages_and_copies_the_partial_page_on_write():
    """Four samples of one 6-token prompt (pages of 4): one full page shared by all, the partial page copied
    by each writer but the last, which writes it in place."""
    pool = PagePool(num_pages=16, page_tokens=4, slots=4)
    pool.admit(0, prompt_tokens=6, max_tokens=10)
    for s in (1, 2, 3):
        assert pool.admit(s, prompt_tokens=6, max_tokens=10, fork=0) == []
    full, partial = pool.table(0)
    assert pool.refs(full) == pool.refs(partial) == 4 and pool.free_pages == 14
    copies = [pool.append(s) for s in (0, 1, 2, 3)]
    assert [len(c) for c in copies] == [1, 1, 1, 0]  # the last holder owns the page alone by then
    assert all(c[0].src == partial and c[0].tokens == 2 for c in copies[:3])
    assert pool.table(3) == [full, partial] and pool.refs(full) == 4
    assert len({pool.table(s)[1] for s in range(4)}) == 4  # each writes its own page
    pool.check()
    # Reserved exactly: the group needs 1 shared page + 4 x 2 of its own = 9 pages to reach its limits. In a
    # pool of 9 all four are admitted and grow to 10 tokens; in a pool of 8 the fourth waits.
    for pages, admitted in ((9, 4), (8, 3)):
        pool = PagePool(num_pages=pages, page_tokens=4, slots=4)
        pool.admit(0, prompt_tokens=6, max_tokens=10)
        got = [pool.admit(s, prompt_tokens=6, max_tokens=10, fork=0) for s in (1, 2, 3)]
        assert sum(c is not None for c in got) + 1 == admitted and pool.available_pages >= 0
        for s in pool.live_slots():
            pool.append(s, 4)
        pool.check()
        assert pool.free_pages == pages - (1 + 2 * admitted)


def test_prefix_shared_and_refusals():
    pool = PagePool(num_pages=8, page_tokens=4, slots=2)
    head = pool.hold_prefix(6)  # the chat template's head: 2 pages, the second half full
    copies = pool.admit(0, prompt_tokens=9, max_tokens=12, prefix=head)
    assert len(copies) == 1 and copies[0].src == head.pages[1] and copies[0].tokens == 2
    assert pool.table(0)[0] == head.pages[0] and pool.refs(head.pages[0]) == 2
    pool.release_prefix(head)
    assert pool.refs(head.pages[0]) == 1  # still the slot's
    pool.finish(0)
    assert pool.free_pages == 8
    with pytest.raises(PageError, match=r"up to 40 tokens needs 10 pages of 4 tokens; the pool has 8 pages \(32 tokens\)"):
        pool.admit(1, prompt_tokens=8, max_tokens=40)
    with pytest.raises(PageError, match="a pool of 3 pages of 16 tokens cannot hold one page per slot \\(4 slots\\)"):
        PagePool(num_pages=3, page_tokens=16, slots=4)
    with pytest.raises(PageError, match="slot 5 does not exist"):
        pool.admit(5, prompt_tokens=1, max_tokens=2)


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
    from dora_jax.rollout.pages import safe_to_grow

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
    from dora_jax.rollout.page_book import PageBook

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
        book.allocators[0].check()
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
    from dora_jax.rollout.page_book import PageBook

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
    from dora_jax.rollout.page_book import PageBook

    book = PageBook(64, 4, 1, table_width=8)
    with pytest.raises(PageError, match=r"up to 33 tokens needs 9 pages of 4 tokens; a slot's table holds 8"):
        book.admit(0, 4, 33)
    book.admit(0, 4, 32)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_page_book_tables_are_full_width_rows_of_the_allocator_tables(data):
    """After random admissions (fresh, forked from a live request, after a held head) in two batch shards,
    dispatches and releases, every state's :meth:`PageBook.tables` is int32 at the full table width and equals
    each slot's allocator table + 1 with scratch (0) after it and for an empty slot, and
    :meth:`PageBook.live_pages` is each table's length."""
    import numpy as np

    from dora_jax.rollout.page_book import PageBook, PoolFull

    width, p = 8, 4
    book = PageBook(60, p, 2, table_width=width)
    live: list = []
    heads: dict = {}

    def check():
        slots = data.draw(st.permutations(live + [None] * data.draw(st.integers(0, 3))))
        cut = data.draw(st.integers(0, len(slots)))
        states = [slots[:cut], slots[cut:]]
        for ids, table, pages in zip(states, book.tables(states), book.live_pages(states)):
            want = np.zeros((len(ids), width), np.int64)
            for b, ref in enumerate(ids):
                t = book.table(ref)
                want[b, :len(t)] = [page + 1 for page in t]
            assert table.dtype == np.int32 and table.shape == (len(ids), width)
            assert table.tolist() == want.tolist()
            assert pages.dtype == np.int32 and pages.tolist() == [len(book.table(ref)) for ref in ids]
        for alloc in book.allocators:
            alloc.check()

    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["admit", "fork", "head", "dispatch", "dispatch", "release"]))
        shard = data.draw(st.integers(0, 1))
        try:
            if op == "admit":
                prompt = data.draw(st.integers(1, width * p))
                live.append(book.admit(shard, prompt, data.draw(st.integers(prompt, width * p))))
            elif op == "fork" and live:
                src = data.draw(st.sampled_from(live))
                length = book.allocators[src[0]].length(src[1])
                if length >= p:
                    shared = p * data.draw(st.integers(1, length // p))
                    prompt = data.draw(st.integers(shared, length))
                    live.append(book.admit(src[0], prompt, data.draw(st.integers(prompt, width * p)), fork=src,
                                           fork_tokens=shared))
            elif op == "head":
                if shard not in heads:
                    held = book.hold_prefix(shard, p * data.draw(st.integers(1, 3)))
                    if held is not None:
                        heads[shard] = held
                if shard in heads:
                    prompt = data.draw(st.integers(heads[shard].tokens, width * p))
                    live.append(book.admit(shard, prompt, data.draw(st.integers(prompt, width * p)),
                                           prefix=heads[shard]))
            elif op == "dispatch" and live:
                ids = data.draw(st.permutations(live))
                book.dispatch([ids], [[data.draw(st.integers(0, 9)) for _ in ids]])
            elif op == "release" and live:
                ref = data.draw(st.sampled_from(live))
                live.remove(ref)
                book.release(ref)
        except PoolFull:
            pass
        check()
    for ref in live:
        book.release(ref)
    live.clear()
    book.release_prefixes(heads)
    check()
    assert book.held_pages == 0
