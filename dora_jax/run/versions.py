"""Policy versions kept resident for rollout, and their Orbax snapshots.

:class:`VersionStore` holds the resident versions with a refcount of in-flight trajectories each, under a hard
cap of K + 1 (staleness bound K); :class:`Snapshots` writes one asynchronous Orbax snapshot per published
version, with retention, restorable onto any mesh. docs/versions.md has the rules and how resume uses both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import jax

from dora_jax.run.checkpoint import CheckpointError, abstract_tree, leaf_shardings, tree_bytes
from dora_jax.config import Config, LoraConfig
from dora_jax.sharding import serial_jit

_SNAP = re.compile(r"^v_(\d{8,})$")
_SNAP_TMP = re.compile(r"^v_(\d{8,})\.orbax-checkpoint-tmp")
# Written into a snapshot once Orbax has committed it: every file's size, checked before Orbax reads it.
SIZES = "dora_sizes.json"


class VersionError(RuntimeError):
    """A version-store operation that would break refcounts, ordering or the residency cap."""


@dataclasses.dataclass
class _Version:
    params: Any  # full params, or LoRA adapters
    refs: int
    step: int | None
    parent: int | None


def _own(tree: Any, shardings: Any) -> Any:
    """A copy of ``tree`` that no one else can donate or delete, in ``shardings`` (default: its own)."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = [s if s is not None else x.sharding for x, s in zip(leaves, leaf_shardings(tree, shardings))]
    return treedef.unflatten(jax.device_put(leaves, targets, may_alias=False))


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class VersionStore:
    """The resident policy versions, each with a refcount of in-flight trajectories.

    Args:
      max_resident: hard cap on resident versions (K + 1 for staleness bound K).
      lora: the LoRA config when versions are adapters over ``base``; None for full parameters.
      base: the frozen base weights under LoRA (``TrainState.frozen``); copied once and shared.
      shardings: where stored versions live (one ``Sharding`` or a tree matching the published params);
        default: where the published arrays are, or under LoRA replicated over the base's mesh.
      snapshots: snapshot every published version there (asynchronously).
    """

    def __init__(self, max_resident: int, *, lora: LoraConfig | None = None, base: Any = None,
                 shardings: Any = None, snapshots: "Snapshots | None" = None):
        if max_resident < 1:
            raise VersionError(f"max_resident = {max_resident}: at least one version must fit")
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is not None and base is None:
            raise VersionError("LoRA versions need the shared base weights: pass base=state.frozen")
        if self.lora is None and base is not None:
            raise VersionError("base weights were given without a LoRA config (lora.rank > 0)")
        self.max_resident = max_resident
        self.shardings = shardings
        self.snapshots = snapshots
        self._base = _own(base, None) if base is not None else None
        if self._base is not None and shardings is None:
            # Adapters live with the base (replicated over its mesh), as the trainer keeps them.
            first = jax.tree.leaves(self._base)[0].sharding
            if isinstance(first, jax.sharding.NamedSharding):
                self.shardings = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
        self._versions: dict[int, _Version] = {}
        self._newest: int | None = None
        self._evicted: set[int] = set()
        self._pinned: set[int] = set()
        self._signature: tuple | None = None
        self._merge = None
        if self.lora is not None:
            from dora_jax.trainer import lora as lora_lib

            cfg = self.lora
            self._merge = serial_jit(lambda b, a: lora_lib.merge(b, a, cfg))
            if snapshots is not None:
                snapshots.save_base(self._base)

    @classmethod
    def from_config(cls, cfg: Config, *, base: Any = None, shardings: Any = None,
                    snapshots: "Snapshots | None" = None) -> "VersionStore":
        """A store capped at ``cfg.train.max_staleness + 1`` versions, LoRA from ``cfg.train.lora``."""
        lora = cfg.train.lora if cfg.train.lora.rank > 0 else None
        return cls(cfg.train.max_staleness + 1, lora=lora, base=base, shardings=shardings, snapshots=snapshots)

    # -- residency ----------------------------------------------------------------------------------------

    @property
    def newest(self) -> int | None:
        """The newest published version (None before the first publish)."""
        return self._newest

    def resident(self) -> set[int]:
        return set(self._versions)

    def refcount(self, version: int) -> int:
        return self._get(version).refs

    def _describe(self) -> str:
        return ", ".join(f"v{v} (refcount {e.refs}{', newest' if v == self._newest else ''})"
                         for v, e in sorted(self._versions.items())) or "none"

    def _get(self, version: int) -> _Version:
        e = self._versions.get(version)
        if e is None:
            why = "was evicted" if version in self._evicted else "was never published or reinstated"
            raise VersionError(f"policy version {version} is not resident: it {why}; resident: {self._describe()}")
        return e

    def _check(self, params: Any, version: int) -> None:
        sig = _signature(params)
        if self._signature is None:
            self._signature = sig
        elif sig != self._signature:
            raise VersionError(f"version {version}: params differ in structure, shapes or dtypes from the "
                               "versions already stored" + (" (under LoRA, publish the adapters, TrainState.params)"
                                                            if self.lora else ""))

    def _admit(self, version: int, params: Any, *, drop: set[int], step: int | None, parent: int | None,
               copy: bool = True) -> None:
        remaining = self.resident() - drop
        if len(remaining) + 1 > self.max_resident:
            raise VersionError(f"adding version {version} would make {len(remaining) + 1} versions resident, above "
                               f"the cap of {self.max_resident}; resident: {self._describe()} (only versions with "
                               "refcount 0 that are not the newest can be evicted)")
        self._check(params, version)
        stored = _own(params, self.shardings) if copy or self.shardings is not None else params
        for v in drop:
            self._evict(v)
        self._versions[version] = _Version(stored, 0, step, parent)

    def publish(self, version: int, params: Any, *, step: int | None = None, parent: int | None = None,
                copy: bool = True) -> list[int]:
        """Adds ``version`` as the newest, evicting every drained version first, and snapshots it.

        Args:
          version: greater than every version published before.
          params: the full parameters, or under LoRA the adapters (``TrainState.params``); copied unless
            ``copy`` is False (the caller hands over arrays no one else holds or donates).
          step: the train step that produced it (snapshot metadata).
          parent: the version it was trained from; default: the previous newest.

        Returns:
          The versions evicted to make room.

        Raises:
          VersionError: ``version`` is not newer than the newest, or the cap would be exceeded (nothing changes).
        """
        version = int(version)
        if self._newest is not None and version <= self._newest:
            raise VersionError(f"publish of version {version}: versions must increase (newest is {self._newest})")
        drained = {v for v, e in self._versions.items() if e.refs == 0}
        parent = self._newest if parent is None else parent
        self._admit(version, params, drop=drained, step=step, parent=parent, copy=copy)
        self._newest = version
        if self.snapshots is not None:
            self.snapshots.save(version, self._versions[version].params, step=step, parent=parent,
                                kind="lora" if self.lora else "full", protect=self.resident() | self._pinned)
        return sorted(drained)

    def reinstate(self, version: int, params: Any, *, copy: bool = True) -> None:
        """Brings back an older version (from a snapshot, on resume) with refcount 0; no snapshot is written.
        Raises VersionError if it is resident already, is not older than the newest, or the cap is full."""
        version = int(version)
        if version in self._versions:
            raise VersionError(f"reinstate of version {version}: it is already resident")
        if self._newest is None or version >= self._newest:
            raise VersionError(f"reinstate of version {version}: only versions older than the newest "
                               f"({self._newest}) are reinstated; publish the newest first")
        self._admit(version, params, drop=set(), step=None, parent=None, copy=copy)
        self._evicted.discard(version)

    def acquire(self, version: int, n: int = 1) -> None:
        """Counts ``n`` more in-flight trajectories of ``version``, which must be resident."""
        if n < 1:
            raise VersionError(f"acquire of version {version}: n = {n} must be >= 1")
        self._get(version).refs += n

    def release(self, version: int, n: int = 1) -> None:
        """Counts ``n`` in-flight trajectories of ``version`` as finished; it is evicted later (publish or
        ``evict_drained``), not here."""
        e = self._get(version)
        if n < 1 or n > e.refs:
            raise VersionError(f"release of {n} from version {version} would take its refcount below zero "
                               f"(refcount is {e.refs})")
        e.refs -= n

    def _evict(self, version: int) -> None:
        del self._versions[version]
        self._evicted.add(version)

    def evict(self, version: int) -> None:
        """Evicts one drained version; raises VersionError if it is not resident, is the newest, or has refs."""
        e = self._get(version)
        if version == self._newest or e.refs:
            raise VersionError(f"version {version} cannot be evicted: "
                               + ("it is the newest" if version == self._newest else f"refcount is {e.refs}"))
        self._evict(version)

    def evict_drained(self) -> list[int]:
        """Evicts every version that is not the newest and has refcount 0; returns them."""
        drained = sorted(v for v, e in self._versions.items() if e.refs == 0 and v != self._newest)
        for v in drained:
            self._evict(v)
        return drained

    def pin(self, versions: Iterable[int]) -> None:
        """Versions whose snapshots retention must keep besides the resident ones (e.g. the versions in flight
        in every retained run checkpoint). Replaces the previous pins."""
        self._pinned = {int(v) for v in versions}

    # -- params -------------------------------------------------------------------------------------------

    def stored(self, version: int) -> Any:
        """What the store holds for ``version``: full params, or under LoRA the adapters."""
        return self._get(version).params

    @property
    def base(self) -> Any:
        """The shared base weights under LoRA (None otherwise)."""
        return self._base

    def params(self, version: int) -> Any:
        """The full parameters of ``version``, as the rollout engine takes them (under LoRA a merged copy the
        caller owns; call once per version and keep it while the version decodes)."""
        p = self._get(version).params
        return self._merge(self._base, p) if self._merge is not None else p

    def resident_bytes(self) -> dict[int, int]:
        """Bytes each resident version holds (global, unsharded size), the shared base not counted."""
        return {v: tree_bytes(e.params) for v, e in sorted(self._versions.items())}

    def shared_bytes(self) -> int:
        """Bytes of the shared LoRA base (0 under full fine-tuning)."""
        return tree_bytes(self._base) if self._base is not None else 0


# -- snapshots ---------------------------------------------------------------------------------------------------


def retained(versions: Iterable[int], keep_last: int, keep_every: int = 0, protect: Iterable[int] = ()) -> set[int]:
    """The snapshot versions retention keeps: the newest ``keep_last``, every multiple of ``keep_every``
    (0: none), and the protected ones."""
    versions = sorted(set(versions))
    keep = set(versions[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {v for v in versions if v % keep_every == 0}
    return keep | (set(versions) & set(protect))


class Snapshots:
    """One Orbax checkpoint per published version, written in the background, with retention.

    Args:
      directory: where snapshots live (``v_00000012/``, plus ``base/`` under LoRA).
      fingerprint: the run's ``Config.fingerprint()``, recorded and checked on restore.
      keep_last: newest versions kept (at least 1; above K + 1 so a resume finds every version in flight).
      keep_every: also keep every version that is a multiple of this (0: none).

    Multi-host: every process calls ``save``; only process 0 deletes.
    """

    def __init__(self, directory: str | os.PathLike, *, fingerprint: str, keep_last: int = 4, keep_every: int = 0):
        import orbax.checkpoint as ocp

        if keep_last < 1 or keep_every < 0:
            raise ValueError(f"keep_last = {keep_last} must be >= 1 and keep_every = {keep_every} >= 0")
        # Absolute from here on: Orbax refuses relative paths, and a later change of directory must not move it.
        self.directory = Path(directory).absolute()
        self.fingerprint = fingerprint
        self.keep_last, self.keep_every = keep_last, keep_every
        self._protect: set[int] = set()
        self._unsealed: list[Path] = []
        self._ckptr = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())

    def path(self, version: int) -> Path:
        return self.directory / f"v_{int(version):08d}"

    def versions(self) -> list[int]:
        """Committed snapshot versions, oldest first (a write in progress is not listed)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _SNAP.match(p.name)))

    def _meta(self, version: int | None, step: int | None, parent: int | None, kind: str) -> dict[str, Any]:
        return {"version": version, "step": step, "parent": parent, "fingerprint": self.fingerprint,
                "kind": kind, "time": time.time(), "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _write(self, path: Path, params: Any, meta: dict[str, Any]) -> None:
        import orbax.checkpoint as ocp

        self._ckptr.save(path, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                       meta=ocp.args.JsonSave(meta)))
        self._unsealed.append(path)

    def _finish(self) -> None:
        """Waits for the writes in flight, then writes each committed one's :data:`SIZES` record (process 0).
        See docs/versions.md, 'Snapshots'."""
        self._ckptr.wait_until_finished()
        unsealed, self._unsealed = self._unsealed, []
        if jax.process_index() != 0:
            return
        for path in unsealed:
            if not path.is_dir() or (path / SIZES).exists():
                continue
            sizes = {f.relative_to(path).as_posix(): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
            tmp = path / f".{SIZES}.tmp"
            tmp.write_text(json.dumps(sizes, indent=0))
            os.replace(tmp, path / SIZES)

    def _check_sizes(self, path: Path) -> None:
        """Every file recorded in ``path``'s size record is there with its recorded size."""
        record = path / SIZES
        if not record.exists():
            return
        try:
            sizes = json.loads(record.read_text())
            items = [(str(rel), int(size)) for rel, size in sizes.items()]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{record}: unreadable size record ({e})") from None
        for rel, size in items:
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{f}: missing from the snapshot ({SIZES} lists it)")
            if f.stat().st_size != size:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {SIZES} records {size} (truncated or corrupt)")

    def save(self, version: int, params: Any, *, step: int | None = None, parent: int | None = None,
             kind: str = "full", protect: Iterable[int] = ()) -> bool:
        """Starts writing ``version``'s snapshot and returns once its arrays are copied to the host (they
        may be donated or deleted after). Waits for the previous write first, then applies retention.

        Returns:
          False if a snapshot of ``version`` already exists (it is kept as it is), True otherwise.
        """
        self.wait(protect)
        if self.path(version).exists():
            return False
        self._write(self.path(version), params, self._meta(int(version), step, parent, kind))
        return True

    def save_base(self, base: Any) -> None:
        """Writes the shared LoRA base once (kept if already there)."""
        if not (self.directory / "base").exists():
            self._finish()
            self._write(self.directory / "base", base, self._meta(None, None, None, "base"))

    def wait(self, protect: Iterable[int] | None = None) -> None:
        """Blocks until every started write is committed, then applies retention (``protect``: versions
        kept besides the newest ``keep_last`` and every ``keep_every``-th; default: the last ones given)."""
        self._finish()
        if protect is not None:
            self._protect = {int(v) for v in protect}
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        keep = retained(self.versions(), self.keep_last, self.keep_every, self._protect)
        for p in list(self.directory.iterdir()):
            if ((m := _SNAP.match(p.name)) and int(m.group(1)) not in keep) or _SNAP_TMP.match(p.name):
                shutil.rmtree(p)  # a dropped version, or a write that never committed

    def metadata(self, version: int) -> dict[str, Any]:
        """The snapshot's metadata (version, step, parent, fingerprint, kind, time)."""
        return self._read(self.path(version))[1]

    def _read(self, path: Path, target: Any = None) -> tuple[Any, dict[str, Any]]:
        import orbax.checkpoint as ocp

        self._finish()
        if not path.is_dir():
            raise CheckpointError(f"no snapshot at {path}; snapshots present: versions {self.versions()}")
        self._check_sizes(path)
        try:
            meta = self._ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: snapshot metadata missing or unreadable ({e!r:.300})") from e
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint:
            got = meta.get("fingerprint") if isinstance(meta, dict) else meta
            raise CheckpointError(f"{path}: snapshot written by config fingerprint {got}, this run's is "
                                  f"{self.fingerprint}")
        if target is None:
            return None, meta
        try:
            restored = self._ckptr.restore(path, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: snapshot params do not restore onto the target ({e!r:.400})") from e
        return restored.params, meta

    def restore(self, version: int, target: Any, shardings: Any = None) -> Any:
        """``version``'s stored params (full, or LoRA adapters) placed in the target shardings.

        Args:
          target: arrays or ``ShapeDtypeStruct``s of the stored tree (e.g. ``TrainState.params``, or
            ``abstract_model(cfg)`` for full params); their shardings are used unless ``shardings`` is given.
          shardings: one ``Sharding`` or a tree of them: where the restored arrays go (any mesh).

        Raises:
          CheckpointError: no snapshot of ``version``, missing metadata, another config fingerprint, or a
            target that does not match what was saved.
        """
        return self._read(self.path(version), abstract_tree(target, shardings))[0]

    def restore_base(self, target: Any, shardings: Any = None) -> Any:
        """The shared LoRA base weights, placed like :meth:`restore` places a version."""
        return self._read(self.directory / "base", abstract_tree(target, shardings))[0]

    def close(self) -> None:
        """Waits for pending writes and releases the writer's threads."""
        self.wait()
        self._ckptr.close()
