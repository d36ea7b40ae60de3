"""Runs a simulator config (every cluster size x every policy, then the projections), compares the results with
the paper's published figures, and draws the plots."""

from __future__ import annotations

import math
import os
import random
from typing import Any

from tqdm import tqdm

from dora_jax.schema import fail
from dora_jax.sim.config import COST_FIELDS, SimConfig
from dora_jax.sim.engine import Placement
from dora_jax.sim.run import simulate

_BALANCE_DRAWS = 20_000


def length_moments(cfg: SimConfig) -> tuple[float, float]:
    """E[L] and E[L^2] of the completion lengths (fixed-seed Monte Carlo, so the answer is reproducible)."""
    rng = random.Random(12345)
    xs = cfg.lengths.draw(rng, _BALANCE_DRAWS)
    return sum(xs) / len(xs), sum(x * x for x in xs) / len(xs)


def placement(cfg: SimConfig, gpus: int, mode: str) -> Placement:
    """Splits ``gpus`` between rollout instances and the trainer for ``mode``.

    Colocated sync uses every GPU for both, in turn. Otherwise ``trainer_gpus`` decides: an explicit count,
    a fraction, or ``balance``: the steady-state rates of both sides are estimated from the cost model (a full
    instance decodes ``slots`` rows whose mean context is the prompt plus the length-biased half-length
    E[L^2] / 2E[L]; the trainer needs the per-sample token and attention work) and the rollout side gets the
    balance point's instance count rounded *up*: a real rollout side never runs every slot full (long tails,
    instances bound to an old version), so the full-instance rate overestimates it.
    """
    tp, slots = cfg.gpus_per_instance, cfg.slots_per_instance
    if mode == "sync" and cfg.sync_colocated:
        return Placement(gpus // tp, slots, gpus, colocated=True)
    tg = cfg.trainer_gpus
    if tg == "balance":
        c, p = cfg.costs, cfg.prompt_tokens
        m1, m2 = length_moments(cfg)
        ctx = p + m2 / (2 * m1)
        inst_per_sample = m1 * c.decode_time(slots, slots * ctx) / slots + p * c.prefill_token_s
        s1, s2 = p + m1, m2 + 2 * p * m1 + p * p  # moments of the trained sequence length
        gpu_per_sample = (c.train_token_gpu_s * s1 + c.train_pair_gpu_s * s2 / 2
                          + (c.train_fixed_s + c.weight_sync_s) * gpus / cfg.train_batch)
        # rollout rate I / inst_per_sample = trainer rate (gpus - tp I) / gpu_per_sample
        balance = gpus / (tp + gpu_per_sample / inst_per_sample)
        instances = min(gpus // tp - 1, max(1, math.ceil(balance)))
    elif isinstance(tg, float):
        instances = max(1, min(gpus // tp - 1, round(gpus * (1 - tg) / tp)))
    else:
        instances = (gpus - tg) // tp
    return Placement(instances, slots, gpus - instances * tp)


def run_one(cfg: SimConfig, gpus: int, mode: str, progress: bool = False,
            versions: int | str | None = None) -> dict[str, Any]:
    """One policy on one cluster size; ``versions``: dora's versions per instance (default: the policy's first).

    Raises:
        ConfigError: one version per instance with fewer rollout instances than K + 1 at this size, naming
            ``policies.dora.versions_per_instance``.
    """
    spec = cfg.policy(mode)
    versions = spec.versions_per_instance[0] if versions is None else versions
    place = placement(cfg, gpus, mode)
    if mode == "dora" and versions == 1 and place.instances < spec.max_staleness + 1:
        fail("policies.dora.versions_per_instance", 1, f"at {gpus} GPUs the split leaves {place.instances} rollout "
             f"instances for K + 1 = {spec.max_staleness + 1} live versions; one version per instance needs at "
             "least one instance per live version (use 'all', or fewer trainer GPUs)")
    rb = max(cfg.train_batch, int(spec.rollout_batches * cfg.train_batch) // cfg.group_size * cfg.group_size)
    label = f"{mode} @ {gpus} GPUs" + (f", {versions} versions per instance" if mode == "dora" else "")
    r = simulate(mode, cfg.costs, place, cfg.lengths, train_batch=cfg.train_batch, group_size=cfg.group_size,
                 prompt_tokens=cfg.prompt_tokens, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                 max_staleness=spec.max_staleness, rollout_batch=rb, seed=cfg.seed, progress=progress, label=label,
                 versions_per_instance=versions if mode == "dora" else 1)
    r["gpus"] = gpus
    return r


def run_key(mode: str, versions: int | str, first: int | str) -> str:
    """The name of a run in ``run_config``'s results: the policy, and for dora's compared settings of versions
    per instance, ``dora_all`` or ``dora_1`` (the policy's own setting keeps the name ``dora``)."""
    return mode if mode != "dora" or versions == first else f"dora_{versions}"


def run_config(cfg: SimConfig, progress: bool = True) -> dict[str, Any]:
    """Every policy at every cluster size (and the projections), the speedups over sync, the comparison with
    the paper's figures, and dora at each of its ``versions_per_instance`` settings (the others at the cluster
    sizes only, not the projections)."""
    sizes = list(cfg.gpus) + [g for g in cfg.projections.get("gpus", []) if g not in cfg.gpus]
    jobs = []
    for g in sizes:
        for p in cfg.policies:
            compared = p.versions_per_instance if p.name == "dora" and g in cfg.gpus else p.versions_per_instance[:1]
            jobs += [(g, p.name, v, run_key(p.name, v, p.versions_per_instance[0])) for v in compared]
    runs: dict[str, dict[str, Any]] = {}
    for g, mode, versions, key in tqdm(jobs, desc=f"simulate {cfg.name}", unit="run", disable=not progress):
        runs.setdefault(str(g), {})[key] = run_one(cfg, g, mode, progress=progress, versions=versions)
    table = [_row(cfg, g, key, x, runs[str(g)].get("sync")) for g in sizes for key, x in runs[str(g)].items()]
    return {"name": cfg.name, "table": table, "paper": compare_with_paper(cfg, runs), "runs": runs,
            "versions_per_instance": compare_versions(runs),
            "costs": {k: getattr(cfg.costs, k) for k in COST_FIELDS}, "derivation": cfg.derivation}


def _row(cfg: SimConfig, gpus: int, key: str, x: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """One run's line of the results table."""
    return {"gpus": gpus, "mode": x["mode"], "run": key, "versions_per_instance": x["versions_per_instance"],
            "instances": x["instances"], "trainer_gpus": x["trainer_gpus"], "step_s": x["step_s"],
            "samples_per_s": x["samples_per_s"], "tokens_per_s": x["tokens_per_s"],
            "rollout_share": x["rollout_share"], "trainer_idle": x["trainer_idle"],
            "slot_utilization": x["slot_utilization"],
            "speedup_vs_sync": x["samples_per_s"] / base["samples_per_s"] if base else None,
            "max_live_versions": x["max_live_versions"], "staleness": x["staleness"],
            "weight_loads": x["weight_loads"], "migrated_rows": x["migrated_rows"],
            "moved_kv_bytes": x["moved_kv_bytes"], "transfer_share": x["transfer_share"],
            "projection": gpus not in cfg.gpus}


def compare_versions(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cluster size where dora ran at more than one setting of versions per instance, one row per setting:
    throughput (and against the first setting's), rollout share, weight loads, rows and KV bytes moved, the
    modelled transfer's share of instance time, and the balancer's plans and decisions per update."""
    rows = []
    for g, r in runs.items():
        dora = [x for k, x in r.items() if x["mode"] == "dora"]
        if len(dora) < 2:
            continue
        sync = r.get("sync")
        for x in dora:
            b = x["balancer"] or {}
            rows.append({"gpus": int(g), "versions_per_instance": x["versions_per_instance"],
                         "samples_per_s": x["samples_per_s"], "step_s": x["step_s"],
                         "vs_first": x["samples_per_s"] / dora[0]["samples_per_s"],
                         "vs_sync": x["samples_per_s"] / sync["samples_per_s"] if sync else None,
                         "rollout_share": x["rollout_share"], "slot_utilization": x["slot_utilization"],
                         "weight_loads": x["weight_loads"], "moved_rows": x["moved_rows"],
                         "moved_kv_bytes": x["moved_kv_bytes"], "transfer_share": x["transfer_share"],
                         "plans_per_update": b.get("plans_per_update"),
                         "decisions_per_update": b.get("decisions_per_update")})
    return rows


def compare_with_paper(cfg: SimConfig, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per published figure: the paper's value, ours, and the relative deviation."""
    rows = []
    for g, figs in cfg.paper.items():
        r = runs.get(str(g), {})
        ours = {"sync_rollout_share": r.get("sync", {}).get("rollout_share"),
                "dora_rollout_share": r.get("dora", {}).get("rollout_share"),
                "speedup": (r["dora"]["samples_per_s"] / r["sync"]["samples_per_s"]
                            if "dora" in r and "sync" in r else None)}
        for key, paper in figs.items():
            sim = ours.get(key)
            rows.append({"gpus": int(g), "figure": key, "paper": paper, "simulated": sim,
                         "deviation": None if sim is None else (sim - paper) / paper})
    return rows


def format_report(result: dict[str, Any]) -> str:
    """The results table, the paper comparison and dora's versions-per-instance comparison as Markdown."""
    out = ["| GPUs | policy | rollout inst. | trainer GPUs | step s | samples/s | tokens/s | rollout share | "
           "trainer idle | slot util. | vs sync | live versions | migrated rows |", "|" + "---|" * 13]
    for r in result["table"]:
        tag = " (proj.)" if r["projection"] else ""
        sp = f"{r['speedup_vs_sync']:.2f}x" if r["speedup_vs_sync"] else "-"
        name = r["mode"] if r["mode"] != "dora" else f"dora ({r['versions_per_instance']} per inst.)"
        out.append(f"| {r['gpus']}{tag} | {name} | {r['instances']} | {r['trainer_gpus']} | {r['step_s']:.0f} | "
                   f"{r['samples_per_s']:.2f} | {r['tokens_per_s']:.0f} | {r['rollout_share']:.1%} | "
                   f"{r['trainer_idle']:.1%} | {r['slot_utilization']:.1%} | {sp} | {r['max_live_versions']} | "
                   f"{r['migrated_rows']} |")
    if result["paper"]:
        out += ["", "| GPUs | figure | paper | simulated | deviation |", "|---|---|---|---|---|"]
        for p in result["paper"]:
            sim = "-" if p["simulated"] is None else f"{p['simulated']:.3g}"
            dev = "-" if p["deviation"] is None else f"{p['deviation']:+.0%}"
            out.append(f"| {p['gpus']} | {p['figure']} | {p['paper']} | {sim} | {dev} |")
    if result.get("versions_per_instance"):
        out += ["", "| GPUs | dora versions per instance | samples/s | vs first | vs sync | rollout share | "
                "slot util. | weight loads | moved rows | moved KV GB | transfer share | plans / update | "
                "decisions / update |", "|" + "---|" * 13]
        for v in result["versions_per_instance"]:
            out.append(f"| {v['gpus']} | {v['versions_per_instance']} | {v['samples_per_s']:.2f} | "
                       f"{v['vs_first']:.2f}x | "
                       f"{_num(v['vs_sync'], '{:.2f}x')} | {v['rollout_share']:.1%} | {v['slot_utilization']:.1%} | "
                       f"{v['weight_loads']} | {v['moved_rows']} | {_num(v['moved_kv_bytes'], '{:.0f}', 1e-9)} | "
                       f"{v['transfer_share']:.3%} | {_num(v['plans_per_update'], '{:.2f}')} | "
                       f"{_num(v['decisions_per_update'], '{:.2f}')} |")
    return "\n".join(out)


def _num(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else fmt.format(x * scale)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
    """Throughput vs accelerators (one line per policy) and a timeline of the trainer's updates and live
    versions for each policy at the first cluster size. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    order = ["sync", "one_step_off", "partial", "dora"]
    keys = sorted({(r["mode"], r.get("run", r["mode"])) for r in result["table"]},
                  key=lambda k: (order.index(k[0]), k[1]))
    for _, key in keys:
        rows = sorted((r for r in result["table"] if r.get("run", r["mode"]) == key), key=lambda r: r["gpus"])
        ax.plot([r["gpus"] for r in rows], [r["samples_per_s"] for r in rows], marker="o", label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("accelerators")
    ax.set_ylabel("trained samples / s")
    ax.set_title(f"{result['name']}: throughput (points past the paper's sizes are projections)", fontsize=9)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    paths.append(os.path.join(out_dir, f"sim_{result['name']}_throughput.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    first = str(min(int(g) for g in result["runs"]))
    runs = result["runs"][first]
    fig, axes = plt.subplots(len(runs), 1, figsize=(7.5, 1.6 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, (mode, r) in zip(axes[:, 0], runs.items()):
        for u in r["updates"]:
            ax.broken_barh([(u["start"], u["end"] - u["start"])], (-0.4, 0.8), color="tab:blue", alpha=0.6)
        xs, lo, hi = [0.0], [0], [0]
        for e in r["timeline"]:
            xs.append(e["t"])
            lo.append(min(e["live"]) - e["version"])
            hi.append(max(e["live"]) - e["version"])
        ax.step(xs, [-x for x in lo], where="post", color="tab:red", label="versions behind (oldest live)")
        ax.set_ylabel(mode, rotation=0, ha="right", fontsize=8)
        ax.set_yticks(range(0, max(2, 1 - min(lo)) + 1))
    axes[0, 0].set_title(f"{result['name']} @ {first} GPUs: updates (blue) and age of the oldest live version "
                         "(red)", fontsize=9)
    axes[-1, 0].set_xlabel("simulated seconds")
    paths.append(os.path.join(out_dir, f"sim_{result['name']}_timeline.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
