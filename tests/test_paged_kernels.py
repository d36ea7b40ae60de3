"""Paged decode attention (dora_jax.kernels.paged_attention): every implementation against a float64 NumPy
oracle written here, one slot and one head at a time from the slot's own table.

The Pallas kernels run in interpret mode on the CPU (the GPU kernel through its ``interpret`` flag, the TPU
kernel under ``pltpu.force_tpu_interpret_mode``), so sizes are tiny: interpret mode executes every grid step
as separate XLA ops. JAX's ragged TPU kernel has no interpreter: off a TPU its wrapper is checked through the
kernel's shipped reference (``ref_ragged_paged_attention``, same arguments, eager only), on a TPU through the
kernel itself.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import rel_err
from jax.experimental.pallas import tpu as pltpu

from dora_jax.kernels.paged_attention import IMPLEMENTATIONS, RAGGED_IMPL, paged_attention, ragged_paged_attention

ON_TPU = jax.default_backend() == "tpu"

# float32: the oracle is float64, and every implementation sums at most W * P = 16 products of length d = 16 in
# float32 (eps 1.2e-7) before a softmax of magnitude-one weights; they reach ~2e-7, so 2e-6 leaves 10x headroom.
F32_TOL = 2e-6
# bf16 inputs: the oracle sees the same bf16 values, so the error is only the kernels' own bf16 roundings: the
# output (2^-9 relative), the scaled q (1/sqrt(16) is exact, so none here), and in the GPU kernel the
# probabilities and the per-partition partial outputs (2^-9 each): they reach ~4e-3, under 1e-2.
BF16_TOL = 1e-2

K, P, D, W, N = 2, 4, 16, 4, 7  # kv heads, tokens per page, head dim, table width, pool pages


def oracle(q, k_pages, v_pages, tables, lengths):
    """float64 decode attention, built independently of the module: loop over slots and heads."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    n_slots, n_heads, d = q.shape
    n_kv, _, page, _ = k_pages.shape
    group = n_heads // n_kv
    out = np.zeros_like(q)
    for b in range(n_slots):
        length = min(int(lengths[b]), tables.shape[1] * page)
        if length == 0:
            continue
        pages = [int(tables[b, i // page]) for i in range(length)]
        rows = [i % page for i in range(length)]
        keys = k_pages[:, pages, rows]  # [K, length, d]: token i of the slot at position i
        values = v_pages[:, pages, rows]
        for h in range(n_heads):
            logits = keys[h // group] @ q[b, h] / math.sqrt(d)
            weights = np.exp(logits - logits.max())
            out[b, h] = (weights / weights.sum()) @ values[h // group]
    return out


def interleaved(k_pages, v_pages):
    """``[K, N, P, d]`` keys and values as the ragged kernel's ``[N, P, 2K, d]``: head h's key at 2h, value at
    2h + 1 (built here with numpy, apart from the library's ``interleave_heads``)."""
    k, v = np.asarray(k_pages), np.asarray(v_pages)
    n_kv, n, page, d = k.shape
    out = np.empty((n, page, 2 * n_kv, d), k.dtype)
    out[:, :, 0::2] = k.transpose(1, 2, 0, 3)
    out[:, :, 1::2] = v.transpose(1, 2, 0, 3)
    return out


def ragged_kernel():
    """The ragged kernel on a TPU; elsewhere its shipped reference, which takes the same arguments."""
    if ON_TPU:
        return None
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    return ref_ragged_paged_attention


def run(impl, q, k_pages, v_pages, tables, lengths, **kwargs):
    if impl == RAGGED_IMPL:
        assert not kwargs
        return ragged_paged_attention(q, jnp.asarray(interleaved(k_pages, v_pages)), tables, lengths,
                                      kernel=ragged_kernel())
    if impl == "pallas_tpu":
        with pltpu.force_tpu_interpret_mode():
            return paged_attention(q, k_pages, v_pages, tables, lengths, impl=impl, **kwargs)
    return paged_attention(q, k_pages, v_pages, tables, lengths, impl=impl, interpret=impl == "pallas_gpu", **kwargs)


def kv_as_seen_by(impl, pages):
    """The TPU kernel rounds K and V to bf16 after loading them (documented): its oracle gets those values."""
    if impl == "pallas_tpu":
        return np.asarray(pages).astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.asarray(pages)


def make_case(seed, lengths, *, group=2, dtype=np.float32, n_kv=K, width=W, n_pages=N):
    """Random pool and queries; each slot's table holds random page ids, junk (but valid) past its length."""
    rng = np.random.default_rng(seed)
    k_pages = rng.standard_normal((n_kv, n_pages, P, D)).astype(dtype)
    v_pages = rng.standard_normal((n_kv, n_pages, P, D)).astype(dtype)
    # Scaled so the logits spread over several units: a near-uniform softmax would hide wrong keys.
    q = (2.0 * rng.standard_normal((len(lengths), n_kv * group, D))).astype(dtype)
    tables = rng.integers(0, n_pages, (len(lengths), width)).astype(np.int32)
    return q, k_pages, v_pages, tables, np.asarray(lengths, np.int32)


# Ragged: one token, exactly one page, one past a page boundary, the full table, empty, mid-page.
RAGGED = [1, P, P + 1, W * P, 0, 2 * P + 3]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_matches_oracle_on_ragged_lengths(impl, dtype, group):
    q, k_pages, v_pages, tables, lengths = make_case(0, RAGGED, group=group, dtype=dtype)
    # Slots 1 and 2 read the same first page; N = 7 < B * W also makes random tables share pages.
    tables[2, 0] = tables[1, 0]
    out = run(impl, jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
              jnp.asarray(lengths))
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    assert not out[4].any(), "a slot of length 0 must give zeros"
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert rel_err(out, expected) < (F32_TOL if dtype == np.float32 else BF16_TOL)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_group_of_eight(impl):
    # G a multiple of 8 takes the TPU kernel's other query layout; G = 8 < 16 still pads the GPU kernel's block.
    q, k_pages, v_pages, tables, lengths = make_case(1, [P + 2, W * P, 3], group=8, n_kv=1)
    out = run(impl, *map(jnp.asarray, (q, k_pages, v_pages, tables, lengths)))
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert rel_err(out, expected) < F32_TOL


@pytest.mark.parametrize("pages_per_compute_block", [1, 2, W])
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_compute_block_sizes(impl, pages_per_compute_block):
    # One page per block makes the kernels loop and merge across blocks (and, on the GPU, across W partitions);
    # a whole-table block loads masked positions past every short slot.
    q, k_pages, v_pages, tables, lengths = make_case(2, [3, W * P, P, 2 * P + 1])
    out = run(impl, *map(jnp.asarray, (q, k_pages, v_pages, tables, lengths)),
              pages_per_compute_block=pages_per_compute_block)
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert rel_err(out, expected) < F32_TOL


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_junk_past_length_and_shared_pages(impl):
    q, k_pages, v_pages, tables, lengths = make_case(3, [P + 1, P + 1, 2 * P, 1])
    # Slots 0 and 1: the same table and query, so the same output. Slot 2 starts at slot 0's second page; slot 3
    # at slot 0's first.
    q[1] = q[0]
    tables[1] = tables[0]
    tables[2, 0] = tables[0, 1]
    tables[3, 0] = tables[0, 0]
    used = -(-lengths // P)  # pages each slot reads
    clean, junk_high = tables.copy(), tables.copy()
    for b, n_used in enumerate(used):
        clean[b, n_used:] = 0
        junk_high[b, n_used:] = N - 1
    outs = [np.asarray(run(impl, *map(jnp.asarray, (q, k_pages, v_pages, t, lengths))))
            for t in (tables, clean, junk_high)]
    # Masked positions contribute exp(mask - max) == 0 exactly, whatever page they came from.
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[0][0], outs[0][1])
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert rel_err(outs[0], expected) < F32_TOL


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_edge_lengths(impl):
    # An all-empty batch, then lengths past the table (clipped to W * P) beside an empty slot.
    q, k_pages, v_pages, tables, _ = make_case(4, [0, 0])
    empty = run(impl, *map(jnp.asarray, (q, k_pages, v_pages, tables, np.zeros(2, np.int32))))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros_like(q))
    lengths = np.asarray([W * P + 3, 0], np.int32)
    out = np.asarray(run(impl, *map(jnp.asarray, (q, k_pages, v_pages, tables, lengths))))
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert np.isfinite(out).all() and not out[1].any()
    assert rel_err(out, expected) < F32_TOL


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_under_jit(impl):
    if impl == RAGGED_IMPL and not ON_TPU:
        pytest.skip("the ragged kernel runs on a TPU only, and its reference does not trace (eager slicing)")
    q, k_pages, v_pages, tables, lengths = make_case(5, [2, W * P, 0])

    @jax.jit
    def step(q, k, v, tables, lengths):
        if impl == RAGGED_IMPL:
            kv = jnp.stack([k, v], axis=1).transpose(2, 3, 0, 1, 4).reshape(N, P, 2 * K, D)
            return ragged_paged_attention(q, kv, tables, lengths)
        return paged_attention(q, k, v, tables, lengths, impl=impl, interpret=impl != "xla")

    out = step(*map(jnp.asarray, (q, k_pages, v_pages, tables, lengths)))
    expected = oracle(q, kv_as_seen_by(impl, k_pages), kv_as_seen_by(impl, v_pages), tables, lengths)
    assert rel_err(out, expected) < F32_TOL


def test_errors_name_the_shapes():
    q, k_pages, v_pages, tables, lengths = map(jnp.asarray, make_case(6, [1, 2]))
    with pytest.raises(ValueError, match="impl must be one of"):
        paged_attention(q, k_pages, v_pages, tables, lengths, impl="triton")
    with pytest.raises(ValueError, match="goes to ragged_paged_attention"):
        paged_attention(q, k_pages, v_pages, tables, lengths, impl=RAGGED_IMPL)
    kv = jnp.asarray(interleaved(k_pages, v_pages))
    with pytest.raises(ValueError, match=r"q \(2, 4, 16\) and kv_pages \(7, 4, 3, 16\)"):
        ragged_paged_attention(q, kv[:, :, :3], tables, lengths)
    with pytest.raises(ValueError, match=r"expected q \[B, H, d\], kv_pages \[N, P, 2K, d\]"):
        ragged_paged_attention(q, kv[0], tables, lengths)
    for impl in ("pallas_gpu", "pallas_tpu"):
        with pytest.raises(ValueError, match=r"pages_per_compute_block=3 must divide the table width W=4"):
            paged_attention(q, k_pages, v_pages, tables, lengths, impl=impl, interpret=True,
                            pages_per_compute_block=3)
    with pytest.raises(ValueError, match=r"multiple of kv heads K=2.*q \(2, 3, 16\)"):
        paged_attention(q[:, :3], k_pages, v_pages, tables, lengths, impl="xla")
    with pytest.raises(ValueError, match="share the slot count"):
        paged_attention(q, k_pages, v_pages, tables[:1], lengths, impl="xla")
    with pytest.raises(ValueError, match="same shape"):
        paged_attention(q, k_pages, v_pages[:, :3], tables, lengths, impl="xla")
    # Triton's power-of-two sizes are checked before compiling for the GPU (nothing runs on this CPU).
    odd_pages = jnp.zeros((K, N, 3, D), jnp.float32)
    with pytest.raises(ValueError, match=r"power-of-two page size.*P=3"):
        paged_attention(q, odd_pages, odd_pages, tables, lengths, impl="pallas_gpu")
    with pytest.raises(ValueError, match=r"pages_per_compute_block \* P >= 16; got 2 with P=4"):
        paged_attention(q, k_pages, v_pages, tables, lengths, impl="pallas_gpu", pages_per_compute_block=2)


def test_tpu_interpret_flag_matches_context():
    q, k_pages, v_pages, tables, lengths = map(jnp.asarray, make_case(7, [3, W * P]))
    flagged = paged_attention(q, k_pages, v_pages, tables, lengths, impl="pallas_tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(flagged), np.asarray(run("pallas_tpu", q, k_pages, v_pages, tables,
                                                                      lengths)))


def test_oracle_catches_broken_inputs():
    """The comparison above would notice a kernel reading the wrong page, kv head or token count."""
    q, k_pages, v_pages, tables, lengths = make_case(8, [P + 2, W * P, 2 * P, 3])
    expected = oracle(q, k_pages, v_pages, tables, lengths)

    def xla(q, k_pages, v_pages, tables, lengths):
        return paged_attention(*map(jnp.asarray, (q, k_pages, v_pages, tables, lengths)), impl="xla")

    assert rel_err(xla(q, k_pages, v_pages, tables, lengths), expected) < F32_TOL
    wrong_table = tables.copy()
    wrong_table[:, 0] = (wrong_table[:, 0] + 1) % N
    assert rel_err(xla(q, k_pages, v_pages, wrong_table, lengths), expected) > 0.1
    assert rel_err(xla(q, k_pages, v_pages, tables, lengths - 1), expected) > 100 * F32_TOL
    assert rel_err(xla(q, k_pages[::-1], v_pages[::-1], tables, lengths), expected) > 0.1
