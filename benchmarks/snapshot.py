"""``dora-jax bench snapshot``: how long an asynchronous version snapshot blocks the trainer."""

from __future__ import annotations

from typing import Any

from benchmarks.record import machine
from benchmarks.timing import timed
from benchmarks.train import bench_trainer, synthetic_samples


def bench_snapshot(config: str = "smollm2_135m", rows: int = 8, prompt_len: int = 32, response_len: int = 96,
                   lora_rank: int = 16, baseline_steps: int = 2, snapshot_steps: int = 3, seed: int = 0,
                   directory: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """How long an asynchronous version snapshot blocks the trainer, against the train step's time, and the
    memory each resident version holds; full fine-tuning and LoRA.

    Each mode runs a compiling step, ``baseline_steps`` steps without snapshots, then ``snapshot_steps``
    steps each followed by ``VersionStore.publish`` (copy into the store + Orbax snapshot started). The
    blocked time is ``publish``'s wall time: the copy, the device-to-host transfer, and any wait for the
    previous write; the file writing itself overlaps the next step. The first publish (Orbax set-up) is
    reported apart.

    Args:
      config: a shipped preset or YAML file.
      rows: samples per step (the batch of ``bench train``).
      prompt_len, response_len: tokens of each row's prompt and response.
      lora_rank: the LoRA side's rank.
      baseline_steps: steps timed without snapshots.
      snapshot_steps: steps each followed by a publish.
      seed: the synthetic batch.
      directory: where the snapshots are written (a temporary directory inside it); default the system's.
      overrides: ``key=value`` config overrides.

    Returns:
      Per mode (``full``, ``lora``) step and blocked times, write times, bytes on disk and resident;
      ``lora_vs_full_bytes_per_version`` and ``machine``.
    """
    import statistics
    import tempfile

    import numpy as np
    from tqdm.auto import tqdm

    from dora_jax.config import load_config
    from dora_jax.run.versions import Snapshots, VersionStore

    cfg = load_config(config, overrides)
    rng = np.random.default_rng(seed)
    seq = prompt_len + response_len
    samples = synthetic_samples(rng, rows, prompt_len, response_len, cfg.model.vocab_size)
    out: dict[str, Any] = {"config": config, "rows": rows, "seq_len": seq, "lora_rank": lora_rank,
                           "baseline_steps": baseline_steps, "snapshot_steps": snapshot_steps}
    bar = tqdm(total=2 * (2 + baseline_steps + snapshot_steps), desc="bench snapshot", unit="step")
    for name, rank in (("full", 0), ("lora", lora_rank)):
        run_cfg, trainer, state, batch = bench_trainer(cfg, samples, seq, response_len, rank, max_staleness=1)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            snaps = Snapshots(tmp, fingerprint=run_cfg.fingerprint(), keep_last=2)

            def first_publish():
                store = VersionStore.from_config(run_cfg, base=state.frozen, snapshots=snaps)
                store.publish(0, state.params, step=0)
                return store

            store, first_publish_s = timed(first_publish)
            snaps.wait()

            def step(state):
                def run():  # waits on the metrics, as the trainer does
                    nonlocal state
                    state, metrics = trainer.train_step(state, batch)
                    return metrics

                t = timed(run)[1]
                bar.update()
                return state, t

            state, compile_s = step(state)
            base_times, snap_times, blocked = [], [], []
            for _ in range(baseline_steps):
                state, t = step(state)
                base_times.append(t)
            for i in range(snapshot_steps):
                state, t = step(state)
                snap_times.append(t)
                blocked.append(timed(lambda: store.publish(i + 1, state.params, step=int(state.step)))[1])
            drain_s = timed(snaps.wait)[1]
            # one snapshot from start to committed files, for scale
            write_s = timed(lambda: (snaps.save(10_000, store.stored(store.newest), step=-1), snaps.wait()))[1]
            disk = sum(f.stat().st_size for f in (snaps.path(10_000)).rglob("*") if f.is_file())
            bar.update()
            snaps.close()
        step_s = statistics.median(base_times)
        out[name] = {"compile_and_first_step_s": compile_s, "step_s": step_s,
                     "step_s_with_snapshots": statistics.median(snap_times),
                     "blocked_s": statistics.median(blocked), "blocked_max_s": max(blocked),
                     "blocked_fraction_of_step": statistics.median(blocked) / step_s,
                     "first_publish_s": first_publish_s, "last_write_drain_s": drain_s,
                     "snapshot_write_s": write_s, "snapshot_disk_bytes": disk,
                     "resident_bytes_per_version": store.resident_bytes()[store.newest],
                     "shared_bytes": store.shared_bytes()}
        del trainer, state, batch, store
    bar.close()
    out["lora_vs_full_bytes_per_version"] = (out["lora"]["resident_bytes_per_version"]
                                             / out["full"]["resident_bytes_per_version"])
    out["machine"] = machine()
    return out
