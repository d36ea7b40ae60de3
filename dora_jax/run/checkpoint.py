"""Run checkpoints: the trainer state and a JSON run-state dict, written atomically, restored with fallback.

:class:`RunCheckpoints` writes ``step_N/`` (Orbax TrainState, ``run_state.json``, ``meta.json`` and a
``COMPLETE`` marker of sizes and checksums, written last) and :meth:`~RunCheckpoints.restore_latest` returns
the newest one that verifies. Every process calls both with the same arguments on a shared file system.
Layout, write protocol and retention: docs/versions.md, 'Run checkpoints'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)


def stop_tensorstore_metrics_leak() -> None:
    """Makes this process's Orbax skip its leaking TensorStore I/O-counter reads (replaced by 0: Orbax then
    skips one throughput log line and nothing else). Process-wide; :class:`~dora_jax.run.resume.RunStore`
    calls it, importing this module does not. See docs/runner.md, 'Checkpoints and resume'."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:  # another Orbax layout: nothing of this to stop
        return
    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        tensorstore_utils.get_tensorstore_raw_bytes = lambda direction=None: 0


# The data-copy (CPU-bound encoding beside training) and file-I/O limits every TensorStore context of the process
# shares: TensorStore's one worker pool then holds at most their sum (docs/runner.md, "Checkpoints and resume").
TENSORSTORE_THREADS = {"data_copy_concurrency": 2, "file_io_concurrency": 4}


def limit_tensorstore_threads() -> None:
    """Makes every TensorStore context Orbax creates in this process take its data-copy and file-I/O limits from
    one shared context with :data:`TENSORSTORE_THREADS`. Process-wide and idempotent; :class:`RunCheckpoints`
    calls it when created. A limit a caller asks for explicitly keeps its own."""
    try:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:  # another Orbax layout: its contexts keep their own limits
        return
    make = tensorstore_utils.get_ts_context
    if getattr(make, "shared", None) is not None:
        return
    shared = ts.Context({name: {"limit": n} for name, n in TENSORSTORE_THREADS.items()})

    def get_ts_context(*, use_ocdbt: bool = True, file_io_concurrency_limit: int | None = None,
                       data_copy_concurrency_limit: int | None = None):
        spec = make(use_ocdbt=use_ocdbt, file_io_concurrency_limit=file_io_concurrency_limit,
                    data_copy_concurrency_limit=data_copy_concurrency_limit).spec.to_json()
        if file_io_concurrency_limit is None:  # a limit a caller asks for keeps its own (Orbax's saves ask none)
            spec.pop("file_io_concurrency", None)
        if data_copy_concurrency_limit is None:
            spec.pop("data_copy_concurrency", None)
        return ts.Context(spec, shared)  # what the spec leaves out comes from ``shared``

    get_ts_context.shared = shared
    tensorstore_utils.get_ts_context = get_ts_context


FORMAT = 1
MARKER = "COMPLETE"
_NAME = re.compile(r"^step_(\d{8,})$")
_TMP = re.compile(r"^\.tmp-step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint or snapshot cannot be written or read; the message says what and where."""


# -- helpers shared with the version snapshots --------------------------------------------------------------


def abstract_tree(tree: Any, shardings: Any = None) -> Any:
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves carrying the shardings to restore into.

    Args:
      tree: arrays or ``ShapeDtypeStruct``s (shape and dtype of each leaf).
      shardings: one ``Sharding`` for every leaf, a tree of them matching ``tree``, or None to keep each
        leaf's own sharding.
    """
    def one(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s if s is not None else getattr(x, "sharding", None))

    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([one(x, s) for x, s in zip(leaves, leaf_shardings(tree, shardings))])


def leaf_shardings(tree: Any, shardings: Any) -> list[Any]:
    """One sharding (or None) per array leaf of ``tree``, from one ``Sharding``, None, or a tree of shardings
    with the same leaves in the same order (``Variable`` nodes or not)."""
    n = len(jax.tree.leaves(tree))
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    out = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(out) != n:
        raise CheckpointError(f"the shardings tree has {len(out)} leaves, the arrays tree {n}; they must match")
    return out


def tree_bytes(tree: Any) -> int:
    """Global (unsharded) bytes of every array leaf of ``tree``."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


def barrier(name: str) -> None:
    """Waits for every process (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def check_json(obj: Any, where: str = "run_state") -> str:
    """``obj`` as JSON text, or a :class:`CheckpointError` naming the first value JSON cannot hold."""
    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"{path}: key {k!r} is a {type(k).__name__}; JSON keys must be strings")
                walk(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif not (x is None or isinstance(x, (bool, int, float, str))):
            raise CheckpointError(f"{path} is a {type(x).__name__} ({x!r:.60}); only dict, list, str, int, float, "
                                  "bool and None can be saved (convert arrays with .tolist())")

    walk(obj, where)
    return json.dumps(obj, sort_keys=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(root: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER)
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}


# -- run checkpoints -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Restored:
    """A run checkpoint brought back by :meth:`RunCheckpoints.restore_latest`."""

    step: int
    train_state: Any
    run_state: dict[str, Any]
    meta: dict[str, Any]
    path: Path
    skipped: list[str]  # newer checkpoints that could not be used, each with the reason


class RunCheckpoints:
    """Atomic run checkpoints in one directory, with keep-last-N retention and fallback on restore.

    Args:
      directory: where checkpoints live (created on the first save).
      fingerprint: the run's ``Config.fingerprint()``; a checkpoint with another one is not restored.
      keep_last: complete checkpoints kept (at least 1).
    """

    def __init__(self, directory: str | os.PathLike, *, fingerprint: str, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"keep_last = {keep_last}: at least one checkpoint must be kept")
        # Absolute from here on: Orbax refuses relative paths, and a later change of directory must not move it.
        self.directory = Path(directory).absolute()
        self.fingerprint = fingerprint
        self.keep_last = keep_last
        limit_tensorstore_threads()

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the checkpoints that carry a completion marker (not verified), oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir()
                      if (m := _NAME.match(p.name)) and (p / MARKER).is_file())

    # -- writing ------------------------------------------------------------------------------------------

    def save(self, step: int, train_state: Any, run_state: dict[str, Any], *,
             meta: dict[str, Any] | None = None) -> Path:
        """Writes checkpoint ``step`` atomically, then applies retention. Blocks until it is complete.

        Args:
          step: the train step the state is at; names the checkpoint.
          train_state: the TrainState (or any pytree of arrays); read, never donated or modified.
          run_state: a JSON-able dict (checked before anything is written).
          meta: extra JSON-able fields stored in ``meta.json`` (e.g. ``{"version": 12}``).

        Returns:
          The checkpoint's directory.

        Raises:
          CheckpointError: ``run_state``/``meta`` hold a value JSON cannot, or a complete checkpoint for
            ``step`` already exists (it is never overwritten).
        """
        import orbax.checkpoint as ocp

        if not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"checkpoint step {step!r} must be a non-negative integer")
        step = int(step)
        run_text = check_json(run_state, "run_state")
        info = {"format": FORMAT, "step": step, "fingerprint": self.fingerprint, "time": time.time(),
                "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {})}
        meta_text = check_json(info, "meta")
        final = self.path(step)
        if (final / MARKER).is_file() and self._usable(final):
            raise CheckpointError(f"a complete checkpoint for step {step} already exists at {final}; "
                                  "it is not overwritten (resume from it, or write to another directory)")
        tmp = self.directory / f".tmp-{final.name}"
        primary = jax.process_index() == 0
        if primary:
            self.directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed write of this step: never complete, never read
                shutil.rmtree(tmp)
            tmp.mkdir()
        barrier(f"dora_ckpt_begin_{step}")
        try:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(tmp / "state", train_state)
                ckptr.wait_until_finished()
            if primary:
                _write_text(tmp / "run_state.json", run_text)
                _write_text(tmp / "meta.json", meta_text)
                marker = {"format": FORMAT, "step": step, "files": _manifest(tmp)}
                _write_text(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True))
        except Exception:
            if primary:  # a write that failed (a full disk) gives its space back; complete ones are untouched
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if primary:
            if final.exists():  # an incomplete or corrupt directory of the same step: keep it aside
                final.rename(self._aside(final))
            tmp.rename(final)
            _fsync_dir(self.directory)
            self._retain(step)
        barrier(f"dora_ckpt_end_{step}")
        return final

    def _usable(self, path: Path) -> bool:
        try:
            self.verify(path)
        except CheckpointError:
            return False
        return True

    def _aside(self, path: Path) -> Path:
        k = 0
        while (aside := path.with_name(f"{path.name}.bad-{k}")).exists():
            k += 1
        log.warning("checkpoint directory %s is incomplete or corrupt; moved to %s", path, aside)
        return aside

    def _retain(self, newest: int) -> None:
        complete = [s for s in self.steps() if s <= newest]
        keep = complete[-self.keep_last:]
        oldest_kept = keep[0]
        for p in list(self.directory.iterdir()):
            m = _NAME.match(p.name.split(".bad-")[0]) or _TMP.match(p.name)
            if m is None:
                continue
            s = int(m.group(1))
            if s < oldest_kept or (s in complete and s not in keep):
                shutil.rmtree(p)

    # -- reading ------------------------------------------------------------------------------------------

    def verify(self, path: str | os.PathLike) -> dict[str, Any]:
        """Checks one checkpoint directory and returns its metadata.

        Raises:
          CheckpointError: naming the directory and the file at fault: no marker, a file missing or of
            another size or checksum, missing or unreadable metadata, or another config fingerprint.
        """
        path = Path(path)
        marker_path = path / MARKER
        if not marker_path.is_file():
            raise CheckpointError(f"{path}: no {MARKER} marker; the write did not finish (partial checkpoint)")
        try:
            marker = json.loads(marker_path.read_text())
            files = marker["files"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{marker_path}: unreadable completion marker ({e})") from e
        for rel in ("meta.json", "run_state.json"):
            if rel not in files:
                raise CheckpointError(f"{path}: {rel} is not listed in {MARKER}; the checkpoint is incomplete")
        for rel, want in files.items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {MARKER} but missing")
            size = f.stat().st_size
            if size != want["size"]:
                raise CheckpointError(f"{f}: {size} bytes, {MARKER} records {want['size']} (truncated or corrupt)")
            if _sha256(f) != want["sha256"]:
                raise CheckpointError(f"{f}: sha256 differs from the one in {MARKER} (corrupt)")
        try:
            meta = json.loads((path / "meta.json").read_text())
            meta["step"], meta["fingerprint"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / 'meta.json'}: unreadable metadata ({e!r})") from e
        if meta["fingerprint"] != self.fingerprint:
            raise CheckpointError(f"{path}: written by config fingerprint {meta['fingerprint']}, this run's is "
                                  f"{self.fingerprint} (a different configuration)")
        return meta

    def restore_latest(self, target: Any = None, *, shardings: Any = None) -> Restored | None:
        """The newest checkpoint that verifies and restores; older ones are tried when newer ones fail.

        Args:
          target: the TrainState to restore into: arrays or ``ShapeDtypeStruct``s whose shapes, dtypes and
            (unless ``shardings`` is given) shardings the restored arrays take. None restores the shardings
            saved, which needs the same device topology.
          shardings: target shardings overriding ``target``'s (a tree matching it, or one sharding).

        Returns:
          The restored checkpoint, or None if the directory holds no checkpoint at all.

        Raises:
          CheckpointError: checkpoints exist but none can be used; the message lists each with its reason.
        """
        import orbax.checkpoint as ocp

        if not self.directory.is_dir():
            return None
        entries = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        skipped = [f"{p}: write in progress or crashed before commit; ignored"
                   for p in self.directory.iterdir() if _TMP.match(p.name)]
        for msg in skipped:
            log.warning("run checkpoint %s", msg)
        if not entries:
            if skipped:
                raise CheckpointError("no usable run checkpoint in " f"{self.directory}:\n  " + "\n  ".join(skipped))
            return None
        abstract = abstract_tree(target, shardings) if target is not None else None
        for step, path in sorted(entries, reverse=True):
            try:
                meta = self.verify(path)
                run_state = json.loads((path / "run_state.json").read_text())
                with ocp.StandardCheckpointer() as ckptr:
                    state = ckptr.restore(path / "state", abstract)
            except Exception as e:  # noqa: BLE001 - any failure means: report it and try the previous one
                msg = str(e) if isinstance(e, CheckpointError) else f"{path}: state does not restore: {e!r:.400}"
                log.warning("run checkpoint unusable, falling back to an older one: %s", msg)
                skipped.append(msg)
                continue
            return Restored(step, state, run_state, meta, path, skipped)
        raise CheckpointError(f"no usable run checkpoint in {self.directory}:\n  " + "\n  ".join(skipped))
