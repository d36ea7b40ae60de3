"""A measured cost profile (``dora-jax bench profile --json OUT``): :func:`load_profile` reads and checks one,
:func:`profile_costs` turns it into the cluster simulator's costs; :mod:`dora_jax.sim.local` takes the whole of
it. The format, what each field measures and how it is interpolated: docs/simulator.md, 'Measured cost
profiles'.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from dora_jax.config import ConfigError
from dora_jax.sim.config import Costs, SimConfig
from dora_jax.textfiles import TextFileError, read_text

KIND = "dora-jax cost profile"
FORMAT = 1


class ProfileError(ConfigError):
    """A profile file that cannot be used: the message names the file and the field."""


def _bad(field: str, value: Any, why: str) -> None:
    shown = value if not isinstance(value, (list, dict)) or len(repr(value)) < 80 else f"{repr(value)[:77]}..."
    raise ProfileError(f"profile field '{field}' = {shown!r}: {why}", field=field)


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points ``(xs[i], ys[i])`` (``xs`` increasing): at or below the first
    point its value, past the last the last segment continued (a single point: its value everywhere)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Profile:
    """A checked profile (build it with :func:`load_profile` or :func:`parse_profile`)."""

    versions: tuple[int, ...]
    batch: tuple[int, ...]
    kv: tuple[int, ...]
    step_s: tuple[tuple[tuple[float, ...], ...], ...]
    dispatch_s: float
    kv_reads: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_s: tuple[float, ...]
    shared_prefix_s: float
    resize_s: float
    free_slot_s: float
    train_tokens: tuple[int, ...]
    train_s: tuple[float, ...]
    train_host_s: float
    train_dispatch_s: float
    publish_s: float
    overlap_rows: tuple[float, ...]
    decode_factor: tuple[float, ...]
    train_factor: tuple[float, ...]
    reward_latency_s: float
    reward_host_s: float
    update_host_s: float
    iteration_host_s: float
    workload: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""

    def read_length(self, kv: float) -> float:
        """The cache slots a step reads for a longest live context of ``kv``: the shortest of ``kv_reads`` that
        covers it (``kv`` itself without them)."""
        if not self.kv_reads:
            return kv
        i = bisect.bisect_left(self.kv_reads, kv)
        return float(self.kv_reads[min(i, len(self.kv_reads) - 1)])

    def _grid(self, versions: float, batch: float, kv: float) -> float:
        """The grid interpolated at ``(versions, batch, kv)``, without rounding ``kv`` to a read length."""
        def at(vi: int) -> float:
            return interp(self.batch, [interp(self.kv, row, kv) for row in self.step_s[vi]], batch)

        if versions in self.versions:
            return at(self.versions.index(versions))
        return interp(self.versions, [at(i) for i in range(len(self.versions))], versions)

    def decode_step(self, versions: int, batch: float, kv: float) -> float:
        """One device decode step of ``versions`` versions, ``batch`` rows computed each, longest context ``kv``."""
        return self._grid(versions, batch, self.read_length(kv))

    def decode_kv_slope(self, versions: int, batch: float, kv: float) -> float:
        """d(step time)/d(kv) at ``kv``, seconds per cache slot: the slope of the grid's segment there (0 with
        one kv point, or where the time falls)."""
        if len(self.kv) < 2:
            return 0.0
        i = min(max(bisect.bisect_right(self.kv, kv), 1), len(self.kv) - 1)
        lo, hi = self.kv[i - 1], self.kv[i]
        return max(0.0, (self._grid(versions, batch, hi) - self._grid(versions, batch, lo)) / (hi - lo))

    def overlap(self, rows: float) -> tuple[float, float]:
        """``(decode_factor, train_factor)`` while a decode of ``rows`` rows computed and a train step run at once:
        interpolated on ``overlap.rows``, held at the table's ends (no extrapolation)."""
        r = min(max(rows, self.overlap_rows[0]), self.overlap_rows[-1])
        return interp(self.overlap_rows, self.decode_factor, r), interp(self.overlap_rows, self.train_factor, r)

    def prefill(self, tokens: float) -> float:
        """One prefill program (first tokens read, requests inserted) over ``tokens`` padded prompt tokens."""
        return interp(self.prefill_tokens, self.prefill_s, tokens)

    def train(self, tokens: float) -> float:
        """One train step over ``tokens`` padded tokens (rows x length bucket) on the profile's trainer devices."""
        return interp(self.train_tokens, self.train_s, tokens)

    def train_per_token(self) -> tuple[float, float]:
        """``(fixed, per token)``: the least-squares line through the train points (one point: all per token)."""
        xs, ys = self.train_tokens, self.train_s
        if len(xs) == 1:
            return 0.0, ys[0] / xs[0]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return max(0.0, my - slope * mx), max(0.0, slope)

    def prefill_per_token(self) -> float:
        """Seconds per padded prompt token: the slope of the prefill points (the largest point's mean with one)."""
        xs, ys = self.prefill_tokens, self.prefill_s
        if len(xs) == 1:
            return ys[0] / xs[0]
        return max(0.0, (ys[-1] - ys[0]) / (xs[-1] - xs[0]))


def _number(data: dict, key: str, field: str, positive: bool = False) -> float:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        _bad(field, v, f"must be a finite number {'> 0' if positive else '>= 0'}")
    return float(v)


def _axis(data: dict, key: str, field: str) -> tuple[int, ...]:
    v = data.get(key)
    if (not isinstance(v, list) or not v or any(isinstance(x, bool) or not isinstance(x, (int, float)) or
                                               not math.isfinite(x) or x <= 0 for x in v)
            or any(b <= a for a, b in zip(v, v[1:]))):
        _bad(field, v, "must be a non-empty list of increasing numbers > 0")
    return tuple(v)


def _times(v: Any, n: int, field: str) -> tuple[float, ...]:
    if (not isinstance(v, list) or len(v) != n or any(isinstance(x, bool) or not isinstance(x, (int, float)) or
                                                      not math.isfinite(x) or x < 0 for x in v)):
        _bad(field, v, f"must be a list of {n} finite numbers >= 0")
    return tuple(float(x) for x in v)


def _factors(data: dict, key: str, n: int) -> tuple[float, ...]:
    v = data.get(key)
    if (not isinstance(v, list) or len(v) != n or any(isinstance(x, bool) or not isinstance(x, (int, float)) or
                                                      not math.isfinite(x) or x < 1 for x in v)):
        _bad(f"overlap.{key}", v, f"must be a list of {n} (overlap.rows) finite numbers >= 1")
    return tuple(float(x) for x in v)


def _section(data: dict, key: str) -> dict:
    v = data.get(key)
    if not isinstance(v, dict):
        _bad(key, v, "must be a mapping (a section of 'dora-jax bench profile')")
    return v


def parse_profile(data: Any, source: str = "") -> Profile:
    """Checks a profile's JSON object and builds the :class:`Profile`; ProfileError names the first field
    that is missing or bad, its value and what it must be."""
    if not isinstance(data, dict):
        _bad("(top level)", type(data).__name__, "must be a JSON object written by 'dora-jax bench profile'")
    if data.get("kind") != KIND:
        _bad("kind", data.get("kind"), f"must be {KIND!r} (a file written by 'dora-jax bench profile')")
    if data.get("format") != FORMAT:
        _bad("format", data.get("format"), f"must be {FORMAT}: this version of dora-jax reads format {FORMAT}")
    dec = _section(data, "decode")
    versions, batch, kv = (_axis(dec, k, f"decode.{k}") for k in ("versions", "batch", "kv"))
    grid = dec.get("step_s")
    if not isinstance(grid, list) or len(grid) != len(versions):
        _bad("decode.step_s", grid, f"must be a list of {len(versions)} (decode.versions) lists")
    step_s = []
    for i, per_v in enumerate(grid):
        if not isinstance(per_v, list) or len(per_v) != len(batch):
            _bad(f"decode.step_s[{i}]", per_v, f"must be a list of {len(batch)} (decode.batch) lists")
        step_s.append(tuple(_times(row, len(kv), f"decode.step_s[{i}][{j}]") for j, row in enumerate(per_v)))
    reads = dec.get("kv_reads", [])
    kv_reads = _axis(dec, "kv_reads", "decode.kv_reads") if reads else ()
    pre, calls, train = _section(data, "prefill"), _section(data, "calls"), _section(data, "train")
    overlap, rewards = _section(data, "overlap"), _section(data, "rewards")
    p_tokens = _axis(pre, "tokens", "prefill.tokens")
    o_rows = _axis(overlap, "rows", "overlap.rows")
    t_tokens = _axis(train, "tokens", "train.tokens")
    workload = data.get("workload", {})
    if not isinstance(workload, dict):
        _bad("workload", workload, "must be a mapping")
    return Profile(
        versions=tuple(int(v) for v in versions), batch=batch, kv=kv, step_s=tuple(step_s),
        dispatch_s=_number(dec, "dispatch_s", "decode.dispatch_s"), kv_reads=kv_reads,
        prefill_tokens=p_tokens, prefill_s=_times(pre.get("seconds"), len(p_tokens), "prefill.seconds"),
        shared_prefix_s=_number(data, "shared_prefix_s", "shared_prefix_s"),
        resize_s=_number(calls, "resize_s", "calls.resize_s"), free_slot_s=_number(calls, "free_slot_s", "calls.free_slot_s"),
        train_tokens=t_tokens, train_s=_times(train.get("seconds"), len(t_tokens), "train.seconds"),
        train_host_s=_number(train, "host_s", "train.host_s"),
        train_dispatch_s=_number(train, "dispatch_s", "train.dispatch_s"), publish_s=_number(data, "publish_s", "publish_s"),
        overlap_rows=o_rows, decode_factor=_factors(overlap, "decode_factor", len(o_rows)),
        train_factor=_factors(overlap, "train_factor", len(o_rows)),
        reward_latency_s=_number(rewards, "latency_s", "rewards.latency_s"),
        reward_host_s=_number(rewards, "host_s", "rewards.host_s"),
        update_host_s=_number(data, "update_host_s", "update_host_s"),
        iteration_host_s=_number(data, "iteration_host_s", "iteration_host_s"),
        workload=workload, source=source)


def load_profile(path: str) -> Profile:
    """Reads and checks a profile written by ``dora-jax bench profile --json PATH``.

    Raises:
      ProfileError: the file cannot be read or parsed, or a field is missing or bad (the message starts with
        the path and names the field).
    """
    try:
        data = json.loads(read_text(path))
    except (TextFileError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: cannot read a profile ({e})") from None
    try:
        return parse_profile(data, source=path)
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}", field=e.field) from None


@dataclass(frozen=True)
class ProfileCosts(Costs):
    """The cluster simulator's costs read from a measured :class:`Profile` (docs/simulator.md, 'Measured cost
    profiles'); the other fields (prefill per token, weight sync) are set from the profile too, so ``Costs``'
    own formulas that read them agree."""

    profile: Profile | None = None
    train_devices: int = 1

    def decode_time(self, n: int, ctx: float) -> float:
        return self.profile.decode_step(1, n, ctx / n if n else 0.0) + self.profile.dispatch_s

    def ctx_rate(self, n: int, ctx: float) -> float:
        return self.profile.decode_kv_slope(1, n, ctx / n if n else 0.0) / max(n, 1)

    def mixed_decode_time(self, counts: tuple[int, ...], ctx: float) -> float:
        """The grid's fused step of ``len(counts)`` versions at their mean rows each (the grid has one row count
        for every version of a step)."""
        n, v = sum(counts), len(counts)
        return self.profile.decode_step(v, n / v, ctx / n if n else 0.0) + self.profile.dispatch_s

    def mixed_ctx_rate(self, counts: tuple[int, ...], ctx: float) -> float:
        n, v = sum(counts), len(counts)
        return self.profile.decode_kv_slope(v, n / v, ctx / n if n else 0.0) / max(n, 1)

    def train_time(self, tokens: float, pairs: float, gpus: int) -> float:
        return self.train_fixed_s + self.profile.train(tokens * self.train_devices / gpus)


def profile_costs(profile: Profile, base: Costs | None = None) -> ProfileCosts:
    """Costs that read ``profile`` in place of the analytic model: decode and train from its grids, prefill per
    token, weight sync (publish) and the fixed train cost from its fits; ``migrate_token_s`` and
    ``kv_bytes_per_token`` (no measurement covers them) are kept from ``base``."""
    fixed, per_token = profile.train_per_token()
    devices = int(profile.workload.get("train_devices", 1) or 1)
    return ProfileCosts(
        decode_step_s=profile.decode_step(1, 1, profile.kv[0]) + profile.dispatch_s, decode_weights_s=0.0,
        decode_row_s=0.0, decode_ctx_s=0.0, prefill_token_s=profile.prefill_per_token(), prefill_pair_s=0.0,
        train_token_gpu_s=per_token * devices, train_pair_gpu_s=0.0, train_fixed_s=0.0,
        weight_sync_s=profile.publish_s, migrate_token_s=base.migrate_token_s if base else 0.0,
        kv_bytes_per_token=base.kv_bytes_per_token if base else 0.0, profile=profile, train_devices=devices)


def with_profile(cfg: SimConfig, profile: Profile) -> SimConfig:
    """``cfg`` with its costs read from ``profile`` (:func:`profile_costs`), the derivation saying so."""
    costs = profile_costs(profile, cfg.costs)
    where = f"measured: {profile.source or 'a profile'}"
    derivation = {k: where for k in ("decode_step_s", "prefill_token_s", "train_token_gpu_s", "weight_sync_s")}
    derivation["migrate_token_s"] = cfg.derivation.get("migrate_token_s", "given")
    if "kv_bytes_per_token" in cfg.derivation:
        derivation["kv_bytes_per_token"] = cfg.derivation["kv_bytes_per_token"]
    return dataclasses.replace(cfg, costs=costs, derivation=derivation)
