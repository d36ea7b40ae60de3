"""The continuous-batching engine and the multi-version driver on tiny random models.

References: per-version static generation and full-forward recomputation of the same params.
"""

import collections
import dataclasses
import gc
import weakref

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import possible_draws, rel_err
from dora_jax.config import ModelConfig
from dora_jax.models.build import init_model
from dora_jax.models.decoder import DecodeSettings
from dora_jax.rollout.driver import Request, RolloutDriver
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from dora_jax.rollout.programs import DecodePrograms

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3, qkv_bias=True)
GREEDY = RequestSampling(temperature=0.0)


@pytest.fixture(scope="module")
def models():
    return init_model(CFG, seed=0), init_model(CFG, seed=1)


def _engine(model, slots=4, **serving):
    # Tests decode two or three full decode states of one engine side by side: a pool for three.
    serving.setdefault("num_pages", 3 * slots * 64 // 16)
    return Engine(model, max_concurrent_decodes=slots, max_prefill_length=32, max_target_length=64, **serving)


def _trace_limit(monkeypatch, method: str):
    """Puts ``DecodePrograms.<method>`` (a pure function the engine jits) behind chex's trace counter, for engines
    made after this call; each trace is one compiled program. Returns ``limit(n)``: at most ``n`` traces from then
    on."""
    original, current = getattr(DecodePrograms, method), {}

    def limit(n: int) -> None:
        chex.clear_trace_counter()
        current["fn"] = chex.assert_max_traces(original, n)

    limit(0)
    monkeypatch.setattr(DecodePrograms, method, lambda self, *args: current["fn"](self, *args))
    return limit


@pytest.fixture(scope="module")
def engine4(models):
    """One 4-slot engine shared by the overlap tests, so they share its compiled programs."""
    return _engine(models[0], slots=4)


def _requests(n, seed=0, versions=(0,), sampling=GREEDY):
    rng = np.random.default_rng(seed)
    return [Request(i, tuple(rng.integers(1, 96, rng.integers(2, 20)).tolist()), version=versions[i % len(versions)],
                    max_new_tokens=int(rng.integers(1, 30)), sampling=sampling) for i in range(n)]


_FORWARD = {}


def _full_logits(model, seq):
    """The logits [len(seq), V] of one full forward of ``model`` on ``seq``, in float64."""
    if id(model) not in _FORWARD:
        # Weights as arguments, not closed over: constants would put the whole model into the program.
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
        _FORWARD[id(model)] = lambda t: forward(state, t)
    padded = np.zeros((1, 64), np.int32)  # causal: the padding after the sequence changes nothing before it
    padded[0, :len(seq)] = seq
    return np.asarray(_FORWARD[id(model)](jnp.asarray(padded)), np.float64)[0, :len(seq)]


def _recompute(model, traj, temperature=1.0, top_p=1.0):
    """Log-probs of the trajectory's tokens from one full forward of the same params (float64 softmax), under
    the distribution that drew them: ``logits / temperature``, cut to the top-p nucleus and renormalized."""
    seq = list(traj.prompt_ids) + traj.tokens
    logits = np.asarray(_full_logits(model, seq), np.float64) / temperature
    if top_p < 1.0:  # the smallest prefix of the sorted distribution whose mass reaches top_p
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, -1)
        keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        logits = np.where(keep, logits, -np.inf)
    n = len(traj.prompt_ids)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    steps = logp[n - 1:-1]
    return steps[np.arange(len(traj.tokens)), traj.tokens], steps.argmax(-1)


def _possible_draws(model, request, prefix):
    """The tokens the draw after ``request.prompt_ids + prefix`` can give within rounding (conftest.TIE), on
    the full forward of ``model``."""
    seq = list(request.prompt_ids) + list(prefix)
    return possible_draws(_full_logits(model, seq)[-1], request.sampling, request.sample_id, len(seq))


def _assert_same_trajectory(got, want, request, model):
    """``got`` and ``want``: one request decoded by two programs. The same version, tokens and finish reason,
    log-probs within float32 rounding; or the same up to a token where the draw was at a tie (both tokens are
    possible draws: two programs round logits apart, see conftest.TIE), after which the two continue apart and
    nothing more is compared. Returns whether they were the same."""
    assert got.version == want.version, request.sample_id
    n = next((i for i, (x, y) in enumerate(zip(got.tokens, want.tokens)) if x != y), None)
    if n is None:
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason), request.sample_id
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
        return True
    np.testing.assert_allclose(got.logprobs[:n], want.logprobs[:n], rtol=1e-5, atol=1e-6)
    possible = _possible_draws(model, request, want.tokens[:n])
    assert {got.tokens[n], want.tokens[n]} <= possible, (request.sample_id, n, got.tokens[n], want.tokens[n],
                                                          sorted(possible))
    return False


def test_two_versions_in_flight(models):
    """Every token of every trajectory comes from its own version: greedy tokens are the argmax of that
    version's full forward and differ from the other version's; log-probs equal its recomputation."""
    m0, m1 = models
    driver = RolloutDriver(_engine(m0))
    driver.add_version(0, nnx.state(m0))
    driver.add_version(1, nnx.state(m1))
    out = driver.run(_requests(12, versions=(0, 1)))
    assert sorted(t.sample_id for t in out) == list(range(12))
    differs = 0
    for t in out:
        mine, other = (m0, m1) if t.version == 0 else (m1, m0)
        lp, argmax = _recompute(mine, t)
        assert t.tokens == argmax.tolist()
        assert rel_err(t.logprobs, lp) <= 1e-4
        differs += t.tokens != _recompute(other, t)[1].tolist()
        assert t.finish_reason == "length"
    assert differs >= 6  # the versions really are different policies


def test_fused_step_equals_one_call_per_version(models, monkeypatch):
    """Stepping every version in one program gives the tokens and log-probs of one call per version, and
    compiles one program per multiset of group capacities (one decode step per program)."""
    m0, m1 = models
    reqs = _requests(12, seed=4, versions=(0, 1, 2), sampling=RequestSampling(temperature=1.0, top_k=20, seed=5))
    runs = {}
    limit = _trace_limit(monkeypatch, "generate_many")
    fused = collections.Counter()
    generate_many = Engine.generate_many
    monkeypatch.setattr(Engine, "generate_many", lambda self, *a, **k: fused.update(["steps"]) or
                        generate_many(self, *a, **k))
    eng = _engine(m0, slots=8)  # one engine: both drivers share its compiled prefill, insert and resize
    for fuse in (False, True):
        # One program per (versions stepping together, shared capacity): 2 or 3 versions x capacities 1..8.
        limit(0 if not fuse else 8)
        driver = RolloutDriver(eng, fuse=fuse, decode_steps=1)
        for v, m in enumerate((m0, m1, m0)):
            driver.add_version(v, nnx.state(m))
        runs[fuse] = {t.sample_id: t for t in driver.run(reqs)}
        assert (fused["steps"] > 0) == fuse  # several versions did step together, only when fused
    assert sorted(runs[True]) == list(range(12))
    for i, t in runs[False].items():
        _assert_same_trajectory(runs[True][i], t, reqs[i], (m0, m1, m0)[t.version])


def test_alone_equals_busy_batch(models):
    """A sample's tokens do not depend on its slot or on what else is decoding (greedy and sampled)."""
    m0, _ = models
    busy_engine, alone_engine = _engine(m0, slots=4), _engine(m0, slots=1)  # each compiles once for both cases
    for sampling in (GREEDY, RequestSampling(temperature=1.0, top_k=20, seed=7)):
        reqs = _requests(9, seed=3, sampling=sampling)
        busy = RolloutDriver(busy_engine)
        busy.add_version(0, nnx.state(m0))
        crowd = {t.sample_id: t for t in busy.run(reqs)}
        alone = RolloutDriver(alone_engine)
        alone.add_version(0, nnx.state(m0))
        for r in reqs[::3]:
            (t,) = alone.run([r])
            _assert_same_trajectory(t, crowd[r.sample_id], r, m0)


def test_sampled_logprobs_match_recompute(models):
    m0, _ = models
    d = RolloutDriver(_engine(m0))
    d.add_version(0, nnx.state(m0))
    out = d.run(_requests(6, seed=5, sampling=RequestSampling(temperature=0.7, top_p=0.9, seed=1)))
    for t in out:  # recorded under the distribution that drew the token: T 0.7, the 0.9 nucleus, renormalized
        lp, _ = _recompute(m0, t, temperature=0.7, top_p=0.9)
        assert rel_err(t.logprobs, lp) <= 1e-4
    assert any(rel_err(t.logprobs, _recompute(m0, t, temperature=0.7)[0]) > 1e-3 for t in out)  # truncation shows


def test_bfloat16_rollout_of_a_float32_model_follows_the_float32_engine(models):
    """``rollout.dtype=bfloat16`` on a float32 model: the engine holds the version's weights in bfloat16 (the
    model's own stay float32: the trainer's) and decodes in it, KV cache included. Greedy decoding follows the
    float32 engine: on the tokens both chose, log-probs agree within bfloat16 rounding (8 significant bits,
    ~0.2% per rounding; through two layers at these logits, whose spread is about 2 nats, measured mean 0.03
    and largest 0.25 nats), and wherever the bfloat16 engine picked another token the float32 model scored the
    two within such a rounding (a near tie; measured gaps up to 0.19 nats)."""
    m0, _ = models
    state = nnx.state(m0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = _engine(m0, dtype=dtype)
        prepared = engine.prepare_params(state)
        assert engine.dtype == dtype and engine.cfg.compute_dtype == dtype
        assert {x.dtype for x in jax.tree.leaves(prepared.tree)} == {jnp.dtype(dtype)}
        assert engine.pool.k.dtype == jnp.dtype(dtype)
        d = RolloutDriver(engine)
        d.add_version(0, prepared)
        runs[dtype] = sorted(d.run(_requests(8, seed=3)), key=lambda t: t.sample_id)
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype("float32")} and m0.cfg.compute_dtype == "float32"
    shared, diffs, near_ties = 0, [], []
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        assert len(b.tokens) == len(a.tokens)  # greedy with no eos: every request runs to its length
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        shared += n
        diffs += list(np.abs(np.asarray(a.logprobs[:n]) - np.asarray(b.logprobs[:n])))
        if n < len(a.tokens):  # the float32 model's log-probs of both choices after the shared prefix
            lp_b, _ = _recompute(m0, b, temperature=1.0)
            near_ties.append(a.logprobs[n] - lp_b[n])
    assert shared >= 0.6 * sum(len(t.tokens) for t in runs["float32"]), shared
    assert 1e-4 < np.mean(diffs) <= 0.06 and max(diffs) <= 0.4, (np.mean(diffs), max(diffs))
    assert all(-1e-4 <= gap <= 0.4 for gap in near_ties), near_ties


def test_stop_and_eos_reasons(models):
    m0, _ = models
    probe = RolloutDriver(_engine(m0))
    probe.add_version(0, nnx.state(m0))
    (free,) = probe.run([Request(0, (5, 6, 7), max_new_tokens=12, sampling=GREEDY)])
    eos, stop = free.tokens[4], free.tokens[2]
    d = RolloutDriver(_engine(m0), eos_ids=[eos])
    d.add_version(0, nnx.state(m0))
    (a,) = d.run([Request(0, (5, 6, 7), max_new_tokens=12, sampling=GREEDY)])
    (b,) = d.run([Request(1, (5, 6, 7), max_new_tokens=12, sampling=GREEDY, stop_ids=(stop,))])
    assert a.finish_reason == "eos" and a.tokens == free.tokens[:free.tokens.index(eos) + 1]
    assert b.finish_reason == "stop" and b.tokens == free.tokens[:free.tokens.index(stop) + 1]


@pytest.mark.parametrize("steps,program", [(1, "generate"), (8, "generate_steps")])
def test_compaction_utilization_and_bounded_compilation(models, monkeypatch, steps, program):
    """One decode program per capacity, with one step per program or several (the budgets, the step limit
    and whether to end at the first stop are arguments, not compiled in)."""
    m0, _ = models
    limit = _trace_limit(monkeypatch, program)
    limit(4)  # capacities 1, 2, 4, 8
    eng = _engine(m0, slots=8)
    d = RolloutDriver(eng, decode_steps=steps)
    d.add_version(0, nnx.state(m0))
    d.run(_requests(24, seed=9))
    assert d.slot_utilization > 0.75
    if steps == 1:  # the first workload reached every capacity: nothing new to compile
        limit(0)
    d.run(_requests(24, seed=10))  # with several steps per program, at most the 4 programs in all


def test_bad_input(models):
    m0, _ = models
    eng = _engine(m0)
    d = RolloutDriver(eng)
    d.add_version(0, nnx.state(m0))
    with pytest.raises(EngineError, match="prompt of 40 tokens; allowed 1..32"):
        d.submit(Request(0, tuple(range(40))))
    with pytest.raises(EngineError, match="policy version 3 is not loaded"):
        d.submit(Request(0, (1, 2), version=3))
    with pytest.raises(EngineError, match="top_p must be in"):
        d.submit(Request(0, (1, 2), max_new_tokens=8, sampling=RequestSampling(top_p=0.0)))
    with pytest.raises(EngineError, match="temperature must be"):
        d.submit(Request(0, (1, 2), max_new_tokens=8, sampling=RequestSampling(temperature=-1.0)))
    with pytest.raises(EngineError, match="must fit max_target_length"):
        d.submit(Request(0, (1, 2), max_new_tokens=63))
    prefix, _ = eng.prefill(padded_tokens=np.array([1, 2, 3]), true_length=3)
    with pytest.raises(EngineError, match="slot 9 does not exist"):
        eng.insert(prefix, eng.init_decode_state(), 9)
    with pytest.raises(EngineError, match="max_prefill_length"):
        eng.prefill(padded_tokens=np.arange(40), true_length=40)
    with pytest.raises(EngineError, match="still has trajectories in flight"):
        d.submit(Request(5, (1, 2), max_new_tokens=8))
        d.remove_version(0)


def test_jetstream_api_shape(models):
    """prefill -> insert -> generate, results read with one host copy per step."""
    m0, _ = models
    eng = _engine(m0, slots=2)
    state = eng.init_decode_state()
    prefix, first = eng.prefill(padded_tokens=np.array([4, 5, 6, 0, 0]), true_length=3, sample_id=11, version=7,
                                sampling=GREEDY)
    r0 = first.to_host().get_result_at_slot(0)
    state = eng.insert(prefix, state, 1)
    state, res = eng.generate(None, state)
    host = res.to_host()
    assert not host.get_result_at_slot(0).valid
    r1 = host.get_result_at_slot(1)
    assert r1.valid and r1.version == 7 and r1.position == 4 and r0.position == 3
    logits = np.asarray(m0(jnp.asarray([[4, 5, 6, r0.token]])))[0]
    assert [r0.token, r1.token] == logits[2:4].argmax(-1).tolist()


def test_sampling_variant_does_not_change_samples(models):
    """Unfiltered requests decode under the sort-free variant alone and under the filtering variant when a
    top-p request shares their batch: their tokens and log-probs are the same either way."""
    m0, _ = models
    plain = RequestSampling(temperature=1.0, seed=3)
    reqs = [dataclasses.replace(r, sampling=RequestSampling(temperature=0.8, top_p=0.7, seed=3) if i == 0 else plain)
            for i, r in enumerate(_requests(4, seed=11))]
    busy = RolloutDriver(_engine(m0, slots=4))
    busy.add_version(0, nnx.state(m0))
    crowd = {t.sample_id: t for t in busy.run(reqs)}
    alone = RolloutDriver(_engine(m0, slots=1))
    alone.add_version(0, nnx.state(m0))
    for r in reqs[1:]:
        (t,) = alone.run([r])
        _assert_same_trajectory(t, crowd[r.sample_id], r, m0)


def test_batched_prefill_equals_one_prompt_at_a_time(models):
    """prefill_batch gives each request the first token and log-prob that prefill gives it alone, and a
    cache row whose decode continues exactly as the single prefill's; equal prompts share one row."""
    m0, _ = models
    eng = _engine(m0, slots=8)
    sampling = RequestSampling(temperature=1.0, seed=3)
    prompts = [(5, 6, 7), (9, 1, 4, 4, 8, 2, 11, 30, 31, 2, 7, 9, 40, 41, 42, 43, 44, 45), (5, 6, 7), (8,), (5, 6, 7)]
    ids = [10, 11, 12, 13, 14]
    batch, first = eng.prefill_batch(prompts=prompts, sample_ids=ids, version=4, samplings=[sampling] * 5)
    assert batch.cache.k.shape[1] == 4  # 3 distinct prompts, bucketed to 4 rows (not 5, not 8)
    assert batch.cache.v.shape[3] == 32  # the prompts' bucket, not the 64-slot decode cache
    cols = first.to_host().columns()
    assert cols["valid"][:5].all() and not cols["valid"][5:].any()
    singles = [eng.prefill(padded_tokens=np.array(p), true_length=len(p), sample_id=i, version=4, sampling=sampling)
               for p, i in zip(prompts, ids)]
    for n, (_, res) in enumerate(singles):
        r = res.to_host().get_result_at_slot(0)
        assert (cols["token"][n], cols["position"][n], cols["version"][n]) == (r.token, r.position, 4)
        np.testing.assert_allclose(cols["logprob"][n], r.logprob, rtol=1e-5, atol=1e-6)
    assert len({int(cols["token"][n]) for n in (0, 2, 4)}) > 1  # same prompt, own streams: not one shared token
    # Decode both ways for a few steps: request n in slot 7 - n (the batch) or inserted alone.
    a = eng.insert_batch(batch, eng.init_decode_state(), [7, 6, 5, 4, 3])
    b = eng.init_decode_state()
    for n, (prefix, _) in enumerate(singles):
        b = eng.insert(prefix, b, 7 - n)
    for _ in range(4):
        a, ra = eng.generate(None, a)
        b, rb = eng.generate(None, b)
        ca, cb = ra.to_host().columns(), rb.to_host().columns()
        assert (ca["token"] == cb["token"]).all() and (ca["valid"] == cb["valid"]).all()
        np.testing.assert_allclose(ca["logprob"], cb["logprob"], rtol=1e-5, atol=1e-6)


def test_group_prefill_does_not_change_samples(models):
    """GRPO-style groups (equal prompts) admitted together are prefilled once per group; every member still
    draws its own tokens, the same as when it is admitted and prefilled alone (a one-slot engine)."""
    m0, _ = models
    base = _requests(6, seed=12, sampling=RequestSampling(temperature=1.0, top_p=0.9, seed=2))
    reqs = [dataclasses.replace(r, sample_id=4 * i + j) for i, r in enumerate(base) for j in range(4)]
    runs, prefilled = {}, {}
    for slots in (1, 8):
        eng = _engine(m0, slots=slots)
        real, calls = eng.prefill_batch, prefilled.setdefault(slots, [])

        def counting(real=real, calls=calls, **kw):  # distinct prompts per prefill call
            calls.append(len(set(map(tuple, kw["prompts"]))))
            return real(**kw)

        eng.prefill_batch = counting
        d = RolloutDriver(eng)
        d.add_version(0, nnx.state(m0))
        runs[slots] = {t.sample_id: t for t in d.run(reqs)}
    assert prefilled[1] == [1] * 24
    assert sum(prefilled[8]) == 6  # each group's prompt once (groups finish together: they are admitted whole)
    assert sorted(runs[1]) == sorted(runs[8]) == list(range(24))
    for i, t in runs[1].items():
        _assert_same_trajectory(runs[8][i], t, reqs[i], m0)
    assert any(len({tuple(runs[8][4 * i + j].tokens) for j in range(4)}) > 1 for i in range(6))
    # The prefill budget splits admitted requests by distinct prompt, never a group.
    d = RolloutDriver(_engine(m0, slots=8))
    assert [len(c) for c in d.prefill_chunks([(r, 0.0) for r in reqs[:8]])] == [8]
    d.prefill_tokens = 1
    assert [[r.sample_id for r, _ in c] for c in d.prefill_chunks([(r, 0.0) for r in reqs[:8]])] == [
        [0, 1, 2, 3], [4, 5, 6, 7]]


def test_insert_batch_bad_slots(models):
    m0, _ = models
    eng = _engine(m0, slots=4)
    batch, _ = eng.prefill_batch(prompts=[(1, 2), (3,)], sample_ids=[0, 1], samplings=[GREEDY] * 2)
    with pytest.raises(EngineError, match="slot 4 does not exist"):
        eng.insert_batch(batch, eng.init_decode_state(), [0, 4])
    with pytest.raises(EngineError, match="repeat a slot"):
        eng.insert_batch(batch, eng.init_decode_state(), [1, 1])
    with pytest.raises(EngineError, match=r"request 1 \(sample 1\): prompt of 0 tokens"):
        eng.prefill_batch(prompts=[(1, 2), ()], sample_ids=[0, 1], samplings=[GREEDY] * 2)
    with pytest.raises(EngineError, match="2 prompts, 1 sample ids"):
        eng.prefill_batch(prompts=[(1, 2), (3,)], sample_ids=[0], samplings=[GREEDY] * 2)


def test_shared_prefix_prefill_equals_the_whole_prompt(models):
    """prefill_batch after a shared prefix gives each request the first token, position and log-prob of a
    whole-prompt prefill, and a cache whose decode continues the same; it prefills only the tokens after the
    prefix (their bucket, not the prompt's). Prompts that do not continue the prefix, or a prefix of another
    version, are refused."""
    m0, _ = models
    eng = _engine(m0, slots=8)
    sampling = RequestSampling(temperature=1.0, seed=3)
    head = (5, 6, 7, 8, 9, 10, 11)
    prompts = [head + (1, 2), head + tuple(range(20, 38)), head + (1, 2), head + (40,)]
    shared = eng.prefill_shared_prefix(tokens=head, version=2)
    assert shared.cache.v.shape[3] == len(head)  # exactly the prefix: no padding slots
    a, first_a = eng.prefill_batch(prompts=prompts, sample_ids=[1, 2, 3, 4], version=2, samplings=[sampling] * 4,
                                   shared_prefix=shared)
    b, first_b = eng.prefill_batch(prompts=prompts, sample_ids=[1, 2, 3, 4], version=2, samplings=[sampling] * 4)
    assert a.cache.v.shape[3] == len(head) + 32 and b.cache.v.shape[3] == 32  # 18 tokens after it: bucket 32
    ca, cb = first_a.to_host().columns(), first_b.to_host().columns()
    for k in ("token", "position", "version", "valid"):
        assert (ca[k] == cb[k]).all(), k
    assert list(ca["position"][:4]) == [len(p) for p in prompts]
    np.testing.assert_allclose(ca["logprob"], cb["logprob"], rtol=1e-5, atol=1e-6)
    x = eng.insert_batch(a, eng.init_decode_state(), [0, 1, 2, 3])
    y = eng.insert_batch(b, eng.init_decode_state(), [4, 5, 6, 7])
    for _ in range(5):
        x, rx = eng.generate(None, x)
        y, ry = eng.generate(None, y)
        cx, cy = rx.to_host().columns(), ry.to_host().columns()
        assert (cx["token"][:4] == cy["token"][4:]).all() and (cx["position"][:4] == cy["position"][4:]).all()
        np.testing.assert_allclose(cx["logprob"][:4], cy["logprob"][4:], rtol=1e-5, atol=1e-6)
    # JetStream's prefill(existing_prefix=...): the tokens after the prefix, the whole sequence's first token,
    # and a row that decodes like the batch's (request 1, inserted alone into slot 2 of a fresh state).
    rest = prompts[1][len(head):]
    padded = np.zeros(32, np.int32)
    padded[:len(rest)] = rest
    single, res = eng.prefill(existing_prefix=shared, padded_tokens=padded, true_length=len(rest), sample_id=2,
                              version=2, sampling=sampling)
    r = res.to_host().get_result_at_slot(0)
    assert (r.token, r.position, r.version) == (cb["token"][1], len(prompts[1]), 2)
    np.testing.assert_allclose(r.logprob, cb["logprob"][1], rtol=1e-5, atol=1e-6)
    z = eng.insert(single, eng.init_decode_state(), 2)
    w = eng.insert_batch(b, eng.init_decode_state(), [None, 2])
    for _ in range(3):
        z, rz = eng.generate(None, z)
        w, rw = eng.generate(None, w)
        cz, cw = rz.to_host().columns(), rw.to_host().columns()
        assert cz["token"][2] == cw["token"][2] and cz["position"][2] == cw["position"][2]
        np.testing.assert_allclose(cz["logprob"][2], cw["logprob"][2], rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineError, match="existing_prefix must be a SharedPrefix"):
        eng.prefill(existing_prefix=object(), padded_tokens=padded, true_length=3)
    with pytest.raises(EngineError, match=r"request 1 \(sample 8\): the prompt does not continue the shared prefix"):
        eng.prefill_batch(prompts=[head + (1,), (5, 6, 1, 2, 3, 4, 5, 6)], sample_ids=[7, 8], version=2,
                          samplings=[sampling] * 2, shared_prefix=shared)
    with pytest.raises(EngineError, match="does not continue"):  # the prefix alone leaves nothing to prefill
        eng.prefill_batch(prompts=[head], sample_ids=[7], version=2, samplings=[sampling], shared_prefix=shared)
    with pytest.raises(EngineError, match="prefilled by policy version 2, the requests are of version 3"):
        eng.prefill_batch(prompts=prompts, sample_ids=[1, 2, 3, 4], version=3, samplings=[sampling] * 4,
                          shared_prefix=shared)
    with pytest.raises(EngineError, match="shared prefix of 32 tokens; allowed 1..31"):
        eng.prefill_shared_prefix(tokens=range(32))


def test_driver_with_a_shared_prefix_gives_the_same_trajectories(models, engine4):
    """Two versions, requests that continue the shared prefix and requests that do not (one is the prefix
    itself), staggered admissions, with and without overlap: the same tokens, reasons and log-probs as whole-
    prompt prefills, and log-probs equal to a full forward of each version. Each version prefills the prefix
    once; each prompt only its tokens after it."""
    m0, m1 = models
    head = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
    sampling = RequestSampling(temperature=1.0, seed=5)
    reqs = [dataclasses.replace(r, prompt_ids=(head + r.prompt_ids)[:32] if i % 4 else r.prompt_ids)
            for i, r in enumerate(_requests(14, seed=21, versions=(0, 1), sampling=sampling))]
    reqs.append(Request(14, head, version=1, max_new_tokens=6, sampling=sampling))  # the prefix alone: whole
    runs, drivers = {}, {}
    for prefix, overlap in (((), False), (head, False), (head, True)):
        d = RolloutDriver(engine4, overlap=overlap, shared_prefix=prefix)
        for v, m in enumerate((m0, m1)):
            d.add_version(v, nnx.state(m))
        runs[prefix, overlap], drivers[prefix, overlap] = _staggered(d, reqs), d
    base = runs[(), False]
    assert sorted(base) == list(range(15))
    for key, run in runs.items():
        for i, t in base.items():
            _assert_same_trajectory(run[i], t, reqs[i], (m0, m1)[t.version])
    for t in runs[head, False].values():
        want, _ = _recompute((m0, m1)[t.version], t)
        assert rel_err(t.logprobs, want) <= 1e-4
    continues = [r for r in reqs if len(r.prompt_ids) > len(head) and r.prompt_ids[:len(head)] == head]
    assert len(continues) == 10
    distinct = {(r.version, r.prompt_ids) for r in reqs}
    whole = sum(len(p) for v, p in distinct)
    saved = sum(len(head) for r in continues) - 2 * len(head)  # each version prefilled the prefix once
    assert drivers[(), False].prefilled_tokens == whole
    assert drivers[head, False].prefilled_tokens == drivers[head, True].prefilled_tokens == whole - saved
    assert all(d.prefill_rows == len(distinct) for d in drivers.values())
    with pytest.raises(EngineError, match="shared_prefix of 32 tokens; it must be shorter than max_prefill_length"):
        RolloutDriver(engine4, shared_prefix=range(32))


@pytest.mark.parametrize("tied", [False, True])
def test_prepared_params_are_the_fused_weights_ready_on_the_mesh(tied):
    """A version's decode weights on a 2 x 2 x 2 mesh: q|k|v (and their biases) concatenated on the head axis,
    gate|up stacked on a new axis, values equal to a numpy concatenation; the other weights, the head
    included, are the stored arrays themselves (not copies); the new ones come back finished (settled
    programs, not eager collectives)."""
    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2, tie_embeddings=tied)
    model = init_model(cfg, mesh, DEFAULT_RULES, seed=3)
    engine = Engine(model, max_concurrent_decodes=4, max_prefill_length=32, max_target_length=64, mesh=mesh)
    prepared = engine.prepare_params(engine.params).tree
    stored = model.decode_params(fuse=False)
    layers, fused = stored["layers"], prepared["layers"]
    w = {n: np.asarray(layers[n]) for n in layers}
    expected = {"wqkv": np.concatenate([w["wq"], w["wk"], w["wv"]], axis=2),
                "w_gate_up": np.stack([w["w_gate"], w["w_up"]], axis=2),
                "bqkv": np.concatenate([w["bq"], w["bk"], w["bv"]], axis=1)}
    kept = ["attn_norm", "mlp_norm", "wo", "w_down"]
    assert set(fused) == set(kept) | set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(fused[name]), value, err_msg=name)
        assert fused[name].is_ready() and len(fused[name].sharding.device_set) == 8
    for name in kept:
        assert fused[name] is layers[name]
    assert prepared["embed"] is stored["embed"]
    assert ("lm_head" in prepared) == (not tied)
    if not tied:
        assert prepared["lm_head"] is stored["lm_head"]
    once = engine.prepare_params(engine.params)
    assert engine.prepare_params(once) is once  # already prepared: returned as is


def _staggered(driver, reqs):
    """Submits the first half, steps three times, submits the rest, then runs to the end: later requests
    are admitted into slots freed while a step may be in flight."""
    half = len(reqs) // 2
    out = []
    for r in reqs[:half]:
        driver.submit(r)
    for _ in range(3):
        out += driver.step()
    out += driver.run(reqs[half:])
    return {t.sample_id: t for t in out}


@pytest.mark.parametrize("fuse", [True, False])
def test_overlap_gives_the_same_trajectories(models, engine4, fuse):
    """Dispatching step t + 1 before reading step t back changes when results are read, not what they are:
    three versions, eos / stop / length finishes, admissions into slots freed by the step read while the next
    one runs, compaction; greedy and sampled requests."""
    m0, m1 = models
    eng = engine4
    probe = RolloutDriver(eng)
    probe.add_version(0, nnx.state(m0))
    common = collections.Counter(x for t in probe.run(_requests(8, seed=11)) for x in t.tokens).most_common(2)
    eos, stop = common[0][0], common[1][0]  # frequent tokens: many trajectories end early
    reqs = [dataclasses.replace(r, stop_ids=(stop,) if i % 3 == 0 else ())
            for i, r in enumerate(_requests(16, seed=12, versions=(0, 1, 2)))]
    reqs = [dataclasses.replace(r, sampling=RequestSampling(temperature=1.0, top_k=20, seed=3)) if i % 2 else r
            for i, r in enumerate(reqs)]
    runs, drivers = {}, {}
    for overlap in (False, True):
        d = RolloutDriver(eng, eos_ids=[eos], fuse=fuse, overlap=overlap)
        for v, m in enumerate((m0, m1, m0)):
            d.add_version(v, nnx.state(m))
        runs[overlap], drivers[overlap] = _staggered(d, reqs), d
    assert sorted(runs[True]) == list(range(16))
    reasons = collections.Counter(t.finish_reason for t in runs[False].values())
    assert set(reasons) == {"eos", "stop", "length"}, reasons  # every way of finishing is exercised
    same = [_assert_same_trajectory(runs[True][i], t, reqs[i], (m0, m1, m0)[t.version]) for i, t in runs[False].items()]
    off, on = drivers[False], drivers[True]
    for d, run in ((off, runs[False]), (on, runs[True])):
        assert d.rows_live == sum(len(t.tokens) - 1 for t in run.values())
    if all(same):  # (trajectories parted at a tie have rows of their own)
        assert on.rows_computed >= off.rows_computed  # rows of finished trajectories computed once more
    assert on.idle and off.idle


def test_overlap_dispatches_the_next_step_before_reading_the_last(models, engine4, monkeypatch):
    """With overlap, two decode steps are outstanding (dispatched, not yet read back) at a time; without it
    one. A fixed batch of equal lengths runs exactly max_new_tokens - 1 steps either way (the first token
    comes from prefill): no step is dispatched for rows whose last token is already being computed. One
    decode step per program here; test_multi_step_decode_* cover several."""
    from dora_jax.rollout.engine import ResultTokens

    m0, _ = models
    eng = engine4
    outstanding, peak = [0], [0]

    class Counted(ResultTokens):
        def to_host(self):
            outstanding[0] -= 1
            return super().to_host()

    def counting(method):
        def wrapped(*args, **kwargs):
            state, result = method(*args, **kwargs)
            outstanding[0] += 1
            peak[0] = max(peak[0], outstanding[0])
            return state, Counted(result.data)
        return wrapped

    monkeypatch.setattr(eng, "generate", counting(eng.generate))
    monkeypatch.setattr(eng, "generate_many", counting(eng.generate_many))
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=10, sampling=GREEDY) for i in range(4)]
    for overlap, expect_peak in ((False, 1), (True, 2)):
        outstanding[0] = peak[0] = 0
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        out = d.run(reqs)
        assert peak[0] == expect_peak, overlap
        assert outstanding[0] == 0  # every dispatched step was read: none was wasted at the end
        assert d.steps == 9 and d.rows_computed == 4 * 9 and all(len(t.tokens) == 10 for t in out)

    # Compaction between a step's dispatch and its read: two rows end at step 2 and the group shrinks from 4
    # slots to 2 while step 3 (dispatched with 4) is in flight; a row of step 3 ends, found in its new slot.
    lengths = (3, 3, 4, 10)
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in enumerate(lengths)]
    tokens = {}
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        tokens[overlap] = {t.sample_id: t.tokens for t in d.run(reqs)}
        assert [len(tokens[overlap][i]) for i in range(4)] == list(lengths)
        assert d.rows_live == sum(n - 1 for n in lengths)
    assert tokens[True] == tokens[False]

    # Requests that end at their first token (sampled at prefill): with overlap they are inserted and their
    # first tokens read with the next launch, which here dispatches no step at all.
    ones = [Request(20 + i, (3 + i, 7), max_new_tokens=1, sampling=GREEDY) for i in range(6)]
    firsts = {}
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        firsts[overlap] = {t.sample_id: (t.tokens, t.finish_reason) for t in d.run(ones)}
        assert d.idle and d.steps == 0 and d.rows_computed == 0
    assert firsts[True] == firsts[False] and sorted(firsts[True]) == list(range(20, 26))

    # Admissions do not wait either: with overlap nothing is read back inside a launch (a request's first
    # token, sampled at prefill, is read with the next step's results), without it the first tokens are.
    reads_in_launch, in_launch = [0], [False]
    to_host = ResultTokens.to_host

    def reading(self):
        reads_in_launch[0] += in_launch[0]
        return to_host(self)

    monkeypatch.setattr(ResultTokens, "to_host", reading)
    reqs = [Request(i, (3 + i, 7, 9), max_new_tokens=2 + i % 5, sampling=GREEDY) for i in range(10)]
    for overlap in (False, True):
        d = RolloutDriver(eng, overlap=overlap, decode_steps=1)
        d.add_version(0, nnx.state(m0))
        launch = d.launch

        def flagged():
            in_launch[0] = True
            try:
                return launch()
            finally:
                in_launch[0] = False

        d.launch, reads_in_launch[0] = flagged, 0
        out = {t.sample_id: t.tokens for t in d.run(reqs)}
        assert [len(out[i]) for i in range(10)] == [2 + i % 5 for i in range(10)]
        assert (reads_in_launch[0] == 0) is overlap, (overlap, reads_in_launch[0])

    # The last trajectory ends by eos: the step dispatched after its last token holds only finished rows and
    # is read before the driver reports idle, so removing the version lets its group (cache, params) go.
    free = RolloutDriver(eng, overlap=False, decode_steps=1)
    free.add_version(0, nnx.state(m0))
    (probe,) = free.run([Request(9, (5, 6, 7), max_new_tokens=10, sampling=GREEDY)])
    eos = next(tok for i, tok in enumerate(probe.tokens) if 2 <= i < 8 and tok not in probe.tokens[:i])
    d = RolloutDriver(eng, eos_ids=[eos], overlap=True, decode_steps=1)
    d.add_version(0, nnx.state(m0))
    outstanding[0] = 0
    (t,) = d.run([Request(9, (5, 6, 7), max_new_tokens=10, sampling=GREEDY)])
    assert t.finish_reason == "eos" and t.tokens == probe.tokens[:probe.tokens.index(eos) + 1]
    assert d.idle and outstanding[0] == 0 and d.steps == len(t.tokens)  # one step past the eos, read back
    # Its decode state goes with it (its params may share arrays with the model the test still holds).
    arrays = [weakref.ref(x) for x in jax.tree.leaves(d.decode_state(0))]
    d.remove_version(0)
    gc.collect()
    assert arrays and all(a() is None for a in arrays)


def test_driver_groups_with_and_without_overlap(models, engine4):
    """Two rollout groups driven as one: every request is answered once, by one group, with the tokens it
    gets from a single driver (sampling depends on (seed, sample id, position) only); with overlap each group
    keeps one step in flight and the answers are the same."""
    from dora_jax.rollout.groups import DriverGroups

    m0, m1 = models
    engines = [engine4, engine4]  # two groups of 4 slots (on one device here; the runner gives each its own)
    reqs = _requests(10, seed=14, versions=(0, 1), sampling=RequestSampling(temperature=1.0, seed=2))
    single = RolloutDriver(engine4)
    for v, m in enumerate((m0, m1)):
        single.add_version(v, nnx.state(m))
    want = {t.sample_id: t for t in single.run(reqs)}
    for overlap in (False, True):
        groups = DriverGroups([RolloutDriver(e, overlap=overlap) for e in engines])
        for v, m in enumerate((m0, m1)):
            groups.add_version(v, [nnx.state(m)] * 2)
        assert groups.overlap is overlap
        got = _staggered(groups, reqs)
        assert sorted(got) == list(range(10)) and groups.idle
        assert all(d.rows_live > 0 for d in groups.drivers)  # both groups decoded
        for i, t in want.items():
            _assert_same_trajectory(got[i], t, reqs[i], (m0, m1)[t.version])


def test_generate_steps_equals_one_step_at_a_time(models):
    """One program of N steps gives each slot the tokens and log-probs of N calls of `generate`, and stops a
    slot on the device: at its budget, at a stop id (reported, then inactive in the returned state), at once
    when the token it would feed is a stop id; an empty slot produces nothing; `limit` runs fewer steps, and
    `end_after` ends the program at the step that frees that many slots (a stop, or a final budget's last token)."""
    m0, _ = models
    eng = _engine(m0, slots=4)
    params = eng.prepare_params(nnx.state(m0))
    sampling = RequestSampling(temperature=1.0, seed=4)

    def fresh(slots=(0, 1, 2)):
        batch, first = eng.prefill_batch(params=params, prompts=[(3, 4, 5), (7, 8), (9, 10, 11, 12)],
                                         sample_ids=[0, 1, 2], samplings=[sampling] * 3)
        return eng.insert_batch(batch, eng.init_decode_state(4), list(slots)), first.to_host().columns()["token"]

    state, first = fresh()
    ref = []
    for _ in range(6):
        state, result = eng.generate(params, state, filtered=False)
        ref.append(result.to_host().columns())
    tok = np.stack([r["token"] for r in ref])  # [6, 4]
    lp = np.stack([r["logprob"] for r in ref])
    stop = int(tok[2, 1])  # slot 1 stops at the first step that samples it (step 2 or sooner)
    at = int(np.argmax(tok[:, 1] == stop))
    state, _ = fresh()
    (out,), res = eng.generate_steps([params], [state], steps=6, budgets=[[6, 6, 4, 6]],
                                     stop_ids=[[(), (stop,), (), ()]], filtered=False)
    cols, counts = res.to_host().columns(), res.counts()
    assert counts.tolist() == [6, at + 1, 4, 0] and res.steps_run() == 6
    for b in range(3):
        n = counts[b]
        np.testing.assert_array_equal(cols["token"][:n, b], tok[:n, b])
        np.testing.assert_allclose(cols["logprob"][:n, b], lp[:n, b], rtol=1e-5, atol=1e-6)
        assert cols["valid"][:n, b].all() and not cols["valid"][n:, b].any()
    assert np.asarray(out.active).tolist() == [True, False, True, False]
    assert np.asarray(out.positions)[[0, 2]].tolist() == [3 + 6, 4 + 4]  # the last token's position
    # Where the token to feed is already a stop id, nothing is produced; limit ends the program early.
    state, first = fresh()
    (_,), res = eng.generate_steps([params], [state], steps=6, budgets=[[6, 6, 6, 0]],
                                   stop_ids=[[(int(first[0]),), (), (), ()]], limit=2, filtered=False)
    assert res.counts().tolist() == [0, 2, 2, 0] and res.steps_run() == 2
    # Ended at the first freed slot: the step in which slot 1 stopped, or the last token of slot 2's final
    # budget of 2; a budget that is not final frees nothing.
    state, _ = fresh()
    (_,), res = eng.generate_steps([params], [state], steps=6, budgets=[[6, 6, 6, 0]],
                                   stop_ids=[[(), (stop,), (), ()]], end_after=[1], filtered=False)
    assert res.steps_run() == at + 1 and res.counts().tolist() == [at + 1] * 3 + [0]
    for final, ran in (([False, False, True, False], 2), ([False] * 4, 6)):
        state, _ = fresh()
        (_,), res = eng.generate_steps([params], [state], steps=6, budgets=[[6, 6, 2, 0]], stop_ids=[[()] * 4],
                                       final=[final], end_after=[1], filtered=False)
        assert res.steps_run() == ran and res.counts().tolist() == [ran, ran, 2, 0]
    with pytest.raises(EngineError, match="limit 7 must be in"):
        eng.generate_steps([params], [fresh()[0]], steps=6, budgets=[[1] * 4], stop_ids=[[()] * 4], limit=7)
    with pytest.raises(EngineError, match="got 3 budgets"):
        eng.generate_steps([params], [fresh()[0]], steps=6, budgets=[[1] * 3], stop_ids=[[()] * 4])
    with pytest.raises(EngineError, match="steps must be an integer >= 1"):
        eng.generate_steps([params], [fresh()[0]], steps=0, budgets=[[1] * 4], stop_ids=[[()] * 4])


def _mixed_requests(eos_probe):
    """16 requests over three versions: mixed prompt lengths and budgets (1..29 tokens), greedy and sampled,
    every third with a stop id; with eos and stop ids frequent in ``eos_probe``'s trajectories."""
    common = collections.Counter(x for t in eos_probe for x in t.tokens).most_common(2)
    eos, stop = common[0][0], common[1][0]
    reqs = [dataclasses.replace(r, stop_ids=(stop,) if i % 3 == 0 else ())
            for i, r in enumerate(_requests(16, seed=12, versions=(0, 1, 2)))]
    return eos, [dataclasses.replace(r, sampling=RequestSampling(temperature=1.0, top_k=20, seed=3)) if i % 2 else r
                 for i, r in enumerate(reqs)]


def test_multi_step_decode_gives_the_tokens_of_one_step_per_program(models, engine4):
    """Several decode steps per program (each slot stopped on the device) give the trajectories of one step
    per program: three versions, mixed lengths, eos and stop ids inside a program, admissions while requests
    wait, overlap on and off; and the driver's counters stay the counts of what ran."""
    m0, m1 = models
    probe = RolloutDriver(engine4, decode_steps=1)
    probe.add_version(0, nnx.state(m0))
    eos, reqs = _mixed_requests(probe.run(_requests(8, seed=11)))
    runs, drivers = {}, {}
    for steps, overlap in ((1, False), (8, False), (8, True)):
        d = RolloutDriver(engine4, eos_ids=[eos], overlap=overlap, decode_steps=steps)
        for v, m in enumerate((m0, m1, m0)):
            d.add_version(v, nnx.state(m))
        runs[steps, overlap], drivers[steps, overlap] = _staggered(d, reqs), d
    want = runs[1, False]
    assert sorted(want) == list(range(16))
    assert set(collections.Counter(t.finish_reason for t in want.values())) == {"eos", "stop", "length"}
    for key, got in runs.items():
        for i, t in want.items():
            _assert_same_trajectory(got[i], t, reqs[i], (m0, m1, m0)[t.version])
        d = drivers[key]
        assert d.idle and d.rows_live == sum(len(t.tokens) - 1 for t in got.values())
        assert d.rows_computed >= d.rows_live and d.batch_steps == d.steps  # one program per dispatch (fused)
        assert d.in_flight() == {0: 0, 1: 0, 2: 0}  # no row of any version live or waiting
    one, many = drivers[1, False], drivers[8, False]
    assert one.decode_steps_per_dispatch == 1 and one.steps == one.dispatches
    assert many.decode_steps_per_dispatch > 2 and many.dispatches < one.dispatches / 2


def test_decode_steps_setting(models):
    """rollout.decode_steps: validated in the config and by the engine, resolved by the driver ("auto": 8)."""
    from dora_jax.config import ConfigError, load_config

    m0, _ = models
    assert load_config("tiny_llama").rollout.decode_steps == "auto"
    assert load_config("tiny_llama", ["rollout.decode_steps=3"]).rollout.decode_steps == 3
    for bad in ("0", "257", "many"):
        with pytest.raises(ConfigError, match="rollout.decode_steps"):
            load_config("tiny_llama", [f"rollout.decode_steps={bad}"])
    with pytest.raises(EngineError, match="decode_steps 0: allowed 'auto' or 1 .. 256"):
        _engine(m0, settings=DecodeSettings(decode_steps=0))
    assert RolloutDriver(_engine(m0)).decode_steps == 8
    assert RolloutDriver(_engine(m0, settings=DecodeSettings(decode_steps=3))).decode_steps == 3
    assert RolloutDriver(_engine(m0), decode_steps=1).decode_steps == 1


def test_multi_step_decode_counts_and_admission(models, engine4, monkeypatch):
    """A fixed batch runs exactly max_new_tokens - 1 decode steps in programs of N (the last one shorter),
    with and without overlap; while a request waits for a slot, a program ends at the first step that frees
    one (a row's last token, or a stop id sampled on the device), and the waiting request takes it; otherwise
    it ends where the group can compact, so it computes the rows one step per program computes."""
    m0, _ = models
    for overlap in (False, True):
        d = RolloutDriver(engine4, overlap=overlap, decode_steps=4)
        d.add_version(0, nnx.state(m0))
        out = d.run([Request(i, (3 + i, 7, 9), max_new_tokens=10, sampling=GREEDY) for i in range(4)])
        assert all(len(t.tokens) == 10 for t in out)
        assert (d.steps, d.dispatches, d.batch_steps, d.rows_computed, d.rows_live) == (9, 3, 9, 4 * 9, 4 * 9)
        assert d.decode_steps_per_dispatch == 3
        # The steady state: the two whole programs of every slot; the drain's last step is not counted.
        assert (d.steady_dispatches, d.steady_decode_steps_per_dispatch) == (2, 4)

    ran = []
    generate_steps = engine4.generate_steps

    def recorded(*args, **kwargs):
        states, result = generate_steps(*args, **kwargs)
        ran.append((kwargs["end_after"], result))
        return states, result

    monkeypatch.setattr(engine4, "generate_steps", recorded)
    # Request 3 ends after 2 decode steps (its first token comes from prefill) while request 4 waits: the
    # first program runs 2 steps; the next one, with nothing waiting, would end when 2 of its 4 rows are
    # freed (compaction) and runs its 8.
    lengths = {0: 20, 1: 20, 2: 20, 3: 3, 4: 20}
    reqs = [Request(i, (7 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in lengths.items()]
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    got = {t.sample_id: t for t in d.run(reqs)}
    assert [len(got[i].tokens) for i in lengths] == list(lengths.values())
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], 2), ([2], 8)]
    # The same when request 4 waits outside the driver (a runner that submits only into free slots).
    ran.clear()
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    for req in reqs[:4]:
        d.submit(req)
    d.waiting_outside = True
    outside = d.step()
    d.waiting_outside = False
    outside = {t.sample_id: t.tokens for t in outside + d.run(reqs[4:])}
    assert outside == {i: t.tokens for i, t in got.items()}
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], 2), ([2], 8)]
    # The same with request 1 ending at a stop id it samples at decode step `at`: the first program ends there.
    probe = RolloutDriver(engine4, decode_steps=1)
    probe.add_version(0, nnx.state(m0))
    alone = {t.sample_id: t for t in probe.run([dataclasses.replace(r, max_new_tokens=20) for r in reqs])}
    b = alone[1].tokens
    at = next(i for i, x in enumerate(b) if i >= 2 and x not in b[:i])  # the first token new at its index
    assert at < 8
    reqs = [dataclasses.replace(r, max_new_tokens=20, stop_ids=(b[at],) if r.sample_id == 1 else ()) for r in reqs]
    ran.clear()
    d = RolloutDriver(engine4, decode_steps=8)
    d.add_version(0, nnx.state(m0))
    got = {t.sample_id: t for t in d.run(reqs)}
    assert got[1].finish_reason == "stop" and got[1].tokens == b[:at + 1]
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([1], at), ([2], 8)]
    assert all(got[i].tokens == alone[i].tokens for i in (0, 2, 3, 4))
    # Nothing waits; two rows end by length after 2 and 3 decode steps: the first program ends when the group
    # can compact (2 of 4 rows freed), and the rows computed are those of one step per program.
    reqs = [Request(i, (7 + i, 7, 9), max_new_tokens=n, sampling=GREEDY) for i, n in enumerate((3, 4, 20, 20))]
    ran.clear()
    computed = {}
    for steps in (1, 8):
        d = RolloutDriver(engine4, decode_steps=steps)
        d.add_version(0, nnx.state(m0))
        d.run(reqs)
        computed[steps] = d.rows_computed
    assert [(end, r.steps_run()) for end, r in ran[:2]] == [([2], 3), ([1], 8)]
    assert computed[8] == computed[1] == 3 * 4 + 16 * 2


def test_overlap_default_follows_the_backend(engine4):
    """Off where the engine decodes on CPU (a step's compute dwarfs the host's work), on elsewhere."""
    from dora_jax.rollout.driver import default_overlap

    eng = engine4
    assert default_overlap(eng) is (jax.devices()[0].platform != "cpu")
    assert RolloutDriver(eng).overlap is default_overlap(eng)
    assert RolloutDriver(eng, overlap=True).overlap is True


def test_bench_engine_reports_every_part():
    """`dora-jax bench engine` on a tiny random config (no tokenizer: random prompts sharing a 16-token head,
    no transformers side): the JSON holds every figure the benchmark promises, consistent with each other."""
    from benchmarks.engine import bench_engine

    out = bench_engine("tiny_llama", batch=4, new_tokens=8, tail_requests=8, tail_slots=4, group_size=2, rounds=2)
    for key in ("engine_tok_s", "roofline_tok_s", "continuous_tok_s", "static_tok_s", "group_prefill_tok_s",
                "single_prefill_tok_s", "overlap_tok_s", "no_overlap_tok_s", "overlap_tail_tok_s",
                "no_overlap_tail_tok_s", "prefix_continuous_tok_s", "no_prefix_continuous_tok_s",
                "prefix_static_tok_s", "no_prefix_static_tok_s"):
        assert out[key] > 0, key
    assert out["shared_prefix_tokens"] == 16
    runs = out["fixed_batch_runs"]  # the fixed batch timed `rounds` times, the best reported
    assert list(runs) == ["engine_tok_s"] and len(runs["engine_tok_s"]) == 2
    assert out["engine_tok_s"] == max(runs["engine_tok_s"])
    assert out["continuous_tok_s"] == max(out["long_tail_runs"]["continuous_tok_s"])
    assert out["static_tok_s"] == max(out["long_tail_runs"]["static_tok_s"])
    assert out["continuous_vs_static"] == pytest.approx(out["continuous_tok_s"] / out["static_tok_s"])
    for name in ("prefix", "no_prefix"):
        assert out[f"{name}_continuous_vs_static"] == pytest.approx(out[f"{name}_continuous_tok_s"]
                                                                    / out[f"{name}_static_tok_s"])
    assert "hf_tok_s" not in out and out["overlap"] is (jax.devices()[0].platform != "cpu")  # the default
    assert out["roofline_fraction"] == pytest.approx(out["engine_tok_s"] / out["roofline_tok_s"])
    assert out["overlap_vs_none"] == pytest.approx(out["overlap_tok_s"] / out["no_overlap_tok_s"])
    assert out["overlap_tail_vs_none"] == pytest.approx(out["overlap_tail_tok_s"] / out["no_overlap_tail_tok_s"])
    util = out["slot_utilization"]
    assert 0 < util["static"] < util["continuous"] <= 1  # the static batch waits for its longest member
    # The matmul ceiling: its ratios follow from its own figures.
    assert out["engine_vs_matmul_only"] == pytest.approx(out["engine_tok_s"] / out["matmul_only_tok_s"])
    assert out["matmul_only_vs_decode_roofline"] == pytest.approx(out["matmul_only_tok_s"]
                                                                  / out["decode_only_roofline_tok_s"])
    assert "matmul_only_vs_hf" not in out and "torch_matmul_only_step_ms" not in out
    # Several decode steps per program (rollout.decode_steps "auto": 8) against one: the fixed batch's 7
    # decode steps (the first token comes from prefill) run in one dispatch.
    assert out["decode_steps"] == 8
    assert out["decode_steps_per_dispatch"] == out["decode_steps_per_dispatch_median"] == 7
    assert 1 <= out["tail_decode_steps_per_dispatch"] <= 8
    for name in ("", "tail_"):
        assert out[f"multi_step_{name}vs_one"] == pytest.approx(out[f"multi_step_{name}tok_s"]
                                                                / out[f"one_step_{name}tok_s"])


def test_matmul_chain_covers_every_weight_matmul_of_a_step():
    """The matmul-only ceiling times exactly the step's weight matmuls: 2 FLOPs per row per parameter of the
    model less its norms and, when the head has its own weights, the embedding table (a lookup, not a matmul),
    whatever the config's shapes."""
    from benchmarks.rates import measure_matmul_chain
    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model

    for overrides in ([], ["model.num_heads=8", "model.num_kv_heads=2", "model.intermediate_size=96",
                           "model.tie_embeddings=true"]):
        cfg = load_config("tiny_llama", overrides).model
        model, _ = load_model(cfg, progress=False)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
        lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
        out = measure_matmul_chain(cfg, batch=3, rounds=1)
        assert out["matmul_only_flops"] == 2 * 3 * (n_params - norms - lookup)
        assert out["matmul_only_tok_s"] == pytest.approx(3e3 / out["matmul_only_step_ms"])
