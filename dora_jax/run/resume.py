"""Run checkpoints and resume for the runner.

:class:`RunStore` owns ``RUN_DIR/checkpoints/`` (train state and run state) and ``RUN_DIR/versions/`` (version
snapshots): it refuses checkpoints of another configuration (:func:`run_fingerprint`), restores the newest good
one and keeps the snapshots a kept checkpoint needs. :func:`pack_run_state` / :func:`unpack_run_state` convert
the scheduler, finished samples, metrics position and seeds to the checkpoint's run-state dict and back.
See docs/runner.md, 'Checkpoints and resume'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from dora_jax.run.checkpoint import CheckpointError, Restored, RunCheckpoints, stop_tensorstore_metrics_leak
from dora_jax.config import Config
from dora_jax.dora.ledger import LedgerError
from dora_jax.dora.scheduler import SchedulePolicy, Scheduler
from dora_jax.rollout.samples import Sample

log = logging.getLogger(__name__)

# Settings that say where a run lives (directory, device mesh), whether/how often it checkpoints and how the
# rollout schedules host and device work, not what it computes. A run may resume on another mesh and other
# hardware: checkpoints and snapshots restore onto any shardings.
_PLACEMENT_SECTIONS = ("mesh",)
_PLACEMENT_FIELDS = {"run": ("name", "out_dir", "resume", "checkpoint_every", "keep_checkpoints"),
                     "rollout": ("overlap",),
                     # How often held-out accuracy is measured during training: it never reaches the trainer or
                     # the ledger, and a checkpoint written before the field existed resumes under any value.
                     "task": ("eval_every",)}


class ResumeError(RuntimeError):
    """A run directory that cannot be resumed as asked; the message names the directory and the cause."""


def _computing_dict(cfg: Config | dict[str, Any]) -> dict[str, Any]:
    """The settings that change what a run computes, of a config or of its ``to_dict()``."""
    d = {k: v for k, v in (cfg if isinstance(cfg, dict) else cfg.to_dict()).items() if k not in _PLACEMENT_SECTIONS}
    for section, names in _PLACEMENT_FIELDS.items():
        d[section] = {k: v for k, v in d.get(section, {}).items() if k not in names}
    return d


def run_fingerprint(cfg: Config | dict[str, Any]) -> str:
    """A short hash of every setting that changes what a run computes, of a config or of its ``to_dict()``:
    ``Config.fingerprint`` without the ``mesh`` section, ``run.name``, ``run.out_dir``, ``run.resume``,
    ``run.checkpoint_every``, ``run.keep_checkpoints``, ``rollout.overlap`` and ``task.eval_every``. Only
    settings that differ from their defaults are hashed.
    """
    blob = json.dumps(_non_default(_computing_dict(cfg), _computing_dict(Config())), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _non_default(settings: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The sections and fields of ``settings`` whose values differ from ``defaults``' (nested dicts)."""
    out = {}
    for k, v in settings.items():
        d = defaults.get(k)
        if isinstance(v, dict) and isinstance(d, dict):
            v = _non_default(v, d)
            if v:
                out[k] = v
        elif k not in defaults or v != d:
            out[k] = v
    return out


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "", where: str = "the checkpoint") -> list[str]:
    """Dotted names of the fields whose values differ between two config dicts, each with both values (the old
    one as found in ``where``)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.", where)
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} in {where}, {b!r} now")
    return out


def seeds(cfg: Config) -> dict[str, int]:
    """The host RNG state of a run (with the scheduler's sample counter, all of it; docs/runner.md)."""
    return {"run.seed": cfg.run.seed, "rollout.seed": cfg.rollout.seed}


def pack_run_state(sched: Scheduler, done: dict[int, Sample], metrics: dict[str, Any],
                   cfg: Config) -> dict[str, Any]:
    """The run-state dict of a checkpoint: the scheduler (ledger included), every finished-unconsumed sample
    as it is, the metrics position and the seeds."""
    led = sched.ledger
    finished = [done[s].to_dict() for s in sorted(led.entries) if led.entries[s].state == "finished"]
    return {"scheduler": sched.state_dict(), "finished": finished, "metrics": metrics, "rng": seeds(cfg)}


# What a checkpoint's run-state metrics hold: the runner's position in its output files and its counters.
RUN_METRICS = ("eval_before", "eval_s", "wall_s", "train_s", "gen_tokens", "checkpoint_s", "lines", "samples_lines",
               "rows_computed", "rows_live", "batch_steps", "max_resident")


def check_later_metrics(metrics: dict[str, Any], cfg: Config) -> str | None:
    """What is wrong with the run-state metrics added after :data:`RUN_METRICS`, in words (None: nothing; a
    checkpoint that lacks them is fine, their figures restart)."""
    n = metrics.get("max_versions_per_group", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return f"max_versions_per_group: {n!r:.80} is not a count (an integer >= 0)"
    if metrics.get("balancer") is not None:
        from dora_jax.run.balancing import check_saved  # not at import: it brings the rollout side

        return check_saved(metrics["balancer"], cfg.roles.rollout_groups)
    return None


def unpack_run_state(policy: SchedulePolicy, run_state: dict[str, Any], where: Path,
                     cfg: Config) -> tuple[Scheduler, list[Sample], dict[str, Any]]:
    """The scheduler, finished samples and metrics position of a checkpoint's run state, with every sample
    that was in flight moved back to pending. Raises ResumeError (naming ``where``) for a run state the runner
    did not write, seeds other than ``cfg``'s, or finished samples that do not match the ledger."""
    where = Path(where) / "run_state.json"
    try:
        sched = Scheduler.from_state_dict(policy, run_state["scheduler"])
        finished = [Sample.from_dict(d) for d in run_state["finished"]]
        metrics, saved_seeds = dict(run_state["metrics"]), run_state["rng"]
    except (KeyError, TypeError, ValueError, LedgerError) as e:
        raise ResumeError(f"{where}: not a run state this runner can continue ({e!r:.300})") from e
    missing = [k for k in RUN_METRICS if k not in metrics]
    if missing:
        raise ResumeError(f"{where}: not a run state this runner can continue (its metrics lack "
                          f"{', '.join(missing)}; written by another version of dora-jax?)")
    if saved_seeds != seeds(cfg):
        raise ResumeError(f"{where}: seeds {saved_seeds} differ from this run's {seeds(cfg)}")
    if (wrong := check_later_metrics(metrics, cfg)) is not None:
        raise ResumeError(f"{where}: not a run state this runner can continue (metrics.{wrong})")
    led = sched.ledger
    want = sorted(s for s, e in led.entries.items() if e.state == "finished")
    if sorted(f.sample_id for f in finished) != want:
        raise ResumeError(f"{where}: the ledger has {len(want)} finished samples, the saved trajectories are "
                          f"{len(finished)} others")
    for sid, e in led.entries.items():
        if e.state == "in_flight":
            led.requeue(sid)
    return sched, finished, metrics


def count_lines(path: str | os.PathLike) -> int:
    """Complete lines in a text file (0 when it does not exist)."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def truncate_lines(path: str | os.PathLike, keep: int) -> int:
    """Keeps the first ``keep`` lines of ``path``, atomically (one rename); returns how many were dropped.
    Raises ResumeError when the file holds fewer than ``keep`` complete lines."""
    path = Path(path)
    if not path.exists():
        if keep:
            raise ResumeError(f"{path} is missing, but the checkpoint records {keep} lines written to it")
        return 0
    with open(path, "rb") as f:
        lines = f.readlines()
    complete = [x for x in lines if x.endswith(b"\n")]
    if len(complete) < keep:
        raise ResumeError(f"{path} has {len(complete)} complete lines, but the checkpoint records {keep}; "
                          "the file was shortened after the checkpoint and the run cannot continue it")
    if len(lines) == keep:
        return 0
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.writelines(lines[:keep])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - keep


def fsync_file(path: str | os.PathLike) -> None:
    """Flushes a file's written data to disk (so a checkpoint never records lines a crash could lose)."""
    if os.path.exists(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile: retention, or a write's temporary file
                pass
    return total


def tree_bytes(tree: Any) -> int:
    """Bytes of a pytree's arrays, summed over the whole (global) arrays."""
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


class RunStore:
    """The run checkpoints and version snapshots of one run directory.

    Args:
      run_dir: the run directory (``checkpoints/`` and ``versions/`` go inside).
      cfg: the run's config; its :func:`run_fingerprint` is checked against every checkpoint and snapshot.

    Keeps the newest ``run.keep_checkpoints`` checkpoints, and a snapshot while a kept checkpoint or residency
    needs its version.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: Config):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.fingerprint = run_fingerprint(cfg)
        self.every = cfg.run.checkpoint_every
        stop_tensorstore_metrics_leak()  # a run writes a snapshot per version: the leak would grow without bound
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", fingerprint=self.fingerprint,
                                          keep_last=cfg.run.keep_checkpoints)
        self._snaps = None

    @property
    def snapshots(self):
        """The version snapshots (created on first use: a run that never checkpoints never writes one)."""
        if self._snaps is None:
            from dora_jax.run.versions import Snapshots

            # The newest is always resident; the others stay while protected (see the class docstring).
            self._snaps = Snapshots(self.run_dir / "versions", fingerprint=self.fingerprint, keep_last=1)
        return self._snaps

    def disk_estimate(self, state_bytes: int, params_bytes: int, bound: int) -> int:
        """The most bytes retention lets the run directory hold (kept checkpoints and the snapshots they and
        the resident versions need)."""
        keep = self.cfg.run.keep_checkpoints
        return keep * state_bytes + ((bound + 1) + keep * bound) * params_bytes

    def warn_if_short_of_disk(self, state_bytes: int, params_bytes: int, bound: int) -> None:
        """Logs a warning when the run directory's disk has less free space than :meth:`disk_estimate`."""
        need = self.disk_estimate(state_bytes, params_bytes, bound)
        where = next(p for p in (self.run_dir, *self.run_dir.parents) if p.exists())
        free = shutil.disk_usage(where).free + dir_bytes(self.run_dir)  # what is there now is replaced in time
        if need > free:
            log.warning("checkpoints may not fit: this run keeps up to %.2f GiB under %s (%d checkpoints of %.2f "
                        "GiB and version snapshots of %.2f GiB each) and %.2f GiB is free there; lower "
                        "run.keep_checkpoints or raise run.checkpoint_every", need / 2**30, self.run_dir,
                        self.cfg.run.keep_checkpoints, state_bytes / 2**30, params_bytes / 2**30, free / 2**30)

    # -- resume ---------------------------------------------------------------------------------------------

    def _metas(self) -> list[tuple[Path, dict[str, Any]]]:
        """Readable metadata of the checkpoint directories that carry a marker (not verified), newest first."""
        out = []
        for step in reversed(self.checkpoints.steps()):
            path = self.checkpoints.path(step)
            try:
                meta = json.loads((path / "meta.json").read_text())
            except (OSError, ValueError):
                continue  # unreadable: restore_latest reports it and falls back
            if isinstance(meta, dict):  # anything else is corrupt: restore_latest reports it likewise
                out.append((path, meta))
        return out

    def check_config(self) -> None:
        """Raises ResumeError, naming the checkpoint and every field that differs (or both fingerprints), when
        the directory's checkpoints were written by another configuration."""
        for path, meta in self._metas():
            if meta.get("fingerprint") == self.fingerprint:
                continue
            saved = meta.get("config")
            diff = (config_diff(saved, _computing_dict(self.cfg)) if isinstance(saved, dict)
                    else [f"fingerprint {meta.get('fingerprint')} in the checkpoint, {self.fingerprint} now"])
            raise ResumeError(
                f"{path} was written by another configuration; resuming would mix two runs. Differences:\n  "
                + "\n  ".join(diff or ["(none in the fields compared; the fingerprint differs)"])
                + "\nRestore those settings to continue this run, or choose another run.name / run.out_dir."
                + (" (dora.steps cannot change on resume: a run continues to the end it was started for.)"
                   if any(d.startswith("dora.steps") for d in diff) else ""))

    def check_restart(self) -> None:
        """Refuses to start over in a directory whose earlier attempt left updates but no checkpoint, unless
        that attempt's ``config.json`` shows the same configuration (its lines are then rewritten).

        Raises:
          ResumeError: naming the files that would be replaced and every field that differs (or that
            ``config.json`` is missing or unreadable).
        """
        if self.has_checkpoints() or not (left := self.leftovers()):
            return
        path = self.run_dir / "config.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            why = [f"its configuration is unknown ({path}: {e.__class__.__name__}: {e})"]
        else:
            why = (config_diff(_computing_dict(saved), _computing_dict(self.cfg), where=str(path))
                   if isinstance(saved, dict) else [f"its configuration is unknown ({path} holds no mapping)"])
        if why:
            raise ResumeError(
                f"{self.run_dir} holds an unfinished run ({', '.join(left)}) with no checkpoint to continue from, "
                "and starting over would replace it with another configuration's:\n  " + "\n  ".join(why)
                + "\nChoose another run.name / run.out_dir, or move that run away.")

    def has_checkpoints(self) -> bool:
        return bool(self.checkpoints.steps()) or (self.checkpoints.directory.is_dir() and any(
            p.name.startswith(("step_", ".tmp-step_")) for p in self.checkpoints.directory.iterdir()))

    def restore(self, target: Any) -> Restored | None:
        """The newest good checkpoint (None when the directory has none); bad ones are skipped with a warning.
        Raises ResumeError when checkpoints exist but another configuration wrote them, or none is usable."""
        self.check_config()
        d = self.checkpoints.directory
        if d.is_dir() and not any(p.name.startswith("step_") and p.name[5:].isdigit() for p in d.iterdir()):
            if any(d.iterdir()):  # only a first write that never finished: nothing to resume, start afresh
                log.warning("resume: %s holds no complete checkpoint (a write was cut off); starting afresh", d)
            return None
        try:
            found = self.checkpoints.restore_latest(target=target)
        except CheckpointError as e:
            raise ResumeError(f"{self.run_dir}: cannot resume: {e}") from e
        if found is not None:
            for why in found.skipped:
                log.warning("resume: skipped %s", why)
            log.warning("resume: continuing %s from %s (step %d)", self.run_dir, found.path, found.step)
        return found

    def restore_version(self, version: int, target: Any) -> Any:
        """Version ``version``'s params from its snapshot, placed like ``target``; ResumeError (listing the
        snapshots present) when there is no usable one."""
        try:
            return self.snapshots.restore(version, target)
        except CheckpointError as e:
            raise ResumeError(f"{self.run_dir}: version {version} is still in flight at the checkpoint but "
                              f"cannot be restored: {e}") from e

    # -- saving ---------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written after update ``step``."""
        return self.every > 0 and step % self.every == 0

    def needed_versions(self) -> set[int]:
        """Versions some checkpoint on disk still needs from a snapshot (in flight or finished-unconsumed when
        it was saved, other than its own version)."""
        return {int(v) for _, meta in self._metas() for v in meta.get("versions", ()) if int(v) != meta.get("step")}

    def snapshot(self, version: int, params: Any, resident: set[int]) -> None:
        """Starts the asynchronous snapshot of a published version (kept if one exists already), protecting
        the resident versions and those the checkpoints on disk need."""
        if self.every > 0:
            self.snapshots.save(version, params, step=version, parent=version - 1 if version else None,
                                protect=resident | self.needed_versions())

    def save(self, step: int, train_state: Any, run_state: dict[str, Any], versions: set[int],
             resident: set[int], params_of: Callable[[int], Any]) -> Path:
        """Writes checkpoint ``step`` (blocking; atomic), then drops the snapshots nothing needs any more.

        Args:
          versions: the versions a resume from it needs (in flight or finished-unconsumed); each one's snapshot
            is kept while the checkpoint exists, and written now if missing.
          resident: the versions resident now (their snapshots are kept too).
          params_of: a needed version's params (it is resident).

        Raises:
          ResumeError: the checkpoint could not be written (naming the directory and its free space); the
            checkpoints already there are untouched.
        """
        for v in sorted(versions - {step}):
            if not self.snapshots.path(v).exists():
                self.snapshots.save(v, params_of(v), step=v, parent=v - 1 if v else None,
                                    protect=resident | versions | self.needed_versions())
        meta = {"versions": sorted(int(v) for v in versions), "config": _computing_dict(self.cfg)}
        try:
            path = self.checkpoints.save(step, train_state, run_state, meta=meta)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - Orbax and the OS fail in many ways; the run stops naming both
            free = shutil.disk_usage(self.run_dir).free if self.run_dir.exists() else 0
            raise ResumeError(f"cannot write checkpoint {step} under {self.checkpoints.directory} "
                              f"({free / 2**30:.2f} GiB free there): {e.__class__.__name__}: {e}; the checkpoints "
                              f"already there are kept: {self.checkpoints.steps()}") from e
        if self._snaps is not None:
            self._snaps.wait(protect=resident | versions | self.needed_versions())
        return path

    def close(self) -> None:
        """Waits for snapshot writes in progress and releases the writer."""
        if self._snaps is not None:
            self._snaps.close()
            self._snaps = None

    # -- fresh runs -----------------------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        """Files of an earlier unfinished run in this directory (what a fresh start would overwrite)."""
        found = [n for n in ("metrics.jsonl", "samples.jsonl") if count_lines(self.run_dir / n)]
        if self.has_checkpoints():
            found.append("checkpoints/")
        return found

