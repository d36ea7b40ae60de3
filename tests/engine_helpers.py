"""Shared helpers of the engine and driver tests (test_engine_api.py, test_driver.py, test_driver_overlap.py):
the tiny model's config, engines of it, random requests, and the references a trajectory is checked against (a
full forward of the same params, recomputed log-probs, the same trajectory up to a tie). Their ``models``
fixture (two tiny random models of ``CFG``) is in conftest.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import possible_draws
from dora_jax.config import ModelConfig
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.programs import DecodePrograms
from dora_jax.rollout.samples import Request

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3, qkv_bias=True)
GREEDY = RequestSampling(temperature=0.0)


def make_engine(model, slots=4, **serving):
    # Tests decode two or three full decode states of one engine side by side: a pool for three.
    serving.setdefault("num_pages", 3 * slots * 64 // 16)
    return Engine(model, max_concurrent_decodes=slots, max_prefill_length=32, max_target_length=64, **serving)


def trace_limit(monkeypatch, method: str):
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


def make_requests(n, seed=0, versions=(0,), sampling=GREEDY):
    rng = np.random.default_rng(seed)
    return [Request(i, tuple(rng.integers(1, 96, rng.integers(2, 20)).tolist()), version=versions[i % len(versions)],
                    max_new_tokens=int(rng.integers(1, 30)), sampling=sampling) for i in range(n)]


_FORWARD = {}


def full_logits(model, seq):
    """The logits [len(seq), V] of one full forward of ``model`` on ``seq``, in float64."""
    if id(model) not in _FORWARD:
        # Weights as arguments, not closed over: constants would put the whole model into the program. The
        # model is kept with its program, so its id is not reused (by another test file's models) while cached.
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
        _FORWARD[id(model)] = model, lambda t: forward(state, t)
    padded = np.zeros((1, 64), np.int32)  # causal: the padding after the sequence changes nothing before it
    padded[0, :len(seq)] = seq
    return np.asarray(_FORWARD[id(model)][1](jnp.asarray(padded)), np.float64)[0, :len(seq)]


def recompute(model, traj, temperature=1.0, top_p=1.0):
    """Log-probs of the trajectory's tokens from one full forward of the same params (float64 softmax), under
    the distribution that drew them: ``logits / temperature``, cut to the top-p nucleus and renormalized."""
    seq = list(traj.prompt_ids) + traj.tokens
    logits = np.asarray(full_logits(model, seq), np.float64) / temperature
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
    return possible_draws(full_logits(model, seq)[-1], request.sampling, request.sample_id, len(seq))


def assert_same_trajectory(got, want, request, model):
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


def step_rows(eng, params, state, filtered=None):
    """One decode step of every live slot, as its own program (``generate_steps`` of one step, no stop ids):
    the new state and the step's packed results, int32 [B, 5] (token, valid, position, log-prob bits,
    version)."""
    b = state.tokens.shape[0]
    (state,), result = eng.generate_steps([params], [state], steps=1, budgets=[np.ones((b,), np.int32)],
                                          stop_ids=[[()] * b], filtered=filtered)
    return state, np.asarray(result.to_host().data)[0]


def step_once(eng, params, state, filtered=None):
    """:func:`step_rows` with the results as columns, each [B]."""
    state, d = step_rows(eng, params, state, filtered)
    return state, {"token": d[:, 0], "valid": d[:, 1].astype(bool), "position": d[:, 2],
                   "logprob": np.ascontiguousarray(d[:, 3]).view(np.float32), "version": d[:, 4]}


def prefill_one(eng, prompt, *, sample_id=0, version=0, sampling=RequestSampling(), shared_prefix=None, params=None):
    """One request prefilled alone (``prefill_batch`` of one): its batch and its first token's columns."""
    batch, first = eng.prefill_batch(params=params, prompts=[tuple(prompt)], sample_ids=[sample_id], version=version,
                                     samplings=[sampling], shared_prefix=shared_prefix)
    return batch, {k: v[0] for k, v in first.to_host().columns().items()}
