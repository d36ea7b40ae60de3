"""Decode against a paged KV cache: one pool of fixed-size pages shared by every slot, a page table per slot.

The pool holds every layer's keys and values as ``[L, K, N, P, d]`` (layers, kv heads, pages, tokens per page,
head dim): per layer, the layout JAX's shipped paged-attention kernels read (``jax.experimental.pallas.ops``
``gpu.paged_attention`` and ``tpu.paged_attention``). Token ``i`` of a slot sits in page ``tables[b, i // P]``
at row ``i % P``. Which pages a slot holds is decided on the host (:mod:`dora_jax.rollout.pages`); here the
tables are plain int32 arrays.

On a mesh whose batch axes split the slots over S shards, the pool's pages split the same way and each shard's
slots hold only pages of their own shard: ``tables`` then hold page ids within the slot's shard, and the
gather and scatter run per shard (a batch dimension of S, which XLA partitions without moving pages between
devices). Slot ``b`` of a decode state of B slots is in shard ``b // (B / S)``.

Page 0 of the device pool (of each shard) is scratch: it belongs to no slot. Writes that must not land anywhere (an empty
slot, a slot that is not producing this step, a prompt's padding) go there, so one scatter serves every row
without a branch, and table entries past a slot's pages point there and are masked out by length.

:func:`decode_forward_paged` is :func:`~dora_jax.models.decoder.decode_forward` for one new token per row.
With ``attention_impl = "xla"`` each layer reads the slot's cached tokens ``0 .. position - 1`` through its
table (a gather, then masked attention) and merges the current token's own key and value in the same float32
softmax; the pool is only read inside the layer scan and the new entries are written once after it, so no
layer copies the pool. The kernel implementations read the current token from the pool, so each layer writes
its entry first (:mod:`dora_jax.kernels.paged_attention` picks and calls the kernel).

Shape legend: B slots, H query heads, K kv heads, G = H // K, d head dim, N pages, P tokens per page, W pages
per table, L layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.models.decoder import (_MASK_VALUE, DecodeSettings, embed_tokens, finish_block, head_logits,
                                     qkv_projection, resolve_attention_impl)
from dora_jax.sharding import constrain

SCRATCH_PAGE = 0


class PagedKV(NamedTuple):
    """Every layer's pages: ``k`` and ``v`` [L, K, N, P, d]."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def axes() -> tuple[str | None, ...]:
        # Pages split over the batch axes as the slots do (memory per device falls with the batch shards;
        # a slot may hold pages of another shard, which the gather then fetches), heads over the tensor axes.
        return ("layers", "act_kv_heads", "batch", None, None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_tokens(self) -> int:
        return self.k.shape[3]


def init_pages(cfg: ModelConfig, num_pages: int, page_tokens: int, dtype: str | None = None) -> PagedKV:
    """A zero pool of ``num_pages`` pages (page 0, scratch, included)."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_tokens, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    return PagedKV(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def token_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of one token's keys and values over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype or cfg.compute_dtype).itemsize


def slot_pages(tables_bw: jax.Array, positions_b: jax.Array, page_tokens: int, write_b: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Where each row's token at ``positions_b`` goes: (page, row in page); scratch where ``write_b`` is off."""
    page = jnp.take_along_axis(tables_bw, (positions_b // page_tokens)[:, None], axis=1)[:, 0]
    return jnp.where(write_b, page, SCRATCH_PAGE), jnp.where(write_b, positions_b % page_tokens, 0)


def _shards(x: jax.Array, shards: int, axis: int = 0) -> jax.Array:
    """Splits ``axis`` into (shards, size / shards)."""
    return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])


def write_pages(pool: PagedKV, k_lbkd: jax.Array, v_lbkd: jax.Array, page_b: jax.Array, row_b: jax.Array,
                shards: int = 1) -> PagedKV:
    """Writes one token per row, every layer, with one scatter per tensor (in place when the pool is donated).
    ``page_b`` are page ids within each row's shard."""
    def write(pages, new, page, row):
        # Advanced indices on adjacent axes 2, 3 keep their place: updates are [L, K, B, d].
        return pages.at[:, :, page, row].set(new.transpose(0, 2, 1, 3).astype(pages.dtype))

    if shards == 1:
        k, v = write(pool.k, k_lbkd, page_b, row_b), write(pool.v, v_lbkd, page_b, row_b)
    else:
        per_shard = jax.vmap(write, in_axes=(2, 1, 0, 0), out_axes=2)
        page_s, row_s = _shards(page_b, shards), _shards(row_b, shards)
        k, v = (per_shard(_shards(x, shards, 2), _shards(new, shards, 1), page_s, row_s).reshape(x.shape)
                for x, new in ((pool.k, k_lbkd), (pool.v, v_lbkd)))
    return PagedKV(constrain(k, PagedKV.axes()), constrain(v, PagedKV.axes()))


def write_prompt_pages(pool: PagedKV, k_lrktd: jax.Array, v_lrktd: jax.Array, page_rt: jax.Array,
                       row_rt: jax.Array) -> PagedKV:
    """Writes prompts' entries (``k``, ``v`` [L, R, K, T, d]) at (page, row) per token [R, T]."""
    k = pool.k.at[:, :, page_rt, row_rt].set(k_lrktd.transpose(0, 2, 1, 3, 4).astype(pool.k.dtype))
    v = pool.v.at[:, :, page_rt, row_rt].set(v_lrktd.transpose(0, 2, 1, 3, 4).astype(pool.v.dtype))
    return PagedKV(constrain(k, PagedKV.axes()), constrain(v, PagedKV.axes()))


def paged_attention_with_current(q_bhd: jax.Array, k_knpd: jax.Array, v_knpd: jax.Array, tables_bw: jax.Array,
                                 lengths_b: jax.Array, k_new_bkd: jax.Array, v_new_bkd: jax.Array) -> jax.Array:
    """One query per row over its cached tokens ``0 .. lengths[b] - 1`` (read through its page table) plus the
    row's own new key and value, in one float32 softmax. Returns [B, H, d].

    The XLA path of decode: the test oracle of the kernels' path and what the CPU runs."""
    b, h, d = q_bhd.shape
    kv, _, p, _ = k_knpd.shape
    w = tables_bw.shape[1]
    f32 = jnp.float32
    q = q_bhd.reshape(b, kv, h // kv, d)
    # [K, B, W, P, d] -> [B, K, W * P, d]: the slot's tokens in order.
    k_c = jnp.take(k_knpd, tables_bw, axis=1).reshape(kv, b, w * p, d).transpose(1, 0, 2, 3)
    v_c = jnp.take(v_knpd, tables_bw, axis=1).reshape(kv, b, w * p, d).transpose(1, 0, 2, 3)
    scale = 1.0 / math.sqrt(d)
    sc = jnp.einsum("bkgd,bksd->bkgs", q, k_c, preferred_element_type=f32) * scale
    sc = jnp.where((jnp.arange(w * p)[None, :] < lengths_b[:, None])[:, None, None], sc, _MASK_VALUE)
    sn = jnp.sum(q.astype(f32) * k_new_bkd[:, :, None].astype(f32), axis=-1) * scale  # [B, K, G]
    m = jnp.maximum(jnp.max(sc, axis=-1), sn)
    ec, en = jnp.exp(sc - m[..., None]), jnp.exp(sn - m)
    denom = jnp.sum(ec, axis=-1) + en
    out = jnp.einsum("bkgs,bksd->bkgd", (ec / denom[..., None]).astype(v_c.dtype), v_c, preferred_element_type=f32)
    out = out + (en / denom)[..., None] * v_new_bkd[:, :, None].astype(f32)
    return out.astype(q_bhd.dtype).reshape(b, h, d)


def sharded_attention(q_bhd, k_knpd, v_knpd, tables_bw, lengths_b, k_new_bkd, v_new_bkd, shards: int = 1):
    """:func:`paged_attention_with_current` with the slots and pages split into ``shards`` (tables within each
    shard)."""
    if shards == 1:
        return paged_attention_with_current(q_bhd, k_knpd, v_knpd, tables_bw, lengths_b, k_new_bkd, v_new_bkd)
    per_shard = jax.vmap(paged_attention_with_current, in_axes=(0, 1, 1, 0, 0, 0, 0))
    rows = [_shards(x, shards) for x in (q_bhd, tables_bw, lengths_b, k_new_bkd, v_new_bkd)]
    out = per_shard(rows[0], _shards(k_knpd, shards, 1), _shards(v_knpd, shards, 1), *rows[1:])
    return out.reshape(q_bhd.shape)


def decode_forward_paged(cfg: ModelConfig, p: dict, tokens_b: jax.Array, positions_b: jax.Array, pool: PagedKV,
                         tables_bw: jax.Array, write_b: jax.Array, *, settings: DecodeSettings = DecodeSettings(),
                         shards: int = 1) -> tuple[jax.Array, PagedKV]:
    """One new token per row against the pool: float32 logits [B, V] and the pool with the tokens' entries.

    Row ``b``'s token sits at ``positions_b[b]`` and attends to the row's tokens ``0 .. position``; its entries
    are written at that position's page where ``write_b`` is on, else to scratch. ``tables_bw`` must cover
    position ``positions_b[b]`` for every written row (the host appends pages before it dispatches). With
    ``shards`` > 1 (the xla path), page ids are within each row's shard (module docstring)."""
    impl = resolve_attention_impl(settings)
    page_b, row_b = slot_pages(tables_bw, positions_b, pool.page_tokens, write_b)
    x0 = embed_tokens(cfg, p["embed"], tokens_b[:, None])
    layers = jnp.arange(pool.k.shape[0], dtype=jnp.int32)
    if impl == "xla":
        def block(x, layer):
            lp, i = layer
            # The pool is closed over, not carried: layers only read it, and it is written once after them.
            k_l = jax.lax.dynamic_index_in_dim(pool.k, i, keepdims=False)
            v_l = jax.lax.dynamic_index_in_dim(pool.v, i, keepdims=False)
            q, k, v = qkv_projection(cfg, lp, x, positions_b[:, None])
            att = sharded_attention(q[:, 0], k_l, v_l, tables_bw, positions_b, k[:, 0], v[:, 0], shards)
            return finish_block(cfg, lp, x, att[:, None]), (k[:, 0], v[:, 0])

        x, (k_new, v_new) = jax.lax.scan(block, x0, (p["layers"], layers))
        pool = write_pages(pool, k_new, v_new, page_b, row_b, shards)
    else:
        if shards != 1:
            raise ValueError(f"attention_impl {impl!r} reads one pool: slots split over {shards} batch shards "
                             "need attention_impl='xla'")
        from dora_jax.kernels.paged_attention import paged_attention

        def block(carry, layer):
            x, pk, pv = carry
            lp, i = layer
            q, k, v = qkv_projection(cfg, lp, x, positions_b[:, None])
            # The kernels read the current token from the pool: write this layer's entry first.
            pk = pk.at[i, :, page_b, row_b].set(k[:, 0].astype(pk.dtype))  # indices apart: updates [B, K, d]
            pv = pv.at[i, :, page_b, row_b].set(v[:, 0].astype(pv.dtype))
            att = paged_attention(q[:, 0], pk[i], pv[i], tables_bw, positions_b + 1, impl=impl,
                                  interpret=settings.pallas_interpret)
            return (finish_block(cfg, lp, x, att[:, None]), pk, pv), None

        (x, pk, pv), _ = jax.lax.scan(block, (x0, pool.k, pool.v), (p["layers"], layers))
        pool = PagedKV(constrain(pk, PagedKV.axes()), constrain(pv, PagedKV.axes()))
    return head_logits(cfg, p, x)[:, 0], pool
