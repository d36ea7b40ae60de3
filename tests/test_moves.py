"""Live requests moving between rollout drivers of one process with their KV pages (no prefill again): a request
decoded partway in one group and finished in another, on other devices, gives the tokens it gives unmoved;
:class:`VersionGroups` performs a plan's moves, and a move that does not fit its destination's slots or pages waits.
A dora run at one version per group, which moves requests when a group is busy at a publish, is in
test_version_groups.py."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from engine_helpers import GREEDY, make_engine, make_requests
from dora_jax.dora.balancer import Balancer, GroupState, Move, Plan
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.groups import VersionGroups
from dora_jax.sharding import MESH_AXES

SAMPLED = RequestSampling(temperature=1.0, seed=3)


def engine_on(model, device: int, **serving):
    """The tests' engine shape on one device of its own (a mesh of one device)."""
    mesh = Mesh(np.array([jax.devices()[device]]).reshape(1, 1, 1), MESH_AXES)
    return make_engine(model, slots=4, mesh=mesh, **serving)


@pytest.fixture(scope="module")
def engines(models):
    """Two engines of version 0's model, each on its own device."""
    return engine_on(models[0], 1), engine_on(models[0], 2)


def requests():
    """Three greedy and three sampled requests that outlast a decode program of 8 steps (no eos)."""
    reqs = make_requests(6, seed=21, sampling=GREEDY)
    return [dataclasses.replace(r, max_new_tokens=20 + i, sampling=GREEDY if i % 2 else SAMPLED)
            for i, r in enumerate(reqs)]


def driver(engine, weights, version=0):
    d = RolloutDriver(engine, overlap=False)
    d.add_version(version, weights)
    return d


def assert_close(got, want):
    assert got.tokens == want.tokens, (got.sample_id, got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    assert got.finish_reason == want.finish_reason


def test_a_request_moved_partway_finishes_with_the_tokens_it_gives_unmoved(engines, models):
    """Greedy and sampled requests decoded one program in driver A, moved (the three lowest sample ids, their KV
    pages copied device to device) to driver B on another device, and finished there: the tokens of the same
    requests decoded unmoved, log-probs within 1e-5; no prompt is prefilled again and B's pages hold the moved
    rows' written tokens."""
    weights = nnx.state(models[0])
    reqs = requests()
    want = {t.sample_id: t for t in driver(engines[0], weights).run(reqs)}
    a, b = driver(engines[0], weights), driver(engines[1], weights)
    for r in reqs:
        a.submit(r)
    out = a.step()
    assert not out and a.live_rows == 4  # four admitted and one program run; two still wait
    # The prompt, the first token and 8 decoded ones are in the cache but the last, the next to feed.
    assert a.take_sizes(0, 2)[0][0] == len(reqs[0].prompt_ids) + 1 + 8 - 1
    out += a.read_in_flight()
    sizes = a.take_sizes(0, 3)
    assert b.fits(0, 3, sizes) and len(sizes) == 3
    held = engines[1].pages_held
    moving = a.take(0, 3)
    assert moving.sample_ids == [0, 1, 2] and moving.count == 3 and a.live_rows == 1
    assert moving.kv_bytes == sum(-(-w // 16) for w, *_ in sizes) * 16 * engines[0].token_bytes
    b.put(moving)
    assert engines[1].pages_held - held == sum(-(-w // 16) for w, *_ in sizes) and b.live_rows == 3
    out += a.run() + b.run()
    assert sorted(t.sample_id for t in out) == list(range(6))
    for t in out:
        assert_close(t, want[t.sample_id])
    assert a.stats.prefill_rows + b.stats.prefill_rows == len({r.prompt_ids for r in reqs})
    assert b.stats.prefill_rows == 0
    for e in engines:
        e.book.check()


def one_prompt_four_samples(engines, models):
    """Four sampled requests of one 32-token prompt (two full pages), the trajectories each gives unmoved, and a
    fresh driver on each engine."""
    from dora_jax.rollout.samples import Request

    weights = nnx.state(models[0])
    reqs = [Request(i, tuple(range(1, 33)), max_new_tokens=20, sampling=SAMPLED) for i in range(4)]
    want = {t.sample_id: t for t in driver(engines[0], weights).run(reqs)}
    return reqs, want, driver(engines[0], weights), driver(engines[1], weights)


def decoded_partway(a, reqs):
    """The four samples of :func:`one_prompt_four_samples` run one program in driver ``a``: what finished, and
    the sizes of the four to move (40 tokens written each, growing to 52)."""
    for r in reqs:
        a.submit(r)
    out = a.step() + a.read_in_flight()
    sizes = a.take_sizes(0, 4)
    assert [(w, limit) for w, limit, _ in sizes] == [(40, 52)] * 4
    return out, sizes


def assert_all_finished_unmoved(out, want, engines):
    assert sorted(t.sample_id for t in out) == sorted(want)
    for t in out:
        assert_close(t, want[t.sample_id])
    for e in engines:
        e.book.check()


def test_rows_sharing_prompt_pages_move_them_once_and_share_them_again(engines, models):
    """Four samples of one prompt of two full pages share those pages in driver A; moved together to driver B,
    the shared pages are copied once and shared again there (B takes each distinct page once), and every sample
    finishes with the tokens it gives unmoved."""
    reqs, want, a, b = one_prompt_four_samples(engines, models)
    held = engines[0].pages_held, engines[1].pages_held
    for r in reqs:
        a.submit(r)
    out = a.step()
    out += a.read_in_flight()
    sizes = a.take_sizes(0, 4)
    per_row = sum(-(-w // 16) for w, *_ in sizes)
    distinct = 2 + sum(-(-w // 16) - 2 for w, *_ in sizes)  # the prompt's two pages once, then each row's own
    assert engines[0].pages_held - held[0] == distinct < per_row
    moving = a.take(0, 4)
    assert moving.kv_bytes == distinct * 16 * engines[0].token_bytes
    b.put(moving)
    assert engines[1].pages_held - held[1] == distinct and b.live_rows == 4
    out += a.run() + b.run()
    assert_all_finished_unmoved(out, want, engines)


def test_a_move_fits_where_only_its_shared_pages_counted_once_fit(engines, models):
    """Four samples of one 32-token prompt, 40 tokens written and growing to 52 (4 pages of 16 each), move to a
    driver whose engine has 10 free pages: counted apart they would take 12 now and could need 16, so the old
    check refuses them; sharing the prompt's two pages, they take 6 and need at most 10, which fits. The move is
    performed as checked, and every sample finishes with the tokens it gives unmoved."""
    reqs, want, a, b = one_prompt_four_samples(engines, models)
    book = engines[1].book
    held = {0: book.hold_prefix(0, 16 * (book.shard_free(0) - 10))}  # 10 pages left free
    try:
        out, sizes = decoded_partway(a, reqs)
        assert len({h[:2] for *_, h in sizes}) == 1  # one prompt's two pages
        assert engines[1].admissible([s[:2] for s in sizes]) is None  # as if nothing were shared
        assert b.fits(0, 4, sizes) and engines[1].admissible_moved(sizes) == [0] * 4
        assert not b.fits(0, 4, [(w, limit, (i,)) for i, (w, limit, _) in enumerate(sizes)])  # nothing in common
        b.put(a.take(0, 4))
        assert book.shard_free(0) == 10 - 6
        out += a.run() + b.run()
    finally:
        book.release_prefixes(held)
    assert_all_finished_unmoved(out, want, engines)


def test_a_move_across_batch_shards_counts_the_pages_it_shares_in_each_shard_once(engines, models):
    """The four samples of one prompt moved to an engine whose 4 slots split over 2 batch shards (2 devices),
    with 6 free pages in each shard: two land in each shard (the one with most room, as put places them), where
    counted apart they take 6 pages now and could need 8, but sharing the prompt's two pages they take 4 and
    need at most 6: the check, made in the shards put uses, lets them in. Each shard then has 2 pages left, and
    every sample finishes with the tokens it gives unmoved."""
    mesh = Mesh(np.array(jax.devices()[3:5]).reshape(2, 1, 1), MESH_AXES)
    two = make_engine(models[0], slots=4, mesh=mesh)
    assert two.shards == 2
    reqs, want, a, _ = one_prompt_four_samples(engines, models)
    b = driver(two, nnx.state(models[0]))
    book = two.book
    held = {k: book.hold_prefix(k, 16 * (book.shard_free(k) - 6)) for k in (0, 1)}
    try:
        out, sizes = decoded_partway(a, reqs)
        assert two.admissible([s[:2] for s in sizes]) is None  # as if nothing were shared
        assert two.admissible_moved(sizes) is None  # nor without the shards put will use
        assert b.fits(0, 4, sizes)
        b.put(a.take(0, 4))
        assert [book.shard_free(k) for k in (0, 1)] == [2, 2]
        out += a.run() + b.run()
    finally:
        book.release_prefixes(held)
    assert_all_finished_unmoved(out, want, (engines[0], two))


def test_version_groups_move_a_busy_group_or_wait_when_the_move_does_not_fit(engines, models):
    """Two groups of version 0, each on its own device. A move into a group without the free slots waits: its
    source keeps its version and drains, nothing is evicted or lost. Later the balancer, told the requests fit
    (``VersionGroups.movable``), moves a busy group's requests (lowest sample ids) to the other group and gives
    the emptied group version 1 at once. Every trajectory is the one a driver holding its version gives unmoved,
    and no prompt is prefilled twice."""
    weights = {0: nnx.state(models[0]), 1: nnx.state(models[1])}
    reqs = requests() + [dataclasses.replace(r, sample_id=r.sample_id + 6) for r in requests()[:4]]
    later = [dataclasses.replace(r, sample_id=10 + i, version=1) for i, r in enumerate(requests()[:2])]
    want = {t.sample_id: t for t in driver(engines[0], weights[0]).run(reqs)}
    want.update({t.sample_id: t for t in driver(engines[0], weights[1], 1).run(later)})
    groups = VersionGroups([RolloutDriver(e, overlap=False) for e in engines])
    groups.apply(Plan((0, 0), (), (), (), "start"), lambda g, v: weights[v])
    for r in reqs[:6]:
        groups.submit(r)
    out = groups.step()
    assert [groups.group_in_flight(i) for i in (0, 1)] == [3, 3] and groups.movable() == [False, False]
    assert groups.apply(Plan((1, 0), (), (Move(0, 1, 0, 3),), (), "move"), lambda g, v: weights[v]) == []
    assert groups.serving == [0, 0] and groups.draining == {0} and groups.move_waits == 1
    assert groups.moved_requests == 0 and [groups.group_in_flight(i) for i in (0, 1)] == [3, 3]
    out += groups.run()
    groups.apply(Plan((0, 0), (), (), (), "stop draining"), lambda g, v: weights[v])
    for r in reqs[6:]:
        groups.submit(r)
    out += groups.step()
    assert [groups.group_in_flight(i) for i in (0, 1)] == [2, 2] and groups.movable() == [True, True]
    plan = Balancer(2, max_live=2).plan(groups.states(), {1: 2}, 1, can_move=groups.movable())
    assert plan.moves == (Move(0, 1, 0, 2),) and plan.versions == (1, 0) and not plan.drain
    assert groups.apply(plan, lambda g, v: weights[v]) == [0] and groups.serving == [1, 0]
    assert groups.moved_requests == 2 and groups.moved_kv_bytes > 0 and groups.draining == set()
    assert [groups.group_in_flight(i) for i in (0, 1)] == [0, 4] and groups.stats.max_held == 1
    out += groups.run(later)
    assert sorted(t.sample_id for t in out) == list(range(12))
    for t in out:
        assert t.version == want[t.sample_id].version
        assert_close(t, want[t.sample_id])
    # The prompts of each admission are distinct: each request was prefilled once, and the moves added none.
    assert sum(d.stats.prefill_rows for d in groups.drivers) == len(reqs + later)
    for e in engines:
        e.book.check()


def test_a_move_waits_for_pages(models):
    """A driver takes moved requests only where its pool has the pages for what they have written while every
    request could still reach its limit: a pool of 4 pages of 16 tokens takes one request of 60 written tokens,
    not two (a host check: nothing is compiled). A per-group ``can_move`` drains the group that may not move."""
    d = RolloutDriver(Engine(models[0], max_concurrent_decodes=4, max_prefill_length=32, max_target_length=64,
                             num_pages=4), overlap=False)
    assert d.fits(0, 1, [(60, 64, ())]) and not d.fits(0, 2, [(60, 64, ()), (60, 64, ())]) and not d.fits(0, 5, [])
    G = Balancer(3, max_live=2)
    states = [GroupState(0, 4, 2), GroupState(0, 4, 1), GroupState(0, 4, 1)]
    # Group 1, the first busy group to give up (fewest in flight, the lower), moves its request to the group with
    # the most free slots (group 2) where it may; where no group may move, it drains.
    moved = G.plan(states, {1: 3}, 1, can_move=[False, True, False])
    drained = G.plan(states, {1: 3}, 1, can_move=[False, False, False])
    assert moved.moves == (Move(1, 2, 0, 1),) and moved.versions == (0, 1, 0) and not moved.drain
    assert not drained.moves and drained.drain == (1,) and drained.versions == (0, 0, 0)
