"""Simulator configuration (``configs/sim_*.yaml``): its own small schema, validated on load with errors that
name the field, and the cost model, either given directly, derived from model and hardware figures, or
calibrated from a measured ``dora-jax bench decode`` / ``bench engine`` JSON.

Cost model (all seconds; an *instance* is one rollout engine of ``gpus_per_instance`` GPUs):

* one decode step of an instance (which holds one policy version) with ``n`` live rows whose contexts sum to
  ``S`` tokens costs ``decode_step_s + max(decode_weights_s, n * decode_row_s) + S * decode_ctx_s``: a fixed
  overhead, the weight matmuls (which stream the weights once while computing every row: memory-bound at small
  batches, compute-bound at large ones) and the KV-cache reads of attention;
* moving a live row to another instance of the same version costs the receiving instance ``migrate_token_s``
  per context token (its KV cache crosses the network; no re-prefill); an instance that switches versions
  stalls ``weight_sync_s`` while it loads the weights;
* admitting rows costs ``prefill_token_s`` per prompt token (plus ``prefill_pair_s`` per causal token pair,
  which matters only for the long re-prefills of partial rollout) before the instance's next step;
* one update on ``T`` trainer GPUs over samples of total length ``L_i`` costs
  ``train_fixed_s + (train_token_gpu_s * sum L_i + train_pair_gpu_s * sum L_i^2 / 2) / T``, then
  ``weight_sync_s`` to publish the new weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from dora_jax.sim.lengths import LengthDist, SimConfigError, _need, is_number, length_dist
from dora_jax.textfiles import TextFileError, load_yaml, read_text

POLICIES = ("sync", "one_step_off", "partial", "dora")
COST_FIELDS = ("decode_step_s", "decode_weights_s", "decode_row_s", "decode_ctx_s", "prefill_token_s",
               "prefill_pair_s", "train_token_gpu_s", "train_pair_gpu_s", "train_fixed_s", "weight_sync_s",
               "migrate_token_s")
MODEL_FIELDS = ("params", "layers", "heads", "kv_heads", "head_dim", "bytes_per_param")
HARDWARE_FIELDS = ("peak_flops", "hbm_bytes_s", "hbm_efficiency", "decode_mfu", "prefill_mfu", "train_mfu",
                   "step_overhead_s", "link_bytes_s", "sync_fixed_s", "logprob_forwards")


@dataclass(frozen=True)
class Costs:
    """Per-operation costs in seconds (see the module docstring for how they combine)."""

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

    def decode_time(self, n: int, ctx: float) -> float:
        return self.decode_step_s + max(self.decode_weights_s, n * self.decode_row_s) + ctx * self.decode_ctx_s

    def train_time(self, tokens: float, pairs: float, gpus: int) -> float:
        return self.train_fixed_s + (self.train_token_gpu_s * tokens + self.train_pair_gpu_s * pairs) / gpus


@dataclass(frozen=True)
class PolicySpec:
    name: str
    max_staleness: int = 0
    rollout_batches: float = 1.0  # RBS / TBS (dora, partial)


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
        raise SimConfigError(f"sim config field 'policies': no policy {name!r} (has {[p.name for p in self.policies]})")


def derive_costs(model: dict[str, float], hw: dict[str, float], tp: int) -> tuple[dict[str, float], dict[str, str]]:
    """Costs from model shape and hardware figures (roofline terms with stated efficiencies).

    Args:
        model: ``params`` (count), ``layers``, ``heads``, ``kv_heads``, ``head_dim``, ``bytes_per_param``.
        hw: per-GPU ``peak_flops``, ``hbm_bytes_s`` and the fraction of it reached (``hbm_efficiency``),
            model-FLOPs utilizations for decode, prefill and training, a fixed per-decode-step overhead
            (kernel launches, tensor-parallel all-reduces, sampling), the per-GPU link rate used for weight
            transfer and a fixed cost per weight sync, and ``logprob_forwards`` (extra forward passes per
            update, e.g. recomputing old log-probs).
        tp: GPUs per rollout instance (tensor parallel).

    Returns:
        ``(costs, formulas)``: the cost fields and, for each, the formula with numbers, for the docs.
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
    }
    f = {
        "decode_step_s": f"{hw['step_overhead_s']} s",
        "decode_weights_s": f"{n:.3g} x {by} B / ({tp} x {bw:.3g} B/s)",
        "decode_row_s": f"2 x {n:.3g} / ({tp} x {hw['peak_flops']:.3g} x {hw['decode_mfu']})",
        "decode_ctx_s": f"{kv_bytes:.0f} B KV per token / ({tp} x {bw:.3g} B/s)",
        "prefill_token_s": f"2 x {n:.3g} / ({tp} x {hw['peak_flops']:.3g} x {hw['prefill_mfu']})",
        "prefill_pair_s": f"4 x {d_attn} x {model['layers']} / ({tp} x {hw['peak_flops']:.3g} x {hw['prefill_mfu']})",
        "train_token_gpu_s": f"2 x {n:.3g} x {passes} / ({hw['peak_flops']:.3g} x {hw['train_mfu']})",
        "train_pair_gpu_s": f"4 x {d_attn} x {model['layers']} x {passes} / ({hw['peak_flops']:.3g} x {hw['train_mfu']})",
        "weight_sync_s": f"{n:.3g} x {by} B / ({tp} x {hw['link_bytes_s']:.3g} B/s) + {hw['sync_fixed_s']} s",
        "migrate_token_s": f"{kv_bytes:.0f} B KV per token / ({tp} x {hw['link_bytes_s']:.3g} B/s)",
    }
    return c, f


def costs_from_bench(path: str) -> dict[str, float]:
    """Decode costs from a measured benchmark JSON.

    ``bench decode`` (``decode_step_ms``, ``layers_and_head_ms``, ``kv_cache_part_ms`` at ``batch`` rows and
    ``cache_length``): the cache-free forward becomes the per-step cost (weights are read once per step,
    whatever the batch) and the cache part is spread over ``batch x cache_length`` context tokens.
    ``bench engine`` (``engine_tok_s`` at ``batch``): one step is ``batch / engine_tok_s``, all of it fixed.
    One measured point cannot separate per-row from per-step work; a second bench at another batch would.
    """
    try:
        data = json.loads(read_text(path))
    except (TextFileError, json.JSONDecodeError) as e:
        raise SimConfigError(f"sim config field 'costs.from_bench' = {path!r}: cannot read ({e})") from None
    _need(isinstance(data, dict), "costs.from_bench", path, "must hold a JSON object written by 'dora-jax bench'")
    fields = ("batch", "cache_length", "layers_and_head_ms", "kv_cache_part_ms") if "layers_and_head_ms" in data \
        else ("batch", "engine_tok_s") if "engine_tok_s" in data else ()
    for k in fields:
        v = data.get(k)
        _need(is_number(v) and v > 0, "costs.from_bench", path, f"its {k!r} = {v!r} must be a finite number > 0")
    if "layers_and_head_ms" in data:
        ctx = data["batch"] * data["cache_length"]
        return {"decode_step_s": data["layers_and_head_ms"] / 1e3, "decode_weights_s": 0.0, "decode_row_s": 0.0,
                "decode_ctx_s": data["kv_cache_part_ms"] / 1e3 / ctx}
    if "engine_tok_s" in data:
        return {"decode_step_s": data["batch"] / data["engine_tok_s"], "decode_weights_s": 0.0, "decode_row_s": 0.0,
                "decode_ctx_s": 0.0}
    raise SimConfigError(f"sim config field 'costs.from_bench' = {path!r}: neither a 'bench decode' JSON "
                         "(layers_and_head_ms) nor a 'bench engine' JSON (engine_tok_s)")


def _number(d: dict, key: str, path: str, lo: float = 0.0, strict: bool = False, integer: bool = False) -> Any:
    v = d.get(key)
    ok = is_number(v, integer) and (v > lo if strict else v >= lo)
    _need(ok, f"{path}.{key}", v,
          f"must be {'an integer' if integer else 'a finite number'} {'>' if strict else '>='} {lo}")
    return v


def _mapping(d: Any, path: str, allowed: tuple[str, ...]) -> dict:
    _need(isinstance(d, dict), path, d, "must be a mapping")
    for k in d:
        _need(k in allowed, f"{path}.{k}", d[k], f"unknown field; allowed: {', '.join(allowed)}")
    return d


PAPER_FIGURES = ("sync_rollout_share", "dora_rollout_share", "speedup")


def _paper_figures(paper: Any, sizes: set[int]) -> dict[str, dict[str, float]]:
    """Checks the ``paper`` section: GPU count -> {figure: published value}, each count one that is simulated."""
    _need(isinstance(paper, dict), "paper", paper, "must be a mapping of GPU counts to published figures")
    out = {}
    for g, figs in paper.items():
        n = int(g) if isinstance(g, str) and g.strip().isdigit() else g
        _need(isinstance(n, int) and not isinstance(n, bool) and n in sizes, f"paper.{g}", figs,
              f"the key must be a GPU count that is simulated (cluster.gpus or projections.gpus: {sorted(sizes)})")
        _mapping(figs, f"paper.{g}", PAPER_FIGURES)
        for key, v in figs.items():
            share = key.endswith("_share")
            _need(is_number(v) and 0 < v and (v <= 1 or not share), f"paper.{g}.{key}", v,
                  "must be a fraction in (0, 1]" if share else "must be a finite number > 0")
        out[str(n)] = figs
    return out


def parse_config(raw: dict[str, Any], base_dir: str = ".") -> SimConfig:
    """Validates a simulator config mapping and builds a :class:`SimConfig` (see ``configs/sim_*.yaml``).

    Raises:
        SimConfigError: naming the dotted field, the bad value and what is allowed.
    """
    top = ("name", "seed", "steps", "warmup_steps", "workload", "cluster", "costs", "model", "hardware",
           "policies", "paper", "projections")
    raw = _mapping(raw, "<top>", top)
    for key in ("workload", "cluster", "policies"):
        _need(key in raw, key, None, "required")
    w = _mapping(raw["workload"], "workload", ("prompts_per_step", "group_size", "prompt_tokens", "lengths"))
    cl = _mapping(raw["cluster"], "cluster", ("gpus", "gpus_per_instance", "slots_per_instance", "trainer_gpus",
                                              "sync_placement"))
    tp = _number(cl, "gpus_per_instance", "cluster", 0, strict=True, integer=True)
    gpus = cl.get("gpus")
    gpus = [gpus] if isinstance(gpus, int) and not isinstance(gpus, bool) else gpus
    _need(isinstance(gpus, list) and gpus and all(isinstance(g, int) and not isinstance(g, bool) and g >= 2 * tp
                                                  and g % tp == 0 for g in gpus),
          "cluster.gpus", cl.get("gpus"), f"must be an integer or list of integers, each a multiple of "
          f"gpus_per_instance ({tp}) and >= 2 instances (one rollout, one trainer side)")
    tg = cl.get("trainer_gpus", "balance")
    _need(tg == "balance" or (isinstance(tg, float) and 0 < tg < 1) or
          (isinstance(tg, int) and not isinstance(tg, bool) and all(0 < tg <= g - tp for g in gpus)),
          "cluster.trainer_gpus", tg, "must be 'balance', a fraction in (0, 1), or a GPU count that leaves at "
          "least one rollout instance on every cluster size")
    placement = cl.get("sync_placement", "colocated")
    _need(placement in ("colocated", "disaggregated"), "cluster.sync_placement", placement,
          "allowed: colocated, disaggregated")

    # Costs: derived from model + hardware, then measured decode costs, then explicit values, later wins.
    costs: dict[str, float] = {}
    derivation: dict[str, Any] = {}
    if "model" in raw or "hardware" in raw:
        m = _mapping(raw.get("model"), "model", MODEL_FIELDS)
        h = _mapping(raw.get("hardware"), "hardware", HARDWARE_FIELDS)
        for k in MODEL_FIELDS:
            _number(m, k, "model", 0, strict=True)
        for k in HARDWARE_FIELDS:
            _number(h, k, "hardware", 0, strict=k not in ("step_overhead_s", "sync_fixed_s", "logprob_forwards"))
        for k in ("hbm_efficiency", "decode_mfu", "prefill_mfu", "train_mfu"):
            _need(h[k] <= 1, f"hardware.{k}", h[k], "a fraction: must be <= 1")
        costs, derivation = derive_costs(m, h, tp)
    c = _mapping(raw.get("costs", {}), "costs", COST_FIELDS + ("from_bench",))
    if "from_bench" in c:
        p = c["from_bench"]
        _need(isinstance(p, str), "costs.from_bench", p, "must be a path to a bench JSON")
        full = p if os.path.isabs(p) else os.path.join(base_dir, p)
        costs.update(costs_from_bench(full))
        derivation.update({k: f"measured: {p}" for k in ("decode_step_s", "decode_weights_s", "decode_row_s",
                                                          "decode_ctx_s")})
    for k in COST_FIELDS:
        if k in c:
            costs[k] = _number(c, k, "costs")
            derivation[k] = "given"
    _need("decode_step_s" in costs, "costs.decode_step_s", None,
          "required (give costs, a model + hardware block, or costs.from_bench)")
    for k in COST_FIELDS:
        v = costs.get(k, 0.0)
        _need(is_number(v) and v >= 0, f"costs.{k}", v,
              "must be a finite number >= 0" + (f" (derived: {derivation[k]})" if k in derivation else ""))
    _need(costs["decode_step_s"] + costs.get("decode_weights_s", 0.0) + costs.get("decode_row_s", 0.0) > 0,
          "costs.decode_step_s", costs["decode_step_s"],
          "a decode step must cost something (decode_step_s + decode_weights_s + decode_row_s > 0)")

    pol = raw["policies"]
    _need(isinstance(pol, dict) and pol, "policies", pol, f"must be a mapping of policy names ({', '.join(POLICIES)})")
    specs = []
    for name, opts in pol.items():
        _need(name in POLICIES, f"policies.{name}", opts, f"unknown policy; allowed: {', '.join(POLICIES)}")
        opts = _mapping(opts or {}, f"policies.{name}", ("max_staleness", "rollout_batches"))
        k = {"sync": 0, "one_step_off": 1}.get(name)
        if name in ("dora", "partial"):
            k = _number(opts, "max_staleness", f"policies.{name}", 0, integer=True) if name == "dora" else 0
            rb = _number(opts, "rollout_batches", f"policies.{name}", 1.0)
            if name == "dora":
                _need(rb <= k + 1, f"policies.{name}.rollout_batches", rb,
                      f"must be <= max_staleness + 1 = {k + 1} (more outstanding work than the next K + 1 updates "
                      "can train)")
            specs.append(PolicySpec(name, k, float(rb)))
        else:
            _need(not opts, f"policies.{name}", opts, "takes no options")
            specs.append(PolicySpec(name, k))

    steps = raw.get("steps", 6)
    warm = raw.get("warmup_steps", 2)
    _need(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "steps", steps,
          "must be an integer >= 1")
    _need(isinstance(warm, int) and not isinstance(warm, bool) and 0 <= warm < steps, "warmup_steps", warm,
          f"must be an integer in [0, steps = {steps})")
    name = raw.get("name", "sim")
    _need(isinstance(name, str), "name", name, "must be a string")
    seed = raw.get("seed", 0)
    _need(isinstance(seed, int) and not isinstance(seed, bool), "seed", seed, "must be an integer")
    proj = _mapping(raw.get("projections", {}), "projections", ("gpus",))
    if proj:
        _need(isinstance(proj.get("gpus"), list) and all(isinstance(g, int) and g % tp == 0 and g > 0
                                                         for g in proj["gpus"]),
              "projections.gpus", proj.get("gpus"), f"must be a list of GPU counts, multiples of {tp}")
    paper = _paper_figures(raw.get("paper", {}), set(gpus) | set(proj.get("gpus", [])))
    return SimConfig(
        name=name, costs=Costs(**costs), lengths=length_dist(w.get("lengths"), base_dir=base_dir),
        prompts_per_step=_number(w, "prompts_per_step", "workload", 0, strict=True, integer=True),
        group_size=_number(w, "group_size", "workload", 0, strict=True, integer=True),
        prompt_tokens=_number(w, "prompt_tokens", "workload", 0, integer=True),
        gpus=tuple(gpus), gpus_per_instance=tp,
        slots_per_instance=_number(cl, "slots_per_instance", "cluster", 0, strict=True, integer=True),
        trainer_gpus=tg, sync_colocated=placement == "colocated", policies=tuple(specs), steps=steps,
        warmup_steps=warm, seed=seed, derivation=derivation, paper=paper, projections=proj)


def load_sim_config(path: str) -> SimConfig:
    """Loads and validates ``path`` (a YAML file, or a shipped preset name such as ``sim_dora_paper``)."""
    if not os.path.exists(path):
        shipped = os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{path}.yaml")
        _need(os.path.exists(shipped), "--config", path, "no such file or shipped preset")
        path = shipped
    try:
        raw = load_yaml(path)
    except TextFileError as e:
        raise SimConfigError(str(e)) from None
    return parse_config(raw or {}, base_dir=os.path.dirname(os.path.abspath(path)))
