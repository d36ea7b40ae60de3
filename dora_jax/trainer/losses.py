"""GRPO-family objectives with a staleness mask and importance corrections, as pure functions of arrays
(:func:`group_advantages`, :func:`policy_loss`, :func:`token_logprobs`). Definitions: docs/trainer.md, 'Losses'
and 'Off-policy corrections'.

Shapes: ``b`` batch rows (one sample each), ``t`` token positions, ``v`` vocabulary. Every per-token array is
aligned with ``tokens_bt``: ``logprobs_bt[b, t] = log pi(tokens[b, t] | tokens[b, :t])``, and ``mask_bt`` marks
the response tokens. Losses are sums over rows divided by the *whole* batch's :class:`Normalizers`, so
micro-batch losses add up to the full loss.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dora_jax.config import TrainConfig


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log p(tokens[b, t] | tokens[b, :t]) in float32 under ``softmax(logits / temperature)`` (the rollout's
    sampling distribution), aligned with ``tokens_bt`` (column 0 is 0)."""
    logits = logits_btv[:, :-1].astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    targets = tokens_bt[:, 1:]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    lp = picked - jax.nn.logsumexp(logits, axis=-1)
    return jnp.pad(lp, ((0, 0), (1, 0)))


def chunked_token_logprobs(hidden_btd: jax.Array, logits_fn, tokens_bt: jax.Array, temperature: float = 1.0,
                           chunk: int = 0) -> jax.Array:
    """:func:`token_logprobs` of ``logits_fn(hidden_btd)``, computed ``chunk`` positions at a time.

    ``logits_fn`` maps hidden states [B, c, D] to logits [B, c, V] (the final norm and the output head). Neither
    pass holds more than one chunk's logits. ``chunk`` 0, or at least T, is the whole row at once.

    Raises:
      ValueError: when ``chunk`` does not divide the row length T.
    """
    b, t = tokens_bt.shape
    if chunk <= 0 or chunk >= t:
        return token_logprobs(logits_fn(hidden_btd), tokens_bt, temperature)
    if t % chunk:
        raise ValueError(f"logprob chunk {chunk} does not divide the row length {t}")
    n = t // chunk
    # Position t's logits predict token t + 1; the last position predicts nothing (a placeholder target).
    targets = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros((b, 1), tokens_bt.dtype)], axis=1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(args):
        h_bcd, y_bc = args
        logits = logits_fn(h_bcd).astype(jnp.float32)
        if temperature != 1.0:
            logits = logits / temperature
        picked = jnp.take_along_axis(logits, y_bc[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    xs = (hidden_btd.reshape(b, n, chunk, -1).swapaxes(0, 1), targets.reshape(b, n, chunk).swapaxes(0, 1))
    lp = jax.lax.map(one, xs).swapaxes(0, 1).reshape(b, t)
    return jnp.pad(lp[:, :-1], ((0, 0), (1, 0)))


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment, added to a response's reward: 0 up to ``budget - buffer`` tokens, then
    linear down to ``-penalty`` at ``budget`` (the generation budget, which a response never exceeds)."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -penalty * min(length - (budget - buffer), buffer) / buffer


def group_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, valid_b: jax.Array, kind: str,
                     std_eps: float) -> jax.Array:
    """Per-sample advantages within each group: ``r - mean`` (dr_grpo) or ``(r - mean) / (std + eps)`` (grpo).

    ``group_ids_b`` are integers in ``[0, B)``; rows with ``valid_b`` False get advantage 0 and do not count
    toward any group's statistics. The standard deviation is the population one (ddof 0).
    """
    n = rewards_b.shape[0]
    w = valid_b.astype(rewards_b.dtype)
    gid = jnp.where(valid_b, group_ids_b, 0)
    r = rewards_b * w
    count = jnp.maximum(jax.ops.segment_sum(w, gid, n), 1.0)
    mean = jax.ops.segment_sum(r, gid, n) / count
    dev = (r - mean[gid]) * w
    if kind == "dr_grpo":
        return dev
    var = jax.ops.segment_sum(dev * dev, gid, n) / count
    return dev / (jnp.sqrt(var[gid]) + std_eps)


def staleness(versions_b: jax.Array, valid_b: jax.Array, trainer_version: jax.Array,
              max_staleness: int) -> tuple[jax.Array, jax.Array]:
    """``(keep_b, stale_b)``: a valid sample is kept iff ``0 <= trainer_version - version <= max_staleness``."""
    lag = trainer_version - versions_b
    stale = valid_b & ((lag > max_staleness) | (lag < 0))
    return valid_b & ~stale, stale


class Normalizers(NamedTuple):
    """Denominators taken over the whole batch (not a micro-batch)."""

    samples: jax.Array  # kept samples
    tokens: jax.Array  # response tokens of kept samples
    constant: jax.Array  # valid rows * max_response_tokens (Dr.GRPO)


def normalizers(mask_bt: jax.Array, keep_b: jax.Array, valid_b: jax.Array, max_response_tokens: int) -> Normalizers:
    keep = keep_b.astype(mask_bt.dtype)
    return Normalizers(
        samples=jnp.maximum(keep.sum(), 1.0),
        tokens=jnp.maximum((mask_bt * keep[:, None]).sum(), 1.0),
        constant=jnp.maximum(valid_b.astype(mask_bt.dtype).sum(), 1.0) * max_response_tokens,
    )


def _aggregate(x_bt: jax.Array, mask_bt: jax.Array, keep_b: jax.Array, norms: Normalizers, loss: str) -> jax.Array:
    keep = keep_b.astype(x_bt.dtype)
    if loss in ("grpo", "gspo"):
        per_sample = (x_bt * mask_bt).sum(-1) / jnp.maximum(mask_bt.sum(-1), 1.0)
        return (per_sample * keep).sum() / norms.samples
    total = (x_bt * mask_bt * keep[:, None]).sum()
    return total / (norms.tokens if loss == "dapo" else norms.constant)


def _is_weight(delta: jax.Array, cfg: TrainConfig, masked_kind: str) -> tuple[jax.Array, jax.Array]:
    """(weight, dropped) for log importance ratios ``delta`` under ``cfg.correction``."""
    w = jnp.exp(delta)
    if cfg.correction == "tis":
        return jnp.minimum(w, cfg.is_cap), jnp.zeros_like(w)
    if cfg.correction == masked_kind:
        inside = (w >= cfg.is_low) & (w <= cfg.is_high)
        return jnp.where(inside, w, 0.0), (~inside).astype(w.dtype)
    if cfg.correction in ("mis_token", "mis_seq"):  # the other granularity: applied elsewhere
        return jnp.ones_like(w), jnp.zeros_like(w)
    if cfg.decoupled_cap:  # decoupled with AReaL's filter: the token leaves the loss, the weight is not clipped
        inside = w <= cfg.decoupled_cap
        return jnp.where(inside, w, 0.0), (~inside).astype(w.dtype)
    return w, jnp.zeros_like(w)  # decoupled


def _surrogate(r: jax.Array, adv: jax.Array, cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """(clipped surrogate loss, clipped mask) of ratios ``r`` with advantages ``adv`` under ``cfg.clip_mode``."""
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    if cfg.clip_mode == "standard":
        return -jnp.minimum(r * adv, jnp.clip(r, lo, hi) * adv), ((r < lo) | (r > hi)).astype(r.dtype)
    # Triple clip: positive advantages clip above at 1 + clip_pos_high (clip-higher); negative ones clip below at
    # 1 - clip_neg_low, and their ratio counts for at most clip_neg_high (dual clip: the loss of a negative sample
    # the policy made far likelier stays bounded).
    neg = adv < 0
    lo_t, hi_t = jnp.where(neg, 1.0 - cfg.clip_neg_low, lo), jnp.where(neg, hi, 1.0 + cfg.clip_pos_high)
    ppo = jnp.minimum(r * adv, jnp.clip(r, lo_t, hi_t) * adv)
    dual = jnp.where(neg, jnp.maximum(ppo, cfg.clip_neg_high * adv), ppo)
    clipped = (r < lo_t) | (r > hi_t) | (neg & (r > cfg.clip_neg_high))
    return -dual, clipped.astype(r.dtype)


class LossTerms(NamedTuple):
    """A micro-batch's share of the loss and of each additive metric."""

    loss: jax.Array
    pg_loss: jax.Array
    kl: jax.Array
    clipped_tokens: jax.Array
    is_weight_sum: jax.Array
    is_dropped_tokens: jax.Array


def policy_loss(logp_bt: jax.Array, behaviour_bt: jax.Array, ref_bt: jax.Array, mask_bt: jax.Array,
                advantages_b: jax.Array, keep_b: jax.Array, norms: Normalizers, cfg: TrainConfig,
                prox_bt: jax.Array | None = None) -> LossTerms:
    """The objective of ``cfg.loss`` with ``cfg.correction`` (docs/trainer.md, 'Losses'). Differentiable in
    ``logp_bt``; everything else is data. Computes in ``logp_bt``'s dtype.

    ``prox_bt`` are the proximal policy's log-probs, taken with the weights at the start of the iteration (the
    first update of an iteration may leave it None: then the proximal policy is the current one, exactly).
    """
    dt = logp_bt.dtype
    keep = keep_b.astype(dt)
    # Dropped (stale) rows are masked before any arithmetic, so even extreme or non-finite values there
    # cannot leak into the loss or the gradient: their contribution is exactly zero.
    m = mask_bt.astype(dt) * keep[:, None]
    logp = logp_bt * m
    prox = jax.lax.stop_gradient(logp) if prox_bt is None else prox_bt * m
    behaviour = behaviour_bt * m
    old = behaviour if cfg.correction == "none" else prox
    delta = (prox - behaviour) * m if cfg.correction != "none" else jnp.zeros_like(logp)
    n_b = jnp.maximum(m.sum(-1), 1.0)
    adv = advantages_b[:, None].astype(dt)

    if cfg.loss == "gspo":
        seq_log_ratio = ((logp - old) * m).sum(-1) / n_b
        s = jnp.exp(seq_log_ratio)[:, None]
        if cfg.correction == "none":
            w, dropped = jnp.ones_like(s), jnp.zeros_like(s)
        else:
            w, dropped = _is_weight((delta.sum(-1) / n_b)[:, None], cfg, "mis_seq")
        surrogate, clipped = _surrogate(s, adv, cfg)
        per_token = jnp.broadcast_to(w * surrogate, m.shape)
        clipped = jnp.broadcast_to(clipped, m.shape)
        w_tok, dropped_tok = jnp.broadcast_to(w, m.shape), jnp.broadcast_to(dropped, m.shape)
    else:
        r = jnp.exp(logp - old)
        if cfg.correction == "none":
            w_tok, dropped_tok = jnp.ones_like(r), jnp.zeros_like(r)
        elif cfg.correction == "mis_seq":
            w_seq, d_seq = _is_weight((delta.sum(-1) / n_b)[:, None], cfg, "mis_seq")
            w_tok, dropped_tok = jnp.broadcast_to(w_seq, m.shape), jnp.broadcast_to(d_seq, m.shape)
        else:
            w_tok, dropped_tok = _is_weight(delta, cfg, "mis_token")
        surrogate, clipped = _surrogate(r, adv, cfg)
        per_token = w_tok * surrogate

    pg = _aggregate(per_token, m, keep_b, norms, cfg.loss)
    if cfg.kl_coef > 0:
        d = (ref_bt - logp_bt) * m
        kl = _aggregate(jnp.exp(d) - d - 1.0, m, keep_b, norms, cfg.loss)
    else:
        kl = jnp.zeros((), dt)
    kept_tokens = m * keep[:, None]
    return LossTerms(
        loss=pg + cfg.kl_coef * kl,
        pg_loss=pg,
        kl=kl,
        clipped_tokens=(clipped * kept_tokens).sum(),
        is_weight_sum=(w_tok * kept_tokens).sum(),
        is_dropped_tokens=(dropped_tok * kept_tokens).sum(),
    )
