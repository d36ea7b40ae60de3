"""The resident policy versions of a run: the one :class:`~dora_jax.run.versions.VersionStore`, and the rollout
engines kept in step with it.

A version's refcount is its samples not yet trained (the ledger's outstanding ones: pending, decoding, or
finished and waiting for the trainer). A version that is not the newest and has none is drained: it leaves
the store and the engines. The store's cap, K + 1 versions for staleness bound K, is a hard limit: a publish
that would exceed it raises instead of holding one more copy of the weights.
"""

from __future__ import annotations

from typing import Any

from dora_jax.run.placement import Placement
from dora_jax.run.versions import VersionStore


class Residency:
    """Versions held for a run: in the store (the trainer's copy, for recomputed log-probs and snapshots) and
    loaded into the rollout driver (each rollout group's copy).

    Args:
      max_resident: the cap, K + 1.
      placement: where the engines are, and how a version reaches them.
      driver: the rollout driver (or driver groups) the versions are loaded into.
    """

    def __init__(self, max_resident: int, placement: Placement, driver: Any):
        self.store = VersionStore(max_resident)
        self.placement, self.driver = placement, driver
        self.sync_s = 0.0  # trainer -> rollout weight transfers, in total
        self.max_resident = 1

    def resident(self) -> set[int]:
        return self.store.resident()

    def __contains__(self, version: int) -> bool:
        """Whether ``version`` is resident (loaded into the engines: its requests can be admitted)."""
        return version in self.store.resident()

    def params(self, version: int) -> Any:
        """A resident version's params on the trainer's devices."""
        return self.store.params(version)

    def rollout_params(self, version: int) -> list[Any]:
        """A resident version's params as each rollout group takes them (moved there again)."""
        return self.placement.to_rollout(self.store.params(version))[0]

    def load(self, version: int, params: Any, *, newest: bool) -> None:
        """Makes ``params`` (on the trainer's devices, handed over) resident: published as the newest version,
        or brought back as an older one (resume); then loaded into the rollout engines."""
        if newest:
            for v in self.store.publish(version, params, step=version, copy=False):
                self.driver.remove_version(v)
        else:
            self.store.reinstate(version, params, copy=False)
        copies, secs = self.placement.to_rollout(params)
        self.sync_s += secs
        self.driver.add_version(version, copies if len(self.placement.engines) > 1 else copies[0])
        self.max_resident = max(self.max_resident, len(self.store.resident()))

    def count(self, outstanding: dict[int, int]) -> None:
        """Every resident version's refcount becomes its outstanding samples (``Ledger.outstanding()``)."""
        for v in self.store.resident():
            want, have = outstanding.get(v, 0), self.store.refcount(v)
            if want > have:
                self.store.acquire(v, want - have)
            elif want < have:
                self.store.release(v, have - want)

    def evict_drained(self, outstanding: dict[int, int]) -> None:
        """Refcounts brought up to date; the drained versions leave the store and the engines."""
        self.count(outstanding)
        for v in self.store.evict_drained():
            self.driver.remove_version(v)
