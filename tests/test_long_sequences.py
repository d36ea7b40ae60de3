"""Training long sequences: attention implementations, per-layer remat, chunked log-probs, mixed precision.

References: attention written out in float64 here, and the materialized float32 path (``xla``,
:func:`dora_jax.models.decoder.attention`) the others must be as close to; the forward without remat, the unchunked log-probs, and the float32 model for bf16 compute.
Padding queries (segment id 0) carry no loss term; attention outputs are compared on the other queries.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import rel_err
from dora_jax.config import Config, ConfigError, LoraConfig, MeshConfig, ModelConfig, TrainConfig
from dora_jax.models import attention as attn
from dora_jax.models.build import init_model
from dora_jax.models.decoder import TrainSettings, attention
from dora_jax.sharding import create_mesh
from dora_jax.trainer import Sample, Trainer, make_batch
from dora_jax.trainer import lora as lora_lib
from dora_jax.trainer.losses import token_logprobs
from dora_jax.trainer.step import check_train_forward, sequence_logprobs

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, init_std=0.1, max_seq_len=128)


def _mask(seg):
    t = seg.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    return causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)


def _xla(q, k, v, seg):
    """The xla path: float32 scores under the [B, T, T] mask the training forward builds."""
    return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), _mask(seg))


def _reference(q, k, v, seg):
    """Written here, in float64: softmax over the visible keys of q . k / sqrt(d), then the values."""
    q, k, v = (x.astype(jnp.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(_mask(seg)[:, None], s, -np.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", jnp.nan_to_num(p), v)


def _qkv(b, t, h, kv, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), dtype) for n in (h, kv, kv))
    # Row 0: one segment, right-padded; row 1: three packed segments, then padding.
    seg = np.ones((b, t), np.int32)
    seg[0, t - t // 5:] = 0
    seg[1, t // 4:t // 2], seg[1, t // 2:t - t // 8], seg[1, t - t // 8:] = 2, 3, 0
    cot = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype) * (seg != 0)[:, :, None, None]
    return q, k, v, jnp.asarray(seg), cot


def _value_and_grads(fn, q, k, v, seg, cot):
    """``fn``'s output and the gradients of <fn(q, k, v), cot> (cot is zero on padding queries)."""
    out = fn(q, k, v, seg)
    grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) * cot), (0, 1, 2))(q, k, v)
    return out * (seg != 0)[:, :, None, None], grads


def _errors(fn, q, k, v, seg, cot):
    """Relative errors of ``fn``'s output and its q, k, v gradients against the float64 reference."""
    out, grads = _value_and_grads(fn, q, k, v, seg, cot)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        ref_out, ref_grads = _value_and_grads(_reference, *map(as64, (q, k, v)), jnp.asarray(seg), as64(cot))
    assert all(np.abs(np.asarray(r)).max() > 0 for r in ref_grads)
    return [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]


def _assert_matches_reference(fn, q, k, v, seg, cot, tol):
    errors = _errors(fn, q, k, v, seg, cot)
    assert max(errors) <= tol, errors
    if q.dtype == jnp.float32:  # as close as the xla path, which computes in float32 too
        assert max(errors) <= 4 * max(_errors(_xla, q, k, v, seg, cot)) + 1e-7, errors


@pytest.mark.parametrize("block", [16, 24])
def test_blockwise_attention_equals_the_reference_in_float64(block):
    """Several blocks, and a block that does not divide T (the row is padded inside); the accumulation
    follows the float64 inputs."""
    fn = lambda q, k, v, s: attn.blockwise_attention(q, k, v, s, block)  # noqa: E731
    with jax.enable_x64(True):
        _assert_matches_reference(fn, *_qkv(2, 64, 4, 2, 8, jnp.float64), 1e-12)


def test_blockwise_attention_equals_the_xla_path_in_float32():
    q, k, v, seg, cot = _qkv(2, 64, 4, 2, 8, jnp.float32)
    fn = lambda q, k, v, s: attn.blockwise_attention(q, k, v, s, 16)  # noqa: E731
    out, grads = _value_and_grads(fn, q, k, v, seg, cot)
    ref_out, ref_grads = _value_and_grads(_xla, q, k, v, seg, cot)
    assert rel_err(out, ref_out) <= 1e-6 and max(rel_err(g, r) for g, r in zip(grads, ref_grads)) <= 1e-6


def test_pallas_gpu_kernel_in_interpret_mode_equals_materialized():
    """jax.experimental.pallas.ops.gpu.attention.mha, run by the Pallas interpreter on the CPU, float32."""
    q, k, v, seg, cot = _qkv(2, 64, 4, 2, 16, jnp.float32)
    fn = lambda q, k, v, s: attn.pallas_gpu_attention(q, k, v, s, block=16, interpret=True)  # noqa: E731
    _assert_matches_reference(fn, q, k, v, seg, cot, 1e-5)


def test_a_kernel_runs_per_shard_under_a_mesh():
    """Under an active mesh a kernel is called per shard (rows over data x fsdp, heads over tensor): the
    pallas_gpu kernel in interpret mode on 8 devices equals the blockwise attention on one, with gradients."""
    from dora_jax.config import DEFAULT_RULES
    from dora_jax.sharding import activate

    q, k, v, seg, cot = _qkv(4, 32, 4, 2, 16, jnp.float32)
    kernel = lambda q, k, v, s: attn.train_attention(q, k, v, s, impl="pallas_gpu", block=16,  # noqa: E731
                                                     interpret=True)
    with activate(create_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8]), DEFAULT_RULES):
        out, grads = jax.jit(lambda q, k, v: _value_and_grads(kernel, q, k, v, seg, cot))(q, k, v)
    assert out.sharding.spec[2] == "tensor"  # the heads stayed split
    ref_out, ref_grads = _value_and_grads(lambda q, k, v, s: attn.blockwise_attention(q, k, v, s, 16), q, k, v,
                                          seg, cot)
    assert rel_err(out, ref_out) <= 1e-6 and max(rel_err(g, r) for g, r in zip(grads, ref_grads)) <= 1e-6


def test_splash_kernel_in_interpret_mode_equals_materialized():
    """jax.experimental.pallas.ops.tpu.splash_attention at its smallest tiles (128), run by the Pallas
    interpreter through the kernel's own ``interpret`` flag, float32. (``pltpu.force_tpu_interpret_mode()``
    fails on this JAX (0.10.2) for a vmapped kernel: the TPU interpreter zips the 4-axis grid that vmap makes
    with the kernel's 3 dimension semantics and raises in ``_get_randomized_grid_coordinates``.)"""
    q, k, v, seg, cot = _qkv(2, 256, 2, 1, 16, jnp.float32)
    fn = lambda q, k, v, s: attn.splash_attention(q, k, v, s, block=128, interpret=True)  # noqa: E731
    _assert_matches_reference(fn, q, k, v, seg, cot, 1e-5)


def test_dot_product_attention_call_with_row_lengths_equals_materialized():
    """The cudnn path's call (causal, keys cut at each row's length) through JAX's XLA implementation: exact on
    right-padded rows of one segment, the rows the trainer builds."""
    q, k, v, _, _ = _qkv(2, 64, 4, 2, 8, jnp.float32)
    seg = jnp.asarray(np.arange(64)[None, :] < np.array([[51], [40]]), jnp.int32)
    cot = jnp.ones(q.shape, jnp.float32) * seg[:, :, None, None]
    _assert_matches_reference(lambda q, k, v, s: attn.cudnn_attention(q, k, v, s, implementation=None),
                              q, k, v, seg, cot, 1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention runs on a GPU only (no interpreter)")
def test_cudnn_attention_equals_materialized_on_gpu():
    q, k, v, _, _ = _qkv(2, 256, 4, 2, 64, jnp.bfloat16)
    seg = jnp.asarray(np.arange(256)[None, :] < np.array([[200], [256]]), jnp.int32)
    cot = jnp.ones(q.shape, jnp.bfloat16) * seg[:, :, None, None]
    _assert_matches_reference(attn.cudnn_attention, q, k, v, seg, cot, 2e-2)


def test_auto_takes_the_portable_paths():
    assert attn.resolve_train_attention("auto", 512, 512) == "xla"
    assert attn.resolve_train_attention("auto", 1024, 512) == "blockwise"
    assert attn.resolve_train_attention("splash", 64, 512) == "splash"


# ---------------------------------------------------------------------------------------------------------
# The model: remat, attention and chunked log-probs against the plain forward.


def _rows(t=64, b=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (b, t)).astype(np.int32)
    lengths = np.array([t, t - 9, t // 2, t - 1])[:b]
    seg = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    mask = seg.astype(np.float32)
    mask[:, :t // 4] = 0  # the prompt
    weight = rng.normal(size=(b, t)).astype(np.float32) * mask
    return jnp.asarray(tokens * seg), jnp.asarray(seg), jnp.asarray(weight)


def _loss_and_grads(model, settings=TrainSettings(), chunk=0, temperature=1.0, lora=None, dtype=jnp.float32):
    """A policy-gradient-shaped loss (sum of weighted response log-probs) and its gradient, from
    ``sequence_logprobs`` with the given forward settings."""
    graphdef, params = nnx.split(model)
    tokens, seg, weight = _rows()

    def loss(p):
        if lora is not None:
            logp = sequence_logprobs(graphdef, params, tokens, seg, p, 0.5, temperature, settings=settings,
                                     logprob_chunk=chunk)
        else:
            logp = sequence_logprobs(graphdef, p, tokens, seg, temperature=temperature, settings=settings,
                                     logprob_chunk=chunk)
        assert logp.dtype == jnp.float32
        return jnp.sum(logp * weight), logp

    (value, logp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params if lora is None else lora)
    flat = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])
    return float(value), np.asarray(logp), flat


@pytest.fixture(scope="module")
def model():
    return init_model(MODEL, seed=3)


@pytest.mark.parametrize("remat", ["full", "dots", "offload"])
def test_remat_changes_neither_loss_nor_gradients(model, remat):
    value, logp, grads = _loss_and_grads(model)
    r_value, r_logp, r_grads = _loss_and_grads(model, TrainSettings(remat=remat))
    assert np.abs(grads).max() > 0
    assert abs(r_value - value) <= 1e-6 * abs(value)
    assert rel_err(r_grads, grads) <= 1e-6


@pytest.mark.parametrize("chunk", [8, 32])
def test_chunked_logprobs_equal_unchunked_at_a_temperature(model, chunk):
    value, logp, grads = _loss_and_grads(model, temperature=0.7)
    c_value, c_logp, c_grads = _loss_and_grads(model, chunk=chunk, temperature=0.7)
    assert rel_err(c_logp, logp) <= 1e-6
    assert abs(c_value - value) <= 1e-6 * abs(value)
    assert rel_err(c_grads, grads) <= 1e-6


def test_chunked_logprobs_with_lora_equal_unchunked(model):
    cfg = LoraConfig(rank=4, alpha=2.0)
    adapters = lora_lib.init_lora(nnx.state(model), cfg, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # b starts at zero: move it so every path counts
    value, logp, grads = _loss_and_grads(model, lora=adapters)
    c_value, c_logp, c_grads = _loss_and_grads(model, chunk=16, lora=adapters, settings=TrainSettings(remat="full"))
    assert np.abs(grads).max() > 0
    assert rel_err(c_logp, logp) <= 1e-6 and rel_err(c_grads, grads) <= 1e-6


def test_chunked_logprobs_function_equals_token_logprobs():
    from dora_jax.trainer.losses import chunked_token_logprobs

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 12, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 9)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 9, (2, 12)), jnp.int32)
    ref = token_logprobs(h @ w, tokens, 1.3)
    assert rel_err(chunked_token_logprobs(h, lambda x: x @ w, tokens, 1.3, 4), ref) <= 1e-6
    with pytest.raises(ValueError, match="chunk 5 does not divide the row length 12"):
        chunked_token_logprobs(h, lambda x: x @ w, tokens, 1.0, 5)


def test_blockwise_forward_equals_xla_forward(model):
    """The whole model's loss and gradients with blockwise attention (4 blocks), remat and chunking together,
    against the plain forward, float32."""
    value, logp, grads = _loss_and_grads(model, TrainSettings(attention_impl="xla"))
    b_value, b_logp, b_grads = _loss_and_grads(
        model, TrainSettings(remat="full", attention_impl="blockwise", attention_block=16), chunk=16)
    real = np.asarray(_rows()[1]) != 0  # a padding position's log-prob is unspecified (it has no loss term)
    assert rel_err(b_logp[real], logp[real]) <= 1e-6
    assert abs(b_value - value) <= 1e-6 * abs(value)
    assert rel_err(b_grads, grads) <= 1e-6


def test_bf16_compute_stays_close_to_float32(model):
    """float32 master weights, bfloat16 compute: the log-probs and the loss are float32, the loss within 2% of
    the float32 model's and the gradient pointing the same way (cosine > 0.99)."""
    bf16 = dataclasses.replace(model.cfg, compute_dtype="bfloat16")
    graphdef, params = nnx.split(model)
    mixed = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: type(model)(bf16, rngs=nnx.Rngs(0)))), params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    value, _, grads = _loss_and_grads(model)
    m_value, _, m_grads = _loss_and_grads(mixed, TrainSettings(remat="full", attention_impl="blockwise",
                                                               attention_block=16), chunk=16)
    assert m_value != value  # the compute really is in bf16
    assert abs(m_value - value) <= 0.02 * abs(value)
    cosine = float(np.dot(m_grads, grads) / np.linalg.norm(m_grads) / np.linalg.norm(grads))
    assert cosine > 0.99, cosine


# ---------------------------------------------------------------------------------------------------------
# The trainer: settings from the config, refusals at start-up, memory.


def _config(**train):
    base = dict(group_size=4, length_buckets=(64,), max_response_tokens=40, max_staleness=1, grad_clip=0.0)
    base.update(train)
    return Config(model=MODEL, train=TrainConfig(**base))


def _samples(seed=0):
    rng = np.random.default_rng(seed)
    return [Sample(sample_id=i, group_id=i // 4, version=0, prompt_ids=rng.integers(1, 64, 9).tolist(),
                   response_ids=rng.integers(1, 64, 20 + 3 * i).tolist(),
                   logprobs=(-rng.uniform(2, 6, 20 + 3 * i)).tolist(), reward=float(rng.normal()))
            for i in range(8)]


def _sgd_grads(cfg, n_devices):
    mesh = create_mesh(MeshConfig(data=2, fsdp=2, tensor=2) if n_devices == 8 else MeshConfig(),
                       jax.devices()[:n_devices])
    trainer, state = Trainer.create(cfg, model=init_model(MODEL, seed=5), mesh=mesh, tx=optax.sgd(1.0))
    batch = trainer.put(make_batch(_samples(), group_size=4, length_buckets=cfg.train.length_buckets,
                                   row_multiple=trainer.row_multiple))
    old = jax.tree.map(np.asarray, state.params)
    new, metrics = trainer.train_step(state, batch)
    return np.concatenate([np.ravel(o - np.asarray(n)) for o, n in zip(jax.tree.leaves(old),
                                                                       jax.tree.leaves(new.params))]), metrics


def test_trainer_long_sequence_settings_equal_the_plain_step_on_a_mesh():
    """remat, blockwise attention, chunked log-probs and packing from the config, on 8 devices (data x fsdp x
    tensor), against the plain step on one device. Each data-parallel device packs its own two samples (the
    first two, 29 and 32 tokens, share a row of 64)."""
    plain, m_plain = _sgd_grads(_config(attention_impl="xla"), 1)
    long, m_long = _sgd_grads(_config(remat="dots", attention_impl="blockwise", attention_block=16,
                                      logprob_chunk=16, packing="pack"), 8)
    assert np.abs(plain).max() > 0
    assert rel_err(long, plain) <= 1e-5  # 8 devices sum their shards in another order
    assert abs(float(m_long["loss"]) - float(m_plain["loss"])) <= 1e-6 * abs(float(m_plain["loss"]))


def test_bad_long_sequence_settings_are_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"'train.logprob_chunk' = 48: must divide every length bucket.*\[64"):
        _config(logprob_chunk=48, length_buckets=(32, 64)).train.validate()
    _config(logprob_chunk=64, length_buckets=(32, 64)).train.validate()  # a shorter bucket is one chunk
    with pytest.raises(ConfigError, match=r"'train.remat' = 'some'"):
        _config(remat="some").train.validate()
    with pytest.raises(ConfigError, match=r"'train.attention_impl' = 'flash'.*blockwise"):
        _config(attention_impl="flash").train.validate()
    with pytest.raises(ConfigError, match=r"'train.attention_block' = 48"):
        _config(attention_block=48).train.validate()
    with pytest.raises(ConfigError, match=r"'train.attention_block' = 256: the splash kernel.*\[384\]"):
        _config(attention_impl="splash", attention_block=256, length_buckets=(128, 384)).train.validate()
    with pytest.raises(ConfigError, match=r"'train.attention_impl' = 'splash': 'splash' runs on TPU only"):
        Trainer.create(_config(attention_impl="splash"), model=init_model(MODEL), mesh=create_mesh(MeshConfig(),
                                                                                                    jax.devices()[:1]))

    class Memory:
        kind = "device"

    class Device:
        platform = "gpu"

        def addressable_memories(self):
            return [Memory()]

    with pytest.raises(ConfigError, match=r"'train.remat' = 'offload': the gpu devices have no pinned host"):
        check_train_forward(TrainConfig(remat="offload"), [Device()])
    check_train_forward(TrainConfig(remat="offload"), jax.devices()[:1])  # the CPU has a pinned host memory


def _temp_bytes(t, **train):
    """XLA's temporary bytes for one update's train step at rows of ``t`` tokens (compiled, not run)."""
    from dora_jax.trainer.batch import TrainBatch
    from dora_jax.trainer.step import make_train_step
    from dora_jax.trainer.state import TrainState, make_optimizer

    model = dataclasses.replace(MODEL, max_seq_len=t, vocab_size=train.pop("vocab", MODEL.vocab_size))
    tcfg = TrainConfig(length_buckets=(t,), max_response_tokens=t, **train)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: __import__("dora_jax.models.decoder", fromlist=["x"])
                                                .Decoder(model, rngs=nnx.Rngs(0))))
    tx = make_optimizer(tcfg)
    s = jax.ShapeDtypeStruct
    state = TrainState(step=s((), jnp.int32), version=s((), jnp.int32), params=params, frozen=None,
                       opt_state=jax.eval_shape(tx.init, params), rng=s((2,), jnp.uint32))
    b = 2
    row = lambda d: s((b, t), d)  # noqa: E731
    batch = TrainBatch(tokens=row(jnp.int32), segment_ids=row(jnp.int32), loss_mask=row(jnp.float32),
                       behaviour_logprobs=row(jnp.float32), recomputed_logprobs=row(jnp.float32),
                       ref_logprobs=row(jnp.float32), prox_logprobs=row(jnp.float32), versions=s((b,), jnp.int32),
                       group_ids=s((b,), jnp.int32), rewards=s((b,), jnp.float32), valid=s((b,), jnp.bool_))
    compiled = jax.jit(make_train_step(graphdef, tcfg, tx)).lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporary_memory_grows_linearly_with_length_and_never_holds_the_logits():
    """Blockwise attention, full remat, chunked log-probs: 4x the length takes at most 4.5x the temporary
    memory (the materialized scores take 14x: benchmarks/train.py), and a 512x larger vocabulary adds a few
    chunks' [rows, chunk, V] float32 logits, far less than the row's [rows, T, V]."""
    long = dict(remat="full", attention_impl="blockwise", attention_block=128, logprob_chunk=64)
    short, four = _temp_bytes(256, **long), _temp_bytes(1024, **long)
    assert four <= 4.5 * short, (short, four)
    vocab = 32768
    big = _temp_bytes(1024, vocab=vocab, **long)
    chunk_logits, logits = 2 * 64 * vocab * 4, 2 * 1024 * vocab * 4
    assert big - four <= 4 * chunk_logits <= logits / 4, (four, big)


# ---------------------------------------------------------------------------------------------------------
# Packing: several samples per training row, the loss and gradients those of the unpacked rows.

# Lengths (prompt of 4 + response) with a long tail: in rows of 64, one long sample and many short ones;
# 154 tokens in all.
TAIL = [54, 10, 12, 20, 8, 14, 30, 6]


def _tail_samples(lengths=TAIL, versions=None, seed=0):
    rng = np.random.default_rng(seed)
    versions = versions or [0] * len(lengths)
    return [Sample(sample_id=i, group_id=i // 4, version=versions[i], prompt_ids=rng.integers(1, 64, 4).tolist(),
                   response_ids=rng.integers(1, 64, n - 4).tolist(), logprobs=(-rng.uniform(2, 6, n - 4)).tolist(),
                   reward=float(rng.normal())) for i, n in enumerate(lengths)]


def test_first_fit_decreasing_by_hand():
    from dora_jax.trainer.packing import first_fit_decreasing, grid

    # Longest first: 8 opens bin 0 (room 2), 6 bin 1 (room 4), 5 bin 2, 3 joins bin 1, 2 fills bin 0; 0 is left out.
    assert first_fit_decreasing([5, 3, 8, 2, 0, 6], 10) == [[2, 3], [5, 1], [0]]
    assert first_fit_decreasing([4, 4, 4], 8) == [[0, 1], [2]]  # ties in index order
    with pytest.raises(Exception, match="a sample of 11 tokens does not fit a packed row of 10"):
        first_fit_decreasing([11], 10)
    assert [grid(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13)] == [1, 1, 2, 3, 4, 6, 6, 8, 12, 16]


def test_a_packing_puts_each_sample_in_its_own_segment_with_positions_from_zero():
    from dora_jax.trainer.packing import iteration_plan, pack_tokens, unpack

    t = 64
    lengths = np.array(TAIL, np.int32)
    tokens = np.zeros((8, t), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = 100 * (i + 1) + np.arange(n)  # a token names its sample and position
    # Two devices, one row each per micro-batch (up to 4 micro-batches, as unpacked). Device 0's samples (54, 10,
    # 12, 20) make [54, 10], [20, 12]; device 1's (8, 14, 30, 6) make [30, 14, 8, 6]: 2 micro-batches.
    (pk,) = iteration_plan([lengths], t, devices=2, rows=1, micro_batches=4)
    assert pk.source.shape == (2, 2, t) and pk.length.shape == (2, 8)
    assert ((np.asarray(pk.length) > 0).sum(0) == 1).all()  # every sample in exactly one micro-batch
    assert np.asarray(pk.segment_ids)[0, 1].tolist() == [1] * 30 + [2] * 14 + [3] * 8 + [4] * 6 + [0] * 6
    assert not np.asarray(pk.segment_ids)[1, 1].any()  # device 1 has nothing left for micro-batch 1
    assert (np.asarray(pk.segment_ids) != 0).sum() == lengths.sum()
    for m in range(2):
        one = jax.tree.map(lambda x: jnp.asarray(x[m]), pk)
        packed = np.asarray(pack_tokens(jnp.asarray(tokens), one))
        back = np.asarray(unpack(jnp.asarray(packed, jnp.float32), one, t))
        seg, pos = np.asarray(one.segment_ids), np.asarray(one.positions)
        for i in range(8):
            n = int(one.length[i])
            if n == 0:
                assert not back[i].any()  # another micro-batch's sample
                continue
            r, o = int(one.row[i]), int(one.offset[i])
            assert r == i // 4  # on its own device's row
            assert list(packed[r, o:o + n]) == list(tokens[i, :n])
            assert list(pos[r, o:o + n]) == list(range(n))
            assert len(set(seg[r, o:o + n])) == 1 and seg[r, o] != 0
            assert back[i, 0] == 0 and list(back[i, 1:n]) == list(tokens[i, 1:n]) and not back[i, n:].any()


def test_packed_logprobs_and_gradients_equal_unpacked(model):
    """The forward on packed rows (segments, positions from 0 in each) returns every sample's unpacked
    log-probs, and a loss on them has the unpacked gradient, float32: the full weights' and LoRA adapters'."""
    from dora_jax.trainer.packing import plan
    from dora_jax.trainer.step import packed_sequence_logprobs

    t, rng = 64, np.random.default_rng(4)
    lengths = np.array(TAIL, np.int32)
    seg = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, (8, t)) * seg, jnp.int32)
    weight = jnp.asarray(rng.normal(size=(8, t)) * seg * (np.arange(t) >= 4), jnp.float32)  # the responses
    pk = jax.tree.map(lambda x: jnp.asarray(x[0]), plan(lengths, t, devices=1))
    assert pk.source.shape == (3, t)
    graphdef, params = nnx.split(model)
    adapters = lora_lib.init_lora(params, LoraConfig(rank=4, alpha=2.0), jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # b starts at zero: move it so every path counts

    def loss(p, a, packed):
        forward = packed_sequence_logprobs if packed else sequence_logprobs
        logp = forward(graphdef, p, tokens, pk if packed else jnp.asarray(seg), a, 0.5, 0.8)  # LoRA scale 0.5, T 0.8
        return jnp.sum(logp * weight), logp

    def flat(tree):
        return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])

    out = {}
    for packed in (False, True):
        (value, logp), (g, g_lora) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
                                             static_argnums=2)(params, adapters, packed)
        out[packed] = (float(value), np.asarray(logp), flat(g), flat(g_lora))
    (value, logp, g, g_lora), (p_value, p_logp, p_g, p_g_lora) = out[False], out[True]
    for i, n in enumerate(lengths):  # position 0 predicts nothing; past the length is padding
        assert rel_err(p_logp[i, 1:n], logp[i, 1:n]) <= 1e-5, i
    assert abs(p_value - value) <= 1e-5 * abs(value)
    assert np.abs(g).max() > 0 and rel_err(p_g, g) <= 1e-5
    assert np.abs(g_lora).max() > 0 and rel_err(p_g_lora, g_lora) <= 1e-5


def _packing_run(packing, samples, version=0, **train):
    base = dict(group_size=4, length_buckets=(32, 64), max_response_tokens=60, max_staleness=1, grad_clip=0.0,
                loss="grpo", advantage="grpo", packing=packing)
    base.update(train)
    cfg = Config(model=MODEL, train=TrainConfig(**base))
    trainer, state = Trainer.create(cfg, model=init_model(MODEL, seed=5), mesh=create_mesh(MeshConfig(),
                                                                                            jax.devices()[:1]),
                                    tx=optax.sgd(1.0))
    state = state.replace(version=jax.device_put(jnp.asarray(version, jnp.int32), state.version.sharding))
    batch = trainer.put(make_batch(samples, group_size=4, length_buckets=cfg.train.length_buckets,
                                   row_multiple=trainer.row_multiple))
    old = jax.tree.map(np.asarray, state.params)
    new, metrics = trainer.train_step(state, batch, iteration=1)
    step = np.concatenate([np.ravel(o - np.asarray(n)) for o, n in zip(jax.tree.leaves(old),
                                                                       jax.tree.leaves(new.params))])
    return step, {k: float(v) for k, v in metrics.items()}


def test_packed_iteration_equals_the_unpacked_one():
    """Float32, GRPO advantages per group: a long-tailed batch of two groups, one sample too stale and one from
    a version not reached yet, in two minibatches (one group each) of four micro-batches of one row, with
    decoupled PPO's proximal forward (blockwise attention, remat and chunking: the mesh test above). The packed
    iteration's parameter update, loss and counts equal the unpacked one's, in half the micro-batches. Padding
    (TAIL's 154 tokens): unpacked, each update's 4 rows of 64 (1 - 154/512 over the two); packed, 2
    micro-batches of one row ([54, 10], [20, 12]; [30, 14, 8, 6], []: 1 - 154/256)."""
    samples = _tail_samples(versions=[3, 2, 3, 0, 3, 3, 4, 2])
    train = dict(loss="dapo", correction="decoupled", minibatches=2, micro_batches=4, attention_impl="xla")
    step, m = _packing_run("none", samples, version=3, **train)
    p_step, p_m = _packing_run("pack", samples, version=3, **train)
    assert np.abs(step).max() > 0 and rel_err(p_step, step) <= 1e-5
    assert m["stale_samples"] == p_m["stale_samples"] == 1  # one in each update's group
    for k in ("loss", "pg_loss", "kept_tokens", "clip_frac", "is_weight_mean", "reward_mean"):
        assert abs(p_m[k] - m[k]) <= 1e-5 * max(abs(m[k]), 1e-6), k
    assert (m["rows"], p_m["rows"]) == (4, 2)
    assert m["padding_frac"] == pytest.approx(1 - 154 / 512, abs=1e-7)
    assert p_m["padding_frac"] == pytest.approx(1 - 154 / 256, abs=1e-7)


def test_padding_fraction_of_a_hand_built_batch():
    """TAIL's 154 tokens: unpacked in 12 rows of 64 (1 - 154/768), the batch's padding rows counted as padding;
    packed, first-fit decreasing makes 3 rows ([54, 10], [30, 20, 14], [12, 8, 6]): 1 - 154/192."""
    from dora_jax.trainer.packing import padding_fraction, plan

    batch = make_batch(_tail_samples(), group_size=4, length_buckets=(64,), row_multiple=3)  # 8 rows up to 12
    assert batch.shape == (12, 64)
    assert float(padding_fraction(batch.segment_ids, batch.valid)) == pytest.approx(1 - 154 / 768, abs=1e-7)
    pk = plan(np.array(TAIL), 64, devices=1)
    assert [sorted(np.asarray(pk.segment_ids)[0, r].tolist()).count(0) for r in range(3)] == [0, 0, 38]
    assert float(padding_fraction(pk.segment_ids)) == pytest.approx(1 - 154 / 192, abs=1e-7)
    # A copy of a sample in a padding row (how a minibatch fills its rows) counts as padding.
    copied = np.asarray(batch.segment_ids).copy()
    copied[8:] = copied[0]
    assert float(padding_fraction(copied, batch.valid)) == pytest.approx(1 - 154 / 768, abs=1e-7)


def test_packing_with_cudnn_or_an_unknown_value_is_refused():
    with pytest.raises(ConfigError, match=r"'train.packing' = 'pack': .*'cudnn' takes only each row's length.*"
                                          r"'pallas_gpu'"):
        _config(packing="pack", attention_impl="cudnn").train.validate()
    with pytest.raises(ConfigError, match=r"'train.packing' = 'first_fit': allowed: none, pack"):
        _config(packing="first_fit").train.validate()
