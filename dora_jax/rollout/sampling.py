"""Token sampling with per-row settings and position-derived randomness.

Every row carries its own temperature, top-k and top-p, and its randomness is a pure function of
``(seed, sample_id, position)``: a sample's tokens never depend on which slot or batch it landed in.

A sampled token's recorded log-prob is its log-probability under the distribution that drew it: the logits
divided by the row's temperature, truncated to the row's top-k set and top-p nucleus, renormalized. Without
truncation that is ``log_softmax(logits / T)``, what the trainer computes from the same parameters at the
same temperature. Greedy rows record ``log_softmax(logits)`` of the argmax.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

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


def _inverse_cdf(keys_b: jax.Array, logits_bv: jax.Array, block: int = 256) -> jax.Array:
    """Exact categorical sampling with one uniform per row: the first token whose cumulative probability
    reaches ``u * total``. Costs O(V) arithmetic instead of V Gumbel draws per row.

    The cumulative sum is taken in two levels (sums of blocks of ``block`` tokens, then the running sum inside
    the one block where ``u * total`` falls), which reads the row a constant number of times instead of the
    log(V) passes of a full prefix sum. Padding tokens have probability zero and are never picked.
    """
    b, v = logits_bv.shape
    nb = -(-v // block)
    logits = jnp.pad(logits_bv, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
    e_bnk = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).reshape(b, nb, block)
    csum_bn = jnp.cumsum(jnp.sum(e_bnk, axis=-1), axis=-1)
    u = 1.0 - jax.vmap(jax.random.uniform)(keys_b)  # in (0, 1]: a zero-probability token is never picked
    target_b = u * csum_bn[:, -1]
    j = jnp.minimum(jnp.sum(csum_bn < target_b[:, None], axis=-1), nb - 1)  # the block holding the target
    before = jnp.where(j > 0, jnp.take_along_axis(csum_bn, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    local = before[:, None] + jnp.cumsum(jnp.take_along_axis(e_bnk, j[:, None, None], axis=1)[:, 0], axis=-1)
    return jnp.minimum(j * block + jnp.sum(local < target_b[:, None], axis=-1), v - 1)


def needs_filter(top_k: Sequence[int], top_p: Sequence[float]) -> bool:
    """Whether any row uses top-k or top-p: the static choice of :func:`sample`'s ``filtered`` argument."""
    return any(int(k) > 0 for k in top_k) or any(float(p) < 1.0 for p in top_p)


def run_filters(top_k: int, top_p: float) -> list[bool]:
    """The sampling variants a run's engine dispatches: its rollout's (``rollout.top_k`` / ``top_p``) and the
    unfiltered one its evaluation samples with."""
    return sorted({needs_filter([top_k], [top_p]), False})


def sample(logits_bv: jax.Array, keys_b: jax.Array, params: SamplingParams,
           filtered: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row.

    Args:
      logits_bv: float32 logits [B, V].
      keys_b: PRNG keys [B] (see :func:`row_keys`).
      params: per-row settings.
      filtered: ``False`` when no row uses top-k / top-p (the vocabulary sort is left out of the program),
        ``True`` to always apply the filters, ``None`` to decide at run time. A row without top-k / top-p gets
        the same token and log-prob under every choice, so a caller may pick the cheapest variant for the
        batch at hand (:func:`needs_filter`) without changing any sample.

    Returns:
      ``(tokens [B] int32, logprobs [B] float32)``.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = params.temperature <= 0
    temp_b = jnp.where(greedy_b, 1.0, params.temperature)
    scaled = logits_bv / temp_b[:, None]
    if filtered is None:
        any_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
        kept = jax.lax.cond(any_filter, _filter_top_k_top_p, lambda x, k, p: x, scaled, params.top_k, params.top_p)
    elif filtered:
        kept = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    else:
        kept = scaled
    drawn = _inverse_cdf(keys_b, kept)
    tokens = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), drawn).astype(jnp.int32)
    drew = jnp.where(greedy_b[:, None], scaled, kept)  # greedy rows: T = 1 and no truncation
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(drew, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
