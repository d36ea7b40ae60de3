"""``dora-jax bench convergence``: does training asynchronously cost accuracy? The main job's task and model
(``configs/smollm2_arith.yaml``: SmolLM2-135M-Instruct on arithmetic) trained by ``sync`` and by DORA at K = 2
(without and with decoupled PPO's correction) and K = 3 (with it), several seeds each, every run on the same
number of samples (``dora.steps`` x ``dora.train_batch``), evaluated before and after on the same held-out set.

Seeds: run ``s`` samples with ``rollout.seed = s`` (other tokens for the same prompts); the model, the data
order and the held-out set are the same for every run, so what differs between runs of one seed is the schedule.
Runs go through :class:`benchmarks.harness.Harness`, one run name at a time (every seed of it), its trainer and
engine freed before the next name's are built.

Reported per run name: held-out accuracy after training per seed (``final_accuracy``), the mean reward of each
trained batch per seed (``reward_per_iteration``), and their means with standard errors; the plot draws each
name's mean reward per iteration with a band of one standard error, and the final accuracy with its standard
error. At least 256 held-out answers (``task.eval_size`` questions x ``task.eval_samples`` answers) per
evaluation by default.

A comparison can run in pieces (``--runs``): ``--merge A.json,B.json`` writes the results of one recipe on one
machine as one, with the target computed over all their runs.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from typing import Any

import numpy as np

from benchmarks.harness import Harness, Variant
from benchmarks.record import machine

CONFIG = "smollm2_arith"
RUNS = [("sync", ["dora.mode=sync", "train.max_staleness=1", "train.correction=none"]),
        ("dora_k2_none", ["dora.mode=dora", "train.max_staleness=2", "train.correction=none"]),
        ("dora_k2_decoupled", ["dora.mode=dora", "train.max_staleness=2", "train.correction=decoupled"]),
        ("dora_k3_decoupled", ["dora.mode=dora", "train.max_staleness=3", "train.correction=decoupled"])]
MIN_ANSWERS = 256
# AReaL's weight cap on the decoupled runs: with it and the main job's 4 updates a version, decoupled PPO at K = 2
# and 3 met sync's floor (docs/performance.md). Results written before this default recorded no cap as 0.
DECOUPLED_CAP = 5.0


def seed_stats(xs: list[float]) -> dict[str, float]:
    """The mean of one figure over seeds and its standard error (0 for a single seed)."""
    a = np.asarray(xs, float)
    se = float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0
    return {"mean": float(a.mean()), "stderr": se}


def parity(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The target: every dora run with decoupled PPO ends with a mean held-out accuracy no lower than sync's
    mean minus two standard errors (over seeds). Without a sync run there is no floor to compare with."""
    if "sync" not in runs:
        return {"floor": None, "met": {}, "why": "no sync run in this result"}
    sync = runs["sync"]["final_accuracy_stats"]
    floor = sync["mean"] - 2 * sync["stderr"]
    return {"floor": floor, "met": {n: bool(r["final_accuracy_stats"]["mean"] >= floor)
                                    for n, r in runs.items() if n.endswith("_decoupled")}}


def bench_convergence(config: str = CONFIG, seeds: int = 4, steps: int | None = None, eval_size: int | None = None,
                      overrides: tuple[str, ...] = (), out_dir: str | None = None, names: tuple[str, ...] = (),
                      decoupled_cap: float = DECOUPLED_CAP) -> dict[str, Any]:
    """Trains every run name once per seed and returns held-out accuracy and reward per iteration.

    Args:
      config: the main job's config (default ``smollm2_arith``).
      seeds: seeds per run name (``rollout.seed`` 0 .. seeds - 1).
      steps: updates per run (default: the config's ``dora.steps``); every run trains ``steps x dora.train_batch``
        samples.
      eval_size: held-out questions (default: enough for ``MIN_ANSWERS`` answers at the config's
        ``task.eval_samples``, at least the config's own ``task.eval_size``).
      overrides: ``key=value`` settings for every run (after the above).
      out_dir: keep the run directories here (default: a temporary directory).
      names: the run names to train (default: all of :data:`RUNS`, in its order).
      decoupled_cap: ``train.decoupled_cap`` of the runs with decoupled PPO (0: none; the others take no cap).
        The default is :data:`DECOUPLED_CAP`.
    """
    from dora_jax.config import load_config

    base = load_config(config, list(overrides))
    samples = base.task.eval_samples
    if eval_size is None:
        eval_size = max(base.task.eval_size, -(-MIN_ANSWERS // samples))
    steps = steps or base.dora.steps
    common = [f"dora.steps={steps}", f"task.eval_size={eval_size}", "run.checkpoint_every=0"]
    h = Harness(config, common + list(overrides), out_dir)
    variants = []
    unknown = sorted(set(names) - {n for n, _ in RUNS})
    if unknown:
        raise ValueError(f"bench convergence: unknown run names {unknown}; known: {', '.join(n for n, _ in RUNS)}")
    for name, extra in RUNS:  # dora holds up to K + 1 batches outstanding (RBS = (K + 1) TBS), sync one
        if names and name not in names:
            continue
        if decoupled_cap and "train.correction=decoupled" in extra:
            extra = extra + [f"train.decoupled_cap={decoupled_cap}"]
        k = int(next(x for x in extra if x.startswith("train.max_staleness=")).split("=")[1])
        rb = (k + 1 if "dora.mode=dora" in extra else 1) * base.dora.train_batch
        variants.append(Variant(name, extra + [f"dora.rollout_batch={rb}"], False))

    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    # One run name at a time, its placement dropped before the next: each name has a trainer and an engine of
    # its own (the staleness bound and the correction are compiled into the train step), and the main job's
    # placements of all four names do not fit a 24 GiB machine together. Accuracy does not drift with the
    # machine as wall time does, so the names need not alternate.
    for v in variants:
        for seed in range(seeds):
            r = h.run(v, [f"rollout.seed={seed}"])
            s = r["summary"]
            runs[v.name].append({"seed": seed, "accuracy_before": s["accuracy_before"],
                                 "final_accuracy": s["accuracy_after"], "reward_after": s["reward_after"],
                                 "reward_per_iteration": [row["reward"] for row in r["rows"]],
                                 # What the correction did in each update: the share of tokens clipped and the
                                 # gradient norm before clipping.
                                 "clip_frac_per_iteration": [row["train"]["clip_frac"] for row in r["rows"]],
                                 "grad_norm_per_iteration": [row["train"]["grad_norm"] for row in r["rows"]],
                                 "samples": s["samples"], "eval_n": s["eval_n"], "wall_s": s["wall_s"],
                                 "max_staleness_seen": max(row["staleness_max"] for row in r["rows"])})
            print(f"seed {seed}: {v.name:>18}: accuracy {s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}, "
                  f"final reward {r['rows'][-1]['reward']:.3f}, {s['samples']} samples in {s['wall_s']:.0f} s",
                  flush=True)
        h.forget()
    out = {}
    for name, rs in runs.items():
        curves = np.asarray([r["reward_per_iteration"] for r in rs])
        out[name] = {"final_accuracy": [r["final_accuracy"] for r in rs],
                     "reward_per_iteration": curves.tolist(),
                     "accuracy_before": [r["accuracy_before"] for r in rs],
                     "final_accuracy_stats": seed_stats([r["final_accuracy"] for r in rs]),
                     "reward_mean": curves.mean(0).tolist(),
                     "reward_stderr": (curves.std(0, ddof=1) / math.sqrt(len(rs))).tolist() if len(rs) > 1
                     else [0.0] * curves.shape[1],
                     "clip_frac_per_iteration": [r["clip_frac_per_iteration"] for r in rs],
                     "grad_norm_per_iteration": [r["grad_norm_per_iteration"] for r in rs],
                     "samples": [r["samples"] for r in rs], "wall_s": [r["wall_s"] for r in rs],
                     "max_staleness_seen": max(r["max_staleness_seen"] for r in rs)}
    return {"machine": machine(), "config": config, "seeds": seeds, "steps": steps,
            "train_batch": base.dora.train_batch, "samples_per_run": steps * base.dora.train_batch,
            "eval_size": eval_size, "eval_samples": samples, "heldout_answers": eval_size * samples,
            "overrides": list(overrides), "decoupled_cap": decoupled_cap,
            "runs": out, "target": parity(out), "settings": {v.name: v.overrides for v in variants},
            "run_dir": h.out_dir}


# What two results must share to be one comparison: the job, its size and evaluation, and the machine (another
# machine's numerics make other samples from the same seed).
SAME = ("config", "seeds", "steps", "train_batch", "samples_per_run", "eval_size", "eval_samples", "heldout_answers",
        "device")
_OVERRIDE = re.compile(r"^[a-z_]+\.[a-z_]+=")


def recipe(result: dict[str, Any]) -> tuple[tuple[str, ...], float]:
    """The settings every run of ``result`` shares: its ``key=value`` overrides (sorted) and the decoupled cap;
    read from the command line for a result written before they were recorded as fields."""
    if "overrides" in result:
        return tuple(sorted(result["overrides"])), float(result["decoupled_cap"])
    words = shlex.split(result["command"])
    # Such a result was written while the default was no cap.
    cap = float(words[words.index("--decoupled-cap") + 1]) if "--decoupled-cap" in words else 0.0
    return tuple(sorted(w for w in words if _OVERRIDE.match(w))), cap


def merge(paths: list[str]) -> dict[str, Any]:
    """One result from the ``bench convergence`` JSONs at ``paths``, each holding other run names of the same
    recipe (a long comparison run in pieces): their runs together, the target computed over them all.

    Raises:
      ValueError: naming the file and field, for a file that is not such a result, results of different jobs,
        sizes, machines or recipes, or a run name in two of them.
    """
    if len(paths) < 2:
        raise ValueError(f"bench convergence --merge: two or more results to merge, got {len(paths)}")
    results = []
    for path in paths:
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"bench convergence --merge: {path}: not readable as JSON ({e})") from None
        missing = [k for k in (*SAME, "command", "date", "runs", "settings") if k not in r]
        if missing:
            raise ValueError(f"bench convergence --merge: {path}: not a bench convergence result (no {missing})")
        results.append(r)
    first, where = results[0], paths[0]
    for path, r in zip(paths[1:], results[1:]):
        for k in SAME:
            if r[k] != first[k]:
                raise ValueError(f"bench convergence --merge: {k} differs: {first[k]!r} in {where}, {r[k]!r} in {path}")
        if recipe(r) != recipe(first):
            raise ValueError(f"bench convergence --merge: the recipe differs: {recipe(first)} in {where}, "
                             f"{recipe(r)} in {path}")
    runs: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    source: dict[str, str] = {}
    for path, r in zip(paths, results):
        for name in r["runs"]:
            if name in runs:
                raise ValueError(f"bench convergence --merge: run {name!r} is in both {source[name]} and {path}")
            runs[name], settings[name], source[name] = r["runs"][name], r["settings"][name], path
    order = [n for n, _ in RUNS if n in runs] + [n for n in runs if n not in dict(RUNS)]
    runs = {n: runs[n] for n in order}
    overrides, cap = recipe(first)
    return {**{k: first[k] for k in SAME if k != "device"}, "measured_on": first["device"],
            "merged_from": [{"path": p, "command": r["command"], "date": r["date"], "runs": list(r["runs"])}
                            for p, r in zip(paths, results)],
            "machine": first.get("machine"), "overrides": list(overrides), "decoupled_cap": cap,
            "runs": runs, "target": parity(runs), "settings": {n: settings[n] for n in order}}


def plot_convergence(result: dict[str, Any], path: str) -> str:
    """Mean reward per iteration with one standard error (left) and final held-out accuracy (right) per run name.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["runs"])
    for name in names:
        r = result["runs"][name]
        mean, se = np.asarray(r["reward_mean"]), np.asarray(r["reward_stderr"])
        it = np.arange(1, len(mean) + 1)
        ax.plot(it, mean, marker=".", label=name)
        ax.fill_between(it, mean - se, mean + se, alpha=0.2)
    ax.set_title(f"reward of each trained batch: mean of {result['seeds']} seed(s), band 1 standard error",
                 fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration (policy version)")
    ax.set_ylabel("mean reward of the batch")
    ax.legend(fontsize=8)
    x = np.arange(len(names))
    acc = [result["runs"][n]["final_accuracy_stats"] for n in names]
    bx.bar(x, [a["mean"] for a in acc], yerr=[a["stderr"] for a in acc], capsize=4)
    before = np.mean([v for n in names for v in result["runs"][n]["accuracy_before"]])
    bx.axhline(before, color="grey", linestyle="--", label=f"before training ({before:.3f})")
    floor = result.get("target", {}).get("floor")
    if floor is not None:
        bx.axhline(floor, color="red", linestyle=":", label=f"sync's mean - 2 SE ({floor:.3f}): decoupled runs' floor")
    bx.set_xticks(x, names, rotation=20)
    bx.set_title(f"held-out accuracy after {result['samples_per_run']} samples ({result['heldout_answers']} answers), "
                 "mean +- 1 standard error", fontsize=9)
    bx.set_xlabel("run")
    bx.set_ylabel("held-out accuracy")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
