"""The decode attention switch on the paged KV cache: the config value, one decode step of the model and greedy
decoding through the engine with each Pallas kernel (interpret mode) against the XLA path, and ``bench kernel``.

The kernels themselves are tested against a float64 oracle in test_paged_kernels.py; here they run inside
:func:`~dora_jax.models.paged.decode_forward_paged`, which writes each layer's new entry into the pool before the
kernel reads it. Interpret mode runs every grid step as separate XLA ops, so the model and pool are tiny.
"""

import dataclasses
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
from dora_jax.kernels.paged_attention import RAGGED_IMPL
from dora_jax.models.paged import (SCRATCH_PAGE, InterleavedKV, PagedKV, decode_forward_paged, init_pages,
                                   write_pages, write_prompt_pages)
from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
from engine_helpers import prefill_one, step_rows

CFG = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, init_std=0.3, qkv_bias=True)
XLA = DecodeSettings(attention_impl="xla")
KERNELS = {impl: DecodeSettings(attention_impl=impl, pallas_interpret=True) for impl in ("pallas_gpu", "pallas_tpu")}
RAGGED = DecodeSettings(attention_impl=RAGGED_IMPL)
ON_TPU = jax.default_backend() == "tpu"

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
    return np.asarray(logits), type(out)(*(np.asarray(x) for x in out))


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


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_run_per_head_shard_on_a_tensor_mesh(xla_step, impl):
    """With kv heads split over a tensor axis of 2, each device runs the kernel on its own heads' pages: the
    logits of the single-device XLA step, and no all-gather in the compiled step. Without the mesh handed to the
    step, XLA gathers the pool for the kernel (the check can fail)."""
    import re

    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.rollout.programs import pool_shardings
    from dora_jax.sharding import create_mesh

    params, pool, tables, tokens, (want, _) = xla_step
    mesh = create_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    pool = jax.device_put(pool, pool_shardings(mesh, DEFAULT_RULES, pool))
    assert pool.k.sharding.shard_shape(pool.k.shape)[0] == CFG.num_kv_heads // 2
    args = (params, tokens, jnp.asarray(POSITIONS), pool, tables, jnp.ones(len(POSITIONS), bool))
    gathers = []
    for mesh_rules in ((mesh, DEFAULT_RULES), None):
        step = jax.jit(functools.partial(decode_forward_paged, CFG, settings=KERNELS[impl], mesh_rules=mesh_rules))
        gathers.append(len(re.findall(r"= \S+ all-gather\(", step.lower(*args).compile().as_text())))
        if mesh_rules is not None:
            got = np.asarray(step(*args)[0])
            assert rel_err(got, want) <= TOL[impl], rel_err(got, want)
    assert gathers[0] == 0 < gathers[1], gathers


def test_pool_layouts_keep_what_a_kernel_reads_whole():
    """Pages split over the batch axes only where a kernel's slots split too (the XLA path may read pages across
    devices; a kernel reads one whole pool per call), and an interleaved pool's heads over the tensor axes only in
    whole (key, value) pairs."""
    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.rollout.programs import pool_shardings
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices=jax.devices()[:4])
    model = init_model(dataclasses.replace(CFG, num_heads=8), mesh, DEFAULT_RULES, seed=0)
    specs = {}
    for impl in ("xla", "pallas_gpu"):
        settings = DecodeSettings(attention_impl=impl, pallas_interpret=True)
        # 3 slots do not split over data = 2; 26 pages would.
        engine = Engine(model, max_concurrent_decodes=3, max_prefill_length=16, max_target_length=32, page_tokens=4,
                        mesh=mesh, settings=settings, num_pages=25)
        assert engine.shards == 1 and engine.pool.num_pages == 26
        specs[impl] = tuple(engine.pool.k.sharding.spec)
    assert specs["xla"][:3] == ("tensor", None, "data")
    assert specs["pallas_gpu"][0] == "tensor" and "data" not in specs["pallas_gpu"]
    for kv_heads, split in ((1, None), (2, "tensor"), (3, None)):
        pool = InterleavedKV(jnp.zeros((2, 6, P, 2 * kv_heads, 8)))
        spec = tuple(pool_shardings(mesh, DEFAULT_RULES, pool, split_pages=False).kv.spec) + (None,) * 5
        assert spec[3] == split, (kv_heads, spec)


# ----------------------------------------------------------------------------------------------------------
# The interleaved pool of the ragged TPU kernel.


def as_interleaved(pool: PagedKV) -> InterleavedKV:
    """A [K, L, N, P, d] pool's contents as [L, N, P, 2K, d] (head h's key at 2h, value at 2h + 1), in numpy."""
    k, v = np.asarray(pool.k), np.asarray(pool.v)
    out = np.empty((k.shape[1], k.shape[2], k.shape[3], 2 * k.shape[0], k.shape[4]), k.dtype)
    out[..., 0::2, :] = k.transpose(1, 2, 3, 0, 4)
    out[..., 1::2, :] = v.transpose(1, 2, 3, 0, 4)
    return InterleavedKV(jnp.asarray(out))


def ragged_stand_in(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, mask_value):
    """``ragged_paged_attention``'s contract for one query per sequence at its last token, traceable (the shipped
    reference is eager only): every table page gathered, positions past ``kv_lens`` masked."""
    del cu_q_lens, num_seqs
    b, h, d = q.shape
    kv = kv_pages.shape[2] // 2
    k, v = (kv_pages[:, :, j::2][page_indices].reshape(b, -1, kv, d) for j in (0, 1))  # [B, W * P, K, d]
    s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(b, kv, h // kv, d), k, preferred_element_type=jnp.float32)
    s = jnp.where((jnp.arange(k.shape[1]) < kv_lens[:, None])[:, None, None], s * sm_scale, mask_value)
    out = jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    return out.reshape(b, h, d).astype(q.dtype)


def test_ragged_stand_in_is_the_shipped_reference():
    """The stand-in the decode-step test below runs in the kernel's place computes what the kernel's shipped
    reference does on the same arguments (the wrapper's, eagerly)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    from dora_jax.kernels.paged_attention import ragged_paged_attention

    pool, tables, _ = step_case(1)
    kv = as_interleaved(pool).kv[1]  # layer 1: [N, P, 2K, d]
    q = jnp.asarray(np.random.default_rng(1).normal(size=(len(POSITIONS), CFG.num_heads, CFG.head_dim)), jnp.float32)
    lengths = jnp.asarray(POSITIONS + 1)
    want = ragged_paged_attention(q, kv, tables, lengths, kernel=ref_ragged_paged_attention)
    got = ragged_paged_attention(q, kv, tables, lengths, kernel=ragged_stand_in)
    assert rel_err(got, want) <= 1e-6
    short = ragged_paged_attention(q, kv, tables, lengths - 1, kernel=ragged_stand_in)
    assert rel_err(short, want) > 1e-2  # one token fewer is seen by the comparison


def test_interleaved_pool_holds_what_the_split_pool_holds():
    """Writes of decode tokens and prompts, and the page copies of request moves, leave the interleaved pool
    holding exactly the split pool's contents, interleaved."""
    rng = np.random.default_rng(3)
    split = PagedKV(*(jnp.asarray(rng.normal(size=(2, 3, 9, P, 8)), jnp.float32) for _ in range(2)))
    inter = as_interleaved(split)
    k_new, v_new = (jnp.asarray(rng.normal(size=(3, 4, 2, 8)), jnp.float32) for _ in range(2))  # [L, B, K, d]
    page, row = jnp.asarray([1, 4, 4, 0]), jnp.asarray([0, 1, 3, 2])
    split, inter = (write_pages(x, k_new, v_new, page, row) for x in (split, inter))
    np.testing.assert_array_equal(as_interleaved(split).kv, inter.kv)
    k_p, v_p = (jnp.asarray(rng.normal(size=(3, 2, 2, 5, 8)), jnp.float32) for _ in range(2))  # [L, R, K, T, d]
    # Two prompts of 5 tokens: a full page and the first row of the next.
    page_rt, row_rt = jnp.asarray([[2, 2, 2, 2, 3], [5, 5, 5, 5, 6]]), jnp.asarray([[0, 1, 2, 3, 0]] * 2)
    split, inter = (write_prompt_pages(x, k_p, v_p, page_rt, row_rt) for x in (split, inter))
    np.testing.assert_array_equal(as_interleaved(split).kv, inter.kv)
    moved = jnp.asarray([2, 7, 0])
    np.testing.assert_array_equal(as_interleaved(split.take(moved)).kv, inter.take(moved).kv)
    dst = jnp.asarray([8, 1, 4])
    np.testing.assert_array_equal(as_interleaved(split.put(dst, split.take(moved))).kv,
                                  inter.put(dst, inter.take(moved)).kv)
    assert inter.num_pages == split.num_pages == 9 and inter.page_tokens == split.page_tokens == P
    assert isinstance(init_pages(CFG, 5, P, impl=RAGGED_IMPL), InterleavedKV)
    assert init_pages(CFG, 5, P, impl=RAGGED_IMPL).kv.shape == (CFG.num_layers, 5, P, 2 * CFG.num_kv_heads,
                                                                 CFG.head_dim)


def spy_ragged(monkeypatch) -> list:
    """The stand-in in the shipped ragged kernel's place; returns the list of the pool shapes it is handed."""
    import dora_jax.kernels.paged_attention as kernels

    seen = []

    def spy(*args, **kw):
        seen.append(args[1].shape)
        return ragged_stand_in(*args, **kw)

    monkeypatch.setattr(kernels, "_shipped_ragged_kernel", lambda: spy)
    return seen


def test_ragged_decode_step_matches_xla(xla_step, monkeypatch):
    """One decode step over the interleaved pool, with the stand-in in the kernel's place: the logits of the XLA
    path on the split pool, the same entries written, and the kernel handed every layer's pages at once."""
    params, pool, tables, tokens, (want, want_pool) = xla_step
    seen = spy_ragged(monkeypatch)
    got, got_pool = run_step(params, as_interleaved(pool), tables, tokens, RAGGED)
    assert rel_err(got, want) <= F32_TOL, rel_err(got, want)
    assert rel_err(got_pool.kv, as_interleaved(want_pool).kv) <= F32_TOL
    unwritten = ~as_interleaved(PagedKV(*(written(tables, POSITIONS, pool.k.shape),) * 2)).kv
    np.testing.assert_array_equal(np.asarray(got_pool.kv)[unwritten], np.asarray(as_interleaved(pool).kv)[unwritten])
    n = pool.num_pages
    assert set(seen) == {(CFG.num_layers * n, P, 2 * CFG.num_kv_heads, CFG.head_dim)}
    # kv heads over a tensor axis of 2: each device's kernel sees its heads' (key, value) pairs.
    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.rollout.programs import pool_shardings
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    inter = as_interleaved(pool)
    inter = jax.device_put(inter, pool_shardings(mesh, DEFAULT_RULES, inter))
    seen.clear()
    step = jax.jit(functools.partial(decode_forward_paged, CFG, settings=RAGGED, mesh_rules=(mesh, DEFAULT_RULES)))
    sharded, _ = step(params, tokens, jnp.asarray(POSITIONS), inter, tables, jnp.ones(len(POSITIONS), bool))
    assert rel_err(np.asarray(sharded), want) <= F32_TOL
    assert set(seen) == {(CFG.num_layers * n, P, CFG.num_kv_heads, CFG.head_dim)}
    with pytest.raises(ValueError, match="cannot read a PagedKV pool"):
        run_step(params, pool, tables, tokens, RAGGED)
    if not ON_TPU:
        with pytest.raises(EngineError, match="runs on TPU only"):
            Engine(init_model(CFG, seed=0), settings=RAGGED)


def test_ragged_decode_step_per_batch_shard(xla_step, monkeypatch):
    """The interleaved pool split over 2 batch shards (each a copy of the step's pool, the tables' page ids
    within a shard) on 2 batch x 2 tensor devices, the stand-in in the kernel's place: each device's kernel sees
    its shard's pages of every layer and its heads' (key, value) pairs, the logits are the XLA path's on one
    pool, and the compiled step copies neither the donated pool nor its view (it fails without the donation)."""
    from dora_jax.config import DEFAULT_RULES, MeshConfig
    from dora_jax.rollout.programs import pool_shardings
    from dora_jax.sharding import create_mesh

    params, pool, tables, tokens, (want, _) = xla_step
    seen = spy_ragged(monkeypatch)
    mesh = create_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices=jax.devices()[:4])
    two = as_interleaved(PagedKV(*(jnp.concatenate([x, x], axis=2) for x in pool)))
    two = jax.device_put(two, pool_shardings(mesh, DEFAULT_RULES, two))
    step = jax.jit(functools.partial(decode_forward_paged, CFG, settings=RAGGED, shards=2,
                                     mesh_rules=(mesh, DEFAULT_RULES)), donate_argnums=(3,))
    args = (params, tokens, jnp.asarray(POSITIONS), two, tables, jnp.ones(len(POSITIONS), bool))
    # The donated pool is written and read in place on each device: no copy of it, or of its layers' view.
    local = two.kv.sharding.shard_shape(two.kv.shape)
    shapes = [f"[{','.join(map(str, s))}]" for s in (local, (local[0] * local[1],) + local[2:])]
    hlo = step.lower(*args).compile().as_text()
    assert not [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in shapes)]
    got, _ = step(*args)
    assert rel_err(np.asarray(got), want) <= F32_TOL
    assert set(seen) == {(CFG.num_layers * pool.num_pages, P, CFG.num_kv_heads, CFG.head_dim)}


# ----------------------------------------------------------------------------------------------------------
# Greedy decoding through the engine.


def _greedy_steps(model, settings, mesh=None):
    """Prefill, insert and 12 greedy steps of 4 rows with ragged prompts on 4-token pages (every row crosses a
    page boundary, most two): ``[steps, B, 5]`` (token, valid, position, log-prob bits, version)."""
    state = nnx.state(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, CFG.vocab_size, n) for n in (2, 5, 9, 14)]
    shell = nnx.eval_shape(lambda: Decoder(CFG, rngs=nnx.Rngs(0)))  # the engine reads only its config
    engine = Engine(shell, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=32,
                    settings=settings, page_tokens=4, mesh=mesh)
    assert engine.shards == (1 if mesh is None else 2)
    params = engine.prepare_params(state)  # the same weights for every setting
    decode_state = engine.init_decode_state()
    for slot, prompt in enumerate(prompts):
        batch, _ = prefill_one(engine, prompt, params=params, sample_id=slot,
                               sampling=RequestSampling(temperature=0.0))
        decode_state = engine.insert_batch(batch, decode_state, [slot])
    steps = []
    for _ in range(12):
        decode_state, rows = step_rows(engine, params, decode_state, filtered=False)
        steps.append(rows)
    return np.stack(steps)


def _same_greedy(got, want, tol):
    assert (want[:, :, 1] == 1).all()
    positions = want[:, :, 2]
    crossed = positions[-1] // 4 - positions[0] // 4
    assert (crossed >= 1).all() and (crossed >= 2).sum() >= 2, positions
    np.testing.assert_array_equal(got[:, :, [0, 1, 2]], want[:, :, [0, 1, 2]])
    assert len(np.unique(want[:, :, 0])) > 4  # not a degenerate constant output
    logp = [np.ascontiguousarray(r[:, :, 3]).view(np.float32) for r in (got, want)]
    assert rel_err(logp[0], logp[1]) <= tol


def test_engine_greedy_identical(model):
    """``pallas_gpu`` (interpret) and ``xla`` through the engine: the same tokens and positions, log-probs within
    float32 rounding."""
    _same_greedy(_greedy_steps(model, KERNELS["pallas_gpu"]), _greedy_steps(model, XLA), F32_TOL)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_engine_greedy_identical_with_a_kernel_per_batch_shard(model, impl):
    """On a mesh of 2 batch shards x 2 tensor shards, each device runs the kernel over its own slots' pages and
    its own kv heads: the tokens and positions of the same kernel on one device, log-probs within float32
    rounding (the GPU kernel's equal ``xla``'s, test_engine_greedy_identical)."""
    from dora_jax.config import MeshConfig
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices=jax.devices()[:4])
    _same_greedy(_greedy_steps(model, KERNELS[impl], mesh), _greedy_steps(model, KERNELS[impl]), F32_TOL)


def test_a_kernel_over_batch_shards_without_their_mesh_is_refused(xla_step):
    """Slots split over batch shards hold page ids within their shard: a kernel runs on them only per shard, on
    the mesh that makes them; without it the step is refused, naming the choice and the way out."""
    params, pool, tables, tokens, _ = xla_step
    with pytest.raises(ValueError, match="'pallas_gpu' with slots split over 2 batch shards.*attention_impl='xla'"):
        decode_forward_paged(CFG, params, tokens, jnp.asarray(POSITIONS), pool, tables, jnp.ones(len(POSITIONS), bool),
                             settings=KERNELS["pallas_gpu"], shards=2)


@pytest.mark.skipif(not ON_TPU, reason="JAX's ragged paged attention runs on a TPU only")
def test_engine_greedy_identical_ragged_on_tpu(model):
    """The ragged TPU kernel through the engine (its interleaved pool, prompts written into it, the kernel
    itself): the XLA path's greedy tokens. Log-probs within the TPU bound: a TPU's default matmul precision
    takes float32 operands through bf16 passes."""
    _same_greedy(_greedy_steps(model, RAGGED), _greedy_steps(model, XLA), TPU_TOL)


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
