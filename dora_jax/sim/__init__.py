"""Cluster simulator: a discrete-event model of the rollout/trainer pipeline driven by the real scheduler
(:mod:`dora_jax.dora.scheduler`, :mod:`dora_jax.dora.ledger`), to reproduce and project DORA's effects on clusters we
cannot book. See docs/simulator.md."""

from dora_jax.sim.config import Costs, SimConfig, SimConfigError, load_sim_config, parse_config
from dora_jax.sim.engine import Placement
from dora_jax.sim.lengths import LengthDist, length_dist
from dora_jax.sim.run import SimulationError, simulate

__all__ = ["Costs", "LengthDist", "Placement", "SimConfig", "SimConfigError", "SimulationError", "length_dist",
           "load_sim_config", "parse_config", "simulate"]
