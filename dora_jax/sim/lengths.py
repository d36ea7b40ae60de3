"""Output-length distributions for the cluster simulator.

Three kinds, all drawn from a seeded ``random.Random`` so a run is reproducible:

* ``fixed``: every completion has ``value`` tokens (hand-checkable cases);
* ``lognormal``: long-tailed, clipped to ``max`` (a clipped sample ends with finish reason "length", as in a
  real rollout). Parametrized either by ``mean`` (of the *clipped* distribution) and ``sigma``, or by the
  quantiles ``p50`` and ``p99`` (of the unclipped one);
* ``jsonl``: lengths recorded by a real run, one JSON object per line with a ``length`` (or ``new_tokens``)
  field, or a bare integer per line; resampled with replacement.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Optional

from dora_jax.schema import ConfigError, fail, from_dict
from dora_jax.textfiles import TextFileError, read_jsonl

Z99 = 2.3263478740408408  # standard normal 99th percentile
KIND_FIELDS = {"fixed": ("kind", "value"), "lognormal": ("kind", "mean", "sigma", "p50", "p99", "max"),
               "jsonl": ("kind", "path")}


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ LogNormal(mu, sigma), in closed form."""
    if sigma == 0:
        return min(math.exp(mu), cap)
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


@dataclass(frozen=True)
class LengthDist:
    """A completion-length distribution (tokens). Build with :func:`length_dist`."""

    kind: str
    mu: float = 0.0
    sigma: float = 0.0
    max: int = 0
    value: int = 0
    table: tuple[int, ...] = ()

    def sample(self, rng: random.Random) -> int:
        """One completion length (>= 1 token)."""
        if self.kind == "fixed":
            return self.value
        if self.kind == "jsonl":
            return self.table[rng.randrange(len(self.table))]
        return max(1, min(self.max, round(rng.lognormvariate(self.mu, self.sigma))))

    def draw(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths: what ``n`` calls of :meth:`sample` return, from the same draws."""
        if self.kind != "lognormal":
            return [self.sample(rng) for _ in range(n)]
        lognormal, mu, sigma, cap = rng.lognormvariate, self.mu, self.sigma, self.max
        out = []
        for _ in range(n):  # max(1, min(cap, x)), without the calls
            x = round(lognormal(mu, sigma))
            x = x if x < cap else cap
            out.append(x if x > 1 else 1)
        return out

    def mean(self) -> float:
        """Expected length (of the clipped distribution for ``lognormal``)."""
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "jsonl":
            return sum(self.table) / len(self.table)
        return _clipped_lognormal_mean(self.mu, self.sigma, self.max)

    def upper(self) -> int:
        """The longest length the distribution can produce."""
        return {"fixed": self.value, "jsonl": max(self.table) if self.table else 0}.get(self.kind, self.max)


@dataclass(frozen=True)
class LengthSpec:
    """``workload.lengths`` as written: a ``kind`` and that kind's fields (:data:`KIND_FIELDS`); the rest stay
    ``None``. :func:`length_dist` checks it and builds the distribution."""

    kind: Optional[str] = None
    value: Optional[int] = None
    mean: Optional[float] = None
    sigma: Optional[float] = None
    p50: Optional[float] = None
    p99: Optional[float] = None
    max: Optional[int] = None
    path: Optional[str] = None


def length_dist(spec: LengthSpec | dict[str, Any], path: str = "workload.lengths", base_dir: str = ".") -> LengthDist:
    """Builds a :class:`LengthDist` from its config mapping, validating every field.

    Args:
        spec: ``{kind: fixed, value}``, ``{kind: lognormal, mean, sigma, max}``,
            ``{kind: lognormal, p50, p99, max}`` or ``{kind: jsonl, path}``, as a mapping or a
            :class:`LengthSpec`.
        path: dotted config path, used in error messages.
        base_dir: directory a relative ``jsonl`` path is resolved against (the config file's).

    Returns:
        The distribution. For ``mean``/``sigma`` the location ``mu`` is solved (bisection) so that the
        *clipped* mean equals ``mean``: the figure papers report is the mean of what was generated.

    Raises:
        ConfigError: naming the field, the value and what is allowed.
    """
    if not isinstance(spec, LengthSpec):
        if not isinstance(spec, dict):
            fail(path, spec, "must be a mapping with a 'kind'")
        spec = from_dict(LengthSpec, spec, path)
    kind = spec.kind
    if kind not in KIND_FIELDS:
        fail(f"{path}.kind", kind, f"allowed: {', '.join(KIND_FIELDS)}")
    given = {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
    for key, v in given.items():
        if key not in KIND_FIELDS[kind]:
            fail(f"{path}.{key}", v, f"unknown for kind {kind}; allowed: {', '.join(KIND_FIELDS[kind])}")

    def positive(key: str) -> Any:
        v = given.get(key)
        if v is None or v <= 0:
            fail(f"{path}.{key}", v, f"must be {'an integer' if key in ('value', 'max') else 'a number'} > 0")
        return v

    if kind == "fixed":
        return LengthDist("fixed", value=positive("value"))
    if kind == "jsonl":
        p = spec.path
        if p is None:
            fail(f"{path}.path", p, "must be a file path")
        full = p if os.path.isabs(p) else os.path.join(base_dir, p)
        if not os.path.isfile(full):
            fail(f"{path}.path", p, f"no such file ({full})")
        table = []
        try:
            rows = read_jsonl(full)
        except TextFileError as e:
            raise ConfigError(str(e)) from None
        for n, row in rows:
            v = row.get("length", row.get("new_tokens")) if isinstance(row, dict) else row
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{full} line {n}: length {v!r} must be an integer >= 1 "
                                  "(a bare integer or a 'length' / 'new_tokens' field)")
            table.append(v)
        if not table:
            fail(f"{path}.path", p, "the file holds no lengths")
        return LengthDist("jsonl", table=tuple(table))
    cap = positive("max")
    if "p50" in given or "p99" in given:
        if "mean" in given or "sigma" in given:
            fail(path, given, "give either mean + sigma or p50 + p99")
        p50, p99 = positive("p50"), positive("p99")
        if not p99 > p50:
            fail(f"{path}.p99", p99, f"must be > p50 ({p50})")
        return LengthDist("lognormal", mu=math.log(p50), sigma=math.log(p99 / p50) / Z99, max=cap)
    mean, sigma = positive("mean"), spec.sigma
    if sigma is None or not 0 <= sigma <= 4:
        fail(f"{path}.sigma", sigma, "must be a number in [0, 4]")
    if not mean < cap:
        fail(f"{path}.mean", mean, f"must be < max ({cap})")
    lo, hi = -10.0, math.log(cap) + 10
    for _ in range(200):  # the clipped mean is increasing in mu
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _clipped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
    return LengthDist("lognormal", mu=(lo + hi) / 2, sigma=float(sigma), max=cap)
