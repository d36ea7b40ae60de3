"""The decoder family (Llama 2/3/3.1, Qwen2, Qwen3, SmolLM2) in Flax NNX.

RMSNorm, rotary embeddings (with Llama 3.1 scaling), grouped-query attention, SwiGLU MLP, optional qkv bias
(Qwen2), optional q/k RMSNorm (Qwen3), tied or untied embeddings.

Layer parameters are stacked on a leading ``layers`` axis and the blocks run under ``jax.lax.scan``, so the
compiled program has one block body whatever the depth (MaxText's ``scan_layers``). Every parameter carries
logical axis names in its ``axes`` metadata; :mod:`dora_jax.sharding` turns them into shardings.

Two entry points:
  * :meth:`Decoder.__call__` — training forward over full sequences with padding / packing masks;
  * :meth:`Decoder.decode` — forward of a chunk of new tokens against an explicit :class:`KVCache` that is
    passed in and returned, so decode stays a pure function (prefill is a decode of the whole prompt).

Shape legend: B batch, T new tokens, S cache length, D hidden, H query heads, K kv heads, G = H // K,
d head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dora_jax.config import REMAT_POLICIES, ModelConfig, RolloutConfig
from dora_jax.sharding import constrain

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class KVCache(NamedTuple):
    """Keys and values of every layer: ``k`` [L, B, K, d, S] and ``v`` [L, B, K, S, d]. Slot ``s`` holds the
    token at position ``s`` of that row. Heads before length, and keys stored transposed, so that one decode
    query's scores (contract d) and its output (contract S) both stream the cache along its minor axis
    instead of reducing across it or transposing it every step."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        """Logical axes of ``v``."""
        return ("layers", "batch", "act_kv_heads", "cache_length", None)

    @staticmethod
    def k_axes() -> tuple[str | None, ...]:
        """Logical axes of ``k`` (transposed: head dim before length)."""
        return ("layers", "batch", "act_kv_heads", None, "cache_length")


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str | None = None) -> KVCache:
    """A zero cache for ``batch`` rows of ``length`` slots (layout: :class:`KVCache`)."""
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    lbk = (cfg.num_layers, batch, cfg.num_kv_heads)
    return KVCache(jnp.zeros(lbk + (cfg.head_dim, length), dt), jnp.zeros(lbk + (length, cfg.head_dim), dt))


# ----------------------------------------------------------------------------------------------------------
# Pure building blocks.


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalizes in float32 and scales in the input dtype, as the reference implementations do."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [d/2] in float32, with optional Llama 3.1 or linear scaling."""
    d = cfg.head_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(
        np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.type == "linear":
        return (inv / rs.factor).astype(np.float32)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_btnd: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates channel pairs (i, i + d/2) by position * inv_freq[i] (the "rotate half" convention)."""
    freqs_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(freqs_btf)[:, :, None, :].astype(x_btnd.dtype)
    sin = jnp.sin(freqs_btf)[:, :, None, :].astype(x_btnd.dtype)
    x1, x2 = jnp.split(x_btnd, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q_bthd: jax.Array, k_bksd: jax.Array, v_bksd: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """Grouped-query attention with a boolean mask; softmax in float32. Returns [B, T, H, d]."""
    b, t, h, d = q_bthd.shape
    kv = k_bksd.shape[1]
    q_bkgtd = q_bthd.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    if t == 1:
        # One query per row (decode): a fused multiply-reduce beats b*k tiny batched matmuls on CPU.
        scores = jnp.sum(q_bkgtd.astype(jnp.float32) * k_bksd[:, :, None].astype(jnp.float32), axis=-1)[:, :, :, None]
    else:
        scores = jnp.einsum("bkgtd,bksd->bkgts", q_bkgtd, k_bksd, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksd.dtype)
    if t == 1:
        out = jnp.sum(probs[:, :, :, 0, :, None] * v_bksd[:, :, None], axis=3)[:, :, :, None]
    else:
        out = jnp.einsum("bkgts,bksd->bkgtd", probs, v_bksd)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def attention_with_cache(q_bthd: jax.Array, k_bkds: jax.Array, v_bksd: jax.Array, k_new_btkd: jax.Array,
                         v_new_btkd: jax.Array, mask_cache_bts: jax.Array, mask_new_btt: jax.Array) -> jax.Array:
    """Grouped-query attention over a read-only cache plus the chunk's own new keys and values.

    One softmax over both parts (exact, float32): the cache is only read here, and the new entries are
    written once after all layers (:func:`write_cache`), so no layer ever copies the cache. Returns [B, T, H, d].
    """
    b, t, h, d = q_bthd.shape
    kv = k_bkds.shape[1]
    f32 = jnp.float32
    q_bkgtd = q_bthd.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    k_new_bkjd, v_new_bkjd = k_new_btkd.transpose(0, 2, 1, 3), v_new_btkd.transpose(0, 2, 1, 3)
    sc = jnp.einsum("bkgtd,bkds->bkgts", q_bkgtd, k_bkds, preferred_element_type=f32)
    sn = jnp.einsum("bkgtd,bkjd->bkgtj", q_bkgtd, k_new_bkjd, preferred_element_type=f32)
    scale = 1.0 / math.sqrt(d)
    sc = jnp.where(mask_cache_bts[:, None, None], sc * scale, _MASK_VALUE)
    sn = jnp.where(mask_new_btt[:, None, None], sn * scale, _MASK_VALUE)
    m = jnp.maximum(jnp.max(sc, axis=-1, keepdims=True), jnp.max(sn, axis=-1, keepdims=True))
    ec, en = jnp.exp(sc - m), jnp.exp(sn - m)
    denom = jnp.sum(ec, axis=-1, keepdims=True) + jnp.sum(en, axis=-1, keepdims=True)
    pc, pn = (ec / denom).astype(v_bksd.dtype), (en / denom).astype(v_bksd.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", pc, v_bksd) + jnp.einsum("bkgtj,bkjd->bkgtd", pn, v_new_bkjd)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How the training forward runs (``train.remat``, ``train.attention_impl``, ``train.attention_block``);
    none of them changes a result beyond float rounding.

    ``remat``: what each scanned layer keeps for the backward pass. ``none`` keeps every intermediate;
    ``full`` keeps only the layer's input and recomputes the layer in the backward pass; ``dots`` keeps the
    weight products' outputs (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: attention scores,
    which have batch dims, are recomputed); ``offload`` keeps the same products in pinned host memory
    (``offload_dot_with_no_batch_dims``). ``attention_impl``: :mod:`dora_jax.models.attention`;
    ``interpret`` runs a Pallas kernel through its interpreter (CPU tests).
    """

    remat: str = "none"
    attention_impl: str = "xla"
    attention_block: int = 512
    interpret: bool = False

    @classmethod
    def of(cls, train) -> "TrainSettings":
        """The settings of a config's ``train`` section."""
        return cls(remat=train.remat, attention_impl=train.attention_impl, attention_block=train.attention_block)


def remat_policy(remat: str):
    """The ``jax.checkpoint`` policy of ``train.remat`` (not ``none``)."""
    policies = jax.checkpoint_policies
    if remat == "full":
        return policies.nothing_saveable
    if remat == "dots":
        return policies.dots_with_no_batch_dims_saveable
    if remat == "offload":
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"remat {remat!r}: allowed {', '.join(REMAT_POLICIES)}")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """How the rollout engine runs decode: its serving settings, apart from the architecture.

    The fields and their meaning are those of the same names in :class:`~dora_jax.config.RolloutConfig`
    (``rollout.attention_impl``, ``rollout.pallas_interpret``, ``rollout.cache_read_buckets``,
    ``rollout.decode_weights``, ``rollout.decode_steps``). :func:`decode_forward` reads the first three;
    ``decode_weights`` is read where the engine prepares a version's weights (:func:`decode_forward`
    recognizes the layout from the params), ``decode_steps`` by the rollout driver (decode steps per
    dispatched program). None of them changes a result beyond float rounding.
    """

    attention_impl: str = "xla"
    pallas_interpret: bool = False
    cache_read_buckets: int = 0
    decode_weights: str = "auto"
    decode_steps: int | str = "auto"

    @classmethod
    def of(cls, rollout: RolloutConfig) -> "DecodeSettings":
        """The settings of a config's ``rollout`` section."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)})


def resolve_attention_impl(settings: DecodeSettings | RolloutConfig) -> str:
    """``settings.attention_impl`` with ``"auto"`` resolved: ``"pallas"`` on TPU, ``"xla"`` on CPU and GPU.

    GPU resolves to XLA because that is what measured faster there: on an H100 the Triton kernel read full
    caches slower than XLA's masked attention, which reads every slot (docs/performance.md);
    it stays available as ``attention_impl="pallas"``.
    """
    if settings.attention_impl != "auto":
        return settings.attention_impl
    return "pallas" if jax.default_backend() == "tpu" else "xla"


def attention_with_cache_kernel(q_b1hd: jax.Array, k_bkds: jax.Array, v_bksd: jax.Array, k_new_b1kd: jax.Array,
                                v_new_b1kd: jax.Array, lengths_b: jax.Array, *, interpret: bool) -> jax.Array:
    """:func:`attention_with_cache` for one new token per row, with the cached part read by the Pallas kernel.

    The kernel covers cache slots ``0 .. lengths[b] - 1`` and returns its softmax statistics (row max ``m``,
    sum of exponentials ``l``); the current token's own key and value are merged here in float32, so the
    result is the same single softmax over cache plus current token. Returns [B, 1, H, d].
    """
    from dora_jax.kernels.ragged_decode_attention import ragged_decode_attention

    b, _, h, d = q_b1hd.shape
    kv = k_bkds.shape[1]
    f32 = jnp.float32
    q_bkgd = q_b1hd.reshape(b, kv, h // kv, d)
    out_c, m_c, l_c = ragged_decode_attention(q_bkgd, k_bkds, v_bksd, lengths_b, interpret=interpret,
                                              return_stats=True)
    s_n = jnp.sum(q_bkgd.astype(f32) * k_new_b1kd[:, 0, :, None, :].astype(f32), axis=-1) * (1.0 / math.sqrt(d))
    m = jnp.maximum(m_c, s_n)
    w_c, w_n = l_c * jnp.exp(m_c - m), jnp.exp(s_n - m)  # w_c = 0 for an empty cache part
    out = (out_c * w_c[..., None] + v_new_b1kd[:, 0, :, None, :].astype(f32) * w_n[..., None]) / (w_c + w_n)[..., None]
    return out.astype(q_b1hd.dtype).reshape(b, 1, h, d)


def write_cache(cache: KVCache, k_lbtkd: jax.Array, v_lbtkd: jax.Array, positions_bt: jax.Array) -> KVCache:
    """Writes every layer's new entries at their rows' positions with one scatter per tensor (in place when
    the cache is donated)."""
    b, t = positions_bt.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))

    # Advanced indices on two non-adjacent axes put the (b, t) index dims first: updates are [B, T, L, K, d].
    k = cache.k.at[:, rows, :, :, positions_bt].set(k_lbtkd.transpose(1, 2, 0, 3, 4).astype(cache.k.dtype))
    v = cache.v.at[:, rows, :, positions_bt, :].set(v_lbtkd.transpose(1, 2, 0, 3, 4).astype(cache.v.dtype))
    return KVCache(constrain(k, KVCache.k_axes()), constrain(v, KVCache.axes()))


def cache_read_lengths(settings: DecodeSettings | RolloutConfig, cache_len: int) -> tuple[int, ...]:
    """The cache prefixes the xla decode path chooses among: ``n = settings.cache_read_buckets`` evenly spaced
    lengths ``S/n, 2S/n, ..., S`` (rounded up; 0 = auto), shortest first; always ends with the whole cache."""
    # Auto: on CPU, for caches long enough that reading them is a real share of a step (below 256 slots the
    # whole read is cheap, and each prefix is one more copy of the attention in the compiled step). Even
    # spacing reads at most S/n slots more than the longest live context needs.
    n = settings.cache_read_buckets or (8 if jax.default_backend() == "cpu" and cache_len >= 256 else 1)
    return tuple(sorted({max(1, -(-cache_len * i // n)) for i in range(1, n + 1)}))


def decode_forward(cfg: ModelConfig, p: dict, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache,
                   *, logits: bool = True, read_upto: jax.Array | None = None,
                   settings: DecodeSettings = DecodeSettings()) -> tuple[jax.Array, KVCache]:
    """Forward of T new tokens per row against the cache, as a pure function of ``Decoder.decode_params()``.

    Row ``b``'s new tokens sit at positions ``positions_bt[b]`` (distinct within a row); a query at position
    ``p`` sees the cached slots ``s <= p`` that this chunk does not overwrite, plus the chunk's own tokens at
    positions ``<= p``: exactly slots ``0..p`` after the write. Layers read the cache and the new entries are
    written once after all layers. With one token per row and ``settings.attention_impl`` resolving to
    ``"pallas"``, the cached part is read by the ragged decode-attention kernel
    (:func:`attention_with_cache_kernel`), which loads only each row's valid slots. Otherwise the masked
    attention reads the shortest of :func:`cache_read_lengths` that covers every row's visible slots, chosen
    on device (``lax.switch``), so one compiled program serves every context length.

    Args:
      cfg: the architecture; activations and the new cache entries are in ``cfg.compute_dtype`` (the rollout
        engine passes its architecture with its own dtype).
      p: ``Decoder.decode_params(fuse=..., transpose=...)``: stacked layer params are scanned over, those
        stored one buffer per layer (the ``out_in`` layout's tuples) read through :class:`LayerWeights`.
      tokens_bt, positions_bt: int [B, T].
      cache: [L, B, K, S, d] each; donate it to update it in place.
      logits: return float32 logits [B, T, V]; else the final hidden states [B, T, D] (for
        :func:`head_logits` on the rows that need it).
      read_upto: int scalar: no row that matters sees a cached slot at or beyond it (the engine passes its
        live rows' largest position, so that empty slots' stale positions do not lengthen the read). Default:
        every row's first new position.
      settings: how the cache is read (the rollout engine's :class:`DecodeSettings`).

    Returns:
      ``(logits or hidden states, new cache)``.
    """
    s_len = cache.v.shape[3]
    if positions_bt.shape[1] == 1 and resolve_attention_impl(settings) == "pallas":
        # One token per row: the cached slots it sees are exactly 0 .. position - 1.
        lengths_b = jnp.clip(positions_bt[:, 0], 0, s_len).astype(jnp.int32)

        def attend(q, k_c, v_c, k, v, n):
            return attention_with_cache_kernel(q, k_c, v_c, k, v, lengths_b, interpret=settings.pallas_interpret)
        reads = (s_len,)
    else:
        def attend(q, k_c, v_c, k, v, n):
            return attention_with_cache(q, k_c, v_c, k, v, mask_cache_bts[..., :n], mask_new_btt)
        reads = cache_read_lengths(settings, s_len)
    slots = jnp.arange(s_len)
    written_bs = jnp.any(slots[None, None, :] == positions_bt[:, :, None], axis=1)
    mask_cache_bts = (slots[None, None, :] <= positions_bt[:, :, None]) & ~written_bs[:, None, :]
    mask_new_btt = positions_bt[:, None, :] <= positions_bt[:, :, None]
    if read_upto is None:  # slots at or after a row's first new position are written by the chunk or unseen
        read_upto = jnp.max(jnp.min(positions_bt, axis=1))
    branch = jnp.sum(jnp.asarray(reads[:-1], jnp.int32) < read_upto.astype(jnp.int32)) if len(reads) > 1 else 0

    def read(layer, n):
        """Layer ``layer``'s first ``n`` cache slots: one slice of the stacked cache, sized to what is read."""
        k_c = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(cache.k, layer, keepdims=False), 0, n, 3)
        v_c = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(cache.v, layer, keepdims=False), 0, n, 2)
        return k_c, v_c

    def block(x, layer):
        lp, i = layer
        q, k, v = qkv_projection(cfg, lp, x, positions_bt)
        if len(reads) == 1:
            attn = attend(q, *read(i, reads[0]), k, v, reads[0])
        else:
            attn = jax.lax.switch(branch, [lambda q, k, v, i, n=n: attend(q, *read(i, n), k, v, n) for n in reads],
                                  q, k, v, i)
        x = finish_block(cfg, lp, x, attn)
        return x, (k, v)

    stacked, per_layer = split_layer_params(p["layers"])

    def scanned(x, layer):
        lp, i = layer
        return block(x, ({**lp, **{n: LayerWeights(ws, i) for n, ws in per_layer.items()}}, i))

    layers = jnp.arange(cache.k.shape[0], dtype=jnp.int32)
    x, (k_new, v_new) = jax.lax.scan(scanned, embed_tokens(cfg, p["embed"], tokens_bt), (stacked, layers))
    cache = write_cache(cache, k_new, v_new, positions_bt)
    return (head_logits(cfg, p, x) if logits else x), cache


def _proj(p: dict[str, jax.Array], name: str, eq: str, x: jax.Array) -> jax.Array:
    """``x @ W[name]`` plus, when ``p`` carries a low-rank adapter for it, ``scale * (x @ a) @ b``.

    Applying the adapter on the activations (instead of merging it into W) keeps the backward pass free
    of W's gradient: only the input gradient flows through W."""
    dt = x.dtype
    y = jnp.einsum(eq, x, p[name].astype(dt))
    if f"lora_a:{name}" not in p:
        return y
    a, b = p[f"lora_a:{name}"].astype(dt), p[f"lora_b:{name}"].astype(dt)
    n_in = a.shape[0]
    x_flat = x.reshape(*x.shape[:2], n_in)  # [b, t, in...] -> [b, t, in]
    delta = jnp.einsum("btr,ro->bto", jnp.einsum("bti,ir->btr", x_flat, a), b)
    return y + (p["lora_scale"].astype(dt) * delta).reshape(y.shape)


# The layer weights :func:`fuse_layer_params` replaces (biases only where the architecture has them).
FUSED_INPUTS = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")


def fuse_layer_params(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """q|k|v -> ``wqkv`` [L, D, H + 2K, d] (and ``bqkv``), gate|up -> ``w_gate_up`` [L, D, 2, F].

    The blocks accept either form and compute the same values; the fused one runs one matmul for q, k, v and
    one for gate, up. Gate and up are stacked on a new axis (not concatenated along F) so the ``mlp`` axis
    keeps its meaning and its sharding."""
    p = dict(p)
    p["wqkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")], axis=2)
    if "bq" in p:
        p["bqkv"] = jnp.concatenate([p.pop("bq"), p.pop("bk"), p.pop("bv")], axis=1)
    p["w_gate_up"] = jnp.stack([p.pop("w_gate"), p.pop("w_up")], axis=2)
    return p


def resolve_decode_weights(settings: DecodeSettings | RolloutConfig) -> str:
    """``settings.decode_weights`` with ``"auto"`` resolved: ``"out_in"`` on CPU, ``"in_out"`` elsewhere."""
    if settings.decode_weights != "auto":
        return settings.decode_weights
    return "out_in" if jax.default_backend() == "cpu" else "in_out"


# Weight -> (its transposed name, how many leading axes after the layer axis are inputs).
_TRANSPOSED = {"wqkv": ("wqkv_t", 1), "wo": ("wo_t", 2), "w_gate_up": ("w_gate_up_t", 1),
               "w_down": ("w_down_t", 1)}


def transpose_weights(ws: dict[str, jax.Array]) -> dict:
    """The projections of :data:`TRANSPOSED_INPUTS` (stacked [L, *in, *out]) -> one array per layer, output
    axes first and input axes last: ``wqkv_t`` L x [H + 2K, d, D], ``wo_t`` L x [D, H, d], ``w_gate_up_t``
    L x [2, F, D], ``w_down_t`` L x [D, F] (tuples); an untied ``lm_head`` [D, V] -> ``head_t`` [V, D].

    One buffer per layer, not one stacked array: a scanned layer reads its weights through
    :class:`LayerWeights` (a ``lax.switch`` over the buffers), which XLA:CPU runs on the buffer itself, where
    a slice of a stacked array is first copied out (the whole model's projections, every step)."""
    out = {}
    for name, w in ws.items():
        if name == "lm_head":
            out["head_t"] = w.T
            continue
        new, n_in = _TRANSPOSED[name]
        src, dst = tuple(range(n_in)), tuple(range(w.ndim - 1 - n_in, w.ndim - 1))
        out[new] = tuple(jnp.moveaxis(w[i], src, dst) for i in range(w.shape[0]))
    return out


TRANSPOSED_INPUTS = tuple(_TRANSPOSED)


def transpose_decode_params(p: dict, transpose=transpose_weights) -> dict:
    """Fused decode params (``Decoder.decode_params(fuse=True)``) -> the ``out_in`` layout
    (:func:`transpose_weights`, or ``transpose``: the same function jitted), with ``head_t`` [V, D] the tied
    embedding itself, not a copy. The blocks then compute every product as ``W^T @ x^T``
    (:func:`_dot_out_in`)."""
    layers = dict(p["layers"])
    moved = {n: layers.pop(n) for n in TRANSPOSED_INPUTS}
    if "lm_head" in p:
        moved["lm_head"] = p["lm_head"]
    moved = transpose(moved)
    head = moved.pop("head_t", p["embed"])
    return {**{k: v for k, v in p.items() if k != "lm_head"}, "layers": {**layers, **moved}, "head_t": head}


class LayerWeights(NamedTuple):
    """Layer ``index``'s weight out of ``weights``, one buffer per layer (:func:`transpose_weights`), inside a
    scan over layers; :func:`_dot_out_in` multiplies by it."""

    weights: tuple[jax.Array, ...]
    index: jax.Array


def split_layer_params(layers: dict) -> tuple[dict, dict]:
    """``(stacked, per_layer)``: the layer params scanned over their leading axis, and those stored one buffer
    per layer (tuples, read through :class:`LayerWeights`)."""
    per_layer = {k: v for k, v in layers.items() if isinstance(v, tuple)}
    return {k: v for k, v in layers.items() if k not in per_layer}, per_layer


# Above this many rows (B x T) an out_in product contracts both operands on their minor axis instead: the
# two activation transposes of the W^T @ x^T form grow with the rows, and from ~96 rows XLA:CPU runs the
# contraction as fast as x @ W (benchmarks/experiments/out_in_rows.py measures both).
OUT_IN_MAX_ROWS = 64


def _dot_out_in(x: jax.Array, w_t: jax.Array | LayerWeights, n_in: int, out_dtype=None) -> jax.Array:
    """``x`` [B, T, *in] times ``w_t`` [*out, *in] -> [B, T, *out], computed as ``w_t @ x^T``.

    XLA:CPU runs a product with few rows (decode: B x T is the batch) 1.1-2.8x faster with the rows as the
    second operand's columns than as the first operand's rows. Left to itself XLA folds the transposes into
    the product and picks the slow form again; the barriers keep the product as written, and the two
    transposes only move activations, which are small. With more than :data:`OUT_IN_MAX_ROWS` rows (prefill)
    the product contracts ``x`` and ``w_t`` on their minor axes, with no transposes. A :class:`LayerWeights`
    is multiplied inside a ``lax.switch`` with one branch per layer, so each product reads its layer's
    buffer in place."""
    b, t = x.shape[:2]
    k = math.prod(x.shape[2:])
    w0 = w_t.weights[0] if isinstance(w_t, LayerWeights) else w_t
    out = w0.shape[:w0.ndim - n_in]
    few = b * t <= OUT_IN_MAX_ROWS
    x2 = x.reshape(b * t, k)
    if few:
        x2 = jax.lax.optimization_barrier(x2.T)

    def product(w, x2):
        w = w.reshape(-1, k).astype(x.dtype)
        if few:
            return jnp.matmul(w, x2, preferred_element_type=out_dtype)
        return jnp.einsum("ri,oi->ro", x2, w, preferred_element_type=out_dtype)

    if isinstance(w_t, LayerWeights):
        y = jax.lax.switch(w_t.index, [lambda x2, w=w: product(w, x2) for w in w_t.weights], x2)
    else:
        y = product(w_t, x2)
    if few:
        y = jax.lax.optimization_barrier(y).T
    return y.reshape(b, t, *out)


def embed_tokens(cfg: ModelConfig, embed_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    x = jnp.take(embed_vd, tokens_bt, axis=0).astype(cfg.compute_dtype)
    return constrain(x, ("batch", "length", "act_embed"))


def head_logits(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    """Final norm and output head: float32 logits [B, T, V]."""
    x = rms_norm(x_btd, p["final_norm"], cfg.rms_norm_eps)
    if "head_t" in p:  # decode params in the out_in layout
        logits = _dot_out_in(x, p["head_t"], 1, jnp.float32)
    elif cfg.tie_embeddings:
        logits = jnp.einsum("btd,vd->btv", x, p["embed"].astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", x, p["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "act_vocab"))


def qkv_projection(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array):
    """Normed input -> rotated q [B, T, H, d], rotated k and v [B, T, K, d] (fused or separate weights)."""
    dt = x_btd.dtype
    h = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in p or "wqkv_t" in p:
        qkv = (_dot_out_in(h, p["wqkv_t"], 1) if "wqkv_t" in p
               else jnp.einsum("btd,dhk->bthk", h, p["wqkv"].astype(dt)))
        if cfg.qkv_bias:
            qkv = qkv + p["bqkv"].astype(dt)
        q, k, v = jnp.split(qkv, [cfg.num_heads, cfg.num_heads + cfg.num_kv_heads], axis=2)
    else:
        q = _proj(p, "wq", "btd,dhk->bthk", h)
        k = _proj(p, "wk", "btd,dhk->bthk", h)
        v = _proj(p, "wv", "btd,dhk->bthk", h)
        if cfg.qkv_bias:
            q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions_bt, inv_freq)
    k = apply_rope(k, positions_bt, inv_freq)
    q = constrain(q, ("batch", "length", "act_heads", None))
    k = constrain(k, ("batch", "length", "act_kv_heads", None))
    v = constrain(v, ("batch", "length", "act_kv_heads", None))
    return q, k, v


def finish_block(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array, attn_bthd: jax.Array) -> jax.Array:
    """Output projection, residual, SwiGLU MLP (fused or separate gate/up), residual."""
    dt = x_btd.dtype
    x = x_btd + (_dot_out_in(attn_bthd, p["wo_t"], 2) if "wo_t" in p
                 else _proj(p, "wo", "bthk,hkd->btd", attn_bthd))
    if cfg.o_bias:
        x = x + p["bo"].astype(dt)
    x = constrain(x, ("batch", "length", "act_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in p or "w_gate_up_t" in p:
        gate_up = (_dot_out_in(h, p["w_gate_up_t"], 1) if "w_gate_up_t" in p
                   else jnp.einsum("btd,dcf->btcf", h, p["w_gate_up"].astype(dt)))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        gate = _proj(p, "w_gate", "btd,df->btf", h)
        up = _proj(p, "w_up", "btd,df->btf", h)
    act = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    x = x + (_dot_out_in(act, p["w_down_t"], 1) if "w_down_t" in p
             else _proj(p, "w_down", "btf,fd->btd", act))
    return constrain(x, ("batch", "length", "act_embed"))


# ----------------------------------------------------------------------------------------------------------
# The model.


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, axes=axes)


class Decoder(nnx.Module):
    """A decoder-only transformer of the Llama / Qwen family with stacked, scanned layers."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        L, D, H, K, d, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
        normal = nnx.initializers.normal(cfg.init_std)

        def w(shape, axes):
            return _param(normal(rngs.params(), shape, pd), axes)

        def ones(shape, axes):
            return _param(jnp.ones(shape, pd), axes)

        def zeros(shape, axes):
            return _param(jnp.zeros(shape, pd), axes)

        self.embed = w((V, D), ("vocab", "embed"))
        self.attn_norm = ones((L, D), ("layers", "norm"))
        self.wq = w((L, D, H, d), ("layers", "embed", "q_heads", "head_dim"))
        self.wk = w((L, D, K, d), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = w((L, D, K, d), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = w((L, H, d, D), ("layers", "q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.bq = zeros((L, H, d), ("layers", "q_heads", "head_dim"))
            self.bk = zeros((L, K, d), ("layers", "kv_heads", "head_dim"))
            self.bv = zeros((L, K, d), ("layers", "kv_heads", "head_dim"))
        if cfg.o_bias:
            self.bo = zeros((L, D), ("layers", "norm"))
        if cfg.qk_norm:
            self.q_norm = ones((L, d), ("layers", "head_dim"))
            self.k_norm = ones((L, d), ("layers", "head_dim"))
        self.mlp_norm = ones((L, D), ("layers", "norm"))
        self.w_gate = w((L, D, F), ("layers", "embed", "mlp"))
        self.w_up = w((L, D, F), ("layers", "embed", "mlp"))
        self.w_down = w((L, F, D), ("layers", "mlp", "embed"))
        self.final_norm = ones((D,), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = w((D, V), ("embed", "vocab"))

    # -- helpers -------------------------------------------------------------------------------------------

    def _layer_params(self) -> dict[str, jax.Array]:
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        if self.cfg.qkv_bias:
            names += ["bq", "bk", "bv"]
        if self.cfg.o_bias:
            names += ["bo"]
        if self.cfg.qk_norm:
            names += ["q_norm", "k_norm"]
        return {n: getattr(self, n)[...] for n in names}

    def _embed(self, tokens_bt: jax.Array) -> jax.Array:
        return embed_tokens(self.cfg, self.embed[...], tokens_bt)

    def _logits(self, x_btd: jax.Array) -> jax.Array:
        return head_logits(self.cfg, self.head_params(), x_btd)

    def _qkv(self, p: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array):
        return qkv_projection(self.cfg, p, x_btd, positions_bt)

    def _finish_block(self, p: dict[str, jax.Array], x_btd: jax.Array, attn_bthd: jax.Array) -> jax.Array:
        return finish_block(self.cfg, p, x_btd, attn_bthd)

    def head_params(self) -> dict[str, jax.Array]:
        """The final norm and the output head (the embedding when tied)."""
        out = {"final_norm": self.final_norm[...], "embed": self.embed[...]}
        if not self.cfg.tie_embeddings:
            out["lm_head"] = self.lm_head[...]
        return out

    def decode_params(self, fuse: bool = False, transpose: bool = False) -> dict:
        """Everything :func:`decode_forward` needs: ``{"layers": stacked layer params, **head_params()}``.

        Args:
          fuse: concatenate q|k|v and gate|up into one weight each (:func:`fuse_layer_params`), so that a
            decode step runs two larger matmuls instead of five smaller ones. Do it once per set of weights
            (``Engine.prepare_params``), not inside a step.
          transpose: also store each projection output axes first (:func:`transpose_decode_params`, the
            ``out_in`` layout of ``rollout.decode_weights``; needs ``fuse``).
        """
        if transpose and not fuse:
            raise ValueError("decode_params: transpose=True needs fuse=True (the out_in layout is of fused weights)")
        layers = self._layer_params()
        p = {"layers": fuse_layer_params(layers) if fuse else layers, **self.head_params()}
        return transpose_decode_params(p) if transpose else p

    # -- entry points --------------------------------------------------------------------------------------

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 segment_ids_bt: jax.Array | None = None, lora: dict[str, dict[str, jax.Array]] | None = None,
                 lora_scale: float = 1.0, *, settings: TrainSettings = TrainSettings(),
                 hidden: bool = False) -> jax.Array:
        """Training forward. Returns float32 logits [B, T, V] (or, with ``hidden``, the last layer's output
        [B, T, D] before the final norm, for :func:`head_logits` over chunks of positions).

        Args:
          tokens_bt: int token ids.
          positions_bt: rotary positions; defaults to 0..T-1 per row. Packed rows restart them per segment.
          segment_ids_bt: tokens attend only within their own segment; 0 marks padding. Defaults to all 1.
          lora: low-rank adapters ``{param name: {"a": [L, in, r], "b": [L, r, out]}}`` added to those
            projections on the activations (``dora_jax.trainer.lora``); the weights themselves are unchanged.
          lora_scale: ``alpha / r`` for ``lora``.
          settings: remat policy and attention implementation (:class:`TrainSettings`).
          hidden: return the last layer's output instead of the logits.
        """
        from dora_jax.models.attention import resolve_train_attention, train_attention

        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        impl = resolve_train_attention(settings.attention_impl, t, settings.attention_block)
        if impl == "xla":  # the reference: scores materialized under a [B, T, T] mask
            causal = jnp.tril(jnp.ones((t, t), bool))
            same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
            mask_bts = causal[None] & same & (segment_ids_bt[:, :, None] != 0)

        def attend(q, k, v):
            if impl == "xla":
                return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask_bts)
            return train_attention(q, k, v, segment_ids_bt, impl=impl, block=settings.attention_block,
                                   interpret=settings.interpret)

        def block(x, p):
            q, k, v = self._qkv(p, x, positions_bt)
            return self._finish_block(p, x, attend(q, k, v)), None

        if settings.remat != "none":
            block = jax.checkpoint(block, policy=remat_policy(settings.remat), prevent_cse=False)

        layer_params = self._layer_params()
        for name, ab in (lora or {}).items():
            layer_params[f"lora_a:{name}"], layer_params[f"lora_b:{name}"] = ab["a"], ab["b"]
        if lora:
            layer_params["lora_scale"] = jnp.full((self.cfg.num_layers,), lora_scale, jnp.float32)
        x, _ = jax.lax.scan(block, self._embed(tokens_bt), layer_params)
        return x if hidden else self._logits(x)

    def decode(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Forward of T new tokens per row against the cache; returns (float32 logits [B, T, V], new cache).

        Row ``b``'s new tokens sit at positions ``positions_bt[b]`` and land in the matching cache slots; a
        query at position ``p`` sees exactly slots ``0..p``. Prefill is this call with the whole (right-padded)
        prompt; stale slots past ``p`` are always masked. See :func:`decode_forward`.
        """
        return decode_forward(self.cfg, self.decode_params(), tokens_bt, positions_bt, cache)


def param_axes(state: nnx.State) -> dict:
    """The logical axes of every parameter, as a pytree shaped like ``state`` (leaves are tuples)."""
    return jax.tree.map(lambda v: v.get_metadata()["axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
