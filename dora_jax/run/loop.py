"""The training run: DORA's scheduler, the rollout side, the trainer and the resident versions in one loop.

One iteration per decode step: dispatch new groups (newest version); admit waiting requests to free slots,
shared between versions by the scheduler; one decode step; scores in; refcounts updated and drained versions
evicted; a train step when the scheduler hands out a batch (whole groups, staleness within K), its version
published when it completes. What to run is the scheduler's decision (:mod:`dora_jax.dora.scheduler`); where it
runs, the :class:`~dora_jax.run.placement.Placement`'s; which versions are resident, the
:class:`~dora_jax.run.residency.Residency`'s (at most K + 1). Under ``split`` placement decoding goes on while
a train step runs. Every ``run.checkpoint_every`` updates a checkpoint is written; a runner created on a
directory with a good one (and ``run.resume``) continues from it. With ``task.eval_every`` a published version's
held-out requests decode beside rollout (:mod:`dora_jax.run.evals`) and its accuracy is written when they are
scored. With ``roles.versions_per_group: 1`` each rollout group holds one version, and the balancer reassigns
groups between versions (:mod:`dora_jax.run.balancing`) after a publish, after a drain, and on imbalance.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import Any

import jax
from tqdm.auto import tqdm

from dora_jax.compiles import COUNTER, compile_count
from dora_jax.config import Config
from dora_jax.distributed import gather_decisions
from dora_jax.dora.scheduler import Scheduler
from dora_jax.metrics import MetricsWriter
from dora_jax.rollout.groups import DriverGroups, VersionGroups
from dora_jax.rollout.stats import RESUMED
from dora_jax.rollout.warmup import warmup
from dora_jax.run.balancing import ElasticLending, GroupBalancing
from dora_jax.run.evals import update_allowed
from dora_jax.run.evaluation import RunError, evaluate
from dora_jax.run.meter import Meter
from dora_jax.run.placement import Placement
from dora_jax.run.preemption import StopSignals
from dora_jax.run.residency import Residency
from dora_jax.run.resume import RunStore, dir_bytes, fsync_file, pack_run_state, tree_bytes, unpack_run_state
from dora_jax.run.rollout import RolloutSide
from dora_jax.run.setup import (advice, agree, byte_tokenizer, check_multiprocess, check_placement, check_run_dir,
                                save_ledger, schedule_policy, summarize, truncate_outputs)
from dora_jax.rollout.sampling import run_filters
from dora_jax.run.training import TrainInFlight, batch_row, build_batch, write_samples
from dora_jax.tasks import Task, load_task
from dora_jax.tokenizer import chat_template_head

log = logging.getLogger(__name__)
RECENT_UPDATES = 100  # Runner.updates keeps this many


class Runner:
    """One training run in ``cfg.dora.mode`` on ``cfg.task``, writing into ``run_dir``.

    Args:
      cfg: the whole config (validated here).
      run_dir: where ``metrics.jsonl``, ``samples.jsonl``, ``ledger.json``, ``summary.json``, ``checkpoints/``
        and ``versions/`` go. If it holds a run checkpoint (and ``cfg.run.resume``), the run continues from the
        newest good one; a checkpoint of another configuration is refused, naming the fields that differ,
        before anything is built.
      model, tokenizer: an already built model (default: ``cfg.model``'s weights or random init) and its
        tokenizer (default: the weights' own; byte tokens for models without one).
      task: default ``load_task(cfg.task)``.
      placement: a :class:`Placement` built earlier (runs that share one share its compiled programs);
        default: built from ``cfg`` over ``devices`` (default: all).
      progress: show a progress bar.

    Under several processes (``jax.distributed``) every process runs the same run, checked to agree; only
    process 0 writes the run directory (docs/scale.md).
    """

    def __init__(self, cfg: Config, run_dir: str, *, model: Any = None, tokenizer: Any = None,
                 task: Task | None = None, placement: Placement | None = None,
                 devices: list[jax.Device] | None = None, progress: bool = True):
        cfg.validate()
        if placement is not None and devices is not None:
            raise RunError("Runner: give devices or a placement, not both (the placement's meshes fix its devices)")
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        for said in advice(cfg):
            log.warning(said)
        self.policy = schedule_policy(cfg)
        self.store = RunStore(run_dir, cfg)
        check_run_dir(cfg, run_dir, self.store)  # before anything is built or written
        self.multi, self.writes = jax.process_count() > 1, jax.process_index() == 0
        if self.multi:
            check_multiprocess(cfg, placement)
            # Also a barrier: no process writes to the run directory before every process has checked it.
            agree(self.multi, "config fingerprint", cfg.fingerprint(), "at startup")
        check_placement(cfg, placement)
        self.task = task if task is not None else load_task(cfg.task)
        self.placement = placement or Placement.build(cfg, model, devices, progress=progress)
        tokenizer = tokenizer or self.placement.tokenizer or byte_tokenizer(cfg)
        self.tokenizer, self.trainer, self.engines = tokenizer, self.placement.trainer, self.placement.engines
        self.state = self.placement.take_state()
        head = chat_template_head(tokenizer) if cfg.rollout.shared_prefix else []  # prefilled once per version
        self.shared_prefix = tuple(head) if 0 < len(head) < self.placement.engine.max_prefill_length else ()
        self.driver = self.placement.drivers(tokenizer.eos_ids, cfg.rollout.overlap, self.shared_prefix,
                                             one_version=cfg.roles.versions_per_group == 1)
        self.sched = Scheduler(self.policy)
        self.rollout = RolloutSide(cfg, self.sched, self.task, tokenizer, self.driver,
                                   cfg.rollout.slots * len(self.engines), spans=self.placement.spans)
        self.versions = Residency(self.policy.bound + 1, self.placement, self.driver)
        # One version per rollout group: the balancer decides which (None: every group holds every version).
        self.balancing = (GroupBalancing(self.driver, self.versions, self.policy.bound + 1, multi=self.multi)
                          if isinstance(self.driver, VersionGroups) else None)
        # The trainer's devices as one more rollout group while the trainer waits (roles.elastic_group).
        self.elastic = (ElasticLending(self.driver, self.versions)
                        if isinstance(self.driver, VersionGroups) and self.driver.elastic is not None else None)
        # The newest updates (step, trained groups and samples, train metrics), for inspection: metrics.jsonl and
        # samples.jsonl hold every one, and a run of thousands of updates must not keep them all in memory.
        self.updates: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_UPDATES)
        self._in_flight: TrainInFlight | None = None
        self._resumed, self._lines = None, {"metrics.jsonl": 0, "samples.jsonl": 0}
        self.disk = {"checkpoint_bytes": 0, "run_dir_bytes": 0}  # as of the newest checkpoint this run wrote
        self._saved_at: int | None = None  # the version of the checkpoint this run last wrote or resumed from
        self.eval_curve: list[list[float]] = []  # [version, held-out accuracy] of every evaluation recorded
        os.makedirs(run_dir, exist_ok=True)  # only now: a start that fails leaves no empty directory
        found = self.store.restore(self.state) if cfg.run.resume else None
        if found is not None:
            self._restore(found)
        else:
            self._publish(0, self.trainer.policy_params(self.state))
        if self.writes:
            self.store.warn_if_short_of_disk(tree_bytes(self.state), tree_bytes(self.versions.params(self.sched.version)),
                                             self.policy.bound)
        self.warmup = self._warm_up()

    @property
    def warms(self) -> bool:
        """Whether the run compiles its rollout programs before the first update (``rollout.warmup``)."""
        on = self.cfg.rollout.warmup
        return jax.default_backend() != "cpu" if on is None else bool(on)

    def _warm_up(self) -> dict[str, Any]:
        """Compiles every program the rollout engines can dispatch before the first update (later compiles are
        logged with their shapes, and counted in each metrics row's ``compiles``)."""
        cfg = self.cfg
        r = cfg.rollout
        filtered = run_filters(r.top_k, r.top_p)
        out = {"programs": 0, "seconds": 0.0, "on": self.warms}
        if not self.warms:
            return out
        drivers = self.driver.drivers if isinstance(self.driver, DriverGroups) else [self.driver]
        one = isinstance(self.driver, VersionGroups)  # a group steps one version, never several fused
        for i, (engine, driver) in enumerate(zip(self.engines, drivers)):
            # The newest version as the engine holds it (at one version per group, the group's own, which the
            # first plan made the newest): the programs are compiled for its devices and layout.
            version = self.driver.serving[i] if one else self.sched.version
            got = warmup(engine, driver.params(version), versions=1 if one else self.policy.bound + 1,
                         filtered=filtered, prefix_tokens=len(self.shared_prefix),
                         progress=self.progress and self.writes)
            out["programs"] += got["programs"]
            out["seconds"] += got["seconds"]
        if self.placement.elastic_engine is not None:  # lent the newest version while the trainer waits
            e = self.placement.elastic_engine
            got = warmup(e, e.prepare_params(self.versions.params(self.sched.version)), versions=1, filtered=filtered,
                         prefix_tokens=len(self.shared_prefix), progress=self.progress and self.writes)
            out["programs"] += got["programs"]
            out["seconds"] += got["seconds"]
        log.info("warm-up: %d rollout programs compiled in %.1f s", out["programs"], out["seconds"])
        return out

    def _holding(self) -> dict[int, int]:
        """What keeps each version resident: its samples not yet trained, and its held-out answers not yet
        decoded (an evaluation during training)."""
        out = self.sched.ledger.outstanding()
        for v, n in self.rollout.pinned().items():
            out[v] = out.get(v, 0) + n
        return out

    def _publish(self, version: int, params: Any) -> None:
        self.versions.count(self._holding())  # versions the batch just trained drained make room
        self.versions.load(version, params, newest=True)
        self.store.snapshot(version, params, self.versions.resident())
        self._balance(f"version {version} published")

    def _balance(self, trigger: str | None = None) -> None:
        """At one version per rollout group: the balancer's plan, when ``trigger`` (a publish, a drain) or an
        imbalance calls for one, applied to the groups (:class:`~dora_jax.run.balancing.GroupBalancing`)."""
        if self.balancing is not None:
            self.balancing.rebalance(self.rollout.waiting_counts(self.versions.__contains__), trigger)

    def _train(self, group_ids: list[int]) -> None:
        """Dispatches one train step on ``group_ids`` (whole groups); :meth:`_complete` publishes its version."""
        led, version = self.sched.ledger, self.sched.version
        in_flight = {str(v): n for v, n in sorted(led.outstanding().items())}
        done = self.rollout.take(group_ids)
        batch = build_batch(self.trainer, done, self.versions.params, self.state)
        if not self.placement.disjoint:
            # Time-sharing: the rollout's device work finishes before the train step takes the devices (on
            # multi-device CPU meshes, overlapping sharded programs have aborted the XLA runtime).
            self.driver.block_until_ready()
        dispatched = time.perf_counter()
        self.state, metrics = self.trainer.train_step(self.state, batch, version)  # asynchronous: futures
        self.sched.trained(group_ids)
        self._lines["samples.jsonl"] += len(done)
        if self.writes:
            write_samples(os.path.join(self.run_dir, "samples.jsonl"), done, version)
        self._in_flight = TrainInFlight(self.sched.version, group_ids, done, metrics,
                                        batch_row(done, version, in_flight), dispatched)

    def _complete(self) -> tuple[dict[str, Any], float] | None:
        """Publishes the in-flight train step's version, waiting for the step to finish; returns its metrics
        row and its time from dispatch (None when no step is in flight)."""
        f = self._in_flight
        if f is None:
            return None
        metrics = {k: float(v) for k, v in jax.device_get(f.metrics).items()}
        train_s, self._in_flight, sync_before = time.perf_counter() - f.dispatched, None, self.versions.sync_s
        if metrics["applied"]:
            self._publish(f.version, self.trainer.policy_params(self.state))
            if self.rollout.evals is not None and self.rollout.evals.due(f.version):
                self.rollout.evals.start(f.version)
        else:  # every update was non-finite: the trainer kept its version, and so does everything else
            self.sched.retract()
            self.rollout.move_waiting(f.version, self.sched.version)
        self.updates.append({"step": f.version, "group_ids": list(f.group_ids),
                             "samples": [[d.sample_id, d.version] for d in f.done], "train": metrics})
        return {**f.row, "train": metrics, "sync_s": self.versions.sync_s - sync_before}, train_s

    def _checkpoint(self, meter: Meter, eval_before: dict[str, Any], eval_s: float) -> str:
        """Saves the run at the current version (records the versions a resume from it needs); returns its path.
        A version this run already saved or resumed from (an update that applied nothing keeps its version)
        keeps that checkpoint."""
        if self.sched.version == self._saved_at:
            return str(self.store.checkpoints.path(self.sched.version))
        t0 = time.perf_counter()
        for name in self._lines:
            fsync_file(os.path.join(self.run_dir, name))
        stats = self.driver.stats
        counters = meter.counters(eval_before=eval_before, eval_s=eval_s, lines=self._lines["metrics.jsonl"],
                                  samples_lines=self._lines["samples.jsonl"], **{k: getattr(stats, k) for k in RESUMED},
                                  max_resident=self.versions.max_resident, evals=self.eval_curve,
                                  max_versions_per_group=self.versions.max_versions_per_group,
                                  balancer=self.balancing.state() if self.balancing is not None else None)
        path = self.store.save(self.sched.version, self.state,
                               pack_run_state(self.sched, self.rollout.done, counters, self.cfg),
                               set(self.sched.live_versions()), self.versions.resident(), self.versions.params)
        secs, self._saved_at = time.perf_counter() - t0, self.sched.version
        meter.checkpointed(secs)
        if self.writes:
            self.disk = {"checkpoint_bytes": dir_bytes(path), "run_dir_bytes": dir_bytes(self.run_dir)}
            log.info("checkpoint %s: %.2f GiB in %.1f s; the run directory holds %.2f GiB", path,
                     self.disk["checkpoint_bytes"] / 2**30, secs, self.disk["run_dir_bytes"] / 2**30)
        return str(path)

    def _restore(self, found: Any) -> None:
        """Continues from a checkpoint: state, scheduler, finished samples as they were; pending and in-flight
        samples queued again on their own versions (restored from their snapshots)."""
        sched, finished, counters = unpack_run_state(self.policy, found.run_state, found.path, self.cfg)
        self.state, self.sched = found.train_state, sched
        params = self.trainer.policy_params(self.state)
        self._publish(sched.version, params)
        for v in sched.live_versions():
            if v != sched.version:
                self.versions.load(v, self.store.restore_version(v, params), newest=False)
        self.rollout.resume(sched, finished)
        self.driver.restore_stats({k: counters[k] for k in RESUMED})
        self.versions.max_resident = max(counters["max_resident"], self.versions.max_resident)
        self.versions.max_versions_per_group = counters.get("max_versions_per_group", 0)  # absent: an older run's
        if self.balancing is not None and counters.get("balancer") is not None:
            self.balancing.restore(counters["balancer"])
        self._resumed, self._saved_at = counters, found.step
        self.eval_curve = [list(x) for x in counters.get("evals", [])]  # evaluations in flight were dropped
        if self.writes:
            self.disk = {"checkpoint_bytes": dir_bytes(found.path), "run_dir_bytes": dir_bytes(self.run_dir)}

    def evaluate(self, version: int | None = None) -> dict[str, float]:
        """Accuracy on the task's held-out set with one resident version (default: the newest), decoded on the
        first rollout group (at one version per group, the first that holds that version, if any)."""
        version = self.sched.version if version is None else version
        group = 0
        if isinstance(self.driver, VersionGroups) and version in self.driver.serving:
            group = self.driver.serving.index(version)
        return evaluate(self.cfg, self.task, self.engines[group], self.tokenizer,
                        self.versions.group_params(version, group), version, self.shared_prefix)

    def run(self) -> dict[str, Any]:
        """Trains ``cfg.dora.steps`` updates (the rest of them when resuming), evaluating before and after;
        returns (and writes) the summary."""
        try:
            return self._run()
        finally:
            self.rollout.close()
            self.store.close()  # snapshot writes in progress finish before the runner lets go

    def _run(self) -> dict[str, Any]:
        cfg, m = self.cfg, self._resumed
        if m is None:
            if self.writes:
                with open(os.path.join(self.run_dir, "config.json"), "w") as f:
                    json.dump(cfg.to_dict(), f, indent=1)
            t_eval = time.perf_counter()
            before = self.evaluate(0)
            m = {"eval_before": before, "eval_s": time.perf_counter() - t_eval, "wall_s": 0.0, "train_s": 0.0,
                 "gen_tokens": 0, "checkpoint_s": 0.0, "lines": 0, "samples_lines": 0}
        before, eval_s = m["eval_before"], m["eval_s"]
        self._lines = {"metrics.jsonl": m["lines"], "samples.jsonl": m["samples_lines"]}
        if self.writes:
            truncate_outputs(self.run_dir, self._lines, resumed=self._resumed is not None)
        writer = MetricsWriter(self.run_dir, step=self.sched.version) if self.writes else None
        bar = tqdm(total=cfg.dora.steps, initial=self.sched.version, desc=f"{cfg.dora.mode} K={self.policy.bound}",
                   unit="update", disable=not self.progress or not self.writes)
        meter = Meter(m)
        if self._resumed is None and cfg.task.eval_every:
            self._record_eval(0, before, eval_s, meter, writer)
        self._compiled = (compile_count(), COUNTER.names())
        preempted = self._loop(lambda done_step: self._record(done_step, meter, before, eval_s, writer, bar),
                               lambda *done: self._record_eval(*done, meter, writer), meter, before, eval_s)
        bar.close()
        if preempted is not None:
            if writer is not None:
                writer.close()
            return preempted
        return self._finish(before, eval_s, meter, writer)

    def _loop(self, record: Any, record_eval: Any, meter: Meter, before: dict[str, Any], eval_s: float
              ) -> dict[str, Any] | None:
        """Runs the loop (module docstring) until the last update is published and the evaluations in flight are
        recorded; returns what a preemption reports (None when the run went to its end)."""
        led, rollout, evals = self.sched.ledger, self.rollout, self.rollout.evals
        loaded = self.versions.__contains__  # a version whose train step is still running is not: its prompts wait
        stop = StopSignals(self.multi)
        with stop:
            while agree(self.multi, "going on", not self.sched.done() or self._in_flight is not None
                        or (evals is not None and evals.busy), f"before update {self.sched.version + 1}"):
                asked = stop.asked()
                if any(gather_decisions(asked)) if self.multi else asked:
                    return self._preempt(stop.signal or "a notice on another process", record, meter, before, eval_s)
                rollout.dispatch()
                self._balance()  # on imbalance only
                meter.decoded(*rollout.step(rollout.admit(loaded)), rollout.slots)
                rollout.collect_rewards()
                for done in evals.finished() if evals is not None else ():
                    record_eval(*done)
                rollout.dispatch()
                if drained := self.versions.evict_drained(self._holding()):
                    self._balance(f"version {', '.join(map(str, drained))} drained")
                # An update waits while it would push a version an evaluation still decodes out of the K + 1.
                if (self._in_flight is None and not self.sched.done()
                        and update_allowed(rollout.pinned(), self.sched.version + 1, self.policy.bound)):
                    batch = agree(self.multi, "the batch to train", self.sched.next_batch(),
                                  f"before update {self.sched.version + 1}")
                    if batch is not None and (self.elastic is None or self.elastic.hand_back()):
                        self._train(batch)
                    elif batch is None and self.elastic is not None:
                        self.elastic.lend()
                # Shared placement completes the step now; split placement once it has finished or rollout is idle.
                nothing_to_decode = self.driver.idle and not rollout.has_waiting(loaded)
                finished = self._in_flight is not None and (not self.placement.disjoint or self._in_flight.ready())
                if self.multi:  # the branches below take decisions: every process must take the same one
                    votes = gather_decisions([nothing_to_decode, finished])
                    nothing_to_decode, finished = all(v[0] for v in votes), all(v[1] for v in votes)
                if (finished or nothing_to_decode) and (done_step := self._complete()) is not None:
                    record(done_step)
                elif nothing_to_decode and self._in_flight is None:
                    if rollout.rewards.outstanding:
                        rollout.collect_rewards(wait_s=0.05)
                    elif not rollout.dispatch() and not led.count("finished") and not self.sched.done():
                        raise RunError(f"no progress possible at version {self.sched.version}: ledger {led.counts()}")
        return None

    def _finish(self, before: dict[str, Any], eval_s: float, meter: Meter, writer: MetricsWriter | None
                ) -> dict[str, Any]:
        """Checks and saves the ledger, evaluates the last version, writes the summary and returns it."""
        wall = time.perf_counter() - meter.t0
        save_ledger(self.sched, self.policy.bound, self.run_dir, self.multi, self.writes)
        t_eval = time.perf_counter()
        after = self.evaluate()
        secs = time.perf_counter() - t_eval
        if self.cfg.task.eval_every:
            self._record_eval(self.sched.version, after, secs, meter, writer)
        if writer is not None:
            writer.close()
        summary = summarize(self, before, after, wall, eval_s + secs, meter)
        if self.writes:
            summary.update(run_dir_bytes=dir_bytes(self.run_dir), checkpoint_bytes=self.disk["checkpoint_bytes"])
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
            log.info("the run directory %s holds %.2f GiB", self.run_dir, summary["run_dir_bytes"] / 2**30)
        return summary

    def _record_eval(self, version: int, result: dict[str, Any], secs: float, meter: Meter,
                     writer: MetricsWriter | None) -> None:
        """Writes the metrics row of an evaluation of ``version`` (``secs``: from its start to its result) and
        adds its accuracy to the run's curve (the summary's ``eval_curve``)."""
        self.eval_curve.append([version, result["accuracy"]])
        self._lines["metrics.jsonl"] += 1
        if writer is not None:
            writer.write({"step": version, "version": version, "eval": result, "eval_s": secs,
                          "wall_s": time.perf_counter() - meter.t0})
        log.info("held-out accuracy of version %d: %.3f (pass@%d %.3f, reward %.3f, %d answers)", version,
                 result["accuracy"], result["k"], result["pass_at_k"], result["reward"], result["n"])

    def _record(self, done_step: tuple[dict[str, Any], float], meter: Meter, before: dict[str, Any], eval_s: float,
                writer: MetricsWriter | None, bar: Any) -> None:
        """Writes the metrics row of the update that just completed, then its checkpoint when one is due."""
        row, train_s = done_step
        row = meter.update(row, train_s)
        (seen, seen_names), self._compiled = self._compiled, (compile_count(), COUNTER.names())
        compiled, names = self._compiled
        if (compiled - seen).compiles and self.sched.version > 1 and self.warms:
            log.warning("compiled during update %d: %s", self.sched.version,
                        ", ".join(f"{k} x{v}" for k, v in (names - seen_names).items()))
        row.update(step=self.sched.version, version=self.sched.version, filtered=self.sched.ledger.count("filtered"),
                   resident_versions=len(self.versions.resident()), slot_utilization=self.driver.stats.slot_utilization,
                   max_versions_per_group=self.versions.max_versions_per_group,
                   compiles=(compiled - seen).compiles, compile_cache_loads=(compiled - seen).cache_loads,
                   **self.disk)  # as of the newest checkpoint
        if self.balancing is not None:
            row["balancer"] = self.balancing.report()
        if self.elastic is not None:
            row["elastic"] = self.elastic.report()
        if writer is not None:
            writer.write(row)
        self._lines["metrics.jsonl"] += 1
        if self.store.due(self.sched.version) and row["train"]["applied"]:
            self._checkpoint(meter, before, eval_s)
        bar.set_postfix(reward=f"{row['reward']:.2f}", acc=f"{row['accuracy']:.2f}",
                        lag=f"{row['staleness_mean']:.1f}", gen=f"{row['gen_tok_s']:.0f}tok/s")
        bar.update(1)

    def _preempt(self, signal_name: str, record: Any, meter: Meter, before: dict[str, Any],
                 eval_s: float) -> dict[str, Any]:
        """Stops on a preemption notice: the train step in flight completes (its row is written), then the run
        is checkpointed at its version. Returns what the caller reports (no summary: the run is not over)."""
        if self._in_flight is not None:
            record(self._complete())
        t0 = time.perf_counter()
        path = self._checkpoint(meter, before, eval_s)
        out = {"preempted": True, "signal": signal_name, "step": self.sched.version, "checkpoint": path,
               "checkpoint_s": time.perf_counter() - t0}
        log.warning("stopped on %s at update %d of %d: checkpoint %s (%.1f s); the same command continues the run",
                    signal_name, self.sched.version, self.cfg.dora.steps, path, out["checkpoint_s"])
        return out
