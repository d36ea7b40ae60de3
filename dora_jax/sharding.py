"""Meshes, logical axis rules and shardings.

Parameters and activations carry *logical* axis names (``("embed", "mlp")``); one rules table from the config
(:data:`dora_jax.config.DEFAULT_RULES` or ``mesh.logical_axis_rules`` in YAML) maps them to the mesh axes
``data``, ``fsdp`` and ``tensor``. Nothing else in the code base names a mesh axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dora_jax.config import ConfigError, MeshConfig, RolesConfig
from dora_jax.xla_flags import warn_if_unsafe

MESH_AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, tuple[str, ...]], ...]


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Resolves per-axis sizes (one may be -1) against ``num_devices``; ConfigError if they do not multiply to it."""
    sizes = [cfg.axis_sizes[a] for a in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) do not "
                              f"divide the {num_devices} available devices")
        sizes[sizes.index(-1)] = num_devices // known
    elif known != num_devices:
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {known} devices, but {num_devices} are "
                          f"available; set one axis to -1 to use all of them")
    return tuple(sizes)


def create_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    local_cpu = [d for d in devices if d.platform == "cpu" and d.process_index == jax.process_index()]
    warn_if_unsafe(len(local_cpu))
    try:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001 - topology-aware placement is best effort (e.g. CPU or odd subsets)
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], rules: Rules, *, where: str = "") -> P:
    """Maps logical axis names to a PartitionSpec; a mesh axis is used at most once (first come)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ConfigError(f"logical axis {name!r}{' of ' + where if where else ''} has no entry in "
                              f"mesh.logical_axis_rules (known: {', '.join(sorted(table))})")
        mesh_axes = tuple(a for a in table[name] if a not in used)
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return P(*out)


def mesh_axes(logical: str, mesh: Mesh, rules: Rules) -> tuple[tuple[str, ...], int]:
    """The axes of ``mesh`` that ``rules`` map the logical axis ``logical`` to (those ``mesh`` has), and how many
    shards they make together (1 for none)."""
    entry = logical_to_spec((logical,), rules)[0]
    names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in mesh.shape)
    return names, math.prod(mesh.shape[a] for a in names)


def check_divisible(shape: Sequence[int], spec: P, mesh: Mesh, *, where: str,
                    axes: Sequence[str | None] = ()) -> None:
    """Raises a ConfigError naming ``where`` if a mesh axis does not divide the dimension it shards."""
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        n = math.prod(mesh.shape[a] for a in names)
        if size % n:
            logical = f" (logical axis {axes[dim]!r})" if dim < len(axes) and axes[dim] else ""
            raise ConfigError(
                f"{where}: dimension {dim}{logical} of size {size} is sharded over mesh axes {names} of total "
                f"size {n}, which does not divide it; change the mesh sizes or mesh.logical_axis_rules")


def named_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None,
                   *, where: str = "") -> NamedSharding:
    spec = logical_to_spec(axes, rules, where=where)
    if shape is not None:
        check_divisible(shape, spec, mesh, where=where or "array", axes=axes)
    return NamedSharding(mesh, spec)


# ----------------------------------------------------------------------------------------------------------
# Activation constraints. Model code calls ``constrain(x, ("batch", "length", "act_embed"))``; it is a no-op
# unless a mesh and rules are active (``with activate(mesh, rules):``), so the model runs unsharded as is.

_ACTIVE = threading.local()


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Makes ``mesh`` and ``rules`` the target of :func:`constrain` while tracing inside the block."""
    prev = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (mesh, rules)
    try:
        yield
    finally:
        _ACTIVE.value = prev


def active_mesh() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` made active by :func:`activate` around the current trace, or None."""
    return getattr(_ACTIVE, "value", None)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    active = getattr(_ACTIVE, "value", None)
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(axes, rules)
    # Drop a constraint that would not divide (e.g. a batch of 1 on a data axis of 2): XLA picks a layout.
    for size, entry in zip(x.shape, spec):
        if entry is not None:
            names = (entry,) if isinstance(entry, str) else entry
            if size % math.prod(mesh.shape[a] for a in names):
                return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def tree_shardings(abstract_tree: Any, axes_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a tree of ShapeDtypeStructs given a matching tree of logical-axes tuples."""
    paths_and_shapes = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
    axes_leaves = jax.tree.leaves(axes_tree, is_leaf=lambda a: isinstance(a, tuple))
    out = []
    for (path, leaf), axes in zip(paths_and_shapes, axes_leaves, strict=True):
        where = "param " + jax.tree_util.keystr(path, simple=True, separator="/")
        out.append(named_sharding(mesh, axes, rules, leaf.shape, where=where))
    return jax.tree.unflatten(jax.tree.structure(abstract_tree), out)


def describe_shardings(shardings: Any) -> dict[str, list[Any]]:
    """``{param/path: partition spec as a JSON-able list}`` for golden dumps and ``dora-jax check``."""
    out = {}
    for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        out[key] = [list(e) if isinstance(e, tuple) else e for e in s.spec]
    return out


# ----------------------------------------------------------------------------------------------------------
# Role submeshes: the trainer on one set of devices, rollout groups on others (or every role on one set).


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    """The trainer's mesh and one mesh per rollout group. Under ``shared`` placement they are all the same
    mesh; under ``split`` their device sets are disjoint."""

    trainer: Mesh
    rollout: tuple[Mesh, ...]

    @property
    def shared(self) -> bool:
        return all(m is self.trainer for m in self.rollout)


def rollout_mesh_config(roles: RolesConfig) -> MeshConfig:
    """A rollout group's mesh: ``data`` x ``tensor`` (no fsdp: a decode step must not gather weights)."""
    return MeshConfig(data=roles.rollout_data, fsdp=1, tensor=roles.rollout_tensor)


def role_meshes(mesh_cfg: MeshConfig, roles: RolesConfig,
                devices: Sequence[jax.Device] | None = None) -> RoleMeshes:
    """Splits ``devices`` (default: all, in ``jax.devices()`` order, so whole hosts stay together) into roles.

    ``shared``: one mesh of ``mesh_cfg`` over every device, for trainer and rollout alike. ``split``: the
    trainer's ``mesh_cfg`` mesh over the first ``roles.trainer_devices`` devices; the rest cut into
    ``roles.rollout_groups`` equal consecutive groups, each a :func:`rollout_mesh_config` mesh. Raises
    ConfigError, naming the roles field, when the devices do not split that way.
    """
    devices = list(jax.devices() if devices is None else devices)
    if roles.placement == "shared":
        mesh = create_mesh(mesh_cfg, devices)
        return RoleMeshes(mesh, (mesh,) * roles.rollout_groups)
    n_train = roles.trainer_devices
    rest = len(devices) - n_train
    if rest <= 0:
        raise ConfigError(f"roles.trainer_devices = {n_train} leaves no rollout devices out of {len(devices)}")
    if rest % roles.rollout_groups:
        raise ConfigError(f"roles.rollout_groups = {roles.rollout_groups} does not divide the {rest} rollout devices "
                          f"({len(devices)} devices - roles.trainer_devices {n_train})")
    per_group = rest // roles.rollout_groups
    trainer = create_mesh(mesh_cfg, devices[:n_train])
    groups = []
    for g in range(roles.rollout_groups):
        group_devices = devices[n_train + g * per_group:n_train + (g + 1) * per_group]
        try:
            groups.append(create_mesh(rollout_mesh_config(roles), group_devices))
        except ConfigError as e:
            raise ConfigError(f"roles.rollout_data/rollout_tensor: rollout group of {per_group} devices: {e}") from None
    return RoleMeshes(trainer, tuple(groups))


def settle(tree: Any) -> Any:
    """Waits for ``tree`` when it lives on several CPU devices of this process; returns it unchanged. On CPU
    this runs one multi-device program at a time (docs/scale.md); elsewhere it does nothing.
    """
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            try:
                devices = leaf.sharding.device_set
            except AttributeError:  # a tracer (the call is being traced, e.g. by eval_shape): nothing runs
                break
            # Only this process's devices share its thread pool: a program spanning processes with one device
            # here (a trainer step beside this process's rollout device) may run while the host goes on.
            here = [d for d in devices if d.process_index == jax.process_index()]
            if len(here) > 1 and here[0].platform == "cpu":
                jax.block_until_ready(tree)
            break
    return tree


def serial_jit(fun: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
    """``jax.jit(fun, **jit_kwargs)``, whose calls on the CPU backend also :func:`settle` their results (on
    accelerators, ``jax.jit`` itself). Keeps ``lower`` and ``_cache_size``.
    """
    jitted = jax.jit(fun, **jit_kwargs)
    if jax.default_backend() != "cpu":
        return jitted

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        return settle(jitted(*args, **kwargs))

    call.lower, call._cache_size = jitted.lower, jitted._cache_size  # inspection of the compiled programs
    return call


_RELAYOUTS: dict[Any, Callable[[jax.Array], jax.Array]] = {}


def _relayout(sharding: Any) -> Callable[[jax.Array], jax.Array]:
    """A compiled identity into ``sharding``: XLA's collectives over the input's devices, which must be
    ``sharding``'s (one per target sharding, built once)."""
    fn = _RELAYOUTS.get(sharding)
    if fn is None:
        fn = _RELAYOUTS[sharding] = serial_jit(lambda x: x, out_shardings=sharding)
    return fn


def _ordered_devices(sharding: Any) -> list[jax.Device]:
    return list(sharding.mesh.devices.flat) if isinstance(sharding, NamedSharding) else \
        sorted(sharding.device_set, key=lambda d: d.id)


def _cut(devices: list[jax.Device], pieces: Sequence[int]) -> NamedSharding | None:
    """A sharding over ``devices`` that cuts dimension i into ``pieces[i]`` equal blocks, each block on
    len(devices) / prod(pieces) of them; None when that does not divide."""
    n = math.prod(pieces)
    if len(devices) % n:
        return None
    names = tuple(f"d{i}" for i in range(len(pieces))) + ("copies",)
    mesh = Mesh(np.array(devices, dtype=object).reshape(*pieces, len(devices) // n), names)
    return NamedSharding(mesh, P(*(names[i] if k > 1 else None for i, k in enumerate(pieces))))


def _move(x: Any, target: Any) -> Any:
    """``x`` in ``target`` without a host copy: laid out in the target's blocks on its own devices, then each
    block copied over (the whole array when the blocks do not fit the source devices); docs/scale.md."""
    if not isinstance(x, jax.Array):
        return jax.device_put(x, target)
    if x.sharding.device_set == target.device_set:
        if x.sharding.is_equivalent_to(target, x.ndim):
            # Each device already holds its block: the same buffers, named by the target's sharding (compiled
            # programs are keyed by mesh, so an array left on the source's mesh would compile them again).
            return x if x.sharding == target else _local_array(x, target, x.shape)
        if _ordered_devices(x.sharding) == _ordered_devices(target):
            return _relayout(target)(x)
        # A compiled relayout needs one device order on both sides; jax.device_put permutes on the devices.
        return settle(jax.device_put(x, target))
    pieces = [n // s if s else 1 for n, s in zip(x.shape, target.shard_shape(x.shape))]
    staging = _cut(_ordered_devices(x.sharding), pieces)
    if staging is not None:
        return jax.device_put(_relayout(staging)(x), target)
    whole = _relayout(_cut(_ordered_devices(x.sharding), [1] * x.ndim))(x)
    return _relayout(target)(jax.device_put(whole, _cut(_ordered_devices(target), [1] * x.ndim)))


def reshard(tree: Any, shardings: Any) -> tuple[Any, float]:
    """Moves ``tree`` into ``shardings`` (one ``Sharding`` or a tree of them) device to device, never through
    host memory, and waits for it; with equal shardings nothing moves.

    Returns:
      ``(moved tree, seconds)``, the time including the wait for the last copy.
    """
    t0 = time.perf_counter()
    # ``shardings`` may be a prefix of ``tree`` (as for jax.device_put): each sharding applies to its subtree.
    out = jax.tree.map(lambda s, sub: jax.tree.map(lambda x: _move(x, s), sub), shardings, tree)
    out = jax.block_until_ready(out)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------
# Several processes (multi-controller): the trainer's arrays span every process's devices; each process's
# rollout engine holds its own copy of the policy on its own devices.


def process_meshes(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, ...]:
    """One ``mesh_cfg`` mesh per process over that process's devices among ``devices`` (default: all),
    indexed by process index; every process computes the same tuple. ConfigError (naming the process and its
    device count) when a process's devices do not fit ``mesh_cfg``."""
    devices = list(jax.devices() if devices is None else devices)
    out = []
    for p in range(jax.process_count()):
        mine = [d for d in devices if d.process_index == p]
        if not mine:
            raise ConfigError(f"process {p} has none of the {len(devices)} devices given")
        try:
            out.append(create_mesh(mesh_cfg, mine))
        except ConfigError as e:
            raise ConfigError(f"process {p} ({len(mine)} devices): {e}") from None
    return tuple(out)


def process_role_meshes(mesh_cfg: MeshConfig, roles: RolesConfig, devices: Sequence[jax.Device] | None = None
                        ) -> tuple[Mesh, tuple[tuple[Mesh, ...], ...]]:
    """Under several processes: the trainer's mesh and each process's rollout group meshes, ``local[p][g]`` for
    group ``g`` of process ``p``.

    ``shared``: the trainer's ``mesh_cfg`` mesh spans every device and each process decodes on all of its own (one
    group). ``split``: each process gives its first ``roles.trainer_devices / process_count`` devices to the
    trainer, whose mesh spans those of every process, and cuts the rest into ``roles.rollout_groups`` equal
    consecutive groups (:func:`rollout_mesh_config` meshes), as :func:`role_meshes` does in one process.
    Raises ConfigError, naming the roles field, when the devices do not split that way.
    """
    devices = list(jax.devices() if devices is None else devices)
    rollout_cfg = rollout_mesh_config(roles)
    if roles.placement == "shared":
        return create_mesh(mesh_cfg, devices), tuple((m,) for m in process_meshes(rollout_cfg, devices))
    n, total, groups = jax.process_count(), roles.trainer_devices, roles.rollout_groups
    if total % n:
        raise ConfigError(f"roles.trainer_devices = {total} is not a multiple of the {n} processes: each process "
                          "gives the trainer the same number of its devices")
    trainer, local = [], []
    for p in range(n):
        mine = [d for d in devices if d.process_index == p]
        rest = mine[total // n:]
        if not rest:
            raise ConfigError(f"roles.trainer_devices = {total}: process {p} has {len(mine)} devices, "
                              f"{total // n} of which would train, leaving none to decode")
        if len(rest) % groups:
            raise ConfigError(f"roles.rollout_groups = {groups} does not divide process {p}'s {len(rest)} rollout "
                              f"devices ({len(mine)} devices - roles.trainer_devices / processes {total // n})")
        trainer += mine[:total // n]
        per = len(rest) // groups
        try:
            local.append(tuple(create_mesh(rollout_cfg, rest[g * per:(g + 1) * per]) for g in range(groups)))
        except ConfigError as e:
            raise ConfigError(f"roles.rollout_data/rollout_tensor: process {p}'s rollout groups of {per} "
                              f"devices: {e}") from None
    return create_mesh(mesh_cfg, trainer), tuple(local)


class ProcessLocalCopy:
    """Makes each process's own copy of a tree whose arrays span every process's devices.

    ``local_shardings`` are this process's target shardings (a tree of NamedShardings on
    ``meshes[jax.process_index()]``); the result lives on this process's devices only, moved device to device
    (docs/scale.md). Every process calls it at the same point, with the same tree.
    """

    def __init__(self, local_shardings: Any, meshes: Sequence[Mesh]):
        self.local = jax.tree.leaves(local_shardings)
        self.meshes = tuple(meshes)
        names = meshes[0].axis_names
        stacked = Mesh(np.stack([m.devices for m in meshes]), ("process",) + tuple(names))
        self._devices = frozenset(stacked.devices.flat)
        spread = [NamedSharding(stacked, s.spec) for s in self.local]
        self._spread = jax.jit(lambda xs: list(xs), out_shardings=spread)
        self._across: dict[Any, list[tuple[list[int], _Across]]] = {}

    def __call__(self, tree: Any) -> tuple[Any, float]:
        """``(this process's copy of tree, seconds)``, the time including the wait for the last copy."""
        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(tree)
        if len(leaves) != len(self.local):
            raise ValueError(f"ProcessLocalCopy: the tree has {len(leaves)} arrays, the shardings {len(self.local)}")
        sources = {frozenset(x.sharding.device_set) for x in leaves}
        if len(sources) == 1 and not (source := sources.pop()) & self._devices:  # disjoint: send the blocks
            key = tuple((x.shape, x.dtype, x.sharding) for x in leaves)
            if key not in self._across:
                specs = [s.spec for s in self.local]
                self._across[key] = [(part, _Across([leaves[i] for i in part], [specs[i] for i in part], self.meshes))
                                     for part in move_parts(leaves, self.local, len(source))]
            out = [None] * len(leaves)
            for part, move in self._across[key]:
                # One part at a time: what a move stages on the trainer's devices stays within MOVE_PART_BYTES.
                for i, y in zip(part, jax.block_until_ready(move([leaves[i] for i in part]))):
                    out[i] = y
        else:
            out = []
            for x, sharding in zip(self._spread(leaves), self.local):
                out.append(_local_array(x, sharding, x.shape))
        out = jax.block_until_ready(jax.tree.unflatten(treedef, out))
        return out, time.perf_counter() - t0


MOVE_PART_BYTES = 1 << 30  # per trainer device: what a split move stages at once beside the trainer's state


def move_parts(leaves: list[jax.Array], targets: list[NamedSharding], sources: int) -> list[list[int]]:
    """``leaves``' indices in consecutive parts, each staging at most :data:`MOVE_PART_BYTES` on a source
    device (an array above it alone): its target block, or the whole array when the blocks do not fit the
    ``sources`` devices."""
    parts, part, size = [], [], 0
    for i, (x, target) in enumerate(zip(leaves, targets)):
        block = target.shard_shape(x.shape)
        fits = x.ndim and sources % math.prod(n // b for n, b in zip(x.shape, block)) == 0
        nbytes = (math.prod(block) if fits else x.size) * x.dtype.itemsize
        if part and size + nbytes > MOVE_PART_BYTES:
            parts.append(part)
            part, size = [], 0
        part.append(i)
        size += nbytes
    return parts + [part] if part else parts


def _local_array(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The array of ``sharding`` made of ``x``'s shards on this process's devices of it (no copy)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    shards = [by_device[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


class _Across:
    """The move of a tree from devices of every process (the trainer's) to each process's rollout mesh, for one
    layout of the tree: a staging program on the source devices, then collective permutes to every target
    device, from a source device of its own process where one holds it (docs/scale.md).
    """

    def __init__(self, leaves: list[jax.Array], specs: list[Any], meshes: Sequence[Mesh]):
        src = sorted(leaves[0].sharding.device_set, key=lambda d: (d.process_index, d.id))
        dst = [d for m in meshes for d in m.devices.flat]
        self.mesh = Mesh(np.array(src + dst, dtype=object), ("all",))
        index = {d: i for i, d in enumerate(self.mesh.devices.flat)}
        here = meshes[jax.process_index()]
        self.stagings, self.blocks, self.targets, self.received = [], [], [], []
        routes = []
        for x, spec in zip(leaves, specs):
            targets = [NamedSharding(m, spec) for m in meshes]
            shape = tuple(x.shape) or (1,)  # a scalar travels as one element
            block = targets[0].shard_shape(shape)
            staging = _stage(src, [n // b for n, b in zip(shape, block)]) if x.ndim else None
            whole = staging is None
            if whole:  # every target device receives the whole array and cuts its own block
                block, staging = shape, _stage(src, [1] * len(shape))
            holders: dict[tuple[int, ...], list[jax.Device]] = {}
            for d, idx in staging.devices_indices_map(shape).items():
                holders.setdefault(tuple(s.start or 0 for s in idx), []).append(d)
            load: dict[jax.Device, int] = {}
            recv, perms = np.full(len(index), -1, np.int32), {}
            for t in targets:
                for d, idx in sorted(t.devices_indices_map(tuple(x.shape)).items(), key=lambda kv: index[kv[0]]):
                    key = (0,) * len(shape) if whole else tuple(s.start or 0 for s in idx)
                    # A holder on the receiver's own host first, then the least loaded (fewest rounds).
                    source = min(holders[key], key=lambda h: (h.process_index != d.process_index, load.get(h, 0),
                                                              index[h]))
                    r = load[source] = load.get(source, 0)
                    load[source] += 1
                    perms.setdefault(r, []).append((index[source], index[d]))
                    recv[index[d]] = r
            routes.append((recv, [perms[r] for r in sorted(perms)]))
            self.stagings.append(staging)
            self.blocks.append(block)
            local = targets[jax.process_index()]
            self.targets.append(local)
            self.received.append((shape, NamedSharding(here, P())) if whole else None)
        self.shape_of = [tuple(x.shape) or (1,) for x in leaves]
        self._stage = serial_jit(lambda xs: [x.reshape(s) for x, s in zip(xs, self.shape_of)],
                                 out_shardings=self.stagings)
        dtypes, self.shapes = [x.dtype for x in leaves], [tuple(x.shape) for x in leaves]
        self._blank = serial_jit(lambda: [jnp.zeros(b, t) for b, t in zip(self.blocks, dtypes)],
                                 out_shardings=[NamedSharding(here, P())] * len(leaves))
        self._send = jax.jit(jax.shard_map(functools.partial(_route, routes=routes), mesh=self.mesh,
                                           in_specs=(P("all"),), out_specs=P("all")))
        cut = [(i, t) for i, (t, w) in enumerate(zip(self.targets, self.received)) if w is not None]
        self._cut_at = [i for i, _ in cut]
        shapes = [tuple(leaves[i].shape) for i in self._cut_at]
        self._cut = serial_jit(lambda ys: [y.reshape(s) for y, s in zip(ys, shapes)],
                               out_shardings=[t for _, t in cut]) if cut else None
        self.gsharding = NamedSharding(self.mesh, P("all"))

    def __call__(self, leaves: list[jax.Array]) -> list[jax.Array]:
        staged, blank = self._stage(leaves), self._blank()
        n = self.mesh.devices.size
        glob = []
        for x, b, block in zip(staged, blank, self.blocks):
            shards = [s.data for s in x.addressable_shards] + [s.data for s in b.addressable_shards]
            glob.append(jax.make_array_from_single_device_arrays((n * block[0],) + tuple(block[1:]),
                                                                 self.gsharding, shards))
        sent = self._send(glob)
        out = []
        for y, target, received, shape in zip(sent, self.targets, self.received, self.shapes):
            out.append(_local_array(y, target, shape) if received is None
                       else _local_array(y, received[1], received[0]))
        if self._cut is not None:
            for i, y in zip(self._cut_at, self._cut([out[i] for i in self._cut_at])):
                out[i] = y
        return out


def _stage(devices: list[jax.Device], pieces: Sequence[int]) -> NamedSharding | None:
    """A sharding over ``devices`` (process by process) that cuts dimension i into ``pieces[i]`` blocks, the
    blocks on consecutive devices and their copies along a leading axis (so each process holds every block when
    its device count allows); None when the blocks do not divide the devices."""
    n = math.prod(pieces)
    if len(devices) % n:
        return None
    names = tuple(f"d{i}" for i in range(len(pieces)))
    mesh = Mesh(np.array(devices, dtype=object).reshape(len(devices) // n, *pieces), ("copies",) + names)
    return NamedSharding(mesh, P(*(names[i] if k > 1 else None for i, k in enumerate(pieces))))


def _route(xs: list[jax.Array], routes: list[Any]) -> list[jax.Array]:
    """Inside ``shard_map``: every receiving device's block from its source, one permute per round."""
    i = jax.lax.axis_index("all")
    out = []
    for x, (recv, rounds) in zip(xs, routes):
        y = x
        for r, perm in enumerate(rounds):
            y = jnp.where(jnp.asarray(recv)[i] == r, jax.lax.ppermute(x, "all", perm), y)
        out.append(y)
    return out
