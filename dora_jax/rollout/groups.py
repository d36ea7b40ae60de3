"""Several rollout drivers, each over its own engine on its own devices (``roles.rollout_groups``: data-parallel
rollout), driven as one driver."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from dora_jax.rollout.driver import Request, RolloutDriver, Trajectory, run_all
from dora_jax.rollout.engine import EngineError


class DriverGroups:
    """Several drivers, each over its own engine on its own devices (``roles.rollout_groups``), driven as one.

    A request goes to the group with the most free slots (ties to the lower group), and stays there from
    its first token to its last. A step dispatches every busy group's decode step before reading any result
    back, so groups on disjoint devices decode at the same time. Sampling depends on (seed, sample id,
    position) only, so a sample's tokens do not depend on its group. Every version is loaded in every group
    (:meth:`add_version` takes one copy per group, placed on that group's devices).
    """

    def __init__(self, drivers: Sequence[RolloutDriver]):
        if not drivers:
            raise EngineError("DriverGroups: at least one driver")
        self.drivers = list(drivers)

    def add_version(self, version: int, params_per_group: Sequence[Any]) -> None:
        if len(params_per_group) != len(self.drivers):
            raise EngineError(f"policy version {version}: {len(params_per_group)} copies for {len(self.drivers)} groups")
        for d, p in zip(self.drivers, params_per_group):
            d.add_version(version, p)

    def remove_version(self, version: int) -> None:
        for d in self.drivers:
            d.remove_version(version)

    def held(self) -> list[int]:
        """The versions held by any group (each group holds its own copy of each, on its own devices)."""
        return sorted({v for d in self.drivers for v in d.held()})

    @property
    def max_held(self) -> int:
        """The most versions one group held at once (:attr:`RolloutDriver.max_held`)."""
        return max(d.max_held for d in self.drivers)

    @property
    def versions(self) -> list[int]:
        return self.drivers[0].versions

    def in_flight(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in self.drivers:
            for v, n in d.in_flight().items():
                out[v] = out.get(v, 0) + n
        return out

    @property
    def slots(self) -> int:
        return sum(d.engine.max_concurrent_decodes for d in self.drivers)

    @property
    def overlap(self) -> bool:
        """Whether the groups' drivers dispatch a step before reading the previous one back."""
        return all(d.overlap for d in self.drivers)

    def submit(self, request: Request) -> None:
        free = [d.engine.max_concurrent_decodes - sum(d.in_flight().values()) for d in self.drivers]
        self.drivers[free.index(max(free))].submit(request)

    @property
    def idle(self) -> bool:
        return all(d.idle for d in self.drivers)

    def block_until_ready(self) -> None:
        for d in self.drivers:
            d.block_until_ready()

    def step(self) -> list[Trajectory]:
        busy = [d for d in self.drivers if not d.idle]
        for d in busy:
            d.dispatch()
        return sorted((t for d in busy for t in d.harvest()), key=lambda t: t.sample_id)

    def run(self, requests: Iterable[Request] = ()) -> list[Trajectory]:
        """Submits ``requests`` and steps until everything has finished."""
        return run_all(self, requests)

    @property
    def rows_computed(self) -> int:
        return sum(d.rows_computed for d in self.drivers)

    @rows_computed.setter
    def rows_computed(self, value: int) -> None:  # a resume restores the total into the first group
        self.drivers[0].rows_computed, rest = value, self.drivers[1:]
        for d in rest:
            d.rows_computed = 0

    @property
    def rows_live(self) -> int:
        return sum(d.rows_live for d in self.drivers)

    @rows_live.setter
    def rows_live(self, value: int) -> None:
        self.drivers[0].rows_live, rest = value, self.drivers[1:]
        for d in rest:
            d.rows_live = 0

    @property
    def batch_steps(self) -> int:
        return sum(d.batch_steps for d in self.drivers)

    @batch_steps.setter
    def batch_steps(self, value: int) -> None:
        self.drivers[0].batch_steps, rest = value, self.drivers[1:]
        for d in rest:
            d.batch_steps = 0

    @property
    def slot_utilization(self) -> float:
        return self.rows_live / max(self.rows_computed, 1)

    @property
    def steps(self) -> int:
        return sum(d.steps for d in self.drivers)

    @property
    def dispatches(self) -> int:
        return sum(d.dispatches for d in self.drivers)

    @property
    def waiting_outside(self) -> bool:
        return any(d.waiting_outside for d in self.drivers)

    @waiting_outside.setter
    def waiting_outside(self, value: bool) -> None:  # requests wait outside every group (RolloutDriver's)
        for d in self.drivers:
            d.waiting_outside = value

    @property
    def decode_steps_per_dispatch(self) -> float:
        """Device decode steps per host dispatch over every group (:attr:`RolloutDriver.decode_steps_per_dispatch`)."""
        return self.steps / max(self.dispatches, 1)
