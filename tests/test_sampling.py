"""Sampling settings hold, and randomness depends only on (seed, sample id, position)."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import chi2

from dora_jax.rollout.sampling import SamplingParams, row_keys, sample


def _logits(b=4, v=50, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(b, v)) * 2, jnp.float32)


def test_temperature_zero_is_greedy():
    logits = _logits()
    keys = row_keys(0, jnp.arange(4), jnp.zeros(4, jnp.int32))
    tokens, lp = sample(logits, keys, SamplingParams.make(4, 0.0, top_k=3, top_p=0.5))
    assert tokens.tolist() == np.argmax(np.asarray(logits), -1).tolist()
    np.testing.assert_allclose(lp, np.max(jax.nn.log_softmax(logits), -1), rtol=1e-6)


def test_top_k_and_top_p_sets():
    logits = _logits(b=1, v=30)
    order = np.argsort(-np.asarray(logits)[0])
    probs = np.asarray(jax.nn.softmax(logits))[0][order]
    nucleus = order[: int(np.searchsorted(np.cumsum(probs), 0.6) + 1)]
    n = 400  # many independent draws as rows of one batch
    tiled = jnp.tile(logits, (n, 1))
    keys = row_keys(0, jnp.arange(n), jnp.zeros(n, jnp.int32))
    draw = jax.jit(sample)
    seen_k = set(np.asarray(draw(tiled, keys, SamplingParams.make(n, 1.0, top_k=4))[0]).tolist())
    seen_p = set(np.asarray(draw(tiled, keys, SamplingParams.make(n, 1.0, top_p=0.6))[0]).tolist())
    assert seen_k == set(order[:4].tolist())
    assert seen_p == set(nucleus.tolist())


def test_mixed_rows_in_one_batch():
    """Row settings do not leak: a greedy row next to a top-k row stays greedy."""
    logits = _logits(b=2)
    p = SamplingParams(jnp.array([0.0, 1.0]), jnp.array([0, 2]), jnp.array([1.0, 1.0]))
    top2 = set(np.argsort(-np.asarray(logits)[1])[:2].tolist())
    draw = jax.jit(sample)
    for i in range(10):
        t, _ = draw(logits, row_keys(i, jnp.arange(2), jnp.zeros(2, jnp.int32)), p)
        assert int(t[0]) == int(np.argmax(logits[0]))
        assert int(t[1]) in top2


def test_randomness_depends_on_sample_and_position_only():
    logits = jnp.tile(_logits(b=1, v=1000), (3, 1))
    params = SamplingParams.make(3, 1.0)
    a, _ = sample(logits, row_keys(7, jnp.array([11, 12, 11]), jnp.array([5, 5, 5])), params)
    assert int(a[0]) == int(a[2])  # same (seed, sample, position) in different rows
    b, _ = sample(logits[:1], row_keys(7, jnp.array([11]), jnp.array([5])), SamplingParams.make(1, 1.0))
    assert int(b[0]) == int(a[0])  # alone or in a batch


def test_sampled_frequencies_follow_the_distribution():
    """20,000 independent draws (rows) from a 5-token distribution at temperature 0.8: each token's frequency
    is within 5 standard errors of softmax(logits / 0.8)."""
    logits = jnp.asarray([[1.0, 0.2, -0.5, 2.0, -3.0]], jnp.float32)
    n = 20_000
    keys = row_keys(3, jnp.arange(n), jnp.zeros(n, jnp.int32))
    tokens, _ = jax.jit(sample)(jnp.tile(logits, (n, 1)), keys, SamplingParams.make(n, 0.8))
    p = np.asarray(jax.nn.softmax(logits[0] / 0.8), np.float64)
    freq = np.bincount(np.asarray(tokens), minlength=5) / n
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_unfiltered_variant_equals_general_on_rows_without_filters():
    """The variant compiled without the vocabulary sort (``filtered=False``), the always-filtering one and the
    run-time choice give the same tokens and log-probs on rows without top-k / top-p, across temperatures
    (greedy included) and a vocabulary that is not a multiple of the CDF block (300 tokens: two blocks)."""
    from dora_jax.rollout.sampling import needs_filter

    n, v = 64, 300
    logits = _logits(b=n, v=v, seed=4)
    temps = jnp.asarray(np.random.default_rng(5).choice([0.0, 0.5, 1.0, 1.7], n), jnp.float32)
    params = SamplingParams(temps, jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32))
    assert not needs_filter(params.top_k.tolist(), params.top_p.tolist())
    assert needs_filter([0, 3], [1.0, 1.0]) and needs_filter([0], [0.9])
    keys = row_keys(12, jnp.arange(n), jnp.full(n, 9, jnp.int32))
    # Each variant is a program of its own, whose reductions XLA may fuse, and so round, its own way (on GPU it
    # does; on CPU it depends on the compiler and the machine): float32 rounding apart. A token can then differ
    # only where a row's uniform lies within that rounding (~1e-6 of a 300-token CDF) of a CDF boundary. These
    # keys leave every draw at least 1e-4 from one, measured below against float64, where every token must be
    # the float64 draw (the first token whose cumulative probability reaches the row's uniform).
    t64 = np.where(np.asarray(temps) > 0, np.asarray(temps), 1.0)[:, None]
    z = np.asarray(logits, np.float64) / t64
    cdf = np.cumsum(np.exp(z - z.max(-1, keepdims=True)), -1)
    cdf /= cdf[:, -1:]
    u = 1.0 - np.asarray(jax.vmap(jax.random.uniform)(keys), np.float64)  # the sampler's one uniform per row
    drawn64 = np.array([np.searchsorted(c, x) for c, x in zip(cdf, u)])
    sampled = np.asarray(temps) > 0
    assert np.min(np.abs(cdf - u[:, None])[sampled]) >= 1e-4
    outs = [jax.jit(sample, static_argnums=3)(logits, keys, params, f) for f in (False, True, None)]
    for t, lp in outs[1:]:
        assert np.array_equal(np.asarray(t), np.asarray(outs[0][0]))
        np.testing.assert_allclose(np.asarray(lp), np.asarray(outs[0][1]), rtol=1e-6, atol=1e-6)
    # Log-probs against float64 numpy: log_softmax(logits / T) at the sampled token (T = 1 for greedy rows).
    ref = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    tok = np.asarray(outs[0][0])
    assert np.array_equal(tok[sampled], drawn64[sampled])
    np.testing.assert_allclose(np.asarray(outs[0][1]), ref[np.arange(n), tok], rtol=1e-5, atol=1e-5)
    greedy = np.asarray(temps) == 0
    assert np.array_equal(tok[greedy], np.asarray(logits).argmax(-1)[greedy])


# -- the token distribution against a float64 reference ------------------------------------------------------

V = 48
DRAWS = 20_000  # per setting: a wrong distribution below is rejected at p < 1e-70, the right one passes
ALPHA = 1e-6  # a correct sampler fails a setting with this probability (the draws are fixed by their seeds)
# (temperature, top_k, top_p): temperature alone, top-k alone, top-p alone, and top-p and top-k at T != 1, where a
# nucleus taken before the temperature or before the top-k cut is another set.
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 6, 1.0), (1.0, 0, 0.8), (0.6, 0, 0.9), (1.8, 0, 0.7),
            (1.5, 10, 0.85), (0.5, 12, 0.95)]


def processed_distribution(logits, temperature, top_k, top_p, *, nucleus_after_temperature=True, top_k_first=True):
    """The distribution a row's token is drawn from, in float64: softmax(logits / T) restricted to the top-k
    tokens, then to the nucleus (the fewest most likely tokens whose mass, renormalized over the top-k set,
    reaches top_p), renormalized. The keyword arguments give two wrong orders: the nucleus of softmax(logits)
    (before the temperature), and the nucleus of the whole distribution (before the top-k cut)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    k = top_k if 0 < top_k < len(z) else len(z)
    scores = z if nucleus_after_temperature else np.asarray(logits, np.float64)
    ranked = scores[order[:k] if top_k_first else order]
    q = np.exp(ranked - ranked.max())
    q /= q.sum()
    n = max(1, int(np.sum(np.cumsum(q) - q < top_p)))
    keep = order[:min(n, k)]
    w = np.zeros(len(z))
    w[keep] = np.exp(z[keep] - z[keep].max())
    return w / w.sum()


def multinomial_pvalue(tokens, probs):
    """Pearson's chi-square p-value of the draws ``tokens`` against ``probs`` (bins expecting fewer than 5 draws
    pooled into one); 0 when a draw has probability 0."""
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    if counts[probs == 0].sum():
        return 0.0
    expected = probs * counts.sum()
    big, small = expected >= 5, (probs > 0) & (expected < 5)
    observed, wanted = list(counts[big]), list(expected[big])
    if small.any():
        observed.append(counts[small].sum())
        wanted.append(expected[small].sum())
    observed, wanted = np.asarray(observed), np.asarray(wanted)
    if len(observed) == 1:
        return 1.0
    return float(chi2.sf(np.sum((observed - wanted) ** 2 / wanted), len(observed) - 1))


def _logits_v():
    return np.random.default_rng(0).normal(size=V) * 1.5


def wrong_distributions(logits, t, k, p):
    """The distributions of samplers with one mistake each, where they differ from the right one."""
    right = processed_distribution(logits, t, k, p)
    wrong = {"uniform over the kept set": (right > 0) / np.sum(right > 0),
             "nucleus before the temperature": processed_distribution(logits, t, k, p, nucleus_after_temperature=False),
             "nucleus before the top-k cut": processed_distribution(logits, t, k, p, top_k_first=False),
             "temperature left out": processed_distribution(logits, 1.0, k, p)}
    return {name: d for name, d in wrong.items() if not np.allclose(d, right)}


def test_token_distribution_follows_temperature_top_k_and_top_p():
    """DRAWS rows per setting, all settings in one batch (each row its own): the tokens of each setting follow
    the float64 reference distribution (chi-square, no token outside the kept set)."""
    logits = _logits_v()
    for t, k, p in SETTINGS:  # no nucleus boundary within float32 rounding of top_p
        z = np.sort(logits / t)[::-1][: k or V]
        q = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert p == 1.0 or np.min(np.abs(np.cumsum(q) - q - p)) > 1e-3
    n = len(SETTINGS) * DRAWS
    column = lambda i, dtype: jnp.asarray(np.repeat([s[i] for s in SETTINGS], DRAWS), dtype)  # noqa: E731
    params = SamplingParams(column(0, jnp.float32), column(1, jnp.int32), column(2, jnp.float32))
    keys = row_keys(11, jnp.arange(n), jnp.zeros(n, jnp.int32))
    tokens = np.asarray(jax.jit(sample)(jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)), keys, params)[0])
    for i, (t, k, p) in enumerate(SETTINGS):
        drawn = tokens[i * DRAWS:(i + 1) * DRAWS]
        pvalue = multinomial_pvalue(drawn, processed_distribution(logits, t, k, p))
        assert pvalue >= ALPHA, ((t, k, p), pvalue, np.bincount(drawn, minlength=V))


def test_the_distribution_check_rejects_samplers_with_one_mistake():
    """The check above, fed DRAWS tokens from the right distribution (passes) and from each wrong one (fails):
    with this many draws it tells them apart. The settings make every mistake visible somewhere, the wrong
    orders at T != 1 included."""
    logits = _logits_v()
    rng = np.random.default_rng(1)
    caught = set()
    for t, k, p in SETTINGS:
        right = processed_distribution(logits, t, k, p)
        assert multinomial_pvalue(rng.choice(V, DRAWS, p=right), right) >= ALPHA
        for name, wrong in wrong_distributions(logits, t, k, p).items():
            assert multinomial_pvalue(rng.choice(V, DRAWS, p=wrong), right) < ALPHA, ((t, k, p), name)
            caught.add(name)
    assert caught == {"uniform over the kept set", "nucleus before the temperature", "nucleus before the top-k cut",
                      "temperature left out"}
