"""The engine's paged KV cache: pages follow live tokens, a GRPO group shares its prompt's pages, a full pool makes
admission wait without touching live samples, bad sizes are refused, and per-shard paging computes what one
pool does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from dora_jax.config import ConfigError, ModelConfig, RolloutConfig
from dora_jax.models.build import init_model
from dora_jax.kernels.paged_attention import live_block_pages
from dora_jax.models.paged import sharded_live_attention, sharded_live_plan, write_pages
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from dora_jax.rollout.pages import pages_for
from dora_jax.rollout.samples import Request
from engine_helpers import prefill_one, step_rows

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3)
P = 8  # tokens per page


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _engine(model, slots=8, num_pages=None, target=96):
    return Engine(model, max_concurrent_decodes=slots, max_prefill_length=min(48, target - 1), max_target_length=target,
                  page_tokens=P, num_pages=num_pages)


def _steps(engine, state, n):
    out = []
    for _ in range(n):
        state, rows = step_rows(engine, None, state)
        out.append(rows)
    return state, np.stack(out)


def test_group_shares_prompt_pages_and_decodes_as_alone(model):
    """Four samples of a 20-token prompt (2 full pages and 4 tokens) and one other prompt, inserted together:
    the group holds its 2 full pages once and each sample its own partial page; decoding crosses page
    boundaries and gives each sample the tokens and log-probs it gets inserted alone into its own pages.
    Freeing every slot returns every page."""
    prompt, other = tuple(range(1, 21)), (7, 8, 9)
    prompts = [prompt] * 4 + [other]
    samplings = [RequestSampling(temperature=1.0, seed=5)] * 5
    ids = [10, 11, 12, 13, 14]
    limits = [len(p) + 24 for p in prompts]
    eng = _engine(model)
    batch, _ = eng.prefill_batch(prompts=prompts, sample_ids=ids, samplings=samplings)
    state = eng.insert_batch(batch, eng.init_decode_state(8), [0, 1, 2, 3, 4], limits)
    assert eng.pages_held == 2 + 4 * 1 + pages_for(len(other), P)
    assert eng.book.free_pages == eng.num_pages - eng.pages_held  # nothing reserved: taken as they grow
    state, grouped = _steps(eng, state, 20)

    alone = _engine(model)
    single = alone.init_decode_state(8)
    for slot, (p, i) in enumerate(zip(prompts, ids)):
        batch, _ = prefill_one(alone, p, sample_id=i, sampling=samplings[0])
        single = alone.insert_batch(batch, single, [slot])
    assert alone.pages_held == 4 * 3 + 1  # 20 tokens: 3 pages each, nothing shared
    single, separate = _steps(alone, single, 20)
    assert (grouped[:, :5, 1] == 1).all() and (grouped[:, 5:, 1] == 0).all()
    np.testing.assert_array_equal(grouped[..., [0, 2, 4]], separate[..., [0, 2, 4]])
    np.testing.assert_allclose(grouped[..., 3].view(np.float32), separate[..., 3].view(np.float32), rtol=1e-5,
                               atol=1e-6)
    assert len(np.unique(grouped[:, :4, 0])) > 4  # the samples drew their own tokens
    # 20 steps after 20 prompt tokens: positions up to 39 written, 5 pages per sample, 2 of them shared.
    assert eng.pages_held == 2 + 4 * 3 + pages_for(len(other) + 20, P)
    for slot in range(5):
        state = eng.free_slots(state, [slot])
    assert eng.pages_held == 0 and eng.book.free_pages == eng.num_pages


def test_dropped_state_returns_its_pages(model):
    import gc

    eng = _engine(model)
    batch, _ = prefill_one(eng, range(1, 12))
    state = eng.insert_batch(batch, eng.init_decode_state(), [0])
    assert eng.pages_held == 2
    del state
    gc.collect()
    assert eng.pages_held == 0 and eng.book.free_pages == eng.num_pages
    with pytest.raises(EngineError, match="decode state this engine does not know"):
        step_rows(eng, None, _engine(model).init_decode_state())


def test_a_short_pool_makes_requests_and_slots_wait_never_evicts(model):
    """Six requests of up to 24 tokens (3 pages each) on four slots, through pools of 4, 6 and 12 pages: the
    driver admits a request only while every live one could still reach its limit, a slot the pool cannot
    serve waits for pages, nothing is evicted, and every trajectory is the one the roomy pool gives (no live
    sample overwritten). The shortest pool holds admission back, the middle one makes slots wait (with 4 decode
    steps per program and with 1), the roomy one neither."""
    requests = [Request(i, tuple(range(1 + i, 6 + i)), max_new_tokens=19, sampling=RequestSampling(temperature=0.0))
                for i in range(6)]

    def run(num_pages, steps=4):
        eng = _engine(model, slots=4, num_pages=num_pages, target=32)
        d = RolloutDriver(eng, decode_steps=steps)
        d.add_version(0, eng.params)
        for r in requests:
            d.submit(r)
        out, most = [], 0
        while not d.idle:
            out += d.step()
            most = max(most, d.live_rows)
            assert eng.pages_held <= eng.num_pages
        assert eng.pages_held == 0
        return {t.sample_id: t for t in out}, most, d.stats.page_waits

    roomy, most_roomy, waits_roomy = run(12)
    assert (most_roomy, waits_roomy) == (4, 0)
    for pages, steps in ((4, 4), (6, 4), (6, 1)):  # one step per program: a waiting row reports nothing
        got, most, waits = run(pages, steps)
        assert sorted(got) == list(range(6))
        for i in range(6):
            assert got[i].tokens == roomy[i].tokens and len(got[i].tokens) == 19
            np.testing.assert_allclose(got[i].logprobs, roomy[i].logprobs, rtol=1e-5, atol=1e-6)
        if pages == 4:
            assert most < 4, most  # 4 pages: a third request of 1 page now and 2 later is not safe
        else:
            assert most == 4 and waits > 0, (most, waits)  # all admitted; growth outruns the pool


def test_sizes_that_cannot_work_are_refused(model):
    with pytest.raises(EngineError, match="cannot hold one page per slot"):
        _engine(model, slots=4, num_pages=3)
    eng = _engine(model, slots=2, num_pages=4, target=64)
    d = RolloutDriver(eng)
    d.add_version(0, eng.params)
    with pytest.raises(EngineError, match=r"need 5 pages of 8 tokens; the page pool holds 4"):
        d.submit(Request(0, (1, 2, 3), max_new_tokens=34))
    batch, _ = prefill_one(eng, (1, 2, 3))
    with pytest.raises(EngineError, match="needs 8 pages of 8 tokens; the pool has 4 pages"):
        eng.insert_batch(batch, eng.init_decode_state(), [0])  # no limit: max_target_length
    assert eng.pages_held == 0
    with pytest.raises(ConfigError, match="rollout.kv_pages.*one page per slot"):
        RolloutConfig(slots=16, kv_pages=8).validate()
    with pytest.raises(ConfigError, match="rollout.kv_pages.*needs 12 pages of 16 tokens"):
        RolloutConfig(slots=4, max_prompt_len=128, max_new_tokens=64, kv_pages=8).validate()


def test_per_shard_paging_is_one_pool_split():
    """Slots and pages split over 2 shards (tables within each shard) compute what one pool with pool-wide
    page ids does: attention, and the write of each slot's token; rows of a shard never touch the other's."""
    rng = np.random.default_rng(0)
    k_heads, g, d, n_shard, b, w = 2, 3, 8, 6, 4, 3
    pool = [jnp.asarray(rng.normal(size=(k_heads, 1, 2 * n_shard, P, d)), jnp.float32) for _ in range(2)]
    local = np.array([[1, 2, 0], [3, 0, 0], [2, 4, 5], [1, 0, 0]], np.int32)  # rows 0, 1: shard 0; 2, 3: shard 1
    shard_of = np.array([0, 0, 1, 1])
    glob = local + (shard_of * n_shard)[:, None]
    lengths = jnp.asarray([13, 5, 20, 1], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, k_heads * g, d)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, k_heads, d)), jnp.float32) for _ in range(2))
    want = _float64_attention(q, np.asarray(pool[0]), np.asarray(pool[1]), 0, glob, lengths, k_new, v_new)

    def sharded(shards):  # the decode step's attention: each shard's slots planned and read apart
        plan = sharded_live_plan(jnp.asarray(local), lengths, P, shards)
        return sharded_live_attention(q, pool[0], pool[1], jnp.int32(0), plan, k_new, v_new, shards=shards,
                                      block_pages=live_block_pages(w, P, b // shards))

    got = sharded(2)
    assert rel_err(got, want) <= 1e-5
    wrong = sharded(1)
    assert rel_err(wrong, want) > 0.1  # local ids read as pool-wide ones: the check can fail
    from dora_jax.models.paged import PagedKV

    page = jnp.asarray(local[np.arange(b), np.asarray(lengths) // P])
    row = lengths % P
    kv = PagedKV(*pool)
    new = (k_new[None], v_new[None])
    a = write_pages(kv, *new, page + jnp.asarray(shard_of * n_shard), row)
    c = write_pages(kv, *new, page, row, shards=2)
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(c.k))
    np.testing.assert_array_equal(np.asarray(a.v), np.asarray(c.v))
    assert not np.array_equal(np.asarray(a.k), np.asarray(kv.k))


HEAD = tuple(range(60, 80))  # a template head of 20 tokens: 2 full pages of 8 and 4 tokens


def _unshared(batch):
    """The batch as if prefilled with no shared prefix: each request writes the head into pages of its own."""
    return batch._replace(host=batch.host[:2] + (None,))


def _same_decode(got, want):
    np.testing.assert_array_equal(got[..., [0, 1, 2, 4]], want[..., [0, 1, 2, 4]])
    np.testing.assert_array_equal(got[..., 3], want[..., 3])  # log-probs: the same computation, bit for bit


def test_prompts_after_a_shared_head_share_its_full_pages(model):
    """Prompts after a 20-token head, inserted in two batches and one alone: the head's 2 full pages are held once for every slot, each slot writes the head's last 4
    tokens and its own into pages of its own, and decoding gives the tokens and log-probs of the same requests
    inserted into an engine that shares nothing. Dropping the prefix while slots read its pages frees nothing;
    freeing the slots then returns every page."""
    import gc

    samplings = [RequestSampling(temperature=1.0, seed=3)] * 3
    tails = [(30, 31, 32), tuple(range(40, 47)), (50,)]
    eng, alone = _engine(model), _engine(model)
    shared = eng.prefill_shared_prefix(tokens=HEAD)
    batch, _ = eng.prefill_batch(prompts=[HEAD + t for t in tails], sample_ids=[1, 2, 3], samplings=samplings,
                                 shared_prefix=shared)
    later, _ = eng.prefill_batch(prompts=[HEAD + (9, 8)], sample_ids=[4], samplings=samplings[:1],
                                 shared_prefix=shared)
    single, _ = prefill_one(eng, HEAD + (5, 6, 7), sample_id=5, sampling=samplings[0], shared_prefix=shared)
    limits = [len(HEAD) + len(t) + 16 for t in tails]
    state = eng.insert_batch(batch, eng.init_decode_state(8), [0, 1, 2], limits)
    assert eng.pages_held == 2 + 1 + 2 + 1  # 23, 27 and 21 tokens: 3, 4 and 3 pages, the head's first 2 shared
    state = eng.insert_batch(later, state, [3], [40])
    state = eng.insert_batch(single, state, [4])
    assert eng.pages_held == 2 + 1 + 2 + 1 + 1 + 1
    ref = alone.insert_batch(_unshared(batch), alone.init_decode_state(8), [0, 1, 2], limits)
    ref = alone.insert_batch(_unshared(later), ref, [3], [40])
    ref = alone.insert_batch(_unshared(single), ref, [4])
    assert alone.pages_held == 3 + 4 + 3 + 3 + 3
    state, got = _steps(eng, state, 14)
    ref, want = _steps(alone, ref, 14)
    _same_decode(got, want)
    held = eng.pages_held
    del shared, batch, later, single
    gc.collect()
    assert eng.pages_held == held  # the slots still read the head's pages
    for slot in range(5):
        state = eng.free_slots(state, [slot])
    assert eng.pages_held == 0 and eng.book.free_pages == eng.num_pages


def test_a_group_after_a_shared_head_shares_the_head_and_its_own_full_pages(model):
    """A group of 4 samples of a 33-token prompt after the 20-token head, and one other prompt after it: the
    head's 2 full pages are held once, the group's next 2 full pages once more, each sample writes its partial
    last page; decoding matches an engine sharing only the group's pages. The head's pages go back when the
    prefix is dropped after its slots are freed. Zeroing the head's entries before insertion changes the
    log-probs: the comparison sees what the head's pages hold."""
    import gc

    prompt, other = HEAD + tuple(range(30, 43)), HEAD + (5, 6)
    prompts = [prompt] * 4 + [other]
    samplings = [RequestSampling(temperature=1.0, seed=11)] * 5
    limits = [len(p) + 16 for p in prompts]
    eng, alone = _engine(model), _engine(model)
    shared = eng.prefill_shared_prefix(tokens=HEAD)
    batch, _ = eng.prefill_batch(prompts=prompts, sample_ids=[20, 21, 22, 23, 24], samplings=samplings,
                                 shared_prefix=shared)
    state = eng.insert_batch(batch, eng.init_decode_state(8), [0, 1, 2, 3, 4], limits)
    assert eng.pages_held == 2 + 2 + 4 * 1 + 1
    tables = [eng.page_table(state, slot) for slot in range(5)]
    assert all(t[:4] == tables[0][:4] for t in tables[:4]) and tables[4][:2] == tables[0][:2]
    assert len({t[4] for t in tables[:4]} | {tables[4][2]}) == 5  # partial last pages: each its own
    ref = alone.insert_batch(_unshared(batch), alone.init_decode_state(8), [0, 1, 2, 3, 4], limits)
    assert alone.pages_held == 4 + 4 * 1 + 3
    state, got = _steps(eng, state, 12)
    ref, want = _steps(alone, ref, 12)
    _same_decode(got, want)
    for slot in range(5):
        state = eng.free_slots(state, [slot])
    assert eng.pages_held == 2  # held for the prefix's next requests
    del shared, batch
    gc.collect()
    assert eng.pages_held == 0 and eng.book.free_pages == eng.num_pages

    shared = eng.prefill_shared_prefix(tokens=HEAD)
    batch, _ = eng.prefill_batch(prompts=prompts, sample_ids=[20, 21, 22, 23, 24], samplings=samplings,
                                 shared_prefix=shared)
    k, v = batch.cache
    batch = batch._replace(cache=type(batch.cache)(k.at[..., :16].set(0), v.at[:, :, :, :16].set(0)))
    state = eng.insert_batch(batch, state, [0, 1, 2, 3, 4], limits)
    state, broken = _steps(eng, state, 12)
    assert not np.array_equal(broken[..., 3], want[..., 3])


def test_a_head_is_held_only_where_the_requests_after_it_still_fit():
    """Holding a head's pages takes them from every request's end: a 4-page pool refuses to hold 2 of them
    before a 3-page prompt growing to 4 (alone it fits), and changes nothing; an 8-page pool holds them, the
    request shares them, and the pool gets them back once both let go."""
    from dora_jax.rollout.page_book import PageBook

    short = PageBook(4, P, 1, 4)
    assert short.hold_prefix(0, 16, [(21, 32)]) is None and short.free_pages == 4
    assert short.admissible([(21, 32)]) == [0]
    book = PageBook(8, P, 1, 4)
    held = book.hold_prefix(0, 16, [(21, 32)])
    ref = book.admit(0, 21, 32, prefix=held)
    assert book.held_pages == 2 + 1 and book.table(ref)[:2] == list(held.pages)
    book.release_prefixes(holds := {0: held})
    assert not holds and book.held_pages == 3  # the request still reads them
    book.release(ref)
    assert book.held_pages == 0


def _float64_attention(q, k_pool, v_pool, layer, tables, lengths, k_new, v_new):
    """One query per row over its cached tokens (through its table) and its own new key and value, in float64
    numpy: the oracle of the live-reading path."""
    q, k_pool, v_pool, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool, k_new, v_new))
    b, h, d = q.shape
    kv, p = k_pool.shape[0], k_pool.shape[3]
    out = np.zeros((b, h, d))
    for r in range(b):
        n = int(lengths[r])
        pages = [tables[r][i // p] for i in range(n)]
        for head in range(h):
            kh = head // (h // kv)
            keys = [k_pool[kh, layer, pages[i], i % p] for i in range(n)] + [k_new[r, kh]]
            values = [v_pool[kh, layer, pages[i], i % p] for i in range(n)] + [v_new[r, kh]]
            s = np.array([q[r, head] @ key for key in keys]) / np.sqrt(d)
            e = np.exp(s - s.max())
            out[r, head] = (e / e.sum()) @ np.array(values)
    return out


@pytest.mark.parametrize("slots, width, page, kv, g", [(5, 6, 4, 2, 3), (32, 20, 4, 1, 2), (3, 1, 16, 2, 1),
                                                       (17, 40, 2, 2, 2), (128, 24, 8, 1, 2)])
def test_live_attention_reads_live_blocks_and_equals_float64(slots, width, page, kv, g):
    """The XLA decode path that reads only each length class's live page blocks equals a float64 softmax over
    each row's tokens (rows of length 0, rows longer than one block, slots not a multiple of the classes, tiles
    of one class in one group of a trip), and its host count of tokens read is the blocks its loop ran."""
    from dora_jax.kernels.paged_attention import (live_group_trips, live_paged_attention, live_plan,
                                                  live_read_tokens)

    rng = np.random.default_rng(slots)
    d, layers, n = 8, 3, slots * width + 1
    k_pool, v_pool = (rng.normal(size=(kv, layers, n, page, d)).astype(np.float32) for _ in range(2))
    lengths = rng.integers(0, width * page + 1, slots)
    lengths[0] = 0
    tables = np.zeros((slots, width), np.int32)
    free = iter(rng.permutation(np.arange(1, n)))
    for r in range(slots):
        for i in range(-(-lengths[r] // page)):
            tables[r, i] = next(free)
    q = rng.normal(size=(slots, kv * g, d)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(slots, kv, d)).astype(np.float32) for _ in range(2))
    plan = live_plan(jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), page)
    bp = live_block_pages(width, page, slots)
    for layer in range(layers):
        got = live_paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(layer), plan,
                                   jnp.asarray(k_new), jnp.asarray(v_new), block_pages=bp)
        want = _float64_attention(q, k_pool, v_pool, layer, tables, lengths, k_new, v_new)
        assert rel_err(got, want) <= 1e-5
    rows, tiles = plan.lengths.shape[1], int(plan.tiles)
    assert live_read_tokens(lengths, width, page) == tiles * rows * bp * page >= lengths.sum()
    assert live_group_trips(lengths, width, page) == [tiles // 16, tiles % 16 // 4, tiles % 4]
    # Sorted into classes, 256 slots with a long tail read a fraction of what every slot read to the widest
    # would (about 6x their live tokens); unsorted classes would read near that.
    tail = 256 + rng.integers(128, 384, 256) + rng.integers(1, 4096, 256) * (rng.random(256) < 0.08)
    assert live_read_tokens(tail, 272, 16) < 1.4 * tail.sum() < 0.3 * 256 * tail.max()


def test_live_attention_trips_counted_on_the_host_are_the_device_loops_trips(monkeypatch):
    """Two batch shards of 8 slots needing 16 and 3 tiles: their vmapped loops take one trip of 16 (for the
    first) and three of 1 (for the second), 4 in all, not the 3 of the longer shard alone, and on each trip both
    shards read the trip's tiles: 38 tiles, not the 19 the shards need. The device's trips are counted by a
    callback in every loop body; the host count (``attention_step_reads``) must equal
    them."""
    from dora_jax.kernels import paged_attention as pa
    from dora_jax.models.paged import attention_step_reads

    trips, loops = [], []
    while_loop = jax.lax.while_loop

    def counted(cond, body, init):
        n = pa.LIVE_TILE_GROUPS[len(loops)]  # the loops are traced in the order of their group sizes
        loops.append(n)

        def each(carry):
            jax.debug.callback(lambda: trips.append(n))
            return body(carry)
        return while_loop(cond, each, init)

    monkeypatch.setattr(pa.jax.lax, "while_loop", counted)
    w, page, d, kv, g = 128, 16, 8, 1, 2
    lengths = np.array([2048] * 8 + [512] * 6 + [0] * 2)  # 4 classes x 4 blocks; 3 classes x 1 block
    rng = np.random.default_rng(0)
    n = 8 * w + 1
    k_pool, v_pool = (jnp.asarray(rng.normal(size=(kv, 1, 2 * n, page, d)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(np.tile(1 + np.arange(w, dtype=np.int32), (16, 1)))  # within each shard's pages
    q = jnp.asarray(rng.normal(size=(16, kv * g, d)), jnp.float32)
    k_new = v_new = jnp.asarray(rng.normal(size=(16, kv, d)), jnp.float32)
    plan = sharded_live_plan(tables, jnp.asarray(lengths, jnp.int32), page, 2)
    jax.block_until_ready(sharded_live_attention(q, k_pool, v_pool, jnp.int32(0), plan, k_new, v_new, shards=2,
                                                 block_pages=live_block_pages(w, page, 8)))
    jax.effects_barrier()
    tile_tokens = plan.lengths.shape[-1] * live_block_pages(w, page, 8) * page
    read, by_loop = attention_step_reads("xla", np.split(lengths, 2), w, page, d)
    assert sum(by_loop) == len(trips) == 4 and attention_step_reads("pallas_gpu", np.split(lengths, 2), w, page,
                                                                     16, interpret=True)[1] == []
    assert sorted(trips) == [1, 1, 1, 16] and by_loop == [1, 0, 3]
    assert read == 2 * sum(trips) * tile_tokens == 38 * tile_tokens


def test_batch_shards_on_devices_of_their_own_loop_apart(monkeypatch):
    """The two shards of the test above on a mesh whose batch axis makes them (the engine's case): each device
    loops over its own shard's tiles only (one trip of 16 on the first, three of 1 on the second, counted by a
    callback per device), with no collective in the loops' conditions, reading the 19 tiles the shards need;
    the output is the side-by-side path's. The host counts (``attention_step_reads`` apart) say the same."""
    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.kernels import paged_attention as pa
    from dora_jax.models.paged import attention_step_reads, shards_apart
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(MeshConfig(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    assert shards_apart(mesh, DEFAULT_RULES, 2) and not shards_apart(mesh, DEFAULT_RULES, 4)
    w, page, d, kv, g = 128, 16, 8, 1, 2
    lengths = np.array([2048] * 8 + [512] * 6 + [0] * 2)
    rng = np.random.default_rng(0)
    n = 8 * w + 1
    k_pool, v_pool = (jnp.asarray(rng.normal(size=(kv, 1, 2 * n, page, d)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(np.tile(1 + np.arange(w, dtype=np.int32), (16, 1)))
    q = jnp.asarray(rng.normal(size=(16, kv * g, d)), jnp.float32)
    k_new = v_new = jnp.asarray(rng.normal(size=(16, kv, d)), jnp.float32)
    plan = sharded_live_plan(tables, jnp.asarray(lengths, jnp.int32), page, 2)
    bp = live_block_pages(w, page, 8)
    side = sharded_live_attention(q, k_pool, v_pool, jnp.int32(0), plan, k_new, v_new, shards=2, block_pages=bp)

    trips, loops = [], []
    while_loop = jax.lax.while_loop

    def counted(cond, body, init):
        size = pa.LIVE_TILE_GROUPS[len(loops) % 3]
        loops.append(size)

        def each(carry):
            jax.debug.callback(lambda i: trips.append((int(i), size)), jax.lax.axis_index("data"))
            return body(carry)
        return while_loop(cond, each, init)

    monkeypatch.setattr(pa.jax.lax, "while_loop", counted)
    attend = jax.jit(lambda *a: sharded_live_attention(*a, shards=2, block_pages=bp, mesh_rules=(mesh, DEFAULT_RULES)))
    apart = attend(q, k_pool, v_pool, jnp.int32(0), plan, k_new, v_new)
    jax.effects_barrier()
    assert sorted(trips) == [(0, 16), (1, 1), (1, 1), (1, 1)]
    assert rel_err(apart, side) <= 1e-6
    hlo = attend.lower(q, k_pool, v_pool, jnp.int32(0), plan, k_new, v_new).compile().as_text()
    assert "all-reduce" not in hlo
    tile_tokens = plan.lengths.shape[-1] * bp * page
    read, by_loop = attention_step_reads("xla", np.split(lengths, 2), w, page, d, apart=True)
    assert read == 19 * tile_tokens and by_loop == [0, 0, 3]


def test_live_attention_trips_are_tile_groups():
    """128 slots in 16 classes of 8 rows, class c holding rows of (c + 1) blocks of 128 tokens: 136 tiles that
    read exactly the live tokens, in 8 trips of 16 tiles and 2 of 4 (a loop trip per tile would be 136)."""
    from dora_jax.kernels.paged_attention import live_group_trips, live_read_tokens

    lengths = np.repeat(128 * np.arange(1, 17), 8)
    assert live_read_tokens(lengths, 272, 16) == lengths.sum() == 136 * 8 * 128
    assert live_group_trips(lengths, 272, 16) == [8, 2, 0]
    assert live_group_trips(lengths[:8], 272, 16) == [0, 1, 0]  # 8 rows of 128: 4 classes of 2, a block each
