"""Creating models already sharded: ``eval_shape`` the init, derive shardings, jit the init with them.

The functional view used by the engine and trainer is ``graphdef, state = nnx.split(model)``; jitted code
takes ``state`` (a pytree of arrays) and rebuilds the module with ``nnx.merge(graphdef, state)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from dora_jax.config import ModelConfig
from dora_jax.models.decoder import Decoder, param_axes
from dora_jax.sharding import Rules, serial_jit, tree_shardings


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph definition and a state of ShapeDtypeStructs, without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """A state-shaped tree of NamedShardings from the parameters' logical axes and the rules table.

    Raises:
      ConfigError: naming the parameter if a mesh axis does not divide the dimension it shards.
    """
    values = jax.tree.map(lambda v: v.get_value(), abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tree_shardings(values, param_axes(abstract_state), mesh, rules)


def init_model(cfg: ModelConfig, mesh: Mesh | None = None, rules: Rules = (), *, seed: int = 0) -> Decoder:
    """A randomly initialized model whose parameters are created directly in their shardings."""
    graphdef, _ = abstract_model(cfg)
    return nnx.merge(graphdef, _jitted_init(cfg, mesh, tuple(rules))(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg: ModelConfig, mesh: Mesh | None, rules: Rules) -> Callable[[jax.Array], nnx.State]:
    """The jitted init of one architecture and sharding, shared by every model made alike in this process. The
    key is an argument, not a constant of the program, so models of any seed share one compiled init."""

    def init(key: jax.Array) -> nnx.State:
        return nnx.state(Decoder(cfg, rngs=nnx.Rngs(key)))

    if mesh is None:
        return serial_jit(init)
    return serial_jit(init, out_shardings=state_shardings(abstract_model(cfg)[1], mesh, rules))
