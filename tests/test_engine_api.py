"""The continuous-batching engine's calls on tiny random models: prefill_batch, insert_batch, generate_steps,
prefill after a shared prefix, and a version's prepared params (fused weights on a mesh, bfloat16 decoding of a
float32 model).

References: one prompt at a time, one step per program, whole-prompt prefills, a full forward of the same params.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dora_jax.models.build import init_model
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from engine_helpers import CFG, GREEDY, make_engine, make_requests, prefill_one, recompute, step_once


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
        engine = make_engine(m0, dtype=dtype)
        prepared = engine.prepare_params(state)
        assert engine.dtype == dtype and engine.cfg.compute_dtype == dtype
        assert {x.dtype for x in jax.tree.leaves(prepared.tree)} == {jnp.dtype(dtype)}
        assert engine.pool.k.dtype == jnp.dtype(dtype)
        d = RolloutDriver(engine)
        d.add_version(0, prepared)
        runs[dtype] = sorted(d.run(make_requests(8, seed=3)), key=lambda t: t.sample_id)
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype("float32")} and m0.cfg.compute_dtype == "float32"
    shared, diffs, near_ties = 0, [], []
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        assert len(b.tokens) == len(a.tokens)  # greedy with no eos: every request runs to its length
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        shared += n
        diffs += list(np.abs(np.asarray(a.logprobs[:n]) - np.asarray(b.logprobs[:n])))
        if n < len(a.tokens):  # the float32 model's log-probs of both choices after the shared prefix
            lp_b, _ = recompute(m0, b, temperature=1.0)
            near_ties.append(a.logprobs[n] - lp_b[n])
    assert shared >= 0.6 * sum(len(t.tokens) for t in runs["float32"]), shared
    assert 1e-4 < np.mean(diffs) <= 0.06 and max(diffs) <= 0.4, (np.mean(diffs), max(diffs))
    assert all(-1e-4 <= gap <= 0.4 for gap in near_ties), near_ties


def test_one_request_prefill_insert_step(models):
    """A request alone: its first token at prefill, one decode step, results read with one host copy each; an
    empty slot reports nothing."""
    m0, _ = models
    eng = make_engine(m0, slots=2)
    batch, r0 = prefill_one(eng, (4, 5, 6), sample_id=11, version=7, sampling=GREEDY)
    state = eng.insert_batch(batch, eng.init_decode_state(), [1])
    state, r1 = step_once(eng, None, state)
    assert not r1["valid"][0]
    assert r1["valid"][1] and r1["version"][1] == 7 and r1["position"][1] == 4 and r0["position"] == 3
    logits = np.asarray(m0(jnp.asarray([[4, 5, 6, int(r0["token"])]])))[0]
    assert [int(r0["token"]), int(r1["token"][1])] == logits[2:4].argmax(-1).tolist()


def test_batched_prefill_equals_one_prompt_at_a_time(models):
    """prefill_batch gives each request the first token and log-prob that a prefill of it alone gives, and a
    cache row whose decode continues exactly as the lone prefill's; equal prompts share one row."""
    m0, _ = models
    eng = make_engine(m0, slots=8)
    sampling = RequestSampling(temperature=1.0, seed=3)
    prompts = [(5, 6, 7), (9, 1, 4, 4, 8, 2, 11, 30, 31, 2, 7, 9, 40, 41, 42, 43, 44, 45), (5, 6, 7), (8,), (5, 6, 7)]
    ids = [10, 11, 12, 13, 14]
    batch, first = eng.prefill_batch(prompts=prompts, sample_ids=ids, version=4, samplings=[sampling] * 5)
    assert batch.cache.k.shape[1] == 4  # 3 distinct prompts, bucketed to 4 rows (not 5, not 8)
    assert batch.cache.v.shape[3] == 32  # the prompts' bucket, not the 64-slot decode cache
    cols = first.to_host().columns()
    assert cols["valid"][:5].all() and not cols["valid"][5:].any()
    singles = [prefill_one(eng, p, sample_id=i, version=4, sampling=sampling) for p, i in zip(prompts, ids)]
    for n, (_, r) in enumerate(singles):
        assert (cols["token"][n], cols["position"][n], cols["version"][n]) == (r["token"], r["position"], 4)
        np.testing.assert_allclose(cols["logprob"][n], r["logprob"], rtol=1e-5, atol=1e-6)
    assert len({int(cols["token"][n]) for n in (0, 2, 4)}) > 1  # same prompt, own streams: not one shared token
    # Decode both ways for a few steps: request n in slot 7 - n (the batch) or inserted alone.
    a = eng.insert_batch(batch, eng.init_decode_state(), [7, 6, 5, 4, 3])
    b = eng.init_decode_state()
    for n, (single, _) in enumerate(singles):
        b = eng.insert_batch(single, b, [7 - n])
    for _ in range(4):
        a, ca = step_once(eng, None, a)
        b, cb = step_once(eng, None, b)
        assert (ca["token"] == cb["token"]).all() and (ca["valid"] == cb["valid"]).all()
        np.testing.assert_allclose(ca["logprob"], cb["logprob"], rtol=1e-5, atol=1e-6)


def test_insert_batch_bad_slots(models):
    m0, _ = models
    eng = make_engine(m0, slots=4)
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
    eng = make_engine(m0, slots=8)
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
        x, cx = step_once(eng, None, x)
        y, cy = step_once(eng, None, y)
        assert (cx["token"][:4] == cy["token"][4:]).all() and (cx["position"][:4] == cy["position"][4:]).all()
        np.testing.assert_allclose(cx["logprob"][:4], cy["logprob"][4:], rtol=1e-5, atol=1e-6)
    # One request alone after the prefix: the whole sequence's first token, and a row that decodes like the
    # batch's (request 1, inserted alone into slot 2 of a fresh state).
    single, r = prefill_one(eng, prompts[1], sample_id=2, version=2, sampling=sampling, shared_prefix=shared)
    assert (r["token"], r["position"], r["version"]) == (cb["token"][1], len(prompts[1]), 2)
    np.testing.assert_allclose(r["logprob"], cb["logprob"][1], rtol=1e-5, atol=1e-6)
    z = eng.insert_batch(single, eng.init_decode_state(), [2])
    w = eng.insert_batch(b, eng.init_decode_state(), [None, 2])
    for _ in range(3):
        z, cz = step_once(eng, None, z)
        w, cw = step_once(eng, None, w)
        assert cz["token"][2] == cw["token"][2] and cz["position"][2] == cw["position"][2]
        np.testing.assert_allclose(cz["logprob"][2], cw["logprob"][2], rtol=1e-5, atol=1e-6)
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


def test_generate_steps_equals_one_step_at_a_time(models):
    """One program of N steps gives each slot the tokens and log-probs of N one-step programs, and stops a
    slot on the device: at its budget, at a stop id (reported, then inactive in the returned state), at once
    when the token it would feed is a stop id; an empty slot produces nothing; `limit` runs fewer steps, and
    `end_after` ends the program at the step that frees that many slots (a stop, or a final budget's last token)."""
    m0, _ = models
    eng = make_engine(m0, slots=4)
    params = eng.prepare_params(nnx.state(m0))
    sampling = RequestSampling(temperature=1.0, seed=4)

    def fresh(slots=(0, 1, 2)):
        batch, first = eng.prefill_batch(params=params, prompts=[(3, 4, 5), (7, 8), (9, 10, 11, 12)],
                                         sample_ids=[0, 1, 2], samplings=[sampling] * 3)
        return eng.insert_batch(batch, eng.init_decode_state(4), list(slots)), first.to_host().columns()["token"]

    state, first = fresh()
    ref = []
    for _ in range(6):
        state, cols = step_once(eng, params, state, filtered=False)
        ref.append(cols)
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
