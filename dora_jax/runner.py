"""The training run: scheduler, rollout engine, rewards and trainer in one process.

The loop, one iteration per decode step::

    dispatch   new groups from the scheduler, on the newest version (tokenized prompts wait per version)
    admit      free decode slots shared between versions in proportion to their waiting work
    decode     one step of every version's decode group; finished trajectories go to the reward pool
    rewards    finished rewards move samples to ``finished`` (or ``filtered`` with the reason)
    dispatch   again, so that in ``one_step_off`` the next batch starts on the version being trained
    train      when the scheduler hands out a batch (whole groups, staleness within K): one train step,
               the new version is published to the rollout side, drained versions are dropped

Where the work runs is ``roles.placement``. Under ``shared`` rollout and trainer time-share one device set:
a train step runs to completion between two decode steps. Under ``split`` the trainer has its own devices and
the rollout engine its own: a train step is dispatched asynchronously and decoding goes on while it runs; when
it completes, the new version's weights move to the rollout devices device to device (timed as ``sync_s``)
and the version is loaded. Until then its new prompts wait, and the older versions keep the slots busy. At
most one train step is in flight. The trainer never waits for a batch's slowest member in ``dora`` mode: new
prompts keep the decode slots full on the newest version while the old versions' long trajectories finish,
and a batch trains as soon as it is ready.

Every decision about *what* to run is the scheduler's (:mod:`dora_jax.scheduler`), and every sample's state
is in its ledger; the runner only executes them and measures.

Every ``run.checkpoint_every`` updates (after the train step and the publish) the runner writes a run
checkpoint: the train state, the scheduler with its ledger, every finished-but-unconsumed sample as it is, the
metrics position and the seeds; every published version is snapshotted in the background. A runner created
on a directory that holds a good checkpoint (and ``run.resume``) continues from it: samples that were pending
or in flight are regenerated on their own version, whose params come back from its snapshot
(:mod:`dora_jax.resume`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import deque
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from dora_jax.config import Config
from dora_jax.distributed import gather_decisions
from dora_jax.metrics import MetricsWriter
from dora_jax.resume import Finished, RunStore, fsync_file, pack_run_state, truncate_lines, unpack_run_state
from dora_jax.rewards import RewardPool
from dora_jax.rollout.driver import DriverGroups, Request, RolloutDriver, Trajectory
from dora_jax.rollout.engine import Engine, RequestSampling, bucket
from dora_jax.scheduler import SchedulePolicy, Scheduler
from dora_jax.tasks import Item, Score, Task, load_task
from dora_jax.tokenizer import chat_template_head
from dora_jax.sharding import reshard
from dora_jax.trainer import Sample, Trainer, make_batch

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run that cannot continue: the message names what and where."""


def _percentile(xs: list[int], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def _device_set(mesh: Any) -> frozenset[Any] | None:
    return None if mesh is None else frozenset(mesh.devices.flat)


class _NoWriter:
    """The metrics writer of a process other than process 0: only process 0 writes the run directory."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class _TrainInFlight:
    """A dispatched train step: its outputs are futures until the step completes."""

    version: int  # the version the step produces
    group_ids: list[int]
    done: list[Finished]
    metrics: Any  # device arrays
    row: dict[str, Any]  # everything about the batch known at dispatch
    dispatched: float


def make_engine(cfg: Config, model: Any, mesh: Any = None) -> Engine:
    """The rollout engine a run of ``cfg`` uses: ``rollout.slots`` slots, room for the longest prompt plus
    ``rollout.max_new_tokens``, decoding in ``rollout.dtype`` with the rollout section's decode settings."""
    from dora_jax.models.decoder import DecodeSettings

    r = cfg.rollout
    target = min(bucket(r.max_prompt_len + r.max_new_tokens), cfg.model.max_seq_len)
    return Engine(model, max_concurrent_decodes=r.slots, max_prefill_length=r.max_prompt_len,
                  max_target_length=target, mesh=mesh, dtype=r.dtype, settings=DecodeSettings.of(r))


def make_parts(cfg: Config, model: Any) -> tuple[Trainer, Any, Engine]:
    """``(trainer, initial state, engine)`` on the devices ``cfg.roles`` gives each (``model`` on the trainer's
    mesh), for runs that share compiled functions (``Runner(parts=...)``)."""
    from dora_jax.sharding import role_meshes

    meshes = role_meshes(cfg.mesh, cfg.roles)
    trainer, state = Trainer.create(cfg, model=model, mesh=meshes.trainer)
    return trainer, state, make_engine(cfg, model, meshes.rollout[0])


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


class Runner:
    """One training run in ``cfg.dora.mode`` on ``cfg.task``, writing into ``run_dir``.

    Args:
      cfg: the whole config (validated here).
      run_dir: where ``metrics.jsonl``, ``samples.jsonl``, ``ledger.json``, ``summary.json``,
        ``checkpoints/`` and ``versions/`` go. If it holds a run checkpoint (and ``cfg.run.resume``), the
        run continues from the newest good one; a checkpoint of another configuration is refused with a
        :class:`~dora_jax.resume.ResumeError` naming the fields that differ, before anything is built.
      model, tokenizer: an already built model (default: ``cfg.model``'s weights or random init) and its
        tokenizer (default: the weights' own; a :class:`~dora_jax.tokenizer.ByteTokenizer` for models
        without one).
      task: default ``load_task(cfg.task)``.
      keep_versions: keep every published version's params in ``self.versions_seen`` (tests recompute each
        trajectory's log-probs on its own version with them).
      progress: show a progress bar.
      parts: ``(trainer, initial_state, engine)`` built earlier for the same model and config shapes: runs
        that share them share compiled functions (benchmarks compare modes without recompiling). The state is
        donated by the first train step: pass a copy. An engine on other devices than the trainer's mesh
        makes the run ``split`` (see :func:`make_parts`).
      devices: the devices ``cfg.mesh`` and ``cfg.roles`` are laid out over (default: all); not with ``parts``.

    Under several processes (``jax.distributed``, ``jax.process_count() > 1``) every process runs the same
    run: the trainer on one mesh over every process's devices, a rollout engine on each process's own
    devices generating that process's share of the groups, in lockstep, the finished samples shared after
    every decode step; the batch to train and when to stop are checked to be the same on every process,
    and only process 0 writes the run directory's files. Run checkpoints and version snapshots are written
    by every process together (Orbax: each writes its shards of the trainer's arrays, process 0 commits),
    and a resume restores onto the same global mesh (docs/scale.md).
    """

    def __init__(self, cfg: Config, run_dir: str, *, model: Any = None, tokenizer: Any = None,
                 task: Task | None = None, keep_versions: bool = False, progress: bool = True,
                 parts: tuple[Trainer, Any, Engine] | None = None, devices: list[jax.Device] | None = None):
        from dora_jax.models.build import abstract_model, state_shardings
        from dora_jax.models.weights import load_model
        from dora_jax.sharding import ProcessLocalCopy, process_meshes, role_meshes, rollout_mesh_config
        from dora_jax.tokenizer import ByteTokenizer

        cfg.validate()
        if parts is not None and devices is not None:
            raise RunError("Runner: give devices or parts, not both (the parts' meshes fix their devices)")
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
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
        d, t = cfg.dora, cfg.train
        self.policy = SchedulePolicy(mode=d.mode, max_staleness=t.max_staleness, rollout_batch=d.rollout_batch,
                                     train_batch=d.train_batch, group_size=t.group_size,
                                     total_samples=d.train_batch * d.steps)
        self.store = RunStore(run_dir, cfg, self.policy.bound)
        if not cfg.run.resume and (left := self.store.leftovers()):  # refused before anything is built or written
            raise RunError(f"{run_dir} holds an unfinished run ({', '.join(left)}) and run.resume is false: "
                           + ("set run.resume=true to continue it" if self.store.has_checkpoints() else
                              "it has no checkpoint to continue from (run.resume=true starts it over, with the "
                              "configuration it was started with only)")
                           + ", or choose another run.name or run.out_dir")
        if cfg.run.resume:
            self.store.check_config()
            self.store.check_restart()
        # Several processes: every process runs this same run; only process 0 writes the run directory.
        self.multi, self.writes = jax.process_count() > 1, jax.process_index() == 0
        self.rank, self.nproc = jax.process_index(), jax.process_count()
        self.generated = 0  # trajectories this process's engine generated (its share under several processes)
        if self.multi:
            self._check_multiprocess(parts)
            # Also a barrier: no process writes to the run directory before every process has checked it.
            self._agree("config fingerprint", cfg.fingerprint(), "at startup")
        os.makedirs(run_dir, exist_ok=True)
        self.task = task if task is not None else load_task(cfg.task)
        if cfg.roles.rollout_groups > 1 and (cfg.roles.placement != "split" or self.multi or parts is not None):
            why = ("several processes (each decodes its own share on its own devices)" if self.multi else
                   "Runner(parts=...) (the parts hold one engine)" if parts is not None else
                   f"roles.placement={cfg.roles.placement!r} (every group would be the same devices)")
            raise RunError(f"roles.rollout_groups = {cfg.roles.rollout_groups}: rollout groups are disjoint device "
                           f"sets of a split placement, not with {why}; use roles.placement=split, or "
                           "roles.rollout_groups=1")
        meshes = role_meshes(cfg.mesh, cfg.roles, devices) if parts is None else None
        mesh = meshes.trainer if meshes is not None else parts[0].mesh
        if model is None:
            model, tokenizer = load_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=cfg.run.seed,
                                          progress=progress)
        if tokenizer is None:
            if cfg.model.vocab_size < 256:
                raise RunError(f"model.weights={cfg.model.weights!r} has no tokenizer and vocab_size "
                               f"{cfg.model.vocab_size} < 256 is too small for byte tokens")
            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer
        r = cfg.rollout
        if parts is not None:
            self.trainer, self.state, self.engine = parts
        else:
            self.trainer, self.state = Trainer.create(cfg, model=model, mesh=mesh)
            # Several processes: each decodes on its own devices (decode programs never span processes).
            local_meshes = process_meshes(rollout_mesh_config(cfg.roles), devices) if self.multi else None
            rollout_mesh = local_meshes[jax.process_index()] if self.multi else meshes.rollout[0]
            self.engine = make_engine(cfg, model, rollout_mesh)
        # roles.rollout_groups > 1 (split only): one engine per group, each on its own devices.
        self.engines = [self.engine] + ([make_engine(cfg, model, m) for m in meshes.rollout[1:]]
                                        if parts is None and not self.multi else [])
        # Split placement: the rollout engine's devices are not the trainer's; versions move between them.
        self.split = (not self.multi and _device_set(self.engine.mesh) is not None
                      and _device_set(self.engine.mesh) != _device_set(self.trainer.mesh))
        self._group_shardings = [state_shardings(abstract_model(cfg.model)[1], e.mesh, cfg.mesh.logical_axis_rules)
                                 for e in self.engines] if self.split or self.multi else None
        self._rollout_shardings = self._group_shardings[0] if self._group_shardings else None
        # Several processes: each new version goes from the trainer's mesh to every process's own copy.
        self._to_local = ProcessLocalCopy(self._rollout_shardings, local_meshes) if self.multi else None
        self._in_flight: _TrainInFlight | None = None
        self.sync_s = 0.0  # trainer -> rollout weight transfers, in total
        self.sampling = RequestSampling(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
        # The template's head, prefilled once per version, when it leaves room for a prompt after it.
        head = chat_template_head(tokenizer) if r.shared_prefix else []
        self.shared_prefix = tuple(head) if 0 < len(head) < self.engine.max_prefill_length else ()
        drivers = [RolloutDriver(e, eos_ids=tokenizer.eos_ids, overlap=r.overlap, shared_prefix=self.shared_prefix)
                   for e in self.engines]
        self.driver = drivers[0] if len(drivers) == 1 else DriverGroups(drivers)
        self.slots = r.slots * len(drivers)  # decode slots of every group together
        self.sched = Scheduler(self.policy)
        self.rewards = RewardPool(cfg.task.reward_workers, cfg.task.reward_timeout_s)
        self.keep_versions = keep_versions
        self.versions_seen: dict[int, Any] = {}
        self.updates: list[dict[str, Any]] = []  # per update: step, trained groups and samples, train metrics
        self._params: dict[int, Any] = {}  # resident versions on the trainer's devices (recompute, snapshots)
        self._rollout_params: dict[int, Any] = {}  # the same versions on the rollout devices
        self._waiting: dict[int, deque[Request]] = {}
        self._items: dict[int, tuple[int, Item]] = {}  # sample id -> (group id, item)
        self._done: dict[int, Finished] = {}
        self.max_resident = 1
        self._resumed: dict[str, Any] | None = None  # the checkpoint's metrics position, when resuming
        self._metrics_lines = self._sample_lines = 0
        found = self.store.restore(self.state) if cfg.run.resume else None
        if found is not None:
            self._restore(found)
        else:
            self._publish(0, self.trainer.policy_params(self.state))

    # -- versions -------------------------------------------------------------------------------------------

    def _publish(self, version: int, params: Any) -> None:
        self._add_version(version, params)
        self.store.snapshot(version, params, set(self._params))

    def _add_version(self, version: int, params: Any) -> None:
        """Makes ``params`` (on the trainer's devices) a resident version on the rollout side."""
        self._params[version] = params
        rollout = params
        copies = None
        if self.split:  # device to device, never through the host; one copy per rollout group
            copies = []
            for shardings in self._group_shardings:
                copy, secs = reshard(params, shardings)
                copies.append(copy)
                self.sync_s += secs
            rollout = copies[0]
        elif self._to_local is not None:  # several processes: this process's copy, device to device
            rollout, secs = self._to_local(params)
            self.sync_s += secs
        self._rollout_params[version] = rollout  # the first group's copy (evaluation decodes there)
        self.driver.add_version(version, copies if isinstance(self.driver, DriverGroups) else rollout)
        if self.keep_versions:
            self.versions_seen[version] = params

    def _drop_drained(self) -> None:
        live = set(self.sched.live_versions())
        for v in list(self._params):
            if v not in live and not self._waiting.get(v) and not self.driver.in_flight().get(v):
                self.driver.remove_version(v)
                del self._params[v], self._rollout_params[v]

    # -- rollout side ---------------------------------------------------------------------------------------

    def _prompt_ids(self, item: Item) -> list[int]:
        messages = [{"role": "user", "content": item.prompt}]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def _dispatch(self) -> int:
        """Tokenizes newly dispatched groups into per-version waiting queues; returns how many groups."""
        led, r = self.sched.ledger, self.cfg.rollout
        groups = self.sched.dispatch()
        for g in groups:
            item = self.task.train_item(g.prompt_index)
            ids = self._prompt_ids(item)
            if len(ids) > r.max_prompt_len:
                led.filter(g.sample_ids[0], f"prompt {g.prompt_index} has {len(ids)} tokens > "
                                            f"rollout.max_prompt_len {r.max_prompt_len}")
                for sid in g.sample_ids[1:]:
                    led.filter(sid, f"group member {g.sample_ids[0]} filtered")
                continue
            for sid in g.sample_ids:
                self._items[sid] = (g.group_id, item)
                if self._mine(g.group_id):
                    self._enqueue(sid, g.version, ids, item)
        return len(groups)

    def _mine(self, group_id: int) -> bool:
        """Whether this process generates the group: under several processes each generates every
        ``nproc``-th group (strided, so long-tailed prompts spread evenly) and the finished samples are shared."""
        return not self.multi or group_id % self.nproc == self.rank

    def _enqueue(self, sample_id: int, version: int, prompt_ids: list[int], item: Item) -> None:
        r = self.cfg.rollout
        budget = min(item.max_new_tokens or r.max_new_tokens, r.max_new_tokens)
        self._waiting.setdefault(version, deque()).append(
            Request(sample_id, tuple(prompt_ids), version=version, max_new_tokens=budget, sampling=self.sampling))

    def _admit(self) -> list[int]:
        """Submits waiting requests to free slots; returns their sample ids (the ledger records them as
        started once every process's are known, :meth:`_rollout_step`)."""
        busy = sum(self.driver.in_flight().values())
        # A version whose train step is still running is not loaded yet: its prompts wait.
        waiting = {v: len(q) for v, q in self._waiting.items() if q and v in self._params}
        started = []
        for v, n in self.sched.assign_slots(self.slots - busy, waiting).items():
            for _ in range(n):
                req = self._waiting[v].popleft()
                self.driver.submit(req)
                started.append(req.sample_id)
        return started

    def _rollout_step(self, started: list[int]) -> tuple[bool, float, int]:
        """One decode step of this process's engine (if it has work), then the ledger and rewards take the
        started and finished samples: this process's, or under several processes every process's, shared
        with one all-gather and applied in sample-id order so that every ledger stays the same. Returns whether
        this process decoded, the seconds it took and the rows decoded."""
        finished: list[Trajectory] = []
        secs = rows = 0
        stepped = not self.driver.idle
        if stepped:
            ts, before_rows = time.perf_counter(), self.driver.rows_live
            finished = self.driver.step()
            secs, rows = time.perf_counter() - ts, self.driver.rows_live - before_rows
            self.generated += len(finished)
        if self.multi:
            everyone = gather_decisions({"started": started, "finished": [dataclasses.asdict(t) for t in finished]})
            started = sorted(sid for e in everyone for sid in e["started"])
            finished = sorted((Trajectory(**d) for e in everyone for d in e["finished"]), key=lambda t: t.sample_id)
        for sid in started:
            self.sched.ledger.start(sid)
        for traj in finished:
            self._on_finished(traj)
        return stepped, secs, rows

    def _score(self, item: Item, text: str) -> tuple[float, bool]:
        s = self.task.score(item, text)
        return s.reward, s.correct

    def _on_finished(self, traj: Trajectory) -> None:
        group_id, item = self._items[traj.sample_id]
        text = self.tokenizer.decode(traj.tokens, skip_special_tokens=True)
        self._done[traj.sample_id] = Finished(traj, group_id, item, text)
        self.rewards.submit(traj.sample_id, self._score, item, text)

    def _collect_rewards(self, wait_s: float = 0.0) -> None:
        led = self.sched.ledger
        results = self.rewards.poll(wait_s)
        if self.multi:
            # Every process takes the scheduler's next decision on the same ledger: no result may still be
            # on its way on one process and in on another.
            while self.rewards.outstanding:
                results += self.rewards.poll(0.05)
            results.sort(key=lambda res: res.key)
        for res in results:
            if res.error:
                led.filter(res.key, res.error)
                if led.count("filtered") > 4 * self.policy.total_samples + 64:
                    reasons = collections.Counter(led.filtered_reasons().values()).most_common(3)
                    raise RunError(f"{led.count('filtered')} samples filtered and {led.count('consumed')} "
                                   f"trained: the reward function fails on nearly everything. Most common "
                                   f"reasons: {reasons}")
            else:
                d = self._done[res.key]
                d.reward, d.correct = res.reward, res.correct
                led.finish(res.key)
            group = led.groups[led.entries[res.key].group_id]
            for sid in group.sample_ids:  # a filtered group's trajectories are never trained: let them go
                if led.entries[sid].state == "filtered":
                    self._done.pop(sid, None)

    # -- trainer side ---------------------------------------------------------------------------------------

    def _train(self, group_ids: list[int]) -> None:
        """Dispatches one train step on ``group_ids`` (whole groups); :meth:`_complete` publishes its version."""
        led, t = self.sched.ledger, self.cfg.train
        in_flight = {str(v): n for v, n in sorted(led.outstanding().items())}
        done = [self._done[s] for g in group_ids for s in led.groups[g].sample_ids]
        samples = [Sample.from_trajectory(d.traj, d.group_id, d.reward) for d in done]
        batch = make_batch(samples, group_size=t.group_size, length_buckets=t.length_buckets,
                           row_multiple=self.trainer.row_multiple)
        batch = self.trainer.put(batch)
        if t.behaviour_logprobs == "recompute" or t.correction == "decoupled":
            batch = self.trainer.with_recomputed_behaviour(batch, self._params)
        if t.kl_coef > 0:
            batch = self.trainer.with_reference(self.state, batch)
        version = self.sched.version
        if not self.split:
            # Time-sharing: the rollout's in-flight device work finishes before the train step takes the
            # devices (on multi-device CPU meshes, overlapping sharded programs have aborted the XLA runtime).
            self.driver.block_until_ready()
        dispatched = time.perf_counter()
        self.state, metrics = self.trainer.train_step(self.state, batch)  # asynchronous: futures until done
        lags: dict[str, int] = {}
        for d in done:
            lag = str(version - d.traj.version)
            lags[lag] = lags.get(lag, 0) + 1
        self.sched.trained(group_ids)
        lengths = [len(d.traj.tokens) for d in done]
        self._sample_lines += len(done)
        if self.writes:  # only process 0 writes the run directory
            with open(os.path.join(self.run_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
                for d in done:
                    f.write(json.dumps({"sample_id": d.traj.sample_id, "group_id": d.group_id,
                                        "version": d.traj.version, "trained_at": version, "reward": d.reward,
                                        "correct": d.correct, "prompt_ids": d.traj.prompt_ids,
                                        "tokens": d.traj.tokens, "logprobs": d.traj.logprobs,
                                        "finish_reason": d.traj.finish_reason, "text": d.text}) + "\n")
        for d in done:
            del self._done[d.traj.sample_id]
        row = {"reward": float(np.mean([d.reward for d in done])),
               "accuracy": float(np.mean([d.correct for d in done])),
               "len_mean": float(np.mean(lengths)), "len_p50": _percentile(lengths, 50),
               "len_p99": _percentile(lengths, 99), "len_max": int(max(lengths)),
               "trained_tokens": int(sum(len(d.traj.tokens) + len(d.traj.prompt_ids) for d in done)),
               "staleness": lags, "staleness_mean": float(np.mean([int(k) for k, n in lags.items() for _ in range(n)])),
               "staleness_max": max(int(k) for k in lags), "in_flight": in_flight}
        self._in_flight = _TrainInFlight(self.sched.version, group_ids, done, metrics, row, dispatched)

    def _complete(self, wait: bool) -> tuple[dict[str, Any], float] | None:
        """Publishes the in-flight train step's version once the step has finished (``wait``: blocks for it).

        Returns its metrics row and how long the step took from dispatch, or None when nothing finished."""
        f = self._in_flight
        if f is None or (not wait and not all(x.is_ready() for x in jax.tree.leaves(f.metrics))):
            return None
        metrics = {k: float(v) for k, v in jax.device_get(f.metrics).items()}
        train_s = time.perf_counter() - f.dispatched
        self._in_flight = None
        sync_before = self.sync_s
        self._publish(f.version, self.trainer.policy_params(self.state))
        self.updates.append({"step": f.version, "group_ids": list(f.group_ids),
                             "samples": [[d.traj.sample_id, d.traj.version] for d in f.done], "train": metrics})
        return {**f.row, "train": metrics, "sync_s": self.sync_s - sync_before}, train_s

    # -- several processes ----------------------------------------------------------------------------------

    def _check_multiprocess(self, parts: Any) -> None:
        """Refuses what a run under several processes does not support yet, naming the setting."""
        cfg, n = self.cfg, jax.process_count()
        where = f"with {n} processes (jax.process_count())"
        if cfg.roles.placement != "shared":
            raise RunError(f"roles.placement = {cfg.roles.placement!r}: {where} the trainer uses every process's "
                           "devices and each process decodes on its own (time-sharing); use roles.placement=shared")
        t = cfg.train
        if t.behaviour_logprobs == "recompute" or t.correction == "decoupled":
            raise RunError(f"train.behaviour_logprobs = {t.behaviour_logprobs!r}, train.correction = {t.correction!r}: "
                           f"recomputed behaviour log-probs are not supported {where} yet; use "
                           "train.behaviour_logprobs=engine and a correction other than decoupled")
        if parts is not None:
            raise RunError(f"Runner(parts=...) {where}: build the run from the config (each process's rollout "
                           "engine must be on its own devices)")

    def _agree(self, what: str, local: Any, where: str) -> Any:
        """``local``, a decision this process took on its own, checked to be every process's (several processes
        only: with one process it is returned as is).

        Raises:
          RunError: on every process when some process decided otherwise, naming the decision, where, and
            process 0's and the other process's values.
        """
        if not self.multi:
            return local
        values = gather_decisions(local)
        for p, v in enumerate(values):
            if v != values[0]:
                raise RunError(f"{where}: {what} differs between processes: process 0 has {values[0]!r}, "
                               f"process {p} has {v!r}: the processes' runs diverged (every process must run the "
                               "same config and get the same rewards)")
        return local

    # -- checkpoints and resume ------------------------------------------------------------------------------

    def _checkpoint(self, counters: dict[str, Any]) -> None:
        """Saves the run at the current version: train state, scheduler and ledger, finished-unconsumed
        samples, metrics position, seeds; records the versions a resume from it needs."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            fsync_file(os.path.join(self.run_dir, name))
        metrics = {**counters, "lines": self._metrics_lines, "samples_lines": self._sample_lines,
                   "rows_computed": self.driver.rows_computed, "rows_live": self.driver.rows_live,
                   "max_resident": self.max_resident}
        self.store.save(self.sched.version, self.state, pack_run_state(self.sched, self._done, metrics, self.cfg),
                        set(self.sched.live_versions()))

    def _restore(self, found: Any) -> None:
        """Continues from a restored checkpoint: state, scheduler, finished samples as they were; pending and
        in-flight samples queued again on their own versions (restored from their snapshots)."""
        sched, finished, metrics = unpack_run_state(self.policy, found.run_state, found.path, self.cfg)
        self.state, self.sched = found.train_state, sched
        for f in finished:
            self._done[f.traj.sample_id] = f
            self._items[f.traj.sample_id] = (f.group_id, f.item)
        params = self.trainer.policy_params(self.state)
        self._publish(sched.version, params)
        for v in sched.live_versions():
            if v != sched.version:
                self._add_version(v, self.store.restore_version(v, params))
        led, prompts = sched.ledger, {}
        for sid in sorted(s for s, e in led.entries.items() if e.state == "pending"):
            e = led.entries[sid]
            if e.group_id not in prompts:
                item = self.task.train_item(e.prompt_index)
                prompts[e.group_id] = (item, self._prompt_ids(item))
            item, ids = prompts[e.group_id]
            self._items[sid] = (e.group_id, item)
            if self._mine(e.group_id):
                self._enqueue(sid, e.version, ids, item)
        self.driver.rows_computed, self.driver.rows_live = metrics["rows_computed"], metrics["rows_live"]
        self.max_resident = max(metrics["max_resident"], len(self._params))
        self._resumed = metrics

    # -- evaluation -----------------------------------------------------------------------------------------

    def evaluate(self, version: int | None = None) -> dict[str, float]:
        """Accuracy on the task's held-out set with one version's params (default: the newest).

        ``task.eval_samples`` answers per question at ``task.eval_temperature`` (0: greedy). The sampling
        stream is a function of the question's position only, so evaluations of two versions see the same
        random numbers and their difference is not blurred by sampling noise.
        """
        items = self.task.eval_items()
        if not items:
            return {"accuracy": float("nan"), "reward": float("nan"), "n": 0, "len_mean": float("nan"), "score_errors": 0}
        tc = self.cfg.task
        version = self.sched.version if version is None else version
        driver = RolloutDriver(self.engine, eos_ids=self.tokenizer.eos_ids, overlap=self.cfg.rollout.overlap,
                               shared_prefix=self.shared_prefix)
        driver.add_version(version, self._rollout_params[version])
        sampling = RequestSampling(temperature=tc.eval_temperature, seed=self.cfg.rollout.seed + 7919)
        n_new = tc.eval_max_new_tokens
        prompts = [tuple(self._prompt_ids(it)) for it in items]
        budgets = [min(it.max_new_tokens or n_new, n_new) for it in items]
        eng = self.engine
        for i, (p, n) in enumerate(zip(prompts, budgets)):  # named by the settings, before any decoding
            if len(p) > eng.max_prefill_length or len(p) + n > eng.max_target_length:
                raise RunError(
                    f"task {self.task.name!r}: held-out question {i} has {len(p)} prompt tokens and may generate {n} "
                    f"(task.eval_max_new_tokens = {n_new}), but the rollout engine takes prompts of at most "
                    f"{eng.max_prefill_length} tokens (rollout.max_prompt_len) and {eng.max_target_length} positions "
                    "in all (rollout.max_prompt_len + rollout.max_new_tokens, rounded up to a power of two)")
        reqs = [Request(k * len(items) + i, p, version=version, max_new_tokens=n, sampling=sampling)
                for k in range(tc.eval_samples) for i, (p, n) in enumerate(zip(prompts, budgets))]
        trajs = sorted(driver.run(reqs), key=lambda t: t.sample_id)
        # Scored as in training: in worker threads under task.reward_timeout_s, a failure named, not fatal.
        pool, results = RewardPool(tc.reward_workers, tc.reward_timeout_s), {}
        try:
            for k, t in enumerate(trajs):
                pool.submit(k, self._score, items[t.sample_id % len(items)],
                            self.tokenizer.decode(t.tokens, skip_special_tokens=True))
            while pool.outstanding:
                results.update((r.key, r) for r in pool.poll(0.05))
        finally:
            pool.close()
        scores, failed = [], []
        for k, t in enumerate(trajs):
            r = results[k]
            if r.error:
                failed.append(f"held-out question {t.sample_id % len(items)}: {r.error}")
            scores.append(Score(0.0, False) if r.error else Score(r.reward, r.correct))
        if failed:
            what = f"task {self.task.name!r}: scoring failed on {len(failed)} of {len(trajs)} held-out answers"
            if len(failed) == len(trajs):
                raise RunError(f"{what} (version {version}); the first: {failed[0]}")
            log.warning("%s (version %d, counted as wrong with reward 0); the first: %s", what, version, failed[0])
        return {"accuracy": float(np.mean([s.correct for s in scores])),
                "reward": float(np.mean([s.reward for s in scores])), "n": len(scores),
                "len_mean": float(np.mean([len(t.tokens) for t in trajs])), "score_errors": len(failed)}

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Trains ``cfg.dora.steps`` updates (the rest of them when resuming), evaluating before and after;
        returns (and writes) the summary."""
        try:
            return self._run()
        finally:
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
        for name, key in (("metrics.jsonl", "lines"), ("samples.jsonl", "samples_lines")):
            if self.writes and (dropped := truncate_lines(os.path.join(self.run_dir, name), m[key])):
                log.warning("%s: dropped %d lines written after the checkpoint (their updates are redone)"
                            if self._resumed is not None else "%s: no checkpoint to continue from: the run starts "
                            "over with the same configuration, replacing the %d lines of its earlier attempt",
                            os.path.join(self.run_dir, name), dropped)
        self._metrics_lines, self._sample_lines = m["lines"], m["samples_lines"]
        writer = MetricsWriter(self.run_dir) if self.writes else _NoWriter()
        bar = tqdm(total=cfg.dora.steps, initial=self.sched.version, desc=f"{cfg.dora.mode} K={self.policy.bound}",
                   unit="update", disable=not self.progress or not self.writes)
        last = time.perf_counter()
        t0 = last - m["wall_s"]  # wall_s continues across a resume
        train_total, rollout_s, checkpoint_s = m["train_s"], 0.0, m["checkpoint_s"]
        gen_tokens = live_rows = slot_rows = 0
        total_gen = m["gen_tokens"]
        led = self.sched.ledger

        def record(row: dict[str, Any], train_s: float) -> None:
            nonlocal last, rollout_s, gen_tokens, live_rows, slot_rows, train_total, checkpoint_s, total_gen
            now = time.perf_counter()
            train_total += train_s
            step_s = now - last
            total_gen += gen_tokens
            row.update({
                "step": self.sched.version, "version": self.sched.version, "wall_s": now - t0, "step_s": step_s,
                "train_s": train_s, "rollout_s": rollout_s, "rollout_share": max(0.0, 1 - train_s / step_s),
                "trainer_idle_fraction": 1 - train_total / (now - t0), "gen_tok_s": gen_tokens / step_s,
                "train_tok_s": row["trained_tokens"] / step_s, "resident_versions": len(self._params),
                "slot_occupancy": live_rows / max(slot_rows, 1), "slot_utilization": self.driver.slot_utilization,
                "filtered": led.count("filtered")})
            writer.write(row)
            self._metrics_lines += 1
            if self.store.due(self.sched.version):
                tc = time.perf_counter()
                self._checkpoint({"eval_before": before, "eval_s": eval_s, "wall_s": tc - t0, "train_s": train_total,
                                  "gen_tokens": total_gen, "checkpoint_s": checkpoint_s})
                checkpoint_s += time.perf_counter() - tc
                now += time.perf_counter() - tc  # the next step_s counts rollout and training, not the save
            bar.set_postfix(reward=f"{row['reward']:.2f}", acc=f"{row['accuracy']:.2f}",
                            lag=f"{row['staleness_mean']:.1f}", gen=f"{row['gen_tok_s']:.0f}tok/s")
            bar.update(1)
            last, rollout_s, gen_tokens, live_rows, slot_rows = now, 0.0, 0, 0, 0

        while self._agree("going on", not self.sched.done() or self._in_flight is not None,
                          f"before update {self.sched.version + 1}"):
            self._dispatch()
            stepped, step_s, step_rows = self._rollout_step(self._admit())
            if stepped:
                rollout_s += step_s
                gen_tokens += step_rows
                live_rows += step_rows
                slot_rows += self.slots
            self._collect_rewards()
            self._dispatch()
            self._drop_drained()
            self.max_resident = max(self.max_resident, len(self._params))
            if self._in_flight is None and not self.sched.done():
                batch = self._agree("the batch to train", self.sched.next_batch(),
                                    f"before update {self.sched.version + 1}")
                if batch is not None:
                    self._train(batch)
            # Shared placement completes the step now; split placement only when it has finished, or when
            # the rollout has nothing left to do without it.
            nothing_to_decode = self.driver.idle and not any(q for v, q in self._waiting.items() if v in self._params)
            if self.multi:  # the branches below take decisions: every process must take the same one
                nothing_to_decode = all(gather_decisions(nothing_to_decode))
            if (done_step := self._complete(wait=not self.split or nothing_to_decode)) is not None:
                record(*done_step)
            elif nothing_to_decode and self._in_flight is None:
                if self.rewards.outstanding:
                    self._collect_rewards(wait_s=0.05)
                elif not self._dispatch() and not led.count("finished") and not self.sched.done():
                    raise RunError(f"no progress possible at version {self.sched.version}: ledger {led.counts()}")
        bar.close()
        wall = time.perf_counter() - t0
        writer.close()
        led.check(self.policy.bound)
        if self.multi:
            state = json.dumps(self.sched.state_dict(), sort_keys=True).encode()
            self._agree("the ledger's digest", hashlib.sha256(state).hexdigest(), "at the end of the run")
        if self.writes:
            with open(os.path.join(self.run_dir, "ledger.json"), "w") as f:
                json.dump(self.sched.state_dict(), f)
        t_eval = time.perf_counter()
        after = self.evaluate()
        eval_s += time.perf_counter() - t_eval
        counts = led.counts()
        summary = {
            "mode": cfg.dora.mode, "max_staleness": self.policy.bound, "task": self.task.name,
            "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "reward_before": before["reward"], "reward_after": after["reward"], "eval_n": before["n"],
            "steps": self.sched.version, "samples": counts["consumed"], "filtered": counts["filtered"],
            "filtered_reasons": sorted(set(led.filtered_reasons().values()))[:20],
            "wall_s": wall, "eval_s": eval_s, "train_s": train_total, "checkpoint_s": checkpoint_s,
            "samples_per_s": counts["consumed"] / wall, "gen_tok_s": total_gen / wall,
            "trainer_idle_fraction": 1 - train_total / wall, "max_resident_versions": self.max_resident,
            "placement": "split" if self.split else "shared", "rollout_groups": len(self.engines),
            "sync_s": self.sync_s,
            "slot_utilization": self.driver.slot_utilization, "config_fingerprint": cfg.fingerprint(),
            "resumed": self._resumed is not None, "processes": jax.process_count(),
        }
        if self.writes:
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        return summary
