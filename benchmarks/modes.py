"""``dora-jax bench modes``: sync, one_step_off and dora at K = 1, 2, 3 on one long-tailed workload.

Every mode trains the same model from the same initial weights, on the same task and seed, for the same number
of samples. The workload is ``longtail``: each prompt carries a length budget (85% short, p50 ~ 8 tokens; 15%
between 128 and 256), and responses run to their budget, so a synchronous batch waits for its longest member
while most slots sit empty. All modes share one engine and one trainer, so compiled functions are shared, and
each timed run follows an identical untimed one that compiles every shape it meets. ``sync`` runs with several
seeds to show the run-to-run noise of the reward curve that the other modes' curves are compared with.

Placement: with two or more devices, every mode runs under ``split`` placement (trainer on device 0, rollout on
device 1; the train step runs while decoding goes on), and ``sync_shared`` adds the colocated synchronous
baseline (trainer and rollout time-sharing device 0). Speed-ups are against the faster of the two sync runs. On
CPU, ``dora-jax bench modes`` asks XLA for two host devices (they share the machine's cores)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import numpy as np

from benchmarks.record import machine
from benchmarks.timing import timed
from dora_jax.config import load_config
from dora_jax.metrics import read_metrics

# The workload: tiny Llama on one device, 32 slots, groups of 4, 16 samples per update, length budgets up to
# 256 tokens (p50 8, 15% between 128 and 256): every batch meets the tail, as in large-batch RL.
TBS = 16
OVERRIDES = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "task.name=longtail", "task.longtail_max_len=256",
             "task.eval_size=0", "rollout.slots=32", "rollout.max_new_tokens=256", "rollout.max_prompt_len=32",
             "train.group_size=4", "train.learning_rate=0.002", "train.max_response_tokens=256",
             "train.length_buckets=[64, 128, 192, 256, 320]", f"dora.train_batch={TBS}", "run.checkpoint_every=0"]
MODES = [("sync", 0), ("one_step_off", 1), ("dora", 1), ("dora", 2), ("dora", 3)]
SPLIT = ["roles.placement=split", "roles.trainer_devices=1", "target.num_devices=2", "roles.rollout_tensor=1"]


def _mode_overrides(mode: str, k: int, tbs: int) -> list[str]:
    rbs = tbs if mode != "dora" else (k + 1) * tbs
    return [f"dora.mode={mode}", f"train.max_staleness={max(k, 1)}", f"dora.rollout_batch={rbs}"]


def bench_modes(config: str = "tiny_llama", steps: int = 8, noise_seeds: int = 3,
                out_dir: str | None = None) -> dict[str, Any]:
    """Runs every mode once (sync ``noise_seeds`` times) and returns per-mode throughput and schedule figures.

    Args:
      config: the model preset (a small one: every mode runs ``steps`` updates of ``TBS`` samples).
      steps: updates per run.
      noise_seeds: sync runs with different rollout seeds, for the reward curve's run-to-run spread.
      out_dir: keep the run directories here (default: a temporary directory).
    """
    from dora_jax.models.weights import load_model
    from dora_jax.run import Placement, Runner
    from dora_jax.sharding import create_mesh

    devices = jax.devices()
    placement = SPLIT if len(devices) >= 2 else []
    base = load_config(config, OVERRIDES + [f"dora.steps={steps}"])
    one = create_mesh(base.mesh, devices[:1])
    model, _ = load_model(base.model, one, base.mesh.logical_axis_rules, seed=base.run.seed, progress=False)
    # One placement per layout, reused by every mode (compiled once); each run starts from the same weights.
    shared = Placement.build(base, model, devices[:1], keep_initial=True)
    split_placement = (Placement.build(load_config(config, OVERRIDES + placement), model, keep_initial=True)
                       if placement else None)
    tmp = out_dir or tempfile.mkdtemp(prefix="dora_bench_modes_")

    def run(name: str, mode: str, k: int, extra: list[str], n_steps: int, split: bool) -> dict[str, Any]:
        cfg = load_config(config, OVERRIDES + [f"dora.steps={n_steps}"] + _mode_overrides(mode, k, TBS) + extra
                          + (placement if split else []))
        run_dir = os.path.join(tmp, name)
        summary = Runner(cfg, run_dir, placement=split_placement if split else shared, progress=False).run()
        rows = read_metrics(run_dir)
        return {"summary": summary, "rows": rows}

    plan = [(mode if mode != "dora" else f"dora_k{k}", mode, k, bool(placement)) for mode, k in MODES]
    if placement:
        plan.insert(1, ("sync_shared", "sync", 0, False))
    results: dict[str, Any] = {}
    for name, mode, k, split in plan:
        # The same run once untimed first: it compiles every shape (prompt and length buckets, decode-group
        # capacities) the timed run meets, so no mode pays for compilation the others do not.
        run(f"warmup_{name}", mode, k, [], steps, split)
        r, bench_s = timed(lambda: run(name, mode, k, [], steps, split))
        s, rows = r["summary"], r["rows"]
        lags = [int(lag) for row in rows for lag, n in row["staleness"].items() for _ in range(n)]
        results[name] = {
            "mode": mode, "placement": s["placement"], "max_staleness": s["max_staleness"], "samples": s["samples"],
            "wall_s": s["wall_s"], "samples_per_s": s["samples_per_s"],
            # Device-independent: decode batch-steps per trained sample and the share of computed rows that
            # were live (what predicts the speed-up where a decode step costs the same at any batch size).
            "decode_steps_per_sample": s["decode_batch_steps_per_sample"], "decode_batch_steps": s["decode_batch_steps"],
            "slot_utilization": s["slot_utilization"],
            "tokens_per_s": sum(row["trained_tokens"] for row in rows) / s["wall_s"],
            "gen_tok_s": s["gen_tok_s"],
            "rollout_share": float(np.mean([row["rollout_share"] for row in rows])),
            "trainer_idle_fraction": s["trainer_idle_fraction"],
            "slot_occupancy": float(np.mean([row["slot_occupancy"] for row in rows])),
            "mean_staleness": float(np.mean(lags)), "max_staleness_seen": int(max(lags)),
            "max_resident_versions": s["max_resident_versions"], "weight_sync_s": s["sync_s"],
            "reward_per_step": [row["reward"] for row in rows], "final_reward": rows[-1]["reward"],
            "len_p50": float(np.median([row["len_p50"] for row in rows])),
            "len_p99": float(max(row["len_p99"] for row in rows)),
            "bench_s": bench_s,
        }
        print(f"{name:>13}: {results[name]['samples_per_s']:.2f} samples/s, "
              f"{results[name]['decode_steps_per_sample']:.2f} decode batch-steps/sample, rollout share "
              f"{results[name]['rollout_share']:.2f}, staleness mean {results[name]['mean_staleness']:.2f} "
              f"max {results[name]['max_staleness_seen']}, final reward {results[name]['final_reward']:.3f}",
              flush=True)
    noise = []
    for seed in range(1, noise_seeds):
        r = run(f"sync_seed{seed}", "sync", 0, [f"rollout.seed={seed}"], steps, bool(placement))
        noise.append([row["reward"] for row in r["rows"]])
    curves = np.asarray([results["sync"]["reward_per_step"]] + noise)
    sync = max(r["samples_per_s"] for r in results.values() if r["mode"] == "sync")
    return {"machine": machine(), "config": config, "steps": steps, "train_batch": TBS, "group_size": 4,
            "devices": len(devices), "placement": "split (trainer device 0, rollout device 1)" if placement else
            "shared (one device)",
            "slots": 32, "workload": "longtail: 85% lognormal p50 8, 15% uniform 128..256 tokens",
            "modes": results, "speedup_vs_sync": {n: r["samples_per_s"] / sync for n, r in results.items()},
            "decode_steps_per_sample_vs_sync": {
                n: r["decode_steps_per_sample"] / results["sync"]["decode_steps_per_sample"] for n, r in results.items()},
            "sync_reward_curves": curves.tolist(),
            "sync_reward_spread": {"mean": curves.mean(0).tolist(), "min": curves.min(0).tolist(),
                                   "max": curves.max(0).tolist()},
            "run_dir": tmp}


def plot_modes(result: dict[str, Any], path: str) -> str:
    """Reward per update of every mode over the band of the sync runs' spread, and each mode's throughput.

    Args:
      result: what :func:`bench_modes` returned.
      path: the PNG to write.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    spread = result["sync_reward_spread"]
    steps = np.arange(1, len(spread["mean"]) + 1)
    ax.fill_between(steps, spread["min"], spread["max"], color="grey", alpha=0.3,
                    label=f"sync, {len(result['sync_reward_curves'])} seeds (min-max)")
    for name, r in result["modes"].items():
        ax.plot(steps, r["reward_per_step"], marker=".", label=name)
    ax.set_xlabel("update")
    ax.set_ylabel("reward of the trained batch")
    ax.legend(fontsize=7)
    names = list(result["modes"])
    bx.bar(names, [result["modes"][n]["samples_per_s"] for n in names])
    bx.set_ylabel("trained samples / s")
    bx.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
