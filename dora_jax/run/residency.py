"""The resident policy versions of a run: the one :class:`~dora_jax.run.versions.VersionStore`, and the rollout
engines kept in step with it.

A version's refcount is its samples not yet trained (the ledger's outstanding ones: pending, decoding, or
finished and waiting for the trainer), and during an evaluation of it (``task.eval_every``) its held-out answers
not yet decoded. A version that is not the newest and has none is drained: it leaves the store and the engines.
The cap, K + 1 versions for staleness bound K, is a hard limit on both sides: a
publish that would exceed it in the store, or a load into rollout engines that already hold K + 1 versions,
raises instead of holding one more copy of the weights.

The drained versions leave before the new one arrives: the store evicts them as it publishes, the driver
unloads them (waiting for a decode step still computing with one), and only then is the new version moved
to the rollout devices and loaded. The cap counts the new version. :attr:`Residency.max_resident` reports
the most versions either side held, measured where the weights are: the store's after every publish, and
the rollout driver's own count (:meth:`~dora_jax.rollout.driver.RolloutDriver.held`) after every load and
every decode step it dispatches.

At one version per rollout group (``roles.versions_per_group: 1``, :class:`~dora_jax.rollout.groups.VersionGroups`)
a published version is not loaded into every group: the store holds it, and a group takes it when a balancer's
plan gives it that version (:meth:`Residency.load_group`, a copy onto that group's devices only). The groups
hold only versions the store holds (a drained version leaves the groups that served it), so the versions they
hold together stay within the K + 1; :attr:`Residency.rollout_max_resident` is then the most they held
together, and :attr:`Residency.max_versions_per_group` the most one group held (1).
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
      driver: the rollout driver (or driver groups) the versions are loaded into; with
        :class:`~dora_jax.rollout.groups.VersionGroups` (one version per group) a version is loaded into a group
        by :meth:`load_group`, never by :meth:`load`.
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
        """The most versions the rollout engines held at once (the driver's own count): one group's when every
        group holds every version, every group's together at one version per group."""
        return self.driver.max_versions if self.per_group else self.driver.stats.max_held

    @property
    def max_versions_per_group(self) -> int:
        """The most versions one rollout group held at once (the drivers' own counts; 1 at one version per
        group), and at least the figure a resumed run had reached before its checkpoint."""
        return max(self.driver.stats.max_held, self._restored_per_group)

    @max_versions_per_group.setter
    def max_versions_per_group(self, value: int) -> None:  # a resume restores the figure the run had reached
        self._restored_per_group = int(value)

    @property
    def max_resident(self) -> int:
        """The most versions held at once on either side (the store; each rollout group), and at least the
        figure a resumed run had reached before its checkpoint."""
        return max(self.store_max_resident, self.rollout_max_resident, self._restored)

    @max_resident.setter
    def max_resident(self, value: int) -> None:  # a resume restores the figure the run had reached
        self._restored = int(value)

    def resident(self) -> set[int]:
        return self.store.resident()

    def __contains__(self, version: int) -> bool:
        """Whether ``version`` is resident (loaded into the engines, at one version per group into the store: its
        requests can be admitted, at one version per group into the groups serving it)."""
        return version in self.store.resident()

    def params(self, version: int) -> Any:
        """A resident version's params on the trainer's devices."""
        return self.store.params(version)

    def rollout_params(self, version: int) -> list[Any]:
        """A resident version's params as each rollout group takes them (moved there again)."""
        return self.placement.to_rollout(self.store.params(version))[0]

    def group_params(self, version: int, group: int) -> Any:
        """A resident version's params as rollout group ``group`` takes them (moved there again, to that group
        only)."""
        return self.placement.to_group(self.store.params(version), group)[0]

    def load(self, version: int, params: Any, *, newest: bool) -> None:
        """Makes ``params`` (on the trainer's devices, handed over) resident: published as the newest version,
        or brought back as an older one (resume); then loaded into the rollout engines (at one version per group:
        into none, :meth:`load_group` loads it where a plan puts it)."""
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
        """A resident version's params moved onto rollout group ``group``'s devices (device to device, from the
        store's copy), for a group a plan gives ``version`` (:meth:`VersionGroups.apply` loads them).

        Raises:
          VersionError: ``version`` is not resident in the store, or the groups would hold a version the store does
            not (the K + 1 would no longer bound them).
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
        """Every resident version's refcount becomes what holds it: its outstanding samples
        (``Ledger.outstanding()``) and held-out answers still decoding."""
        for v in self.store.resident():
            want, have = outstanding.get(v, 0), self.store.refcount(v)
            if want > have:
                self.store.acquire(v, want - have)
            elif want < have:
                self.store.release(v, have - want)

    def evict_drained(self, outstanding: dict[int, int]) -> list[int]:
        """Refcounts brought up to date (:meth:`count`); the drained versions leave the store and the engines.
        Returns them."""
        self.count(outstanding)
        gone = self.store.evict_drained()
        for v in gone:
            self.driver.remove_version(v)
        return gone
