"""Token sampling with per-row settings and position-derived randomness.

Every row carries its own temperature, top-k and top-p, and its randomness is a pure function of
``(seed, sample_id, position)``: a sample's tokens never depend on which slot or batch it landed in.

Recorded log-probs are those of the policy's distribution at the row's temperature, ``log_softmax(logits / T)``
(``T = 1`` for greedy rows), before top-k / top-p truncation: the quantity a trainer recomputes from the same
parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingParams(NamedTuple):
    """Per-row sampling settings, each of shape [B]. ``temperature == 0`` means greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @staticmethod
    def make(batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        return SamplingParams(jnp.full((batch,), temperature, jnp.float32), jnp.full((batch,), top_k, jnp.int32),
                              jnp.full((batch,), top_p, jnp.float32))


def row_keys(seed: int | jax.Array, sample_ids_b: jax.Array, positions_b: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, sample id, position of the token being sampled)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(sample_ids_b, positions_b)


def _filter_top_k_top_p(logits_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array) -> jax.Array:
    """Masks logits outside each row's top-k set and outside its top-p nucleus to -inf."""
    vocab = logits_bv.shape[-1]
    sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
    k = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, vocab), vocab)
    kth = jnp.take_along_axis(sorted_bv, (k - 1)[:, None], axis=-1)
    # Nucleus: the smallest prefix of the sorted distribution whose mass reaches top_p (always >= 1 token).
    probs = jax.nn.softmax(jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_bv, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p_b[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted & (jnp.arange(vocab)[None] < k[:, None]), axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_bv, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    return jnp.where(logits_bv >= threshold, logits_bv, -jnp.inf)


def _inverse_cdf(keys_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
    """Exact categorical sampling with one uniform per row: the first token whose cumulative probability
    reaches ``u * total``. Costs O(V) arithmetic instead of V Gumbel draws per row."""
    probs = jax.nn.softmax(logits_bv, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = 1.0 - jax.vmap(jax.random.uniform)(keys_b)  # in (0, 1]: a zero-probability token is never picked
    return jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)


def sample(logits_bv: jax.Array, keys_b: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row.

    Args:
      logits_bv: float32 logits [B, V].
      keys_b: PRNG keys [B] (see :func:`row_keys`).
      params: per-row settings.

    Returns:
      ``(tokens [B] int32, logprobs [B] float32)``.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = params.temperature <= 0
    temp_b = jnp.where(greedy_b, 1.0, params.temperature)
    scaled = logits_bv / temp_b[:, None]
    needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    filtered = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda x, k, p: x, scaled, params.top_k,
                            params.top_p)
    drawn = _inverse_cdf(keys_b, filtered)
    tokens = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), drawn).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
