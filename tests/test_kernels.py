"""The decode attention switch on the paged KV cache: the config value, one decode step of the model and greedy
decoding through the engine with each Pallas kernel (interpret mode) against the XLA path, and ``bench kernel``.

The kernels themselves are tested against a float64 oracle in test_paged_kernels.py; here they run inside
:func:`~dora_jax.models.paged.decode_forward_paged`, which writes each layer's new entry into the pool before the
kernel reads it. Interpret mode runs every grid step as separate XLA ops, so the model and pool are tiny.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from dora_jax.config import ConfigError, ModelConfig, RolloutConfig
from dora_jax.models.build import init_model
from dora_jax.models.decoder import Decoder, DecodeSettings, resolve_attention_impl
from dora_jax.models.paged import SCRATCH_PAGE, PagedKV, decode_forward_paged
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from engine_helpers import prefill_one, step_rows

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3, qkv_bias=True)
XLA = DecodeSettings(attention_impl="xla")
KERNELS = {impl: DecodeSettings(attention_impl=impl, pallas_interpret=True) for impl in ("pallas_gpu", "pallas_tpu")}

# float32 paths that differ only in summation order (the GPU kernel in interpret mode computes in float32).
F32_TOL = 1e-5
# The TPU kernel rounds K and V to bf16 after loading them. The cached entries below are bf16 values, so that
# rounding is exact for them; what it changes is each layer's current-token K and V, computed in float32 (2^-9
# relative). Both layers add that rounding, and the residual stream and the head carry it to the logits: measured
# 3e-3 to 9e-3 relative over seeds 0-2 (2 to 4 x 2^-9). 2e-2 (10 x 2^-9) bounds it and stays 30 times under what
# a step one position off gives (0.6 to 1.2; test_checkers_catch_broken_steps).
TPU_TOL = 2e-2
TOL = {"pallas_gpu": F32_TOL, "pallas_tpu": TPU_TOL}


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


# ----------------------------------------------------------------------------------------------------------
# The config switch.


def test_config_switch():
    for impl in ("xla", "pallas_gpu", "pallas_tpu", "auto"):
        rollout = RolloutConfig(attention_impl=impl, pallas_interpret=True)
        rollout.validate()
        assert DecodeSettings.of(rollout) == DecodeSettings(attention_impl=impl, pallas_interpret=True)
    # The dense cache's kernel is gone: its old value is refused with the reason, not silently mapped.
    with pytest.raises(ConfigError, match=r"rollout\.attention_impl.*'pallas' was the dense cache's kernel"):
        RolloutConfig(attention_impl="pallas").validate()
    with pytest.raises(ConfigError, match=r"rollout\.attention_impl.*'pallas_gpu'") as unknown:
        RolloutConfig(attention_impl="triton").validate()
    assert "dense cache" not in str(unknown.value)
    with pytest.raises(EngineError, match="attention_impl 'pallas': allowed"):
        Engine(init_model(CFG, seed=0), settings=DecodeSettings(attention_impl="pallas"))
    auto = "xla"  # a kernel becomes a platform's default only with a measurement there
    assert resolve_attention_impl(DecodeSettings(attention_impl="auto")) == auto
    assert resolve_attention_impl(RolloutConfig(attention_impl="auto")) == auto
    for impl in ("xla", "pallas_gpu", "pallas_tpu"):
        assert resolve_attention_impl(DecodeSettings(attention_impl=impl)) == impl
        assert resolve_attention_impl(RolloutConfig(attention_impl=impl)) == impl


# ----------------------------------------------------------------------------------------------------------
# One decode step.

P, W = 4, 4  # tokens per page, pages per table
# Rows at position 0, mid-page, the first token of a page, and the table's last position.
POSITIONS = np.array([0, 5, 2 * P, W * P - 1], np.int32)


def step_case(seed=0):
    """A random pool (bf16 values, see TPU_TOL) with page 0 scratch, and each row's table: its own pages up to
    the page of its position, scratch after, as the engine's tables are."""
    rng = np.random.default_rng(seed)
    b = len(POSITIONS)
    n_pages = 1 + b * W
    shape = (CFG.num_kv_heads, CFG.num_layers, n_pages, P, CFG.head_dim)
    k, v = (rng.normal(size=shape).astype(ml_dtypes.bfloat16).astype(np.float32) for _ in range(2))
    tables = (1 + rng.permutation(b * W)).reshape(b, W).astype(np.int32)
    for row, pos in enumerate(POSITIONS):
        tables[row, pos // P + 1:] = SCRATCH_PAGE
    tokens = rng.integers(0, CFG.vocab_size, b).astype(np.int32)
    return PagedKV(jnp.asarray(k), jnp.asarray(v)), jnp.asarray(tables), jnp.asarray(tokens)


def run_step(params, pool, tables, tokens, settings, positions=POSITIONS):
    step = jax.jit(functools.partial(decode_forward_paged, CFG, settings=settings))
    write = jnp.ones(len(positions), bool)
    logits, out = step(params, tokens, jnp.asarray(positions), pool, tables, write)
    return np.asarray(logits), PagedKV(np.asarray(out.k), np.asarray(out.v))


def written(tables, positions, shape):
    """Mask [K, L, N, P, d] of the entries a step writes: every layer and head at each row's (page, row)."""
    mask = np.zeros(shape, bool)
    tables = np.asarray(tables)
    for row, pos in enumerate(positions):
        mask[:, :, tables[row, pos // P], pos % P] = True
    return mask


def check_pool_step(before, after, tables, positions):
    """Entries outside the rows' (page, row) are the input's bit for bit; each of those entries was written."""
    for name in ("k", "v"):
        b, a = np.asarray(getattr(before, name)), np.asarray(getattr(after, name))
        new = written(tables, positions, b.shape)
        np.testing.assert_array_equal(a[~new], b[~new], err_msg=f"{name}: an entry no row writes changed")
        changed = (a != b)[new].reshape(-1, b.shape[-1]).any(axis=-1)
        assert changed.all(), f"{name}: {int((~changed).sum())} written (layer, head, page, row) kept their old value"


@pytest.fixture(scope="module")
def xla_step(model):
    params = model.decode_params(fuse=True)
    pool, tables, tokens = step_case()
    return params, pool, tables, tokens, run_step(params, pool, tables, tokens, XLA)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_decode_step_matches_xla(xla_step, impl):
    params, pool, tables, tokens, (want, want_pool) = xla_step
    got, got_pool = run_step(params, pool, tables, tokens, KERNELS[impl])
    assert np.isfinite(got).all()
    assert rel_err(got, want) <= TOL[impl], rel_err(got, want)
    check_pool_step(pool, want_pool, tables, POSITIONS)
    check_pool_step(pool, got_pool, tables, POSITIONS)
    new = written(tables, POSITIONS, pool.k.shape)
    # Layer 0's new entries come before any attention: only the fused projection's rounding may differ.
    assert rel_err(got_pool.k[:, 0][new[:, 0]], want_pool.k[:, 0][new[:, 0]]) <= 1e-6
    assert rel_err(got_pool.v[:, 0][new[:, 0]], want_pool.v[:, 0][new[:, 0]]) <= 1e-6
    # Layer 1's follow layer 0's attention output.
    assert rel_err(got_pool.k[new], want_pool.k[new]) <= TOL[impl]
    assert rel_err(got_pool.v[new], want_pool.v[new]) <= TOL[impl]


def test_checkers_catch_broken_steps(xla_step):
    """The logits comparison and the pool check reject a step at the wrong position, a write at the wrong row
    and a stray write."""
    params, pool, tables, tokens, (want, want_pool) = xla_step
    # A row one token short: it attends to one token less and writes one row early.
    shifted = POSITIONS.copy()
    shifted[1:] -= 1
    got, got_pool = run_step(params, pool, tables, tokens, XLA, positions=shifted)
    assert rel_err(got, want) > 10 * TPU_TOL
    with pytest.raises(AssertionError):
        check_pool_step(pool, got_pool, tables, POSITIONS)
    stray = PagedKV(want_pool.k.copy(), want_pool.v)
    stray.k[0, 1, SCRATCH_PAGE, 2, 3] += 1.0
    with pytest.raises(AssertionError, match="an entry no row writes changed"):
        check_pool_step(pool, stray, tables, POSITIONS)
    with pytest.raises(AssertionError, match="kept their old value"):
        check_pool_step(pool, pool, tables, POSITIONS)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations (scan bodies, pallas kernels)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _eqns(inner)


def _kernel_pool_operands(settings, pool, tables, tokens, params):
    """Element counts of the largest operand of each Pallas call in the traced decode step."""
    traced = jax.make_jaxpr(functools.partial(decode_forward_paged, CFG, settings=settings))(
        params, tokens, jnp.asarray(POSITIONS), pool, tables, jnp.ones(len(POSITIONS), bool))
    return [max(int(np.prod(v.aval.shape)) for v in e.invars) for e in _eqns(traced.jaxpr)
            if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_read_the_stacked_pool_in_place(model, impl):
    """Each layer's kernel call is handed the whole pool (a view of every layer's pages, with the layer's page
    ids offset), not a slice of its layer: on an accelerator a slice would be copied before every call."""
    pool, tables, tokens = step_case()
    params = model.decode_params(fuse=True)
    sizes = _kernel_pool_operands(KERNELS[impl], pool, tables, tokens, params)
    assert sizes and set(sizes) == {pool.k.size}, (sizes, pool.k.size)
    # The check fails on a step that hands the kernel one layer's pages.
    import dora_jax.models.paged as paged

    def sliced(q, k, v, tables_bw, lengths, **kw):
        n = pool.num_pages
        layer = tables_bw[0, 0] // n  # the offset this layer's tables carry
        layer_k = jax.lax.dynamic_slice_in_dim(k, layer * n, n, axis=1)
        layer_v = jax.lax.dynamic_slice_in_dim(v, layer * n, n, axis=1)
        return real(q, layer_k, layer_v, tables_bw % n, lengths, **kw)

    real = paged.paged_attention
    try:
        paged.paged_attention = sliced
        sizes = _kernel_pool_operands(KERNELS[impl], pool, tables, tokens, params)
    finally:
        paged.paged_attention = real
    assert set(sizes) == {pool.k.size // CFG.num_layers}


# ----------------------------------------------------------------------------------------------------------
# Greedy decoding through the engine.


def test_engine_greedy_identical(model):
    """Prefill, insert and 12 greedy steps of 4 rows with ragged prompts on 4-token pages (every row crosses a
    page boundary, most two) with ``pallas_gpu`` (interpret) and ``xla``: the same tokens and positions,
    log-probs within float32 rounding."""
    state = nnx.state(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CFG.vocab_size, n) for n in (2, 5, 9, 14)]
    shell = nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))  # the engine reads only its config
    results = []
    for settings in (XLA, KERNELS["pallas_gpu"]):
        engine = Engine(shell, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32,
                        settings=settings, page_tokens=4)
        params = engine.prepare_params(state)  # the same weights for both
        decode_state = engine.init_decode_state()
        for slot, prompt in enumerate(prompts):
            batch, _ = prefill_one(engine, prompt, params=params, sample_id=slot,
                                   sampling=RequestSampling(temperature=0.0))
            decode_state = engine.insert_batch(batch, decode_state, [slot])
        steps = []
        for _ in range(12):
            decode_state, rows = step_rows(engine, params, decode_state, filtered=False)
            steps.append(rows)
        results.append(np.stack(steps))  # [steps, B, 5]: token, valid, position, log-prob bits, version
    xla, pallas = results
    assert (xla[:, :, 1] == 1).all()
    positions = xla[:, :, 2]
    crossed = positions[-1] // 4 - positions[0] // 4
    assert (crossed >= 1).all() and (crossed >= 2).sum() >= 2, positions
    np.testing.assert_array_equal(pallas[:, :, [0, 1, 2]], xla[:, :, [0, 1, 2]])
    assert len(np.unique(xla[:, :, 0])) > 4  # not a degenerate constant output
    logp = [np.ascontiguousarray(r[:, :, 3]).view(np.float32) for r in results]
    assert rel_err(logp[1], logp[0]) <= F32_TOL


# ----------------------------------------------------------------------------------------------------------
# bench kernel.


def test_bench_kernel_reports_both_sides():
    from benchmarks.kernel import bench_kernel

    # 32 tokens per slot on 4-token pages: tables of 8 pages; K = 1, G = 2, d = 8, float32.
    out = bench_kernel(batches=(2,), fills=(0.0, 0.5), cache_length=32, page_tokens=4, kv_heads=1, group=2,
                       head_dim=8, dtype="float32", repeats=1)
    on_cpu = jax.default_backend() == "cpu"
    assert ("Pallas interpreter" in out["kernel"]) == on_cpu and out["copy_gbps"] > 0
    assert out["shape"]["table_pages"] == 8 and out["shape"]["page_tokens"] == 4
    empty, half = out["points"]
    q_and_out = 2 * (2 * 2 * 8 * 4)  # q read, output written: [B=2, H=2, d=8] float32 each
    page_bytes = 4 * 1 * 8 * 4  # P * K * d * 4 bytes, of K and of V alike
    for point in (empty, half):
        assert point["kernel_ms"] > 0 and point["xla_ms"] > 0
        assert point["max_rel_diff"] <= F32_TOL
        assert all(0 <= n <= 32 for n in point["lengths"]) and len(point["lengths"]) == 2
    # XLA reads its one class of both slots in blocks of the whole table (8 pages), none when both are empty.
    assert empty["xla_bytes"] == q_and_out and half["xla_bytes"] == 2 * (2 * 8 * page_bytes) + q_and_out
    assert empty["lengths"] == [0, 0] and empty["kernel_bytes"] == q_and_out
    pages = sum(-(-n // 4) for n in half["lengths"])  # each slot's pages up to its length
    assert half["kernel_bytes"] == 2 * pages * page_bytes + q_and_out
