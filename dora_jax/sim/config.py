"""Simulator configuration (``configs/sim_*.yaml``): the file's sections as dataclasses, and the cost model's
fields (given, derived with :func:`derive_costs`, or measured with :func:`costs_from_bench`).
:func:`load_sim_config` / :func:`parse_config` build a :class:`SimConfig`. docs/simulator.md, 'Model' and
'Writing a config', describe the costs and fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from dora_jax.config import resolve_config_path
from dora_jax.schema import ConfigError, fail, from_dict
from dora_jax.sim.lengths import LengthDist, LengthSpec, length_dist
from dora_jax.textfiles import TextFileError, load_yaml, read_text

# A simulator config is checked by the run config's schema machinery, so its errors are that ConfigError.
SimConfigError = ConfigError

POLICIES = ("sync", "one_step_off", "partial", "dora")
COST_FIELDS = ("decode_step_s", "decode_weights_s", "decode_row_s", "decode_ctx_s", "prefill_token_s",
               "prefill_pair_s", "train_token_gpu_s", "train_pair_gpu_s", "train_fixed_s", "weight_sync_s",
               "migrate_token_s", "kv_bytes_per_token")
# ``policies.dora.versions_per_instance``: one version per rollout instance, placed by the runner's Balancer (DORA's
# Algorithm 1), or every live version resident on every instance.
VERSIONS_PER_INSTANCE = (1, "all")


@dataclass(frozen=True)
class Costs:
    """Per-operation costs in seconds (how they combine: docs/simulator.md, 'Model')."""

    decode_step_s: float
    decode_weights_s: float = 0.0
    decode_row_s: float = 0.0
    decode_ctx_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    train_token_gpu_s: float = 0.0
    train_pair_gpu_s: float = 0.0
    train_fixed_s: float = 0.0
    weight_sync_s: float = 0.0
    migrate_token_s: float = 0.0
    kv_bytes_per_token: float = 0.0  # bytes, not seconds: what a moved row's KV cache weighs per context token

    def decode_time(self, n: int, ctx: float) -> float:
        return self.decode_step_s + max(self.decode_weights_s, n * self.decode_row_s) + ctx * self.decode_ctx_s

    def mixed_decode_time(self, counts: tuple[int, ...], ctx: float) -> float:
        """One decode step of ``counts[j]`` rows of the j-th version: the weight term paid per version, the overhead
        and attention once."""
        w, r = self.decode_weights_s, self.decode_row_s
        return self.decode_step_s + sum(max(w, c * r) for c in counts) + ctx * self.decode_ctx_s

    def mixed_ctx_rate(self, counts: tuple[int, ...], ctx: float) -> float:
        """d(mixed_decode_time)/d(ctx)."""
        return self.decode_ctx_s

    def ctx_rate(self, n: int, ctx: float) -> float:
        """d(decode_time)/d(ctx) at ``(n, ctx)``: what one more context token adds to a step (constant here)."""
        return self.decode_ctx_s

    def train_time(self, tokens: float, pairs: float, gpus: int) -> float:
        return self.train_fixed_s + (self.train_token_gpu_s * tokens + self.train_pair_gpu_s * pairs) / gpus


@dataclass(frozen=True)
class PolicySpec:
    name: str
    max_staleness: int = 0
    rollout_batches: float = 1.0  # RBS / TBS (dora, partial)
    versions_per_instance: tuple[Union[int, str], ...] = (1,)  # dora: the first is the policy's, the rest compared


@dataclass(frozen=True)
class SimConfig:
    """One simulator setup. ``gpus`` lists the cluster sizes to run; everything else is shared."""

    name: str
    costs: Costs
    lengths: LengthDist
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    gpus: tuple[int, ...]
    gpus_per_instance: int
    slots_per_instance: int
    trainer_gpus: Any  # "balance", a fraction in (0, 1), or an int
    sync_colocated: bool
    policies: tuple[PolicySpec, ...]
    steps: int
    warmup_steps: int
    seed: int
    derivation: dict[str, Any] = dataclasses.field(default_factory=dict)  # how costs were obtained
    paper: dict[str, Any] = dataclasses.field(default_factory=dict)
    projections: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def train_batch(self) -> int:
        return self.prompts_per_step * self.group_size

    def policy(self, name: str) -> PolicySpec:
        for p in self.policies:
            if p.name == name:
                return p
        fail("policies", [p.name for p in self.policies], f"has no policy {name!r}")


def derive_costs(model: dict[str, float], hw: dict[str, float], tp: int) -> tuple[dict[str, float], dict[str, str]]:
    """Costs from model shape and hardware figures (roofline terms with stated efficiencies), for ``tp`` GPUs per
    rollout instance. ``model``, ``hw``: the :class:`ModelShape` and :class:`Hardware` sections as dicts.

    Returns:
        ``(costs, formulas)``: the cost fields and, for each, its formula with numbers.
    """
    n, by = model["params"], model["bytes_per_param"]
    d_attn = model["heads"] * model["head_dim"]
    kv_bytes = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * by  # K and V, per token
    bw = hw["hbm_bytes_s"] * hw["hbm_efficiency"]
    attn_pair = 4 * d_attn * model["layers"]  # FLOPs per causal (query, key) pair, forward
    passes = 3 + hw["logprob_forwards"]  # forward + backward (x3) plus the extra forwards
    c = {
        "decode_step_s": hw["step_overhead_s"],
        "decode_weights_s": n * by / (tp * bw),
        "decode_row_s": 2 * n / (tp * hw["peak_flops"] * hw["decode_mfu"]),
        "decode_ctx_s": kv_bytes / (tp * bw),
        "prefill_token_s": 2 * n / (tp * hw["peak_flops"] * hw["prefill_mfu"]),
        "prefill_pair_s": attn_pair / (tp * hw["peak_flops"] * hw["prefill_mfu"]),
        "train_token_gpu_s": 2 * n * passes / (hw["peak_flops"] * hw["train_mfu"]),
        "train_pair_gpu_s": attn_pair * passes / (hw["peak_flops"] * hw["train_mfu"]),
        "weight_sync_s": n * by / (tp * hw["link_bytes_s"]) + hw["sync_fixed_s"],
        "migrate_token_s": kv_bytes / (tp * hw["link_bytes_s"]),
        "kv_bytes_per_token": kv_bytes,
    }
    f = {
        "decode_step_s": f"{hw['step_overhead_s']} s",
        "decode_weights_s": f"{n:.3g} x {by:g} B / ({tp} x {bw:.3g} B/s)",
        "decode_row_s": f"2 x {n:.3g} / ({tp} x {hw['peak_flops']:.3g} x {hw['decode_mfu']})",
        "decode_ctx_s": f"{kv_bytes:.0f} B KV per token / ({tp} x {bw:.3g} B/s)",
        "prefill_token_s": f"2 x {n:.3g} / ({tp} x {hw['peak_flops']:.3g} x {hw['prefill_mfu']})",
        "prefill_pair_s": f"4 x {d_attn} x {model['layers']} / ({tp} x {hw['peak_flops']:.3g} x {hw['prefill_mfu']})",
        "train_token_gpu_s": f"2 x {n:.3g} x {passes:g} / ({hw['peak_flops']:.3g} x {hw['train_mfu']})",
        "train_pair_gpu_s": f"4 x {d_attn} x {model['layers']} x {passes:g} / "
                            f"({hw['peak_flops']:.3g} x {hw['train_mfu']})",
        "weight_sync_s": f"{n:.3g} x {by:g} B / ({tp} x {hw['link_bytes_s']:.3g} B/s) + {hw['sync_fixed_s']} s",
        "migrate_token_s": f"{kv_bytes:.0f} B KV per token / ({tp} x {hw['link_bytes_s']:.3g} B/s)",
        "kv_bytes_per_token": f"2 x {model['layers']} layers x {model['kv_heads']} KV heads x {model['head_dim']} x "
                              f"{by:g} B",
    }
    return c, f


def costs_from_bench(path: str) -> dict[str, float]:
    """Decode costs from a ``bench decode`` JSON (``batch``, ``cache_length``, ``layers_and_head_ms``,
    ``kv_cache_part_ms``) or a ``bench engine`` JSON (``batch``, ``engine_tok_s``); else a ConfigError naming
    ``costs.from_bench``."""
    try:
        data = json.loads(read_text(path))
    except (TextFileError, json.JSONDecodeError) as e:
        fail("costs.from_bench", path, f"cannot read ({e})")
    if not isinstance(data, dict):
        fail("costs.from_bench", path, "must hold a JSON object written by 'dora-jax bench'")
    needed = ("batch", "cache_length", "layers_and_head_ms", "kv_cache_part_ms") if "layers_and_head_ms" in data \
        else ("batch", "engine_tok_s") if "engine_tok_s" in data else ()
    for k in needed:  # a JSON file, not a config section: checked here rather than by from_dict
        v = data.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            fail("costs.from_bench", path, f"its {k!r} = {v!r} must be a finite number > 0")
    if "layers_and_head_ms" in data:
        ctx = data["batch"] * data["cache_length"]
        return {"decode_step_s": data["layers_and_head_ms"] / 1e3, "decode_weights_s": 0.0, "decode_row_s": 0.0,
                "decode_ctx_s": data["kv_cache_part_ms"] / 1e3 / ctx}
    if "engine_tok_s" in data:
        return {"decode_step_s": data["batch"] / data["engine_tok_s"], "decode_weights_s": 0.0, "decode_row_s": 0.0,
                "decode_ctx_s": 0.0}
    fail("costs.from_bench", path, "neither a 'bench decode' JSON (layers_and_head_ms) nor a 'bench engine' JSON "
         "(engine_tok_s)")


# ----------------------------------------------------------------------------------------------------------
# The config file's sections. ``None`` marks a field the file did not give: required ones are refused by name.


def _int_or_list(gpus: Any) -> Any:
    """``cluster.gpus`` as it is reported in an error: the list the file wrote, or the single count."""
    return list(gpus) if isinstance(gpus, tuple) else gpus


@dataclass(frozen=True)
class Workload:
    """``workload``: prompts per update, samples per prompt, prompt tokens and the completion lengths."""

    prompts_per_step: Optional[int] = None
    group_size: Optional[int] = None
    prompt_tokens: Optional[int] = None
    lengths: Optional[LengthSpec] = None

    def validate(self, path: str = "workload") -> None:
        for name in ("prompts_per_step", "group_size"):
            if getattr(self, name) is None or getattr(self, name) <= 0:
                fail(f"{path}.{name}", getattr(self, name), "must be an integer > 0")
        if self.prompt_tokens is None or self.prompt_tokens < 0:
            fail(f"{path}.prompt_tokens", self.prompt_tokens, "must be an integer >= 0")
        if self.lengths is None:
            fail(f"{path}.lengths", None, "must be a mapping with a 'kind'")


@dataclass(frozen=True)
class Cluster:
    """``cluster``: the sizes to run (``gpus``: one count or a list), GPUs and decode slots per rollout instance,
    the trainer's share of the GPUs and where the synchronous baseline syncs weights."""

    gpus: Union[int, tuple[int, ...], None] = None
    gpus_per_instance: Optional[int] = None
    slots_per_instance: Optional[int] = None
    trainer_gpus: Union[str, int, float] = "balance"
    sync_placement: str = "colocated"

    @property
    def sizes(self) -> tuple[int, ...]:
        """The cluster sizes, as a tuple whether the file gave one count or a list."""
        return (self.gpus,) if isinstance(self.gpus, int) else tuple(self.gpus or ())

    def validate(self, path: str = "cluster") -> None:
        tp = self.gpus_per_instance
        if tp is None or tp <= 0:
            fail(f"{path}.gpus_per_instance", tp, "must be an integer > 0")
        if not self.sizes or any(g < 2 * tp or g % tp for g in self.sizes):
            fail(f"{path}.gpus", _int_or_list(self.gpus), f"must be an integer or list of integers, each a multiple "
                 f"of gpus_per_instance ({tp}) and >= 2 instances (one rollout, one trainer side)")
        tg = self.trainer_gpus
        if not (tg == "balance" or (isinstance(tg, float) and 0 < tg < 1) or
                (isinstance(tg, int) and all(0 < tg <= g - tp for g in self.sizes))):
            fail(f"{path}.trainer_gpus", tg, "must be 'balance', a fraction in (0, 1), or a GPU count that leaves at "
                 "least one rollout instance on every cluster size")
        if self.slots_per_instance is None or self.slots_per_instance <= 0:
            fail(f"{path}.slots_per_instance", self.slots_per_instance, "must be an integer > 0")
        if self.sync_placement not in ("colocated", "disaggregated"):
            fail(f"{path}.sync_placement", self.sync_placement, "allowed: colocated, disaggregated")


# ``costs``: each cost given here replaces the derived or measured one; ``from_bench`` is a bench JSON's path,
# relative to the config file.
CostsSection = dataclasses.make_dataclass(
    "CostsSection", [(k, Optional[float], field(default=None)) for k in COST_FIELDS]
    + [("from_bench", Optional[str], field(default=None))], frozen=True)


@dataclass(frozen=True)
class ModelShape:
    """``model``: the figures :func:`derive_costs` reads (parameters, layers, attention shape, bytes per parameter)."""

    params: Optional[float] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    bytes_per_param: Optional[float] = None

    def validate(self, path: str = "model") -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v <= 0:
                fail(f"{path}.{f.name}", v, "must be given and > 0")


@dataclass(frozen=True)
class Hardware:
    """``hardware``: per-GPU figures :func:`derive_costs` reads; the efficiencies and MFUs are fractions."""

    peak_flops: Optional[float] = None
    hbm_bytes_s: Optional[float] = None
    hbm_efficiency: Optional[float] = None
    decode_mfu: Optional[float] = None
    prefill_mfu: Optional[float] = None
    train_mfu: Optional[float] = None
    step_overhead_s: Optional[float] = None
    link_bytes_s: Optional[float] = None
    sync_fixed_s: Optional[float] = None
    logprob_forwards: Optional[float] = None

    def validate(self, path: str = "hardware") -> None:
        for f in dataclasses.fields(self):
            v, may_be_zero = getattr(self, f.name), f.name in ("step_overhead_s", "sync_fixed_s", "logprob_forwards")
            if v is None or v < 0 or (v == 0 and not may_be_zero):
                fail(f"{path}.{f.name}", v, f"must be given and {'>=' if may_be_zero else '>'} 0")
        for name in ("hbm_efficiency", "decode_mfu", "prefill_mfu", "train_mfu"):
            if getattr(self, name) > 1:
                fail(f"{path}.{name}", getattr(self, name), "a fraction: must be <= 1")


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape))
HARDWARE_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware))
POLICY_OPTIONS = {"sync": (), "one_step_off": (), "partial": ("rollout_batches",),
                  "dora": ("max_staleness", "rollout_batches", "versions_per_instance")}


@dataclass(frozen=True)
class PolicyOptions:
    """One entry of ``policies`` (:data:`POLICY_OPTIONS`): ``dora`` takes ``max_staleness``, ``rollout_batches`` and
    ``versions_per_instance`` (``1``, ``all``, or a list: the first is the policy's, the rest run for comparison);
    ``partial`` takes ``rollout_batches``; ``sync`` and ``one_step_off`` nothing."""

    max_staleness: Optional[int] = None
    rollout_batches: Optional[float] = None
    versions_per_instance: Union[int, str, tuple[Union[int, str], ...], None] = None

    def spec(self, name: str, path: str = "policies") -> PolicySpec:
        """Checks these options for policy ``name`` and returns its :class:`PolicySpec`."""
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if name not in POLICY_OPTIONS:
            fail(f"{path}.{name}", given, f"unknown policy; allowed: {', '.join(POLICIES)}")
        allowed = POLICY_OPTIONS[name]
        if not allowed and given:
            fail(f"{path}.{name}", given, "takes no options")
        for k, v in given.items():
            if k not in allowed:
                fail(f"{path}.{name}.{k}", v, f"not an option of {name}; allowed: {', '.join(allowed)}")
        if name not in ("dora", "partial"):
            return PolicySpec(name, {"sync": 0, "one_step_off": 1}[name])
        k = 0
        if name == "dora":
            k = self.max_staleness
            if k is None or k < 0:
                fail(f"{path}.{name}.max_staleness", k, "must be an integer >= 0")
        rb = self.rollout_batches
        if rb is None or rb < 1:
            fail(f"{path}.{name}.rollout_batches", rb, "must be a number >= 1")
        if name == "dora" and rb > k + 1:
            fail(f"{path}.{name}.rollout_batches", rb, f"must be <= max_staleness + 1 = {k + 1} (more outstanding "
                 "work than the next K + 1 updates can train)")
        if name == "partial":
            return PolicySpec(name, k, rb)
        return PolicySpec(name, k, rb, self.versions(f"{path}.{name}.versions_per_instance"))

    def versions(self, path: str) -> tuple[Union[int, str], ...]:
        """``versions_per_instance`` checked, as a tuple (default: one version per instance)."""
        given = self.versions_per_instance
        vs = (1,) if given is None else given if isinstance(given, tuple) else (given,)
        shown = list(given) if isinstance(given, tuple) else given
        if not vs or any(isinstance(v, bool) or v not in VERSIONS_PER_INSTANCE for v in vs) or len(set(vs)) < len(vs):
            fail(path, shown, "allowed: 1 (one version per rollout instance, placed by the balancer), 'all' (every "
                 "live version on every instance), or a list of both without repeats (the first is the policy's)")
        return vs


@dataclass(frozen=True)
class PaperFigures:
    """One GPU count's entry of ``paper``: published rollout shares (fractions in (0, 1]) and DORA's speedup."""

    sync_rollout_share: Optional[float] = None
    dora_rollout_share: Optional[float] = None
    speedup: Optional[float] = None


PAPER_FIGURES = tuple(f.name for f in dataclasses.fields(PaperFigures))


@dataclass(frozen=True)
class Projections:
    """``projections``: further cluster sizes to run, past those the paper reports."""

    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class SimFile:
    """A simulator config file as written; :func:`parse_config` checks it and builds a :class:`SimConfig`."""

    name: str = "sim"
    seed: int = 0
    steps: int = 6
    warmup_steps: int = 2
    workload: Optional[Workload] = None
    cluster: Optional[Cluster] = None
    costs: CostsSection = field(default_factory=CostsSection)
    model: Optional[ModelShape] = None
    hardware: Optional[Hardware] = None
    policies: dict[str, PolicyOptions] = field(default_factory=dict)
    paper: dict[Union[int, str], PaperFigures] = field(default_factory=dict)
    projections: Projections = field(default_factory=Projections)

    def validate(self) -> None:
        """Checks every section and the rules across them, apart from the costs (:func:`parse_config`)."""
        for name in ("workload", "cluster"):
            if getattr(self, name) is None:
                fail(name, None, "required")
        self.workload.validate()
        self.cluster.validate()
        if (self.model is None) != (self.hardware is None):
            missing = "model" if self.model is None else "hardware"
            fail(missing, None, "model and hardware go together: costs are derived from both")
        if self.model is not None:
            self.model.validate()
            self.hardware.validate()
        if self.steps < 1:
            fail("steps", self.steps, "must be an integer >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            fail("warmup_steps", self.warmup_steps, f"must be an integer in [0, steps = {self.steps})")
        if not self.policies:
            fail("policies", self.policies, f"must be a mapping of policy names ({', '.join(POLICIES)})")
        tp = self.cluster.gpus_per_instance
        if any(g <= 0 or g % tp for g in self.projections.gpus):
            fail("projections.gpus", list(self.projections.gpus), f"must be a list of GPU counts, multiples of {tp}")
        self.paper_figures()

    def policy_specs(self) -> tuple[PolicySpec, ...]:
        """The policies to run, in the order the file lists them."""
        return tuple(opts.spec(name) for name, opts in self.policies.items())

    def paper_figures(self) -> dict[str, dict[str, float]]:
        """``paper`` checked: GPU count (a string) -> {figure: published value}, each count one that is simulated."""
        sizes = set(self.cluster.sizes) | set(self.projections.gpus)
        out = {}
        for g, figs in self.paper.items():
            n = int(g) if isinstance(g, str) and g.strip().isdigit() else g
            given = {k: v for k, v in dataclasses.asdict(figs).items() if v is not None}
            if not isinstance(n, int) or n not in sizes:
                fail(f"paper.{g}", given, f"the key must be a GPU count that is simulated (cluster.gpus or "
                     f"projections.gpus: {sorted(sizes)})")
            for key, v in given.items():
                share = key.endswith("_share")
                if not (0 < v and (v <= 1 or not share)):
                    fail(f"paper.{g}.{key}", v, "must be a fraction in (0, 1]" if share else "must be a number > 0")
            out[str(n)] = given
        return out


def _costs(f: SimFile, base_dir: str) -> tuple[Costs, dict[str, str]]:
    """The costs (derived, then measured, then given: later wins) and, for each one set, how it was obtained (a
    formula, ``measured: PATH`` or ``given``)."""
    costs: dict[str, float] = {}
    derivation: dict[str, str] = {}
    if f.model is not None:
        costs, derivation = derive_costs(dataclasses.asdict(f.model), dataclasses.asdict(f.hardware),
                                         f.cluster.gpus_per_instance)
    c = f.costs
    if c.from_bench is not None:
        full = c.from_bench if os.path.isabs(c.from_bench) else os.path.join(base_dir, c.from_bench)
        costs.update(costs_from_bench(full))
        derivation.update({k: f"measured: {c.from_bench}" for k in ("decode_step_s", "decode_weights_s",
                                                                     "decode_row_s", "decode_ctx_s")})
    for k in COST_FIELDS:
        if getattr(c, k) is not None:
            costs[k] = getattr(c, k)
            derivation[k] = "given"
    if "decode_step_s" not in costs:
        fail("costs.decode_step_s", None, "required (give costs, a model + hardware block, or costs.from_bench)")
    for k in COST_FIELDS:
        v = costs.get(k, 0.0)
        if not (math.isfinite(v) and v >= 0):
            how = derivation.get(k, "given")
            fail(f"costs.{k}", v, "must be a finite number >= 0" + ("" if how == "given" else f" (derived: {how})"))
    if not costs["decode_step_s"] + costs.get("decode_weights_s", 0.0) + costs.get("decode_row_s", 0.0) > 0:
        fail("costs.decode_step_s", costs["decode_step_s"],
             "a decode step must cost something (decode_step_s + decode_weights_s + decode_row_s > 0)")
    return Costs(**costs), derivation


def parse_config(raw: Any, base_dir: str = ".") -> SimConfig:
    """Validates a simulator config mapping ``raw`` and builds a :class:`SimConfig`; relative paths in it
    (``costs.from_bench``, a ``jsonl`` length file) are resolved against ``base_dir``.

    Raises:
        ConfigError: naming the dotted field, the bad value and what is allowed.
    """
    f = from_dict(SimFile, raw)
    f.validate()
    specs = f.policy_specs()
    costs, derivation = _costs(f, base_dir)
    w, cl = f.workload, f.cluster
    return SimConfig(
        name=f.name, costs=costs, lengths=length_dist(w.lengths, base_dir=base_dir),
        prompts_per_step=w.prompts_per_step, group_size=w.group_size, prompt_tokens=w.prompt_tokens,
        gpus=cl.sizes, gpus_per_instance=cl.gpus_per_instance, slots_per_instance=cl.slots_per_instance,
        trainer_gpus=cl.trainer_gpus, sync_colocated=cl.sync_placement == "colocated", policies=specs,
        steps=f.steps, warmup_steps=f.warmup_steps, seed=f.seed, derivation=derivation, paper=f.paper_figures(),
        projections={"gpus": list(f.projections.gpus)} if f.projections.gpus else {})


def load_sim_config(path: str) -> SimConfig:
    """Loads and validates ``path`` (a YAML file, or a shipped preset name such as ``sim_dora_paper``); a
    ConfigError starting with the file when it cannot be found or read, or a value is bad."""
    path = resolve_config_path(path)
    try:
        raw = load_yaml(path)
    except TextFileError as e:
        raise ConfigError(str(e)) from None
    try:
        return parse_config(raw, base_dir=os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}", field=e.field) from None
