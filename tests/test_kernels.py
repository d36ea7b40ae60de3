"""The ragged decode-attention kernels against their reference, and the engine with the kernel switched on.

CPU runs both Pallas variants in interpret mode (the GPU/Triton one and the TPU/Mosaic one, with scalar
prefetch) and lowers both for their real platforms (``jax.export``: the Triton and Mosaic lowerings run
without a device). The ``gpu`` / ``tpu`` marked tests run the compiled kernels and are skipped elsewhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from dora_jax.config import ConfigError, ModelConfig, RolloutConfig
from dora_jax.kernels.ragged_decode_attention import (BlockSizes, ragged_decode_attention,
                                                      reference_ragged_decode_attention)
from dora_jax.models.build import init_model
from dora_jax.models.decoder import Decoder, DecodeSettings, decode_forward, init_cache, resolve_attention_impl
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling

# Output tolerance by dtype: float32 differs only by summation order; bfloat16 adds one rounding of the output
# (2^-8 relative) on top of identical float32 math.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Kernel variant -> (cache length, block) used in interpret mode: several blocks per row, and on TPU blocks of
# 128 lanes (the smallest key tile Mosaic accepts).
SHAPES = {"gpu": (64, 16), "tpu": (256, 128)}


def _inputs(b, k, g, d, s, dtype, seed=0, lengths=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, k, g, d)), dtype)
    kc = jnp.asarray(rng.normal(size=(b, k, d, s)), dtype)
    vc = jnp.asarray(rng.normal(size=(b, k, s, d)), dtype)
    if lengths is None:  # always an empty row and a full row, the rest random
        lengths = np.concatenate([[0, s], rng.integers(1, s, b - 2)])
    return q, kc, vc, jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_interpret_matches_reference(impl, g, dtype):
    s, block = SHAPES[impl]
    q, kc, vc, lengths = _inputs(3, 2, g, 8, s, dtype, seed=g)
    # One call with the statistics; the plain call is this output cast to the input dtype.
    o32, m, l_sum = ragged_decode_attention(q, kc, vc, lengths, implementation=impl, block_sizes=BlockSizes(block),
                                            interpret=True, return_stats=True)
    r32, rm, rl = reference_ragged_decode_attention(q, kc, vc, lengths, return_stats=True)
    assert o32.dtype == jnp.float32 and o32.shape == q.shape
    assert rel_err(o32.astype(dtype), r32.astype(dtype)) <= TOL[dtype]
    assert rel_err(o32, r32) <= 1e-5  # the same float32 math on the same (rounded) inputs
    assert rel_err(m[1:], rm[1:]) <= 1e-5 and rel_err(l_sum, rl) <= 1e-5
    np.testing.assert_array_equal(np.asarray(o32[0]), 0.0)  # length 0: zeros
    np.testing.assert_array_equal(np.asarray(l_sum[0]), 0.0)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_blocks_past_length_are_not_read(impl):
    """NaN in every block past a row's last valid block leaves the output finite and equal to the reference:
    those blocks are skipped (GPU: loop bound; TPU: ``pl.when`` and a clamped index map)."""
    s, block = SHAPES[impl]
    lengths = np.array([0, 1, block, block + 3])
    q, kc, vc, lengths_j = _inputs(4, 2, 2, 8, s, jnp.float32, lengths=lengths)
    ref = reference_ragged_decode_attention(q, kc, vc, lengths_j)
    first_unread = -(-lengths // block) * block
    past = np.arange(s)[None, :] >= first_unread[:, None]  # [B, S]
    kc = jnp.where(past[:, None, None, :], jnp.nan, kc)
    vc = jnp.where(past[:, None, :, None], jnp.nan, vc)
    out = ragged_decode_attention(q, kc, vc, lengths_j, implementation=impl, block_sizes=BlockSizes(block_kv=block),
                                  interpret=True)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("s,block,splits,expect", [(64, 16, 1, 1), (64, 16, 2, 2), (64, 16, 4, 4), (64, 16, 8, 4),
                                                    (48, 16, 4, 1), (96, 16, 2, 1), (128, 64, 4, 2)])
def test_gpu_split_cache_merges_exactly(s, block, splits, expect):
    """The GPU variant splits the cache into chunks handled by separate programs and merges them: any split
    count gives the reference, for rows ending before, on and after chunk boundaries; counts that would leave a
    chunk of no whole blocks or of a shape Triton cannot tile fall back to fewer (a cache of 48 or 96: one chunk)."""
    from dora_jax.kernels.ragged_decode_attention import _split_plan

    assert _split_plan(s, block, splits) == expect
    chunk = s // expect
    lengths = np.array([0, 1, chunk - 1, chunk, chunk + 1, s - 1, s, min(2 * chunk + 3, s)])
    q, kc, vc, lengths_j = _inputs(len(lengths), 2, 2, 8, s, jnp.float32, seed=s + splits, lengths=lengths)
    o32, m, l_sum = ragged_decode_attention(q, kc, vc, lengths_j, implementation="gpu", interpret=True,
                                            block_sizes=BlockSizes(block_kv=block, num_splits=splits),
                                            return_stats=True)
    r32, rm, rl = reference_ragged_decode_attention(q, kc, vc, lengths_j, return_stats=True)
    assert rel_err(o32, r32) <= 1e-5
    assert rel_err(m[1:], rm[1:]) <= 1e-5 and rel_err(l_sum, rl) <= 1e-5
    np.testing.assert_array_equal(np.asarray(o32[0]), 0.0)


def test_query_heads_not_a_power_of_two():
    """G = 3 (the engine test model): the GPU variant pads the query rows to 4 and drops the padding."""
    q, kc, vc, lengths = _inputs(3, 2, 3, 8, 32, jnp.float32)
    out = ragged_decode_attention(q, kc, vc, lengths, implementation="gpu", interpret=True)
    assert rel_err(out, reference_ragged_decode_attention(q, kc, vc, lengths)) <= 1e-5


def test_bad_arguments():
    q, kc, vc, lengths = _inputs(3, 2, 2, 8, 32, jnp.float32)
    with pytest.raises(ValueError, match="shapes do not agree"):
        ragged_decode_attention(q, kc, vc[:, :, :16], lengths, interpret=True)
    with pytest.raises(ValueError, match="implementation 'cuda'"):
        ragged_decode_attention(q, kc, vc, lengths, implementation="cuda", interpret=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="no compiled kernel on CPU"):
            ragged_decode_attention(q, kc, vc, lengths)
    with pytest.raises(ValueError, match="BlockSizes.block_kv"):
        BlockSizes(block_kv=48)
    with pytest.raises(ValueError, match="BlockSizes.num_splits"):
        BlockSizes(num_splits=3)
    with pytest.raises(ValueError, match="head dim 12"):
        q12, k12, v12, _ = _inputs(3, 2, 2, 12, 32, jnp.float32)
        ragged_decode_attention(q12, k12, v12, lengths, implementation="gpu", interpret=True)


@pytest.mark.parametrize("impl,platform,target", [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                                  ("tpu", "tpu", "tpu_custom_call")])
def test_lowers_for_hardware(impl, platform, target):
    """The compiled path lowers for its platform (Triton IR / Mosaic module built) at a realistic shape."""
    from jax import export

    args = (jax.ShapeDtypeStruct((4, 2, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((4, 2, 128, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 2, 1024, 128), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    fn = jax.jit(functools.partial(ragged_decode_attention, implementation=impl))
    # Pallas custom calls carry no serialization guarantee; only the lowering is checked here.
    checks = [export.DisabledSafetyCheck.custom_call(target)]
    try:
        exported = export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
    except RuntimeError as e:  # JAX >= 0.11 asks the device for its compute capability before lowering Triton
        if impl == "gpu" and "No supported GPU devices" in str(e):
            pytest.skip("this JAX lowers Triton kernels only with a GPU present (test_compiled_gpu covers it there)")
        raise
    assert target in exported.mlir_module()


# ----------------------------------------------------------------------------------------------------------
# Compiled kernels on hardware.


def _compiled_vs_reference(impl):
    for dtype in (jnp.float32, jnp.bfloat16):
        for g in (1, 2, 4):
            q, kc, vc, lengths = _inputs(8, 4, g, 128, 2048, dtype, seed=g)
            out = jax.jit(functools.partial(ragged_decode_attention, implementation=impl))(q, kc, vc, lengths)
            ref = jax.jit(reference_ragged_decode_attention)(q, kc, vc, lengths)
            assert rel_err(out, ref) <= TOL[dtype], (impl, dtype, g)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_gpu():
    _compiled_vs_reference("gpu")


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_compiled_tpu():
    _compiled_vs_reference("tpu")


# ----------------------------------------------------------------------------------------------------------
# The switch in the model and the engine.

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3, qkv_bias=True)
XLA = DecodeSettings(attention_impl="xla")
PALLAS = DecodeSettings(attention_impl="pallas", pallas_interpret=True)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def test_config_switch():
    with pytest.raises(ConfigError, match="rollout.attention_impl"):
        RolloutConfig(attention_impl="triton").validate()
    with pytest.raises(EngineError, match="attention_impl 'triton'"):
        Engine(init_model(CFG, seed=0), settings=DecodeSettings(attention_impl="triton"))
    rollout = RolloutConfig(attention_impl="pallas", pallas_interpret=True)
    rollout.validate()
    assert DecodeSettings.of(rollout) == PALLAS
    auto = resolve_attention_impl(DecodeSettings(attention_impl="auto"))
    assert auto == ("pallas" if jax.default_backend() == "tpu" else "xla")  # XLA measured faster on GPU
    assert resolve_attention_impl(PALLAS) == "pallas" and resolve_attention_impl(rollout) == "pallas"


def test_decode_step_matches_xla(model):
    """One decode step over a random cache, rows at position 0 (empty cache part), mid and last slot."""
    params = model.decode_params(fuse=True)
    rng = np.random.default_rng(0)
    s = 32
    cache = init_cache(CFG, 4, s)
    cache = type(cache)(jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                        jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
    tokens = jnp.asarray(rng.integers(0, 96, (4, 1)), jnp.int32)
    positions = jnp.asarray([[0], [5], [17], [s - 1]], jnp.int32)
    want, want_cache = jax.jit(functools.partial(decode_forward, CFG, settings=XLA))(params, tokens, positions, cache)
    got, got_cache = jax.jit(functools.partial(decode_forward, CFG, settings=PALLAS))(params, tokens, positions,
                                                                                     cache)
    assert rel_err(got, want) <= 1e-5
    # Each step writes only its rows' new entries (k [L, B, K, d, S], v [L, B, K, S, d]): every other entry is the
    # input's, exactly. Layer 0's new entries do not depend on attention: the two programs compute them alike, up
    # to the rounding of one projection (each program fuses it its own way); later layers' follow attention's.
    for name, slot_axis in (("k", 4), ("v", 3)):
        g, w, before = (np.asarray(getattr(c, name)) for c in (got_cache, want_cache, cache))
        new = np.zeros(g.shape, bool)
        for row, p in enumerate(np.asarray(positions)[:, 0]):
            new[(slice(None), row) + (slice(None),) * (slot_axis - 2) + (p,)] = True
        np.testing.assert_array_equal(g[~new], before[~new], err_msg=name)
        np.testing.assert_array_equal(w[~new], before[~new], err_msg=name)
        assert rel_err(g[0][new[0]], w[0][new[0]]) <= 1e-6, name
    assert rel_err(got_cache.k, want_cache.k) <= 1e-5 and rel_err(got_cache.v, want_cache.v) <= 1e-5


def test_engine_greedy_identical(model):
    """Greedy decoding through the engine (prefill, insert, 12 steps of 4 rows with ragged prompt lengths) with
    ``attention_impl="pallas"`` (interpret) and ``"xla"``: the same tokens, log-probs within float32 rounding."""
    state = nnx.state(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 96, n) for n in (2, 5, 9, 14)]
    results = []
    shell = nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))  # the engine reads only its config
    for settings in (XLA, PALLAS):
        engine = Engine(shell, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32,
                        settings=settings)
        params = engine.prepare_params(state)  # the same weights for both
        decode_state = engine.init_decode_state()
        for slot, prompt in enumerate(prompts):
            prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=len(prompt), sample_id=slot,
                                       sampling=RequestSampling(temperature=0.0))
            decode_state = engine.insert(prefix, decode_state, slot)
        steps = []
        for _ in range(12):
            decode_state, out = engine.generate(params, decode_state, filtered=False)
            steps.append(np.asarray(out.data))
        results.append(np.stack(steps))  # [steps, B, 5]: token, valid, position, log-prob bits, version
    xla, pallas = results
    assert (xla[:, :, 1] == 1).all()
    np.testing.assert_array_equal(pallas[:, :, [0, 2]], xla[:, :, [0, 2]])
    assert len(np.unique(xla[:, :, 0])) > 4  # not a degenerate constant output
    logp = [r[:, :, 3].copy().view(np.float32) for r in results]
    assert rel_err(logp[1], logp[0]) <= 1e-5


def test_bench_kernel_reports_both_sides():
    from benchmarks.kernel import bench_kernel

    out = bench_kernel(batches=(2,), fills=(0.5,), cache_length=32, kv_heads=1, group=2, head_dim=8,
                       dtype="float32", repeats=1)
    on_cpu = jax.default_backend() == "cpu"
    assert ("Pallas interpreter" in out["kernel"]) == on_cpu and out["copy_gbps"] > 0
    (point,) = out["points"]
    assert point["kernel_ms"] > 0 and point["xla_ms"] > 0
    assert point["xla_bytes"] == 2 * (2 * 1 * 8 * 32 * 4) + 2 * 2 * 1 * 2 * 8 * 4  # whole cache + q and out
    assert point["kernel_bytes"] == round(point["mean_length"] * 2) * 8 * 2 * 4 + 2 * 2 * 1 * 2 * 8 * 4
