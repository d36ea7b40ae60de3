"""Causal self-attention for the training forward, with segment ids, in several implementations.

Each computes, for the query at index ``t``, the float32 softmax of ``q . k / sqrt(d)`` over keys ``s <= t``
of the same segment (id 0: padding) and the weighted values; they agree on every query of a non-zero
segment (a padding query's output is unspecified). :func:`train_attention` runs ``blockwise``
(:func:`blockwise_attention`), ``cudnn``, ``pallas_gpu`` or ``splash``; ``xla`` is
:func:`dora_jax.models.decoder.attention`; :func:`resolve_train_attention` resolves ``auto``. docs/trainer.md,
"Long sequences", compares them. Shapes: q [B, T, H, d]; k, v [B, T, K, d] with K dividing H; segment ids
int [B, T].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.config import TRAIN_ATTENTION_IMPLS

# The backend each kernel runs on (interpret mode aside).
KERNEL_BACKENDS = {"cudnn": "gpu", "pallas_gpu": "gpu", "splash": "tpu"}

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def resolve_train_attention(impl: str, seq_len: int, block: int) -> str:
    """``impl`` with ``"auto"`` resolved for rows of ``seq_len`` tokens: ``"xla"`` when a row fits one block of
    ``block`` tokens, ``"blockwise"`` beyond; platform kernels only when named."""
    if impl != "auto":
        return impl
    return "xla" if seq_len <= block else "blockwise"


def unsupported_reason(impl: str, backend: str) -> str | None:
    """Why attention ``impl`` cannot run on ``backend`` (``jax.default_backend()``), or None when it can."""
    need = KERNEL_BACKENDS.get(impl)
    if need is not None and backend != need:
        return f"{impl!r} runs on {need.upper()} only, and this backend is {backend!r}; use 'blockwise' (portable)"
    return None


def _mask(seg_q: jax.Array, seg_k: jax.Array, q0: jax.Array, k0: jax.Array) -> jax.Array:
    """[B, bq, bk] True where query ``q0 + i`` may see key ``k0 + j``: causal, same non-zero segment."""
    bq, bk = seg_q.shape[1], seg_k.shape[1]
    causal = (q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :]
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] != 0)
    return causal[None] & same


def _blocks(x: jax.Array, n: int, axis: int) -> jax.Array:
    """Splits ``axis`` into ``n`` blocks and moves the block index first."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _accumulation(x: jax.Array):
    """The dtype scores, softmax statistics and sums are kept in: float32, or float64 for float64 inputs."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _forward(q, k, v, seg, block):
    """Online-softmax forward. q [B, K, G, T, d], k/v [B, K, T, d], seg [B, T]; T a multiple of ``block``.
    Returns (out [B, K, G, T, d] in q's dtype, lse [B, K, G, T] in the accumulation dtype; lse is 0 on rows
    that see no key)."""
    b, kv, g, t, d = q.shape
    n = t // block
    scale = 1.0 / math.sqrt(d)
    acc_dt = _accumulation(q)
    qb, kb, vb, sb = _blocks(q, n, 3), _blocks(k, n, 2), _blocks(v, n, 2), _blocks(seg, n, 1)

    def query_block(i):
        qi, si = qb[i], sb[i]

        def step(j, carry):
            m, l, acc = carry
            s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kb[j], preferred_element_type=acc_dt) * scale
            mask = _mask(si, sb[j], i * block, j * block)[:, None, None]
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASK_VALUE), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=acc_dt)
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full((b, kv, g, block), _MASK_VALUE, acc_dt), jnp.zeros((b, kv, g, block), acc_dt),
                jnp.zeros((b, kv, g, block, d), acc_dt))
        m, l, acc = jax.lax.fori_loop(0, i + 1, step, init)  # key blocks past the diagonal are all masked
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)

    out, lse = jax.lax.map(query_block, jnp.arange(n))
    return _unblocks(out, 3), _unblocks(lse, 3)


def _backward(q, k, v, seg, out, lse, do, block):
    """Gradients of :func:`_forward` recomputed from the row log-sum-exp, one [B, K, G, block, block] tile at a time."""
    b, kv, g, t, d = q.shape
    n = t // block
    scale = 1.0 / math.sqrt(d)
    acc_dt = _accumulation(q)
    delta = jnp.sum(do.astype(acc_dt) * out.astype(acc_dt), axis=-1)  # [B, K, G, T]
    qb, kb, vb, sb = _blocks(q, n, 3), _blocks(k, n, 2), _blocks(v, n, 2), _blocks(seg, n, 1)
    dob, lb, db = _blocks(do, n, 3), _blocks(lse, n, 3), _blocks(delta, n, 3)

    def tile(i, j):
        """(p, ds) of query block i against key block j, float32 [B, K, G, bq, bk]."""
        s = jnp.einsum("bkgqd,bksd->bkgqs", qb[i], kb[j], preferred_element_type=acc_dt) * scale
        mask = _mask(sb[i], sb[j], i * block, j * block)[:, None, None]
        p = jnp.where(mask, jnp.exp(s - lb[i][..., None]), 0.0)
        dp = jnp.einsum("bkgqd,bksd->bkgqs", dob[i], vb[j], preferred_element_type=acc_dt)
        return p, p * (dp - db[i][..., None])

    def dq_block(i):
        def step(j, acc):
            _, ds = tile(i, j)
            return acc + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(k.dtype), kb[j], preferred_element_type=acc_dt)

        acc = jax.lax.fori_loop(0, i + 1, step, jnp.zeros((b, kv, g, block, d), acc_dt))
        return (acc * scale).astype(q.dtype)

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            p, ds = tile(i, j)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do.dtype), dob[i], preferred_element_type=acc_dt)
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(q.dtype), qb[i], preferred_element_type=acc_dt)
            return dk, dv

        zero = jnp.zeros((b, kv, block, d), acc_dt)
        dk, dv = jax.lax.fori_loop(j, n, step, (zero, zero))  # query blocks before the diagonal see none of it
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dq = _unblocks(jax.lax.map(dq_block, jnp.arange(n)), 3)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
    return dq, _unblocks(dk, 2), _unblocks(dv, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, block):
    return _forward(q, k, v, seg, block)[0]


def _flash_fwd(q, k, v, seg, block):
    out, lse = _forward(q, k, v, seg, block)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, res, do):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg, out, lse, do, block)
    return dq, dk, dv, np.zeros(seg.shape, jax.dtypes.float0)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array,
                        block: int = 512) -> jax.Array:
    """Causal attention within segments, ``block`` queries against ``block`` keys at a time, in plain JAX, with
    a FlashAttention-2-style backward: memory is O(T) in both directions. A row length not a multiple of
    ``block`` is padded with segment id 0 and cut back. Returns [B, T, H, d] in q's dtype."""
    b, t, h, d = q_bthd.shape
    kv = k_btkd.shape[2]
    block = min(block, t)
    pad = -t % block
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_bthd, k_btkd, v_btkd = (jnp.pad(x, widths) for x in (q_bthd, k_btkd, v_btkd))
        segment_ids_bt = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    tp = t + pad
    q = q_bthd.reshape(b, tp, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k, v = k_btkd.transpose(0, 2, 1, 3), v_btkd.transpose(0, 2, 1, 3)
    out = _flash(q, k, v, segment_ids_bt.astype(jnp.int32), block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)[:, :t]


def cudnn_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array,
                    implementation: str | None = "cudnn") -> jax.Array:
    """``jax.nn.dot_product_attention``: causal, each row's keys cut at its non-padding tokens; exact for
    right-padded rows of one segment, not packed rows. ``implementation=None`` runs JAX's XLA form."""
    lengths = jnp.sum(segment_ids_bt != 0, axis=1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, is_causal=True, key_value_seq_lengths=lengths,
                                        implementation=implementation)


def pallas_gpu_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array,
                         block: int = 128, interpret: bool = False) -> jax.Array:
    """``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton), causal with segment ids. ``block`` is the
    forward's query and key tile (at most the row length; it must divide it)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, h = q_bthd.shape[1], q_bthd.shape[2]
    g = h // k_btkd.shape[2]
    k, v = jnp.repeat(k_btkd, g, axis=2), jnp.repeat(v_btkd, g, axis=2)  # query head i reads kv head i // g
    blk = min(block, t)
    sizes = gpu_attention.BlockSizes(block_q=blk, block_k=blk, block_q_dkv=min(32, blk), block_kv_dkv=min(32, blk),
                                     block_q_dq=min(32, blk), block_kv_dq=min(32, blk))
    return gpu_attention.mha(q_bthd, k, v, segment_ids_bt.astype(jnp.int32), sm_scale=1.0 / math.sqrt(q_bthd.shape[3]),
                             causal=True, block_sizes=sizes, interpret=interpret)


def splash_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array,
                     block: int = 512, interpret: bool = False) -> jax.Array:
    """``jax.experimental.pallas.ops.tpu.splash_attention``: causal mask and segment ids, grouped-query heads,
    one call per row (``vmap``). ``block``: every tile's length (at most the row length, dividing it);
    ``interpret``: Pallas's TPU interpreter (CPU tests)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    t, h, d = q_bthd.shape[1], q_bthd.shape[2], q_bthd.shape[3]
    blk = min(block, t)
    mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(h)])
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    kernel = sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    q = (q_bthd * jnp.asarray(1.0 / math.sqrt(d), q_bthd.dtype)).transpose(0, 2, 1, 3)  # splash does not scale
    k, v = k_btkd.transpose(0, 2, 1, 3), v_btkd.transpose(0, 2, 1, 3)
    seg = segment_ids_bt.astype(jnp.int32)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(q=s, kv=s)))(q, k, v, seg)
    return out.transpose(0, 2, 1, 3)


def _per_shard(fn, q, k, v, seg):
    """Runs ``fn`` per shard of the active mesh (rows over the batch axes, heads over the head axes); without a
    multi-device mesh, calls ``fn``."""
    from dora_jax.sharding import active_mesh, mesh_axes

    active = active_mesh()
    if active is None or active[0].size == 1:
        return fn(q, k, v, seg)
    mesh, rules = active
    from jax.sharding import PartitionSpec as P

    (batch, n_batch), (heads, n_heads) = (mesh_axes(a, mesh, rules) for a in ("batch", "act_kv_heads"))
    batch = None if not batch or q.shape[0] % n_batch else batch[0] if len(batch) == 1 else batch
    heads = None if not heads or k.shape[2] % n_heads else heads[0] if len(heads) == 1 else heads
    qkv = P(batch, None, heads, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, P(batch, None)), out_specs=qkv,
                         check_vma=False)(q, k, v, seg)


def train_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array, *,
                    impl: str, block: int = 512, interpret: bool = False) -> jax.Array:
    """Causal attention within segments by ``impl`` (resolved: not ``auto``, not ``xla``). Returns [B, T, H, d]."""
    if impl == "blockwise":
        return blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, block)
    if impl == "cudnn":
        fn = cudnn_attention
    elif impl == "pallas_gpu":
        fn = functools.partial(pallas_gpu_attention, block=block, interpret=interpret)
    elif impl == "splash":
        fn = functools.partial(splash_attention, block=block, interpret=interpret)
    else:
        raise ValueError(f"attention implementation {impl!r}: allowed {', '.join(TRAIN_ATTENTION_IMPLS)}")
    return _per_shard(fn, q_bthd, k_btkd, v_btkd, segment_ids_bt)
