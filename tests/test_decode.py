"""Cached decode equals the full forward; generation is consistent with teacher forcing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from dora_jax.config import ModelConfig, RopeScaling
from dora_jax.models.build import init_model
from dora_jax.models.decoder import init_cache
from dora_jax.rollout.generate import generate

CFGS = {
    "gqa_qknorm_bias": ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6,
                                   num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True, qk_norm=True,
                                   init_std=0.2),
    "mqa_llama3_tied": ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                   num_kv_heads=1, head_dim=8, tie_embeddings=True, init_std=0.2,
                                   rope_scaling=RopeScaling(original_max_position_embeddings=16)),
}


@pytest.mark.parametrize("name", sorted(CFGS))
def test_step_by_step_decode_equals_forward(name):
    cfg = CFGS[name]
    model = init_model(cfg, seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 20)))
    full = np.asarray(model(tokens))

    cache = init_cache(cfg, 3, 32)
    steps = []
    # A prefill chunk of 5 tokens, then one token at a time.
    logits, cache = model.decode(tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (3, 5)), cache)
    steps.append(np.asarray(logits))
    decode = jax.jit(lambda t, p, c: model.decode(t, p, c))
    for i in range(5, 20):
        logits, cache = decode(tokens[:, i:i + 1], jnp.full((3, 1), i), cache)
        steps.append(np.asarray(logits))
    assert rel_err(np.concatenate(steps, axis=1), full) <= 1e-5


def _prefilled(model, cfg, seqs, rows, chunk, cache_len):
    """A cache of ``rows`` x ``cache_len`` slots holding every sequence but its last token, written by one
    prefill chunk of ``chunk`` tokens per row (zero-padded)."""
    padded = np.zeros((rows, chunk), int)
    for i, s in enumerate(seqs):
        padded[i, :len(s) - 1] = s[:-1]
    _, cache = model.decode(jnp.asarray(padded), jnp.broadcast_to(jnp.arange(chunk), (rows, chunk)),
                            init_cache(cfg, rows, cache_len))
    return cache


def test_rows_at_different_positions():
    """Rows of one decode batch sit at different positions; each equals its own full forward."""
    cfg = CFGS["gqa_qknorm_bias"]
    model = init_model(cfg, seed=2)
    rng = np.random.default_rng(3)
    lengths = [4, 9, 15]
    seqs = [rng.integers(0, cfg.vocab_size, n + 1) for n in lengths]
    cache = _prefilled(model, cfg, seqs, 3, 16, 32)
    last = jnp.asarray([[s[-1]] for s in seqs])
    step_logits, _ = model.decode(last, jnp.asarray([[n] for n in lengths]), cache)
    for i, s in enumerate(seqs):
        ref = np.asarray(model(jnp.asarray(s[None])))[0, -1]
        assert rel_err(np.asarray(step_logits)[i, 0], ref) <= 1e-5


def test_greedy_generation_is_teacher_forced_argmax():
    cfg = CFGS["gqa_qknorm_bias"]
    model = init_model(cfg, seed=4)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    trajs, timings = generate(model, prompts, max_new_tokens=10)
    assert timings["new_tokens"] == 30
    for t in trajs:
        seq = t.prompt_ids + t.tokens
        logits = np.asarray(model(jnp.asarray([seq])))[0]
        n = len(t.prompt_ids)
        assert t.tokens == logits[n - 1:-1].argmax(-1).tolist()
        ref_lp = jax.nn.log_softmax(logits[n - 1:-1], -1)[np.arange(10), t.tokens]
        assert rel_err(t.logprobs, ref_lp) <= 1e-4
        assert t.finish_reason == "length"


@pytest.mark.parametrize("name", sorted(CFGS))
def test_fused_params_equal_unfused(name):
    """q|k|v and gate|up fused into one weight each give the unfused logits and cache to float32 tolerance."""
    from dora_jax.models.decoder import decode_forward

    cfg = CFGS[name]
    model = init_model(cfg, seed=5)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    fused = model.decode_params(fuse=True)["layers"]
    assert "wqkv" in fused and "w_gate_up" in fused and "wq" not in fused and "w_up" not in fused
    ref, ref_cache = decode_forward(cfg, model.decode_params(), tokens, pos, init_cache(cfg, 2, 16))
    out, cache = decode_forward(cfg, model.decode_params(fuse=True), tokens, pos, init_cache(cfg, 2, 16))
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(cache.k, ref_cache.k) <= 1e-5 and rel_err(cache.v, ref_cache.v) <= 1e-5


def test_rows_of_every_context_length_equal_the_full_forward():
    """The xla decode step over a cache of 64 slots: rows with contexts from 2 to 63 tokens in one batch, and a
    row standing for an empty slot (a stale position at the cache's end); every live row equals its own full
    forward."""
    from dora_jax.models.decoder import decode_forward

    cfg = CFGS["gqa_qknorm_bias"]
    model = init_model(cfg, seed=5)
    params = model.decode_params(fuse=True)
    rng = np.random.default_rng(6)
    step = jax.jit(lambda t, pos, c: decode_forward(cfg, params, t, pos, c))
    forward = jax.jit(lambda t: model(t))  # a tiny model: its weights as constants cost nothing
    for lengths in ([3, 7, 8], [5, 12, 16], [20, 2, 31], [33, 40, 47], [33, 50, 63]):
        seqs = [rng.integers(0, cfg.vocab_size, n + 1) for n in lengths]
        cache = _prefilled(model, cfg, seqs, 4, 64, 64)
        # Row 3 stands for an empty slot: a stale position at the end of the cache.
        tokens = jnp.asarray([[s[-1]] for s in seqs] + [[0]])
        positions = jnp.asarray([[n] for n in lengths] + [[63]])
        logits, _ = step(tokens, positions, cache)
        # One causal forward of every whole sequence, zero-padded after its end (which changes nothing before).
        full = np.zeros((3, 64), int)
        for i, s in enumerate(seqs):
            full[i, :len(s)] = s
        ref = np.asarray(forward(jnp.asarray(full)))
        for i, n in enumerate(lengths):
            assert rel_err(np.asarray(logits)[i, 0], ref[i, n]) <= 1e-5, (lengths, i)
