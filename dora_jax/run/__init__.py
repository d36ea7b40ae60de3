"""A training run: the loop (:class:`Runner`), where its parts live (:class:`Placement`), its rollout and
trainer sides, evaluation, and the checks it makes before it starts."""

from dora_jax.run.evaluation import RunError
from dora_jax.run.loop import Runner
from dora_jax.run.placement import Placement, make_engine

__all__ = ["Placement", "RunError", "Runner", "make_engine"]
