"""Where a run's work lives: the trainer's mesh, the rollout engines' meshes, and how a version moves between.

:class:`Placement` (built by :meth:`Placement.build` from ``roles.placement``: ``shared`` time-shares one
device set, ``split`` gives the trainer and each rollout group their own) holds the trainer, the engines and
:meth:`Placement.to_rollout`, which moves a version's weights device to device
(:func:`~dora_jax.sharding.reshard`, or :class:`~dora_jax.sharding.ProcessLocalCopy` under several
processes). :func:`make_engine` builds one engine. The loop never looks at meshes. docs/runner.md,
"Placement", and docs/scale.md give the layouts.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from dora_jax.config import Config
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.groups import DriverGroups, VersionGroups
from dora_jax.rollout.engine import Engine, bucket
from dora_jax.sharding import reshard
from dora_jax.trainer import Trainer


def make_engine(cfg: Config, model: Any, mesh: Any = None) -> Engine:
    """The rollout engine a run of ``cfg`` uses: ``rollout.slots`` slots, room for the longest prompt plus
    ``rollout.max_new_tokens``, and the rollout section's decode settings."""
    from dora_jax.models.decoder import DecodeSettings

    r = cfg.rollout
    target = min(bucket(r.max_prompt_len + r.max_new_tokens), cfg.model.max_seq_len)
    return Engine(model, max_concurrent_decodes=r.slots, max_prefill_length=r.max_prompt_len,
                  max_target_length=target, mesh=mesh, dtype=r.dtype, settings=DecodeSettings.of(r),
                  rules=cfg.mesh.logical_axis_rules, page_tokens=r.page_tokens, num_pages=kv_pages(cfg))


def kv_pages(cfg: Config) -> int:
    """``rollout.kv_pages``, ``0`` resolved: room for every slot at its longest sequence."""
    r = cfg.rollout
    longest = -(-(r.max_prompt_len + r.max_new_tokens) // r.page_tokens)
    return r.kv_pages or r.slots * longest


def _device_set(mesh: Any) -> frozenset[Any] | None:
    return None if mesh is None else frozenset(mesh.devices.flat)


class Placement:
    """The trainer, its initial state and the rollout engines of a run, on the devices ``cfg.roles`` gives each,
    with the transfer of a version from the trainer to the engines. Build one with :meth:`build`; with
    ``keep_initial`` it serves several runs of the same model and trainer settings, each from a copy of the
    initial state.

    Attributes:
      trainer: the :class:`~dora_jax.trainer.Trainer` (its mesh spans every process's devices).
      engines: one rollout engine per rollout group (this process's own; with ``roles.rollout_span = all``
        the one engine over every process's devices).
      disjoint: whether the engines' devices are not the trainer's (``split``).
      multi: whether the run spans several processes.
      spans: whether the one rollout engine's mesh spans several processes (every process drives it alike).
      elastic_engine: the elastic group's engine on the trainer's devices (``roles.elastic_group``), or None.
    """

    def __init__(self, cfg: Config, trainer: Trainer, state: Any, engines: Sequence[Engine], *,
                 local_meshes: Sequence[Any] | None = None, keep_initial: bool = False,
                 elastic_engine: Engine | None = None):
        from dora_jax.models.build import abstract_model, state_shardings
        from dora_jax.sharding import ProcessLocalCopy

        self.cfg, self.trainer, self.engines = cfg, trainer, list(engines)
        self.elastic_engine = elastic_engine
        self.tokenizer = None  # the weights' own tokenizer, when build loaded them
        self.multi = jax.process_count() > 1
        engine_devices = _device_set(self.engines[0].mesh)
        self.disjoint = engine_devices is not None and not engine_devices & _device_set(trainer.mesh)
        self.spans = self.engines[0].spans_processes
        self._state = state
        # A pristine copy, only when several runs start from it (the first train step donates the state).
        self._initial = jax.tree.map(lambda x: x.copy(), state) if keep_initial else None
        self._shardings = ([state_shardings(abstract_model(cfg.model)[1], e.mesh, cfg.mesh.logical_axis_rules)
                            for e in self.engines] if self.disjoint or self.multi else None)
        # Several processes: each process's copy into its group g, from the trainer's devices or those it shares
        # with them; every process copies into its own group g at once (local_meshes[p][g]).
        self._to_local = ([ProcessLocalCopy(self._shardings[g], [m[g] for m in local_meshes])
                           for g in range(len(self.engines))] if self.multi and not self.spans else None)

    @classmethod
    def build(cls, cfg: Config, model: Any = None, devices: list[jax.Device] | None = None, *,
              keep_initial: bool = False, progress: bool = True) -> "Placement":
        """Lays ``cfg.mesh`` and ``cfg.roles`` over ``devices`` (default: all) and creates the trainer and one engine
        per rollout group. ``model``: the policy (default: ``cfg.model``'s weights or a random init; their
        tokenizer is then :attr:`tokenizer`)."""
        from dora_jax.models.weights import load_model
        from dora_jax.config import ConfigError
        from dora_jax.sharding import RoleMeshes, create_mesh, process_role_meshes, role_meshes, rollout_mesh_config

        local = None
        if jax.process_count() > 1 and cfg.roles.rollout_span == "all":
            # One engine over every process's devices, listed in the trainer's order so that a version moves by
            # one compiled relayout on the same devices.
            trainer_mesh = create_mesh(cfg.mesh, devices)
            try:
                rollout_mesh = create_mesh(rollout_mesh_config(cfg.roles), list(trainer_mesh.devices.flat))
            except ConfigError as e:
                raise ConfigError(f"roles.rollout_data/rollout_tensor with roles.rollout_span=all: {e}") from None
            meshes = RoleMeshes(trainer_mesh, (rollout_mesh,))
        elif jax.process_count() > 1:  # each process decodes on its own devices (no decode program spans processes)
            trainer_mesh, local = process_role_meshes(cfg.mesh, cfg.roles, devices)
            meshes = RoleMeshes(trainer_mesh, local[jax.process_index()])
        else:
            meshes = role_meshes(cfg.mesh, cfg.roles, devices)
        tokenizer = None
        if model is None:
            model, tokenizer = load_model(cfg.model, meshes.trainer, cfg.mesh.logical_axis_rules, seed=cfg.run.seed,
                                          progress=progress)
        trainer, state = Trainer.create(cfg, model=model, mesh=meshes.trainer)
        if local is not None:
            placement = cls(cfg, trainer, state, [make_engine(cfg, model, m) for m in meshes.rollout],
                            local_meshes=local, keep_initial=keep_initial)
        else:
            elastic = make_engine(cfg, model, meshes.trainer) if cfg.roles.elastic_group else None
            placement = cls(cfg, trainer, state, [make_engine(cfg, model, m) for m in meshes.rollout],
                            keep_initial=keep_initial, elastic_engine=elastic)
        placement.tokenizer = tokenizer
        return placement

    @property
    def engine(self) -> Engine:
        """The first rollout group's engine (evaluation decodes there)."""
        return self.engines[0]

    def take_state(self) -> Any:
        """The initial train state for a run: the built one, or with ``keep_initial`` a fresh copy of it."""
        if self._initial is not None:
            return jax.tree.map(lambda x: x.copy(), self._initial)
        state, self._state = self._state, None
        if state is None:
            raise RuntimeError("this placement's initial state was taken by an earlier run (its first train step "
                               "donated it): build the placement with keep_initial=True to run it again")
        return state

    def drivers(self, eos_ids: Sequence[int], overlap: bool, shared_prefix: tuple[int, ...], *,
                one_version: bool = False) -> RolloutDriver | DriverGroups:
        """A rollout driver over the engines: the one engine's :class:`RolloutDriver`, a :class:`DriverGroups` over
        several, or with ``one_version`` (``roles.versions_per_group: 1``) a :class:`VersionGroups` (the elastic
        group last)."""
        drivers = [RolloutDriver(e, eos_ids=eos_ids, overlap=overlap, shared_prefix=shared_prefix)
                   for e in self.engines]
        if one_version:
            elastic = (None if self.elastic_engine is None else
                       RolloutDriver(self.elastic_engine, eos_ids=eos_ids, overlap=overlap, shared_prefix=shared_prefix))
            return VersionGroups(drivers, elastic=elastic)
        return drivers[0] if len(drivers) == 1 else DriverGroups(drivers)

    def to_rollout(self, params: Any) -> tuple[list[Any], float]:
        """A version's params (on the trainer's mesh) as each rollout group takes them, and the seconds spent moving
        them (0 when nothing moves)."""
        copies, secs = [], 0.0
        for group in range(len(self.engines)):
            copy, s = self.to_group(params, group)
            copies.append(copy)
            secs += s
        return copies, secs

    def to_group(self, params: Any, group: int) -> tuple[Any, float]:
        """As :meth:`to_rollout`, for rollout group ``group`` only (``len(engines)``: the elastic group, which takes
        the trainer's params as they are).

        Raises:
          IndexError: there is no such group.
        """
        if self.elastic_engine is not None and group == len(self.engines):  # on the trainer's devices already
            return params, 0.0
        if not 0 <= group < len(self.engines):
            raise IndexError(f"rollout group {group}: the placement has {len(self.engines)} groups")
        if (self.disjoint and not self.multi) or self.spans:  # device to device, onto this group's mesh
            return reshard(params, self._shardings[group])
        if self._to_local is not None:  # several processes: this process's copy, device to device
            return self._to_local[group](params)
        return params, 0.0
