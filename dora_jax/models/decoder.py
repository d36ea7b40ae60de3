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

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dora_jax.config import ModelConfig
from dora_jax.sharding import constrain

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class KVCache(NamedTuple):
    """Keys and values of every layer: ``k_lbksd``/``v_lbksd`` of shape [L, B, K, S, d]. Slot ``s`` holds the
    token at position ``s`` of that row. Heads before length, so attention contracts the cache in place
    (batch dims b, k leading) instead of transposing it every step."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        return ("layers", "batch", "act_kv_heads", "cache_length", None)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str | None = None) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


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


def _write_cache(cache_lbksd: jax.Array, layer: jax.Array, new_btkd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """Scatters each row's new entries into layer ``layer`` at their positions (in place inside the scan)."""
    b, t = positions_bt.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return cache_lbksd.at[layer, rows, :, positions_bt, :].set(new_btkd.astype(cache_lbksd.dtype))


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
        x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(self.cfg.compute_dtype)
        return constrain(x, ("batch", "length", "act_embed"))

    def _logits(self, x_btd: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = rms_norm(x_btd, self.final_norm[...], cfg.rms_norm_eps)
        if cfg.tie_embeddings:
            head = self.embed[...].astype(x.dtype)
            logits = jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)
        else:
            head = self.lm_head[...].astype(x.dtype)
            logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def _proj(self, p: dict[str, jax.Array], name: str, eq: str, x: jax.Array) -> jax.Array:
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

    def _qkv(self, p: dict[str, jax.Array], x_btd: jax.Array, positions_bt: jax.Array):
        cfg, dt = self.cfg, x_btd.dtype
        h = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
        q = self._proj(p, "wq", "btd,dhk->bthk", h)
        k = self._proj(p, "wk", "btd,dhk->bthk", h)
        v = self._proj(p, "wv", "btd,dhk->bthk", h)
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

    def _finish_block(self, p: dict[str, jax.Array], x_btd: jax.Array, attn_bthd: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x_btd.dtype
        x = x_btd + self._proj(p, "wo", "bthk,hkd->btd", attn_bthd)
        if cfg.o_bias:
            x = x + p["bo"].astype(dt)
        x = constrain(x, ("batch", "length", "act_embed"))
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        gate = self._proj(p, "w_gate", "btd,df->btf", h)
        up = self._proj(p, "w_up", "btd,df->btf", h)
        act = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        x = x + self._proj(p, "w_down", "btf,fd->btd", act)
        return constrain(x, ("batch", "length", "act_embed"))

    # -- entry points --------------------------------------------------------------------------------------

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 segment_ids_bt: jax.Array | None = None, lora: dict[str, dict[str, jax.Array]] | None = None,
                 lora_scale: float = 1.0) -> jax.Array:
        """Training forward. Returns float32 logits [B, T, V].

        Args:
          tokens_bt: int token ids.
          positions_bt: rotary positions; defaults to 0..T-1 per row. Packed rows restart them per segment.
          segment_ids_bt: tokens attend only within their own segment; 0 marks padding. Defaults to all 1.
          lora: low-rank adapters ``{param name: {"a": [L, in, r], "b": [L, r, out]}}`` added to those
            projections on the activations (``dora_jax.trainer.lora``); the weights themselves are unchanged.
          lora_scale: ``alpha / r`` for ``lora``.
        """
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
        mask_bts = causal[None] & same & (segment_ids_bt[:, :, None] != 0)

        def block(x, p):
            q, k, v = self._qkv(p, x, positions_bt)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            return self._finish_block(p, x, attention(q, k, v, mask_bts)), None

        layer_params = self._layer_params()
        for name, ab in (lora or {}).items():
            layer_params[f"lora_a:{name}"], layer_params[f"lora_b:{name}"] = ab["a"], ab["b"]
        if lora:
            layer_params["lora_scale"] = jnp.full((self.cfg.num_layers,), lora_scale, jnp.float32)
        x, _ = jax.lax.scan(block, self._embed(tokens_bt), layer_params)
        return self._logits(x)

    def decode(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Forward of T new tokens per row against the cache; returns (float32 logits [B, T, V], new cache).

        Row ``b``'s new tokens sit at positions ``positions_bt[b]`` and are written to the matching cache
        slots before attending, so a query at position ``p`` sees exactly slots ``0..p``.
        Prefill is this call with the whole (right-padded) prompt; stale slots past ``p`` are always masked.
        """
        s = cache.k.shape[3]
        mask_bts = jnp.arange(s)[None, None, :] <= positions_bt[:, :, None]

        def block(carry, layer):
            x, k_all, v_all = carry
            p, i = layer
            q, k, v = self._qkv(p, x, positions_bt)
            # The whole cache is carried so that writing the new entries is an in-place scatter.
            k_all = _write_cache(k_all, i, k, positions_bt)
            v_all = _write_cache(v_all, i, v, positions_bt)
            k_l = jax.lax.dynamic_index_in_dim(k_all, i, keepdims=False)
            v_l = jax.lax.dynamic_index_in_dim(v_all, i, keepdims=False)
            x = self._finish_block(p, x, attention(q, k_l, v_l, mask_bts))
            return (x, k_all, v_all), None

        layers = (self._layer_params(), jnp.arange(self.cfg.num_layers))
        (x, k, v), _ = jax.lax.scan(block, (self._embed(tokens_bt), cache.k, cache.v), layers)
        cache = KVCache(constrain(k, KVCache.axes()), constrain(v, KVCache.axes()))
        return self._logits(x), cache


def param_axes(state: nnx.State) -> dict:
    """The logical axes of every parameter, as a pytree shaped like ``state`` (leaves are tuples)."""
    return jax.tree.map(lambda v: v.get_metadata()["axes"], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
