"""The decoder family (Llama 2/3/3.1, Qwen2, Qwen3, SmolLM2) in Flax NNX, with stacked, scanned layers.

Entry points: :meth:`Decoder.__call__` (training forward) and :func:`decode_forward` / :meth:`Decoder.decode`
(new tokens against an explicit :class:`KVCache`; prefill included). Both, and the paged decode step of
:mod:`dora_jax.models.paged`, run one layer stack, :func:`decoder_layers`, and differ only in their attention.
Parameters carry logical axis names for :mod:`dora_jax.sharding`. See docs/models.md.

Shapes: B batch, T new tokens, S cache length, D hidden, H query heads, K kv heads, G = H // K, d head dim,
F mlp hidden, V vocab, L layers.
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
    """Keys and values of every layer: ``k`` [L, B, K, d, S] (transposed) and ``v`` [L, B, K, S, d]. Slot ``s``
    holds the token at position ``s`` of that row (layout: docs/models.md, 'The decoder family')."""

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
    """Grouped-query attention over a read-only cache plus the chunk's own new keys and values, one float32
    softmax over both. Returns [B, T, H, d]."""
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
    none of them changes a result beyond float rounding (docs/trainer.md, 'Long sequences'). ``attention_impl``:
    :mod:`dora_jax.models.attention`; ``interpret`` runs a Pallas kernel through its interpreter (CPU tests).
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
    """How the rollout engine runs decode: the fields of the same names in
    :class:`~dora_jax.config.RolloutConfig`. None of them changes a result beyond float rounding.
    """

    attention_impl: str = "xla"
    pallas_interpret: bool = False
    decode_steps: int | str = "auto"

    @classmethod
    def of(cls, rollout: RolloutConfig) -> "DecodeSettings":
        """The settings of a config's ``rollout`` section."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)})


def resolve_attention_impl(settings: DecodeSettings | RolloutConfig) -> str:
    """``settings.attention_impl`` with ``"auto"`` resolved: ``"xla"`` on every platform (the Pallas paged
    kernels are chosen by name; docs/performance.md)."""
    if settings.attention_impl != "auto":
        return settings.attention_impl
    return "xla"


def write_cache(cache: KVCache, k_lbtkd: jax.Array, v_lbtkd: jax.Array, positions_bt: jax.Array) -> KVCache:
    """Writes every layer's new entries at their rows' positions with one scatter per tensor (in place when
    the cache is donated)."""
    b, t = positions_bt.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))

    # Advanced indices on two non-adjacent axes put the (b, t) index dims first: updates are [B, T, L, K, d].
    k = cache.k.at[:, rows, :, :, positions_bt].set(k_lbtkd.transpose(1, 2, 0, 3, 4).astype(cache.k.dtype))
    v = cache.v.at[:, rows, :, positions_bt, :].set(v_lbtkd.transpose(1, 2, 0, 3, 4).astype(cache.v.dtype))
    return KVCache(constrain(k, KVCache.k_axes()), constrain(v, KVCache.axes()))


def decode_forward(cfg: ModelConfig, p: dict, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache,
                   *, logits: bool = True, settings: DecodeSettings = DecodeSettings()) -> tuple[jax.Array, KVCache]:
    """Forward of T new tokens per row against the cache, as a pure function of ``Decoder.decode_params()``.

    Row ``b``'s new tokens sit at positions ``positions_bt[b]`` (distinct within a row); a query at position
    ``p`` sees exactly slots ``0..p`` after the write. Used for prefill; the engine's decode steps use
    :func:`dora_jax.models.paged.decode_forward_paged`.

    Args:
      cfg: the architecture; activations and the new cache entries are in ``cfg.compute_dtype``.
      p: ``Decoder.decode_params(fuse=...)``.
      tokens_bt, positions_bt: int [B, T].
      cache: :class:`KVCache`; donate it to update it in place.
      logits: return float32 logits [B, T, V]; else the final hidden states [B, T, D].
      settings: unused (the dense cache is read whole); accepted for the engine's calls.

    Returns:
      ``(logits or hidden states, new cache)``.
    """
    del settings  # one path: the cache here is a prompt's own, read whole
    slots = jnp.arange(cache.v.shape[3])
    written_bs = jnp.any(slots[None, None, :] == positions_bt[:, :, None], axis=1)
    mask_cache_bts = (slots[None, None, :] <= positions_bt[:, :, None]) & ~written_bs[:, None, :]
    mask_new_btt = positions_bt[:, None, :] <= positions_bt[:, :, None]

    def attend(q, k, v, i, state):
        # The cache is closed over, not carried: layers only read it, and write_cache writes all layers once.
        k_c = jax.lax.dynamic_index_in_dim(cache.k, i, keepdims=False)
        v_c = jax.lax.dynamic_index_in_dim(cache.v, i, keepdims=False)
        return attention_with_cache(q, k_c, v_c, k, v, mask_cache_bts, mask_new_btt), state

    x0 = embed_tokens(cfg, p["embed"], tokens_bt)
    x, _, (k_new, v_new) = decoder_layers(cfg, p["layers"], x0, positions_bt, attend, collect_kv=True)
    cache = write_cache(cache, k_new, v_new, positions_bt)
    return (head_logits(cfg, p, x) if logits else x), cache


def decoder_layers(cfg: ModelConfig, layers: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array,
                   attend, *, state=None, collect_kv: bool = False, remat: str = "none"):
    """The layer stack of every forward (training, prefill, paged decode): one ``jax.lax.scan`` over the stacked
    layer params of :func:`qkv_projection`, ``attend``, :func:`finish_block`.

    Args:
      cfg: the architecture.
      layers: stacked per-layer params [L, ...] (fused or not; LoRA factors ride along as extra entries).
      x_btd: the embedded tokens; positions_bt: their rotary positions.
      attend: ``attend(q, k, v, layer, state) -> (attention [B, T, H, d], state)`` with q [B, T, H, d], this
        layer's rotated k and v [B, T, K, d] and ``layer`` the int32 layer index.
      state: what ``attend`` threads from layer to layer (a pool it writes into); a cache that layers only read
        is better closed over, so that it is not a loop carry.
      collect_kv: also return every layer's new k and v [L, B, T, K, d], for one cache write after the scan.
        Off, they are not kept past their layer (training memory).
      remat: a ``train.remat`` policy wrapped around each layer (:func:`remat_policy`), or ``"none"``.

    Returns:
      ``(x [B, T, D] before the final norm, final state, (k, v) or None)``.
    """
    def block(carry, layer):
        x, st = carry
        lp, i = layer
        q, k, v = qkv_projection(cfg, lp, x, positions_bt)
        att, st = attend(q, k, v, i, st)
        return (finish_block(cfg, lp, x, att), st), ((k, v) if collect_kv else None)

    if remat != "none":
        block = jax.checkpoint(block, policy=remat_policy(remat), prevent_cse=False)
    indices = jnp.arange(jax.tree.leaves(layers)[0].shape[0], dtype=jnp.int32)
    (x, state), kv = jax.lax.scan(block, (x_btd, state), (layers, indices))
    return x, state, kv


def _proj(p: dict[str, jax.Array], name: str, eq: str, x: jax.Array) -> jax.Array:
    """``x @ W[name]`` plus, when ``p`` carries a low-rank adapter for it, ``scale * (x @ a) @ b`` (applied on
    the activations, so no gradient of W is formed)."""
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
    """q|k|v -> ``wqkv`` [L, D, H + 2K, d] (and ``bqkv``), gate|up -> ``w_gate_up`` [L, D, 2, F] (a new axis,
    so ``mlp`` keeps its sharding). The blocks accept either form and compute the same values."""
    p = dict(p)
    p["wqkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")], axis=2)
    if "bq" in p:
        p["bqkv"] = jnp.concatenate([p.pop("bq"), p.pop("bk"), p.pop("bv")], axis=1)
    p["w_gate_up"] = jnp.stack([p.pop("w_gate"), p.pop("w_up")], axis=2)
    return p


def embed_tokens(cfg: ModelConfig, embed_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    x = jnp.take(embed_vd, tokens_bt, axis=0).astype(cfg.compute_dtype)
    return constrain(x, ("batch", "length", "act_embed"))


def head_logits(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    """Final norm and output head: float32 logits [B, T, V]."""
    x = rms_norm(x_btd, p["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_embeddings:
        logits = jnp.einsum("btd,vd->btv", x, p["embed"].astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", x, p["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "act_vocab"))


def qkv_projection(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array):
    """Normed input -> rotated q [B, T, H, d], rotated k and v [B, T, K, d] (fused or separate weights)."""
    dt = x_btd.dtype
    h = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in p:
        qkv = jnp.einsum("btd,dhk->bthk", h, p["wqkv"].astype(dt))
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
    x = x_btd + _proj(p, "wo", "bthk,hkd->btd", attn_bthd)
    if cfg.o_bias:
        x = x + p["bo"].astype(dt)
    x = constrain(x, ("batch", "length", "act_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in p:
        gate_up = jnp.einsum("btd,dcf->btcf", h, p["w_gate_up"].astype(dt))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        gate = _proj(p, "w_gate", "btd,df->btf", h)
        up = _proj(p, "w_up", "btd,df->btf", h)
    act = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    x = x + _proj(p, "w_down", "btf,fd->btd", act)
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

    def head_params(self) -> dict[str, jax.Array]:
        """The final norm and the output head (the embedding when tied)."""
        out = {"final_norm": self.final_norm[...], "embed": self.embed[...]}
        if not self.cfg.tie_embeddings:
            out["lm_head"] = self.lm_head[...]
        return out

    def decode_params(self, fuse: bool = False) -> dict:
        """Everything :func:`decode_forward` needs: ``{"layers": stacked layer params, **head_params()}``.

        ``fuse``: fuse q|k|v and gate|up (:func:`fuse_layer_params`), once per set of weights, not in a step.
        """
        layers = self._layer_params()
        return {"layers": fuse_layer_params(layers) if fuse else layers, **self.head_params()}

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
            projections on the activations (``dora_jax.trainer.lora``).
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

        def attend(q, k, v, layer, state):
            if impl == "xla":
                return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask_bts), state
            return train_attention(q, k, v, segment_ids_bt, impl=impl, block=settings.attention_block,
                                   interpret=settings.interpret), state

        layer_params = self._layer_params()
        for name, ab in (lora or {}).items():
            layer_params[f"lora_a:{name}"], layer_params[f"lora_b:{name}"] = ab["a"], ab["b"]
        if lora:
            layer_params["lora_scale"] = jnp.full((self.cfg.num_layers,), lora_scale, jnp.float32)
        x, _, _ = decoder_layers(self.cfg, layer_params, self._embed(tokens_bt), positions_bt, attend,
                                 remat=settings.remat)
        return x if hidden else self._logits(x)

    def decode(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """:func:`decode_forward` with this module's weights: (float32 logits [B, T, V], new cache). Stale slots
        past a row's position are always masked."""
        return decode_forward(self.cfg, self.decode_params(), tokens_bt, positions_bt, cache)


def param_axes(state: nnx.State) -> dict:
    """The logical axes of every parameter, as a pytree shaped like ``state`` (leaves are tuples)."""
    return jax.tree.map(lambda v: v.get_metadata()["axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
