"""Live requests moving between rollout drivers of one process with their KV pages (no prefill again): a request
decoded partway in one group and finished in another, on other devices, gives the tokens it gives unmoved;
:class:`VersionGroups` performs a plan's moves, and a move that does not fit waits; a dora run at one version per
group moves requests."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from engine_helpers import GREEDY, make_engine, make_requests
from dora_jax.dora.balancer import Move, Plan
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import RequestSampling
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


def driver(engine, weights):
    d = RolloutDriver(engine, overlap=False)
    d.add_version(0, weights)
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
    assert b.fits(3, sizes) and len(sizes) == 3
    held = engines[1].pages_held
    moving = a.take(0, 3)
    assert moving.sample_ids == [0, 1, 2] and moving.count == 3 and a.live_rows == 1
    assert moving.kv_bytes == sum(-(-w // 16) for w, _ in sizes) * 16 * engines[0].token_bytes
    b.put(moving)
    assert engines[1].pages_held - held == sum(-(-w // 16) for w, _ in sizes) and b.live_rows == 3
    out += a.run() + b.run()
    assert sorted(t.sample_id for t in out) == list(range(6))
    for t in out:
        assert_close(t, want[t.sample_id])
    assert a.prefill_rows + b.prefill_rows == len({r.prompt_ids for r in reqs}) and b.prefill_rows == 0
    for e in engines:
        e.book.check()
