"""What a run checks before it builds anything, and the summary it ends with."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Iterator

import jax

from dora_jax.config import Config
from dora_jax.distributed import gather_decisions
from dora_jax.dora.scheduler import SchedulePolicy
from dora_jax.run.resume import RunStore, truncate_lines
from dora_jax.run.evaluation import RunError

log = logging.getLogger(__name__)


def _refuse_foreign_config(run_dir: str) -> None:
    """A run writes ``config.json`` into its directory: one that is not a run's (a Hugging Face model's, say)
    would be overwritten, so such a directory is refused."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:
            saved = json.loads(f.read())
    except (OSError, ValueError) as e:
        saved = e
    sections = {f.name for f in dataclasses.fields(Config)}
    if not (isinstance(saved, dict) and "model" in saved and "dora" in saved and set(saved) <= sections):
        what = ("a Hugging Face model's" if isinstance(saved, dict) and "architectures" in saved else
                "not a dora-jax run's")
        raise RunError(f"{path} is {what} config.json, which a run would overwrite; choose another --run-dir, "
                       "run.name or run.out_dir")


def check_run_dir(cfg: Config, run_dir: str, store: RunStore) -> None:
    """Refuses, before anything is built or written, a run directory that is a file, holds another program's
    ``config.json``, a finished run, or an unfinished one that this config may not continue.

    Raises:
      RunError: naming the directory, what is there and what to do.
      ResumeError: its checkpoints were written by another configuration (naming the fields that differ).
    """
    existing = os.path.abspath(run_dir)  # the run directory, or the nearest ancestor that exists
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunError(f"run directory {run_dir}: {existing} is a file, not a directory; choose another "
                       "--run-dir, run.name or run.out_dir")
    _refuse_foreign_config(run_dir)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        raise RunError(f"{run_dir} already holds a finished run (summary.json); choose another run.name or "
                       "run.out_dir")
    if not cfg.run.resume and (left := store.leftovers()):
        raise RunError(f"{run_dir} holds an unfinished run ({', '.join(left)}) and run.resume is false: "
                       + ("set run.resume=true to continue it" if store.has_checkpoints() else
                          "it has no checkpoint to continue from (run.resume=true starts it over, with the "
                          "configuration it was started with only)")
                       + ", or choose another run.name or run.out_dir")
    if cfg.run.resume:
        store.check_config()
        store.check_restart()


@contextlib.contextmanager
def no_empty_run_dir(run_dir: str) -> Iterator[None]:
    """Around a run: when it fails, the directories it made for ``run_dir`` (the run directory, and the parents
    made with it) are removed again if no file was written into them, so a run that fails at start-up (a bad
    task file, a setting refused after the directory was made) leaves no empty run directory behind. A directory
    that existed before, or that holds any file, is kept as it is."""
    made, path = [], os.path.abspath(run_dir)
    while not os.path.exists(path):  # deepest first
        made.append(path)
        path = os.path.dirname(path)
    try:
        yield
    except BaseException:
        for path in made:
            if os.path.isdir(path) and not any(files for _, _, files in os.walk(path)):
                shutil.rmtree(path, ignore_errors=True)  # other processes of the run may remove it too
        raise


def advice(cfg: Config) -> list[str]:
    """Settings that run but undo what they were chosen for, each said with what to change (logged at start-up)."""
    t, out = cfg.train, []
    if t.correction == "decoupled" and t.minibatches * t.epochs == 1:
        # Measured: bench convergence, main job, K = 2, 4 seeds x 20 updates, with and without the cap
        # (docs/performance.md).
        out.append("train.correction='decoupled' with one update an iteration (train.minibatches x train.epochs = "
                   "1): the proximal policy is the current one, so the clip never acts and nothing bounds how far "
                   "an update moves from the behaviour policy (train.decoupled_cap only drops the heaviest tokens); "
                   "use train.minibatches >= 2 with train.learning_rate lowered in proportion, or correction "
                   "'none' (clip against the behaviour policy) or 'tis'")
    return out


def check_multiprocess(cfg: Config, placement: Any) -> None:
    """Refuses what a run under several processes does not support, naming the setting."""
    if placement is not None:
        raise RunError(f"Runner(placement=...) with {jax.process_count()} processes (jax.process_count()): build "
                       "the run from the config (each process's rollout engine must be on its own devices)")
    roles, impl = cfg.roles, cfg.rollout.attention_impl
    if roles.rollout_span == "all" and roles.placement != "shared":
        raise RunError(f"roles.rollout_span=all with roles.placement={roles.placement!r}: one engine over every "
                       "process's devices is built on the trainer's devices (shared placement) only; a version "
                       "would have to cross from the trainer's devices to other processes' rollout devices. Use "
                       "roles.placement=shared, or roles.rollout_span=process")
    if roles.elastic_group:
        raise RunError(f"roles.elastic_group under several processes (jax.process_count() = {jax.process_count()}): "
                       "the trainer's mesh spans every process, and no decode program does; lending it would also "
                       "have to be agreed by every process at the same step. Use roles.elastic_group=false")
    if roles.rollout_span == "all" and impl.startswith("pallas"):
        raise RunError(f"rollout.attention_impl={impl!r} with roles.rollout_span=all: the Pallas paged kernels run "
                       "per batch shard on a mesh of one process's devices, not on one that spans processes; set "
                       "rollout.attention_impl=xla")


def check_placement(cfg: Config, placement: Any) -> None:
    """A placement given to a run was built for the same model and initial weights (its trainer, engines and
    initial state are what the run uses, whatever ``cfg`` says; ``roles.versions_per_group`` aside, which does not
    change where anything runs); rollout groups are disjoint device sets of a split placement (under several
    processes, ``roles.rollout_groups`` per process); one version per group (``roles.versions_per_group: 1``) needs
    such groups.

    Raises:
      RunError: naming the setting that differs or cannot work.
    """
    if placement is not None:
        for name in ("model", "run.seed", "mesh", "roles"):
            here, there = (c.run.seed if name == "run.seed" else
                           dataclasses.replace(c.roles, versions_per_group="all") if name == "roles" else
                           getattr(c, name) for c in (cfg, placement.cfg))
            if here != there:
                raise RunError(f"Runner(placement=...): the placement was built for another {name} ({there!r}) "
                               f"than this run's ({here!r}); its model, initial weights and devices are the "
                               "placement's: build one for this config")
    if cfg.roles.versions_per_group == 1 and cfg.roles.placement != "split":
        raise RunError(f"roles.versions_per_group = 1 with roles.placement={cfg.roles.placement!r}: shared placement "
                       "has one rollout group, on the trainer's own devices, which decodes from the trainer's copy "
                       "of every live version; one version per group needs rollout groups of their own: use "
                       "roles.placement=split with roles.rollout_groups >= train.max_staleness + 1, or "
                       "roles.versions_per_group=all")
    if cfg.roles.rollout_groups > 1 and cfg.roles.placement != "split":
        raise RunError(f"roles.rollout_groups = {cfg.roles.rollout_groups}: rollout groups are disjoint device "
                       f"sets of a split placement, not with roles.placement={cfg.roles.placement!r} (every group "
                       "would be the same devices); use roles.placement=split, or roles.rollout_groups=1")


def summarize(runner: Any, before: dict[str, Any], after: dict[str, Any], wall: float, eval_s: float,
              meter: Any) -> dict[str, Any]:
    """The run's ``summary.json``: accuracy before and after (with ``task.eval_every``, every evaluation's as
    ``eval_curve``, ``[version, accuracy]`` pairs), what was trained and filtered, time, residency."""
    cfg, led = runner.cfg, runner.sched.ledger
    counts = led.counts()
    out = {
        "mode": cfg.dora.mode, "max_staleness": runner.policy.bound, "task": runner.task.name,
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "reward_before": before["reward"], "reward_after": after["reward"], "eval_n": before["n"],
        "steps": runner.sched.version, "samples": counts["consumed"], "filtered": counts["filtered"],
        "filtered_reasons": sorted(set(led.filtered_reasons().values()))[:20],
        "wall_s": wall, "eval_s": eval_s, "warmup_s": runner.warmup["seconds"],
        "warmup_programs": runner.warmup["programs"], "train_s": meter.train_total, "checkpoint_s": meter.checkpoint_s,
        "samples_per_s": counts["consumed"] / wall, "gen_tok_s": meter.total_gen / wall,
        "trainer_idle_fraction": 1 - meter.train_total / wall,
        "max_resident_versions": runner.versions.max_resident,
        "max_versions_per_group": runner.versions.max_versions_per_group,
        "placement": "split" if runner.placement.disjoint else "shared", "rollout_groups": len(runner.engines),
        "sync_s": runner.versions.sync_s, "slot_utilization": runner.driver.stats.slot_utilization,
        "decode_batch_steps": runner.driver.stats.batch_steps,
        "decode_batch_steps_per_sample": runner.driver.stats.batch_steps / max(counts["consumed"], 1),
        "config_fingerprint": cfg.fingerprint(), "resumed": runner._resumed is not None,
        "processes": jax.process_count(),
    }
    if cfg.task.eval_every:
        out["eval_curve"] = [list(x) for x in runner.eval_curve]
    if runner.balancing is not None:
        out["balancer"] = runner.balancing.summary()
    if runner.elastic is not None:  # the trainer's devices were busy training, or decoding as the elastic group
        out["elastic"] = runner.elastic.totals()
        out["trainer_devices_idle_fraction"] = 1 - (meter.train_total + out["elastic"]["busy_s"]) / wall
    return out


def agree(multi: bool, what: str, local: Any, where: str) -> Any:
    """``local``, a decision this process took on its own, checked to be every process's (one process: returned
    as is).

    Raises:
      RunError: on every process when some process decided otherwise, naming the decision, where, and process
        0's and the other process's values.
    """
    if not multi:
        return local
    values = gather_decisions(local)
    for p, v in enumerate(values):
        if v != values[0]:
            raise RunError(f"{where}: {what} differs between processes: process 0 has {values[0]!r}, process {p} "
                           f"has {v!r}: the processes' runs diverged (every process must run the same config and "
                           "get the same rewards)")
    return local


def truncate_outputs(run_dir: str, lines: dict[str, int], resumed: bool) -> None:
    """Cuts each output file (``metrics.jsonl``, ``samples.jsonl``) back to the lines the run continues from:
    those written after the checkpoint are redone, and an attempt without a checkpoint starts over."""
    for name, keep in lines.items():
        if dropped := truncate_lines(os.path.join(run_dir, name), keep):
            log.warning("%s: dropped %d lines written after the checkpoint (their updates are redone)" if resumed
                        else "%s: no checkpoint to continue from: the run starts over with the same configuration, "
                        "replacing the %d lines of its earlier attempt", os.path.join(run_dir, name), dropped)


def byte_tokenizer(cfg: Config) -> Any:
    """Byte tokens, for a model whose weights bring no tokenizer (a random init).

    Raises:
      RunError: the vocabulary is too small for byte tokens.
    """
    from dora_jax.tokenizer import ByteTokenizer

    if cfg.model.vocab_size < 256:
        raise RunError(f"model.weights={cfg.model.weights!r} has no tokenizer and vocab_size "
                       f"{cfg.model.vocab_size} < 256 is too small for byte tokens")
    return ByteTokenizer()


def save_ledger(sched: Any, bound: int, run_dir: str, multi: bool, writes: bool) -> None:
    """Checks the finished run's ledger (one state a sample, groups whole, staleness within ``bound``), checks
    that every process holds the same one, and writes ``ledger.json``."""
    sched.ledger.check(bound)
    if multi:
        state = json.dumps(sched.state_dict(), sort_keys=True).encode()
        agree(multi, "the ledger's digest", hashlib.sha256(state).hexdigest(), "at the end of the run")
    if writes:
        with open(os.path.join(run_dir, "ledger.json"), "w") as f:
            json.dump(sched.state_dict(), f)


def schedule_policy(cfg: Config) -> SchedulePolicy:
    """The scheduler's settings of a run: mode, staleness bound, batch sizes, the whole run's samples."""
    d, t = cfg.dora, cfg.train
    return SchedulePolicy(mode=d.mode, max_staleness=t.max_staleness, rollout_batch=d.rollout_batch,
                          train_batch=d.train_batch, group_size=t.group_size, total_samples=d.train_batch * d.steps,
                          refill=t.dynamic_sampling)
