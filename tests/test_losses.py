"""GRPO-family losses against a float64 numpy reference written here, sample by sample, from the definitions.

Gradients are compared with central finite differences of the reference (float64) with the proximal
log-probs held fixed, as the trainer holds them.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from dora_jax.config import TrainConfig
from dora_jax.trainer.losses import group_advantages, normalizers, policy_loss, staleness, token_logprobs

B, T = 12, 10
GROUP = 4


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, B)  # mixed response lengths; each row has a prompt of 2..3 tokens first
    mask = np.zeros((B, T))
    for i, n in enumerate(lengths):
        start = 2 + i % 2
        mask[i, start:start + n] = 1
    logp = -rng.uniform(0.05, 4.0, (B, T))
    behaviour = logp + rng.normal(0, 0.35, (B, T))
    ref = logp + rng.normal(0, 0.3, (B, T))
    rewards = rng.normal(size=B)
    groups = np.repeat(np.arange(B // GROUP), GROUP)
    valid = np.ones(B, bool)
    valid[-2:] = False  # two padding rows (their group is the last one; it keeps 2 valid members)
    versions = np.array([5, 4, 3, 5, 2, 5, 4, 5, 5, 3, 0, 0])  # trainer version 5, K = 2: rows 4 is stale
    return dict(logp=logp, behaviour=behaviour * mask, ref=ref * mask, mask=mask, rewards=rewards, groups=groups,
                valid=valid, versions=versions)


def ref_advantages(rewards, groups, valid, kind, eps):
    adv = np.zeros(len(rewards))
    for g in np.unique(groups):
        rows = [i for i in range(len(rewards)) if groups[i] == g and valid[i]]
        if not rows:
            continue
        r = np.array([rewards[i] for i in rows])
        mean = r.mean()
        std = math.sqrt(((r - mean) ** 2).mean())
        for i in rows:
            adv[i] = (rewards[i] - mean) if kind == "dr_grpo" else (rewards[i] - mean) / (std + eps)
    return adv


def ref_surrogate(r, a, cfg: TrainConfig):
    """The clipped surrogate of one ratio, written out case by case."""
    if cfg.clip_mode == "standard":
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        return -min(r * a, min(max(r, lo), hi) * a)
    if a >= 0:
        return -min(r * a, min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_pos_high) * a)
    ppo = min(r * a, min(max(r, 1 - cfg.clip_neg_low), 1 + cfg.clip_high) * a)
    return -max(ppo, cfg.clip_neg_high * a)


def ref_loss(logp, prox, x, cfg: TrainConfig, trainer_version: int):
    """The objective, one sample at a time, in float64. ``prox`` is a constant (the proximal policy)."""
    adv = ref_advantages(x["rewards"], x["groups"], x["valid"], cfg.advantage, cfg.std_eps)
    kept = [i for i in range(B) if x["valid"][i] and 0 <= trainer_version - x["versions"][i] <= cfg.max_staleness]
    n_valid = int(x["valid"].sum())
    total_tokens = sum(int(x["mask"][i].sum()) for i in kept)
    pg_terms, kl_terms = [], []
    for i in kept:
        idx = np.flatnonzero(x["mask"][i])
        lp, mu, px, rf = logp[i, idx], x["behaviour"][i, idx], prox[i, idx], x["ref"][i, idx]
        old = mu if cfg.correction == "none" else px
        delta = px - mu
        a = adv[i]

        def weight(w):
            if cfg.correction == "tis":
                return min(w, cfg.is_cap)
            if cfg.correction in ("mis_token", "mis_seq"):
                return w if cfg.is_low <= w <= cfg.is_high else 0.0
            return w if not cfg.decoupled_cap or w <= cfg.decoupled_cap else 0.0

        if cfg.loss == "gspo":
            s = math.exp(np.mean(lp - old))
            w = 1.0 if cfg.correction == "none" else weight(math.exp(np.mean(delta)))
            per_tok = np.full(len(idx), w * ref_surrogate(s, a, cfg))
        else:
            per_tok = []
            seq_w = weight(math.exp(np.mean(delta))) if cfg.correction == "mis_seq" else None
            for j in range(len(idx)):
                r = math.exp(lp[j] - old[j])
                if cfg.correction == "none":
                    w = 1.0
                elif cfg.correction == "mis_seq":
                    w = seq_w
                else:
                    w = weight(math.exp(delta[j]))
                per_tok.append(w * ref_surrogate(r, a, cfg))
            per_tok = np.array(per_tok)
        kl_tok = np.exp(rf - lp) - (rf - lp) - 1
        pg_terms.append(per_tok)
        kl_terms.append(kl_tok)

    def aggregate(terms):
        if not terms:
            return 0.0
        if cfg.loss in ("grpo", "gspo"):
            return sum(t.mean() for t in terms) / len(terms)
        if cfg.loss == "dapo":
            return sum(t.sum() for t in terms) / total_tokens
        return sum(t.sum() for t in terms) / (n_valid * cfg.max_response_tokens)

    return aggregate(pg_terms) + cfg.kl_coef * aggregate(kl_terms)


def _jax_terms(x, cfg, trainer_version, dtype=jnp.float32, prox=None):
    """logp -> the JAX objective's LossTerms on ``x`` (``prox``: the proximal log-probs, default the current)."""
    f32 = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    valid = jnp.asarray(x["valid"])
    keep, _ = staleness(jnp.asarray(x["versions"]), valid, jnp.int32(trainer_version), cfg.max_staleness)
    adv = group_advantages(f32(x["rewards"]), jnp.asarray(x["groups"]), valid, cfg.advantage, cfg.std_eps)
    norms = normalizers(f32(x["mask"]), keep, valid, cfg.max_response_tokens)

    def terms(logp):
        return policy_loss(logp, f32(x["behaviour"]), f32(x["ref"]), f32(x["mask"]), adv, keep, norms, cfg,
                           None if prox is None else f32(prox))

    return terms


def _jax_loss(x, cfg, trainer_version, dtype=jnp.float32, prox=None):
    terms = _jax_terms(x, cfg, trainer_version, dtype, prox)
    return lambda logp: terms(logp).loss


def _numeric_grad(logp, prox, x, cfg, version, h=1e-6):
    """Central differences of the float64 reference in ``logp`` over the response tokens, ``prox`` held fixed."""
    num = np.zeros((B, T))
    for i, j in zip(*np.nonzero(x["mask"])):
        up, dn = logp.copy(), logp.copy()
        up[i, j] += h
        dn[i, j] -= h
        num[i, j] = (ref_loss(up, prox, x, cfg, version) - ref_loss(dn, prox, x, cfg, version)) / (2 * h)
    return num


CASES = [(loss, corr) for loss, corr in itertools.product(["grpo", "dapo", "dr_grpo", "gspo"],
                                                          ["none", "tis", "mis_token", "mis_seq", "decoupled"])
         if not (loss == "gspo" and corr == "mis_token")]


def _cfg(loss, correction):
    return TrainConfig(loss=loss, correction=correction, advantage="dr_grpo" if loss == "dr_grpo" else "grpo",
                       clip_low=0.2, clip_high=0.28, kl_coef=0.05, max_staleness=2, is_cap=1.3, is_low=0.8,
                       is_high=1.25, max_response_tokens=8)


@pytest.mark.parametrize("loss,correction", CASES)
def test_loss_and_gradient_match_reference(loss, correction):
    """The JAX objective run in float64 equals the reference in value and gradient (<= 1e-5 relative)."""
    x = _inputs()
    cfg = _cfg(loss, correction)
    version = 5
    logp64 = x["logp"]
    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(_jax_loss(x, cfg, version, jnp.float64))(jnp.asarray(logp64))
        value, grad = float(value), np.asarray(grad)
    expected = ref_loss(logp64, logp64, x, cfg, version)
    assert abs(value - expected) <= 1e-5 * abs(expected)

    num = _numeric_grad(logp64, logp64, x, cfg, version)
    assert np.abs(num).max() > 0
    assert rel_err(grad, num) <= 1e-5, (loss, correction)


@pytest.mark.parametrize("loss,correction", [("grpo", "mis_seq"), ("dapo", "tis"), ("gspo", "decoupled")])
def test_float32_path_within_rounding_of_reference(loss, correction):
    """In float32 (what training runs). The loss is a mean of O(1) terms of both signs that nearly cancel
    (group advantages sum to zero), so its float32 error is compared in absolute terms (a few ulps of 1);
    the gradient, elementwise, relative to its largest entry."""
    x = _inputs()
    cfg = _cfg(loss, correction)
    logp32 = jnp.asarray(x["logp"], jnp.float32)
    value, grad = jax.value_and_grad(_jax_loss(x, cfg, 5))(logp32)
    logp64 = np.asarray(logp32, np.float64)
    assert abs(float(value) - ref_loss(logp64, logp64, x, cfg, 5)) <= 1e-6
    with jax.enable_x64(True):
        grad64 = jax.grad(_jax_loss(x, cfg, 5, jnp.float64))(jnp.asarray(logp64))
    assert rel_err(grad, grad64) <= 1e-5


def test_corrections_actually_bite():
    """The inputs exercise clipping, truncation and masking (otherwise the reference test proves little)."""
    x = _inputs()
    delta = (x["logp"] - x["behaviour"])[x["mask"] > 0]
    w = np.exp(delta)
    assert (w > 1.3).any() and (w < 0.8).any() and ((w > 0.8) & (w < 1.25)).any()
    cfg = TrainConfig(correction="mis_token", is_low=0.8, is_high=1.25, max_staleness=2)
    keep, stale = staleness(jnp.asarray(x["versions"]), jnp.asarray(x["valid"]), jnp.int32(5), 2)
    assert int(stale.sum()) == 1 and int(keep.sum()) == 9
    f = _jax_loss(x, cfg, 5)
    assert float(f(jnp.asarray(x["logp"], jnp.float32))) != 0.0


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo"])
def test_advantages(kind):
    x = _inputs(3)
    got = group_advantages(jnp.asarray(x["rewards"], jnp.float32), jnp.asarray(x["groups"]),
                           jnp.asarray(x["valid"]), kind, 1e-6)
    assert rel_err(got, ref_advantages(x["rewards"], x["groups"], x["valid"], kind, 1e-6)) <= 1e-5


def test_stale_samples_get_exactly_zero_gradient():
    x = _inputs(1)
    cfg = TrainConfig(loss="dapo", correction="decoupled", kl_coef=0.1, max_staleness=1)
    grad = jax.grad(_jax_loss(x, cfg, 5))(jnp.asarray(x["logp"], jnp.float32))
    lag = 5 - x["versions"]
    stale = x["valid"] & (lag > 1)
    assert stale.sum() == 3
    assert np.all(np.asarray(grad)[stale] == 0.0)
    assert np.all(np.asarray(grad)[~x["valid"]] == 0.0)
    fresh = x["valid"] & ~stale
    assert np.abs(np.asarray(grad)[fresh]).max() > 0


def test_staleness_counts_future_versions_as_stale():
    keep, stale = staleness(jnp.array([3, 4, 6, 1]), jnp.array([True, True, True, False]), jnp.int32(5), 2)
    assert keep.tolist() == [True, True, False, False]
    assert stale.tolist() == [False, False, True, False]


def test_token_logprobs_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7))
    tokens = rng.integers(0, 7, (2, 5))
    got = np.asarray(token_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens)))
    for b in range(2):
        assert got[b, 0] == 0.0
        for t in range(1, 5):
            z = logits[b, t - 1]
            expected = z[tokens[b, t]] - math.log(np.exp(z).sum())
            assert abs(got[b, t] - expected) <= 1e-5 * abs(expected)


def test_gspo_rejects_token_masking():
    from dora_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.correction.*mis_seq"):
        load_config(None, ["train.loss=gspo", "train.correction=mis_token"])


@pytest.mark.parametrize("loss,correction", [("grpo", "decoupled"), ("dapo", "tis"), ("grpo", "mis_token"),
                                             ("gspo", "decoupled"), ("dr_grpo", "mis_seq")])
def test_a_proximal_policy_apart_from_the_current_one_matches_the_reference(loss, correction):
    """Later updates of an iteration: the proximal log-probs (the weights at the iteration's start) differ from
    the current ones, so the ratio is no longer 1. Value and gradient against the float64 reference with that
    proximal policy held fixed."""
    x = _inputs(3)
    cfg = _cfg(loss, correction)
    version = 5
    logp64 = x["logp"]
    prox64 = logp64 + np.random.default_rng(7).normal(0, 0.3, logp64.shape) * x["mask"]  # the policy moved
    with jax.enable_x64(True):
        terms = _jax_terms(x, cfg, version, jnp.float64, prox64)
        value, grad = jax.value_and_grad(lambda lp: terms(lp).loss)(jnp.asarray(logp64))
        value, grad, clipped = float(value), np.asarray(grad), float(terms(jnp.asarray(logp64)).clipped_tokens)
    expected = ref_loss(logp64, prox64, x, cfg, version)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    assert abs(expected - ref_loss(logp64, logp64, x, cfg, version)) > 1e-3  # the proximal policy matters here
    if loss != "gspo":
        assert clipped > 0  # ratios moved past the clip
    assert rel_err(grad, _numeric_grad(logp64, prox64, x, cfg, version)) <= 1e-5, (loss, correction)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_decoupled_cap_leaves_heavy_tokens_out_as_the_reference_does(loss):
    """AReaL's filter on decoupled PPO's weight pi_prox / mu: value and gradient against the float64 reference,
    on inputs where the cap takes some tokens (or, for GSPO, sequences) out but not all of them."""
    import dataclasses

    x = _inputs(3)
    cfg = dataclasses.replace(_cfg(loss, "decoupled"), decoupled_cap=1.15)
    version = 5
    logp64 = x["logp"]
    prox64 = logp64 + np.random.default_rng(7).normal(0, 0.3, logp64.shape) * x["mask"]
    with jax.enable_x64(True):
        terms = _jax_terms(x, cfg, version, jnp.float64, prox64)
        value, grad = jax.value_and_grad(lambda lp: terms(lp).loss)(jnp.asarray(logp64))
        out = terms(jnp.asarray(logp64))
        value, grad = float(value), np.asarray(grad)
    expected = ref_loss(logp64, prox64, x, cfg, version)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    kept = float(out.is_weight_sum)
    assert 0 < float(out.is_dropped_tokens) and kept > 0
    uncapped = ref_loss(logp64, prox64, x, dataclasses.replace(cfg, decoupled_cap=0.0), version)
    assert abs(expected - uncapped) > 1e-4  # the cap changes the objective here
    assert rel_err(grad, _numeric_grad(logp64, prox64, x, cfg, version)) <= 1e-5


def test_decoupled_cap_is_refused_outside_decoupled_ppo_and_at_one_or_below():
    from dora_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.decoupled_cap.*train.correction is 'tis'"):
        load_config(None, ["train.correction=tis", "train.decoupled_cap=5"])
    with pytest.raises(ConfigError, match="train.decoupled_cap.*> 1"):
        load_config(None, ["train.correction=decoupled", "train.decoupled_cap=0.9"])
    assert load_config(None, ["train.correction=decoupled", "train.decoupled_cap=5"]).train.decoupled_cap == 5


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_triple_clip_matches_the_reference(loss):
    """LongCat's three clips against the case-by-case float64 reference, with the policy moved far enough from
    the proximal one that every clip (and the dual clip of negative advantages) is active somewhere."""
    import dataclasses

    x = _inputs(5)
    cfg = dataclasses.replace(_cfg(loss, "decoupled"), clip_mode="triple", clip_neg_low=0.1, clip_neg_high=1.6,
                              clip_pos_high=0.4)
    version = 5
    logp64 = x["logp"]
    prox64 = logp64 + np.random.default_rng(11).normal(0, 0.6, logp64.shape) * x["mask"]
    with jax.enable_x64(True):
        value = float(_jax_loss(x, cfg, version, jnp.float64, prox64)(jnp.asarray(logp64)))
    expected = ref_loss(logp64, prox64, x, cfg, version)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    standard = ref_loss(logp64, prox64, x, dataclasses.replace(cfg, clip_mode="standard"), version)
    assert abs(expected - standard) > 1e-4  # the three clips change the objective here


def test_overlong_penalty_by_hand():
    """DAPO's soft overlong punishment with a budget of 100 tokens and a buffer of 20: nothing up to 80 tokens,
    then linear to the full penalty at 100."""
    from dora_jax.trainer.losses import overlong_penalty

    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 81, 90, 100)] == [0.0, 0.0, -0.05, -0.5, -1.0]
    assert overlong_penalty(95, 100, 20, penalty=0.5) == -0.375
    assert overlong_penalty(100, 100, 0) == 0.0  # off
