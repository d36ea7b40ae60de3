"""The resident policy versions of a run: the one :class:`~dora_jax.run.versions.VersionStore`, and the rollout
engines kept in step with it (:class:`Residency`).

A version's refcount is its samples not yet trained plus, during an evaluation of it, its held-out answers not
yet decoded; a version that is not the newest and has none is drained and leaves the store and the engines,
before a new version is loaded. The cap, K + 1 versions, is hard on both sides: a publish or load past it
raises :class:`~dora_jax.run.versions.VersionError`. At one version per rollout group
(:class:`~dora_jax.rollout.groups.VersionGroups`) a version reaches a group only through :meth:`Residency.load_group`.
docs/runner.md, "The loop" (Residency), gives the convention and how the figures are measured.
"""

from __future__ import annotations

from typing import Any

from dora_jax.rollout.groups import VersionGroups
from dora_jax.run.placement import Placement
from dora_jax.run.versions import VersionError, VersionStore


class Residency:
    """Versions held for a run: in the store (the trainer's copy, for recomputed log-probs and snapshots) and
    loaded into the rollout driver (each rollout group's copy).

    Args:
      max_resident: the cap, K + 1.
      placement: where the engines are, and how a version reaches them.
      driver: the rollout driver (or driver groups); with :class:`~dora_jax.rollout.groups.VersionGroups` a
        version is loaded into a group by :meth:`load_group`, never by :meth:`load`.
    """

    def __init__(self, max_resident: int, placement: Placement, driver: Any):
        self.store = VersionStore(max_resident)
        self.placement, self.driver = placement, driver
        self.sync_s = 0.0  # trainer -> rollout weight transfers, in total
        self.store_max_resident = 0  # the most versions the store held at once
        self._restored = 0  # the figure a resumed run had reached before its checkpoint
        self._restored_per_group = 0  # likewise for max_versions_per_group
        self.per_group = isinstance(driver, VersionGroups)

    @property
    def rollout_max_resident(self) -> int:
        """The most versions the rollout engines held at once (one group's, or every group's together at one version
        per group)."""
        return self.driver.max_versions if self.per_group else self.driver.stats.max_held

    @property
    def max_versions_per_group(self) -> int:
        """The most versions one rollout group held at once, at least a resumed run's figure."""
        return max(self.driver.stats.max_held, self._restored_per_group)

    @max_versions_per_group.setter
    def max_versions_per_group(self, value: int) -> None:  # a resume restores the figure the run had reached
        self._restored_per_group = int(value)

    @property
    def max_resident(self) -> int:
        """The most versions held at once on either side, at least a resumed run's figure."""
        return max(self.store_max_resident, self.rollout_max_resident, self._restored)

    @max_resident.setter
    def max_resident(self, value: int) -> None:  # a resume restores the figure the run had reached
        self._restored = int(value)

    def resident(self) -> set[int]:
        return self.store.resident()

    def __contains__(self, version: int) -> bool:
        """Whether ``version`` is in the store (so its requests can be admitted; except at one version per group,
        it is then loaded into the engines too)."""
        return version in self.store.resident()

    def params(self, version: int) -> Any:
        """A resident version's params on the trainer's devices."""
        return self.store.params(version)

    def rollout_params(self, version: int) -> list[Any]:
        """A resident version's params as each rollout group takes them (moved there again)."""
        return self.placement.to_rollout(self.store.params(version))[0]

    def group_params(self, version: int, group: int) -> Any:
        """A resident version's params moved to rollout group ``group`` only."""
        return self.placement.to_group(self.store.params(version), group)[0]

    def load(self, version: int, params: Any, *, newest: bool) -> None:
        """Makes ``params`` (on the trainer's devices, handed over) resident, as the newest version or (resume) an older
        one, then loads it into the rollout engines (at one version per group: into none)."""
        if newest:
            for v in self.store.publish(version, params, step=version, copy=False):
                self.driver.remove_version(v)
        else:
            self.store.reinstate(version, params, copy=False)
        self.store_max_resident = max(self.store_max_resident, len(self.store.resident()))
        if self.per_group:
            return
        held = self.driver.held()
        if len(held) + 1 > self.store.max_resident:
            raise VersionError(f"loading version {version} into the rollout engines would make {len(held) + 1} "
                               f"versions resident there, above the cap of {self.store.max_resident}; they hold "
                               f"versions {held}, the store {sorted(self.store.resident())}")
        copies, secs = self.placement.to_rollout(params)
        self.sync_s += secs
        self.driver.add_version(version, copies if len(self.placement.engines) > 1 else copies[0])

    def load_group(self, group: int, version: int) -> Any:
        """A resident version's params copied from the store onto rollout group ``group``'s devices (for
        :meth:`VersionGroups.apply`).

        Raises:
          VersionError: the groups would then hold a version the store does not.
        """
        resident = self.store.resident()
        held = set(self.driver.held()) | {version}
        if not held <= resident:
            raise VersionError(f"loading version {version} into rollout group {group}: the groups would hold "
                               f"versions {sorted(held)}, the store only {sorted(resident)} (at most "
                               f"{self.store.max_resident}): a drained version leaves the groups with the store")
        copy, secs = self.placement.to_group(self.store.params(version), group)
        self.sync_s += secs
        return copy

    def count(self, outstanding: dict[int, int]) -> None:
        """Sets every resident version's refcount to ``outstanding`` (samples not trained, answers decoding)."""
        for v in self.store.resident():
            want, have = outstanding.get(v, 0), self.store.refcount(v)
            if want > have:
                self.store.acquire(v, want - have)
            elif want < have:
                self.store.release(v, have - want)

    def evict_drained(self, outstanding: dict[int, int]) -> list[int]:
        """:meth:`count`, then evicts the drained versions from the store and the engines; returns them."""
        self.count(outstanding)
        gone = self.store.evict_drained()
        for v in gone:
            self.driver.remove_version(v)
        return gone
