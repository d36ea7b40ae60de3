"""``dora-jax bench modes``: sync, one_step_off and dora at K = 1, 2, 3 on one long-tailed workload, measured
and simulated.

Every mode trains the same model from the same initial weights, on the same task and seed, for the same number
of samples. The workload is ``longtail``: each sample carries its own length budget (85% short, p50 ~ 8 tokens;
15% between 128 and 256), and responses run to their budget, so a synchronous batch of 16 nearly always waits for
a long member while most slots sit empty. Runs go through :class:`benchmarks.harness.Harness`: untimed rounds
compile every shape (until a round compiles nothing), then ``repeats`` rounds each run every mode once
(alternated, so the machine's drift spreads over all modes alike); a mode's wall time is the median of its
rounds. ``sync`` runs with further rollout seeds to
show the run-to-run noise of the reward curve the other modes' curves are compared with.

Placement: with two or more devices, every mode runs under ``split`` placement (trainer on device 0, rollout on
device 1; the train step runs while decoding goes on) and again under ``shared`` placement (``<mode>_shared``:
trainer and rollout take turns on device 0); on one device, every mode runs shared. Speed-ups and step counts are
against sync under the same placement. Decode batch-steps per trained sample are the schedule's own under shared
placement (no step is taken while the rollout waits on the trainer), so they are the same on any machine for a
given seed; they are what predicts DORA's speed-up where a decode step costs about the same at any batch size,
as on an accelerator. On CPU, ``dora-jax bench modes`` asks XLA for two host devices (they share the machine's
cores).

Rollout groups (``--groups N``): every mode runs under split placement alone, the trainer on device 0 and N
rollout groups of one device each after it, with one more entry, ``dora_k2_1vpg``: dora at K = 2 with one
policy version per group (``roles.versions_per_group=1``, DORA's load balancing), next to ``dora_k2`` (every
live version in every group), and ``dora_k2_1vpg_elastic``, the same with the trainer's devices decoding as one
more group while the trainer waits (``roles.elastic_group``). Each mode reports the most versions a group held and the balancer's counters;
nothing is simulated (the simulator knows one pool of slots, not groups serving versions).

The simulator check: each mode is also simulated (:func:`dora_jax.sim.local.simulate_run`) on the same
workload (the same prompts, length budgets, engine and trainer settings) with a cost profile of this machine:
the one given (``--profile``) or one measured in this process before the runs (``bench profile``), and the
simulated wall time is compared with the measured median.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.harness import Harness, Variant
from benchmarks.record import machine, source_version
from benchmarks.workload import TBS, workload

# ``--preset reasoning``, for an accelerator: reasoning-length outputs (budgets up to 4,096 tokens, p50 128) on a
# SmolLM2-135M-shaped model with random weights (byte tokens, no end-of-sequence token, so every response runs to
# its budget), computing in bf16, the train step with full remat and chunked log-probs. On one device every mode
# runs shared.
# Its cost profile sweeps a smaller decode grid once: each point runs to 4,096 positions, and the default grid's
# 36 sweeps would take minutes of an accelerator's time on their own.
REASONING = {"config": "smollm2_135m", "max_len": 4096, "steps": 4, "repeats": 2, "noise_seeds": 1,
             "overrides": ["model.weights=''", "model.max_seq_len=4224", "model.compute_dtype=bfloat16",
                           "train.remat=full", "train.logprob_chunk=64"],
             "profile_grid": {"versions": (1, 2, 4), "batches": (1, 16, 32), "rounds": 1}}
MODES = [("sync", 0), ("one_step_off", 1), ("dora", 1), ("dora", 2), ("dora", 3)]
TARGET = 0.15  # simulated wall time and dora / sync ratio: within 15% of the measured


def _mode_overrides(mode: str, k: int, tbs: int) -> list[str]:
    rbs = tbs if mode != "dora" else (k + 1) * tbs
    return [f"dora.mode={mode}", f"train.max_staleness={max(k, 1)}", f"dora.rollout_batch={rbs}"]


MODE_NAMES = tuple(mode if mode != "dora" else f"dora_k{k}" for mode, k in MODES)
# Under rollout groups: dora K = 2 with one version per group, run next to dora_k2 (it needs K + 1 = 3 groups).
ONE_VERSION = ("dora_k2_1vpg", ["roles.versions_per_group=1"])
ONE_VERSION_GROUPS = 3
# And with the trainer's devices lent to rollout while the trainer waits (roles.elastic_group).
ELASTIC = ("dora_k2_1vpg_elastic", ONE_VERSION[1] + ["roles.elastic_group=true"])


def plan(split: bool, only: tuple[str, ...] | None = None, groups: int = 1) -> list[Variant]:
    """The modes, each a :class:`Variant`. Where there are two devices, every mode runs under split placement
    and again under shared placement (named ``<mode>_shared``); on one device, every mode runs shared.
    ``only`` keeps the modes of those names (of :data:`MODE_NAMES`; ``sync`` and ``dora_k2`` among them, the
    pair every comparison and the target are made of). With ``groups`` > 1 (split placement on that many rollout
    groups) every mode runs split only, and :data:`ONE_VERSION` and :data:`ELASTIC` follow ``dora_k2`` when there
    are at least :data:`ONE_VERSION_GROUPS` groups.

    Shared placement is where decode batch-steps per trained sample count the schedule alone: the trainer and
    the rollout take turns, so no decode step is taken while the rollout waits on a slower trainer, and the
    count is the same on any machine. Under split placement the rollout keeps decoding its long samples, a few
    rows at a time, while the trainer works, so the count there grows with the trainer's share of the time."""
    if only is not None:
        unknown = sorted(set(only) - set(MODE_NAMES))
        if unknown or not {"sync", "dora_k2"} <= set(only):
            raise ValueError(f"modes {list(only)}: each of {list(MODE_NAMES)}, with sync and dora_k2 among them"
                             + (f" (unknown: {unknown})" if unknown else ""))
    names = [(name, _mode_overrides(mode, k, TBS)) for name, (mode, k) in zip(MODE_NAMES, MODES)
             if only is None or name in only]
    if groups > 1:
        out = [Variant(name, o, True) for name, o in names]
        if groups >= ONE_VERSION_GROUPS:
            at = next(i for i, v in enumerate(out) if v.name == "dora_k2") + 1
            base = out[at - 1].overrides
            out[at:at] = [Variant(ONE_VERSION[0], base + ONE_VERSION[1], True), Variant(ELASTIC[0], base + ELASTIC[1], True)]
        return out
    if not split:
        return [Variant(name, o, False) for name, o in names]
    return [Variant(name, o, True) for name, o in names] + [Variant(f"{name}_shared", o, False) for name, o in names]


def reference(name: str) -> str:
    """The sync run a mode is compared with: the one under the same placement."""
    return "sync_shared" if name.endswith("_shared") else "sync"


def mode_result(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its timed runs: medians, every run's value, and the median run's details."""
    # A program a run meets for the first time compiles inside it (which programs a run calls follows its
    # schedule, and under split placement the schedule follows the machine's timing): its wall time is taken
    # without that compile time, which a long run pays once.
    walls = [r["summary"]["wall_s"] - r["compile_s"] for r in runs]
    med = runs[int(np.argsort(walls)[len(walls) // 2])]
    s, rows = med["summary"], med["rows"]
    lags = [int(lag) for row in rows for lag, n in row["staleness"].items() for _ in range(n)]
    per_run = {k: [r["summary"][src] for r in runs] for k, src in
               (("wall_with_compile_s", "wall_s"), ("decode_steps_per_sample", "decode_batch_steps_per_sample"),
                ("slot_utilization", "slot_utilization"))}
    per_run.update(wall_s=walls, compile_s=[r["compile_s"] for r in runs],
                   samples_per_s=[r["summary"]["samples"] / w for r, w in zip(runs, walls)])
    return {
        "mode": s["mode"], "placement": s["placement"], "max_staleness": s["max_staleness"], "samples": s["samples"],
        "measured_wall_s": float(np.median(per_run["wall_s"])),
        "samples_per_s": float(np.median(per_run["samples_per_s"])),
        # Device-independent: decode batch-steps per trained sample and the share of computed rows that were
        # live (what predicts the speed-up where a decode step costs the same at any batch size).
        "decode_steps_per_sample": float(np.median(per_run["decode_steps_per_sample"])),
        "slot_utilization": float(np.median(per_run["slot_utilization"])), "runs": per_run,
        "decode_batch_steps": s["decode_batch_steps"], "train_s": s["train_s"],
        "tokens_per_s": sum(row["trained_tokens"] for row in rows) / walls[runs.index(med)],
        "gen_tok_s": s["gen_tok_s"],
        "rollout_share": float(np.mean([row["rollout_share"] for row in rows])),
        "trainer_idle_fraction": s["trainer_idle_fraction"],
        # With an elastic group: the trainer's devices' idle share, its decoding counted as busy, and its figures.
        "trainer_devices_idle_fraction": s.get("trainer_devices_idle_fraction", s["trainer_idle_fraction"]),
        "elastic": s.get("elastic"),
        "slot_occupancy": float(np.mean([row["slot_occupancy"] for row in rows])),
        "mean_staleness": float(np.mean(lags)), "max_staleness_seen": int(max(lags)),
        "max_resident_versions": s["max_resident_versions"], "weight_sync_s": s["sync_s"],
        "reward_per_step": [row["reward"] for row in runs[0]["rows"]], "final_reward": runs[0]["rows"][-1]["reward"],
        "len_p50": float(np.median([row["len_p50"] for row in rows])),
        "len_p99": float(max(row["len_p99"] for row in rows)),
        **groups_result(s),
    }


# The balancer's figures a groups run reports: its counters, each group's version loads, and the requests moved
# between groups with their KV bytes and the moves that waited for room.
BALANCER_FIGURES = ("plans", "changes", "reassigned", "drains", "moved", "loads", "moved_requests", "moved_kv_bytes",
                    "move_waits")


def groups_result(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's rollout groups from its summary: how many, the most versions one group held, the balancer's
    counters (None without one version per group), and the prompts prefilled again.

    Nothing is prefilled twice within a run: a request moved between groups takes its KV pages along, and a group
    changes version only once empty. Only a resume redoes in-flight requests from their prompts, which a bench run
    never does (its count is not in the summary: None then). A figure the summary lacks is None."""
    b = summary.get("balancer")
    return {"rollout_groups": summary.get("rollout_groups"),
            "max_versions_per_group": summary.get("max_versions_per_group"),
            "balancer": None if b is None else {k: b.get(k) for k in BALANCER_FIGURES},
            "prefilled_again": None if summary.get("resumed", True) else 0}


def simulate_modes(h: Harness, variants: list[Variant], profile: Any) -> dict[str, dict[str, Any]]:
    """Each variant simulated on the harness's workload with ``profile`` (:func:`dora_jax.sim.local.simulate_run`)."""
    from dora_jax.run.setup import schedule_policy
    from dora_jax.sim.local import simulate_run

    out = {}
    for v in variants:
        cfg = h.cfg(v.overrides, v.split)
        r = simulate_run(profile, h.run_setup(cfg, v.split), schedule_policy(cfg))
        out[v.name] = {k: r[k] for k in ("wall_s", "samples_per_s", "train_s", "decode_batch_steps",
                                         "decode_batch_steps_per_sample", "slot_utilization", "max_resident_versions")}
    return out


def compare(results: dict[str, dict[str, Any]], simulated: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The simulator against the measurement: each mode of ``results`` gets ``simulated_wall_s``, the simulated
    figures and ``simulated_error`` (simulated / measured wall time - 1); returns, against :data:`TARGET`, which
    modes' wall times are within it and, per dora mode, the dora / sync wall-time ratio measured and simulated
    with the ratio's error.

    Args:
      results: per mode, at least ``mode`` and ``measured_wall_s`` (a ``sync`` mode among them).
      simulated: per mode of ``results``, at least ``wall_s``.
    """
    for name, r in results.items():
        r["simulated"] = simulated[name]
        r["simulated_wall_s"] = float(simulated[name]["wall_s"])
        r["simulated_error"] = r["simulated_wall_s"] / r["measured_wall_s"] - 1
    ratios = {}
    for name, r in results.items():
        if r["mode"] == "dora":
            sync = results[reference(name)]
            m, s = r["measured_wall_s"] / sync["measured_wall_s"], r["simulated_wall_s"] / sync["simulated_wall_s"]
            ratios[name] = {"measured": m, "simulated": s, "error": s / m - 1}
    return {"target": TARGET,
            "wall_within_target": {n: bool(abs(r["simulated_error"]) <= TARGET) for n, r in results.items()},
            "dora_over_sync_wall": ratios,
            "ratio_within_target": {n: bool(abs(x["error"]) <= TARGET) for n, x in ratios.items()}}


def bench_modes(config: str = "tiny_llama", steps: int = 8, repeats: int = 3, noise_seeds: int = 3,
                profile: str | None = None, out_dir: str | None = None, max_len: int = 256,
                overrides: tuple[str, ...] = (), warm_rounds: int = 4,
                profile_grid: dict[str, Any] | None = None,
                modes: tuple[str, ...] | None = None, simulate: bool = True, groups: int = 1) -> dict[str, Any]:
    """Runs every mode ``repeats`` times (alternated, after untimed rounds), simulates each with a cost
    profile of this machine, and returns per-mode throughput, schedule figures and the simulator's error.

    Args:
      config: the model preset (a small one: every mode runs ``steps`` updates of ``TBS`` samples per round).
      steps: updates per run.
      repeats: timed runs per mode; the wall time reported is their median.
      noise_seeds: sync runs with different rollout seeds, for the reward curve's run-to-run spread.
      profile: a ``bench profile`` JSON measured on this machine; default: one is measured here first.
      out_dir: keep the run directories here (default: a temporary directory).
      max_len: the longest length budget (:func:`benchmarks.workload.workload`).
      overrides: ``key=value`` settings after the workload's.
      warm_rounds: untimed rounds at most (:meth:`Harness.warm`).
      profile_grid: the measured profile's decode grid (:func:`benchmarks.profile.bench_profile`'s
        ``versions``, ``batches``, ``rounds``; default its own).
      modes: run only these modes (:func:`plan`); default all of :data:`MODE_NAMES`.
      simulate: measure a cost profile and simulate every mode with it. Without it the result's ``simulator``
        is None: the profile's decode sweeps run to ``max_len`` positions each, minutes of an accelerator's
        time when outputs reach thousands of tokens.
      groups: with more than one, every mode runs under split placement on that many rollout groups of one device
        each (``groups + 1`` devices), with ``dora_k2_1vpg`` (:func:`plan`), and nothing is simulated.
    """
    from dora_jax.sim.profile import load_profile, parse_profile

    from benchmarks.profile import add_train_samples, bench_profile

    plan(False, modes)  # a bad selection fails before anything is built
    simulate = simulate and groups == 1
    h = Harness(config, workload(max_len) + list(overrides) + [f"dora.steps={steps}"], out_dir, shared_devices=1,
                groups=groups)
    variants = plan(h.split, modes, groups)
    # One placement's runs at a time: on XLA:CPU every compiled program holds memory mappings of its own, and the
    # programs of split and shared placement together (a trainer per staleness bound, an engine each) pass Linux's
    # default of 65530 mappings per process. Within a phase the modes alternate, as the comparisons need.
    phases = [[v for v in variants if v.split], [v for v in variants if not v.split]] if h.split else [variants]
    phases = [p for p in phases if p]  # under rollout groups every mode runs split
    measured_profile, prof, runs, simulated, noise, compiled_per_round = None, None, {}, {}, [], []
    for i, phase in enumerate(phases):
        # Compiles every shape the runs meet (the profile shares the programs).
        compiled_per_round.append(h.warm(phase, max_rounds=warm_rounds))
        sample_train = simulate and i == 0 and profile is None
        if sample_train:  # measured between the compiling round and the timed ones, on the same engine and trainer
            measured_profile = bench_profile(config, harness=h, **(profile_grid or {}))
            cfg = h.cfg((), h.split)
            placement = h.placement(cfg, h.split)
            state = [placement.take_state()]
            # The train costs sampled again before every timed round (the largest cost).
            state[0] = add_train_samples(measured_profile, placement.trainer, state[0], cfg)

        def say(v: Variant, r: int, run: dict[str, Any], last: Variant = phase[-1],
                sample: bool = sample_train) -> None:
            s = run["summary"]
            print(f"round {r + 1}: {v.name:>19}: wall {s['wall_s']:.2f} s, {s['samples_per_s']:.2f} samples/s, "
                  f"{s['decode_batch_steps_per_sample']:.2f} decode batch-steps/sample", flush=True)
            if sample and v is last and r + 1 < repeats:
                state[0] = add_train_samples(measured_profile, placement.trainer, state[0], cfg)

        runs.update(h.rounds(phase, repeats, on_run=say))
        if simulate and prof is None:
            prof = (parse_profile(measured_profile, source="measured by this run") if profile is None
                    else load_profile(profile))
        if simulate:
            simulated.update(simulate_modes(h, phase, prof))
        if i == 0:
            noise = [[row["reward"] for row in h.run(Variant(f"sync_seed{seed}", _mode_overrides("sync", 0, TBS),
                                                             h.split), [f"rollout.seed={seed}"])["rows"]]
                     for seed in range(1, noise_seeds)]
        if sample_train:
            del placement, state
        h.forget()
    results = {v.name: mode_result(v.name, runs[v.name]) for v in variants}
    checked = compare(results, simulated) if simulate else None
    curves = np.asarray([results["sync"]["reward_per_step"]] + noise)
    steps_vs_sync = {n: r["decode_steps_per_sample"] / results[reference(n)]["decode_steps_per_sample"]
                     for n, r in results.items()}
    k2 = "dora_k2_shared" if "dora_k2_shared" in results else "dora_k2"
    return {"machine": machine(), "source": source_version(), "config": config, "steps": steps, "repeats": repeats,
            "train_batch": TBS,
            "group_size": 4, "devices": h.device_count,
            "placement": (f"split (trainer device 0, {groups} rollout groups: devices 1-{groups})" if groups > 1
                          else "split (trainer device 0, rollout device 1)" if h.split else "shared (one device)"),
            "rollout_groups": groups,
            "slots": h.cfg().rollout.slots, "max_len": max_len, "overrides": list(overrides),
            "workload": f"longtail: per-sample budgets, 85% lognormal p50 {max_len // 32}, 15% uniform "
                        f"{max_len // 2}..{max_len} tokens",
            "modes": results, "programs_compiled_per_untimed_round": compiled_per_round,
            "speedup_vs_sync": {n: r["samples_per_s"] / results[reference(n)]["samples_per_s"]
                                for n, r in results.items()},
            "decode_steps_per_sample_vs_sync": steps_vs_sync,
            # The device-independent target: dora at K = 2 against sync, both where the count is the schedule's.
            "target": {"variant": k2, "decode_steps_per_sample_vs_sync": steps_vs_sync[k2], "at_most": 0.5,
                       "met": bool(steps_vs_sync[k2] <= 0.5)},
            "simulator": None if checked is None else {
                "profile": profile or "measured in this run, after the untimed rounds of the modes and before the "
                                      "timed ones, its train costs sampled again before every timed round (see "
                                      "'profile')", **checked},
            "profile": measured_profile,
            "sync_reward_curves": curves.tolist(),
            "sync_reward_spread": {"mean": curves.mean(0).tolist(), "min": curves.min(0).tolist(),
                                   "max": curves.max(0).tolist()},
            "run_dir": h.out_dir}


def plot_modes(result: dict[str, Any], path: str) -> str:
    """Four panels: reward per update of every mode over the band of the sync runs' spread; each mode's
    throughput (median of its runs, bars from the slowest to the fastest); measured against simulated wall time;
    decode batch-steps per trained sample against sync's under the same placement.

    Args:
      result: what :func:`bench_modes` returned.
      path: the PNG to write.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax, bx), (cx, dx)) = plt.subplots(2, 2, figsize=(14, 9))
    spread = result["sync_reward_spread"]
    steps = np.arange(1, len(spread["mean"]) + 1)
    ax.fill_between(steps, spread["min"], spread["max"], color="grey", alpha=0.3,
                    label=f"sync, {len(result['sync_reward_curves'])} seeds (min-max)")
    for name, r in result["modes"].items():
        ax.plot(steps, r["reward_per_step"], marker=".", label=name)
    ax.set_title("reward of each trained batch", fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylabel("mean reward of the batch")
    ax.legend(fontsize=7)
    names = list(result["modes"])
    x = np.arange(len(names))
    med = np.asarray([result["modes"][n]["samples_per_s"] for n in names])
    lo = med - np.asarray([min(result["modes"][n]["runs"]["samples_per_s"]) for n in names])
    hi = np.asarray([max(result["modes"][n]["runs"]["samples_per_s"]) for n in names]) - med
    bx.bar(x, med, yerr=[lo, hi], capsize=3)
    bx.set_xticks(x, names, rotation=35, ha="right")
    bx.set_title(f"throughput, median of {result['repeats']} runs (bars: min-max)", fontsize=10)
    bx.set_xlabel("mode")
    bx.set_ylabel("trained samples / s")
    meas = np.asarray([result["modes"][n]["measured_wall_s"] for n in names])
    mlo = meas - np.asarray([min(result["modes"][n]["runs"]["wall_s"]) for n in names])
    mhi = np.asarray([max(result["modes"][n]["runs"]["wall_s"]) for n in names]) - meas
    cx.bar(x - 0.2, meas, 0.4, yerr=[mlo, mhi], capsize=3, label="measured (median, min-max)")
    if result["simulator"] is not None:
        sim = np.asarray([result["modes"][n]["simulated_wall_s"] for n in names])
        cx.bar(x + 0.2, sim, 0.4, label="simulated with this machine's profile")
        for i, (m, s) in enumerate(zip(meas, sim)):
            cx.annotate(f"{s / m - 1:+.0%}", (i + 0.2, s), ha="center", va="bottom", fontsize=7)
    cx.set_xticks(x, names, rotation=35, ha="right")
    cx.set_title("wall time per run, compiling inside it left out: "
                 + ("simulated vs measured" if result["simulator"] is not None else "measured (not simulated)"),
                 fontsize=10)
    cx.set_xlabel("mode")
    cx.set_ylabel("wall seconds of the run")
    cx.legend(fontsize=7, loc="lower right")
    ratio = [result["modes"][n]["decode_steps_per_sample"] / result["modes"][reference(n)]["decode_steps_per_sample"]
             for n in names]
    dx.bar(x, ratio)
    dx.axhline(0.5, color="red", linestyle="--", linewidth=1, label="dora K = 2 target (0.5x)")
    dx.set_xticks(x, names, rotation=35, ha="right")
    dx.set_title("decode batch-steps per trained sample / sync's (same placement)", fontsize=10)
    dx.set_xlabel("mode")
    dx.set_ylabel("ratio to sync")
    dx.legend(fontsize=7)
    fig.suptitle(f"bench modes: {result['steps']} updates of {result['train_batch']} samples per run, "
                 f"{result.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
