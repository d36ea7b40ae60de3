"""A policy version moves from the trainer's devices to the rollout devices device to device, never through
the host (docs/design.md, "Scale"), checked under JAX's transfer guards on 8 fake CPU devices.

A host round trip is a device-to-host copy and then a host-to-device one. On the CPU backend JAX does not
guard the first leg (a CPU array already is host memory), so the second one is what stops a round trip here:
every move runs with host-to-device and device-to-host transfers disallowed, explicit ones included, and
device-to-device copies allowed. The same guards stop a deliberately host-routed copy, and ``jax.device_put``
itself, which assembles a layout change between device sets on the host.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dora_jax.config import MeshConfig, load_config
from dora_jax.models.build import abstract_model, init_model, state_shardings
from dora_jax.sharding import ProcessLocalCopy, create_mesh, process_meshes, reshard


@contextlib.contextmanager
def no_host_copies():
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        yield


HOST_COPY = "Disallowed host-to-device transfer"
D = jax.devices()


def _mesh(devices, shape, names):
    return Mesh(np.array(devices).reshape(shape), names)


def _source():
    """A 16 x 16 array cut both ways over devices 0-3 (rows on t, columns on f), as the trainer lays out."""
    return jax.device_put(jnp.arange(256.0).reshape(16, 16), NamedSharding(_mesh(D[:4], (2, 2), ("f", "t")),
                                                                          P("t", "f")))


TARGETS = {
    "disjoint devices, rows cut four ways": NamedSharding(_mesh(D[4:], (1, 4), ("f", "t")), P("t", "f")),
    "disjoint, fewer devices, columns cut": NamedSharding(_mesh(D[4:6], (2,), ("t",)), P(None, "t")),
    "disjoint, replicated": NamedSharding(_mesh(D[4:], (4,), ("r",)), P()),
    "the same devices, another layout": NamedSharding(_mesh(D[:4], (4,), ("z",)), P(None, "z")),
    # A compiled relayout needs one device order on both sides; reshard permutes these on the devices.
    "the same devices in another order, another layout": NamedSharding(_mesh(D[3::-1], (4,), ("z",)), P(None, "z")),
    # Every device already holds its block: the result is named by the target's mesh (programs are keyed by it).
    "the same blocks on another mesh": NamedSharding(_mesh(D[:4], (2, 2), ("a", "b")), P("b", "a")),
    "more blocks than source devices": NamedSharding(_mesh(D[2:8], (6,), ("z",)), P(None, None)),
    "eight blocks from four devices": NamedSharding(_mesh(D, (8,), ("z",)), P("z")),
}


@pytest.mark.parametrize("case", sorted(TARGETS))
def test_reshard_moves_device_to_device(case):
    x, target = _source(), TARGETS[case]
    with no_host_copies():
        (out,), _ = reshard((x,), (target,))
    assert out.sharding == target
    assert np.array_equal(np.asarray(out), np.arange(256.0).reshape(16, 16))


def test_the_guards_catch_a_host_round_trip():
    """The same guards stop a copy made through the host, and jax.device_put's own move of a layout change
    between device sets (which is why reshard lays the blocks out first)."""
    x, target = _source(), TARGETS["disjoint devices, rows cut four ways"]
    with no_host_copies():
        with pytest.raises(Exception, match=HOST_COPY):
            jax.device_put(np.asarray(x), target)
        with pytest.raises(Exception, match=HOST_COPY):
            jax.device_put(jax.device_get(x), target)
        with pytest.raises(Exception, match=HOST_COPY):
            jax.device_put(x, target)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_version_reaches_every_rollout_group_device_to_device(groups):
    """Split placement as the runner builds it (trainer on devices 0-3 over fsdp 2 x tensor 2; one rollout
    group on 4-7 over tensor 4, or two on 4-5 and 6-7): Placement.to_rollout under the guards gives each
    group the trainer's values in its own layout on its own devices; Placement.to_group (one version per group)
    gives one group its copy alone."""
    from dora_jax.run import Placement

    cfg = load_config("tiny_llama", ["roles.placement=split", "roles.trainer_devices=4", "target.num_devices=8",
                                     "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", f"roles.rollout_groups={groups}"])
    placement = Placement.build(cfg, progress=False)
    params = placement.trainer.policy_params(placement.take_state())
    with no_host_copies():
        copies, secs = placement.to_rollout(params)
    assert len(copies) == groups and secs > 0
    want = jax.tree.leaves(params)
    for copy, engine in zip(copies, placement.engines):
        devices = set(engine.mesh.devices.flat)
        leaves = jax.tree.leaves(copy)
        assert len(leaves) == len(want)
        for got, ref in zip(leaves, want):
            assert set(got.sharding.device_set) == devices
            assert np.array_equal(np.asarray(got), np.asarray(ref))
    with no_host_copies():
        one, secs = placement.to_group(params, groups - 1)
    assert secs > 0 and all(set(x.sharding.device_set) == set(placement.engines[-1].mesh.devices.flat)
                            for x in jax.tree.leaves(one))
    assert all(np.array_equal(np.asarray(got), np.asarray(ref)) for got, ref in zip(jax.tree.leaves(one), want))


def test_process_local_copy_in_one_process_stays_on_device():
    """The multi-process move (each process's own copy of arrays spanning every process) in one process: the
    trainer's params over a 2 x 2 x 2 mesh to a tensor-4 layout of the same devices, under the guards."""
    cfg = load_config("tiny_llama").model
    trainer_mesh = create_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = load_config("tiny_llama").mesh.logical_axis_rules
    model = init_model(cfg, trainer_mesh, rules, seed=0)
    from flax import nnx

    params = nnx.state(model)
    meshes = process_meshes(MeshConfig(data=2, fsdp=1, tensor=4))
    local = ProcessLocalCopy(state_shardings(abstract_model(cfg)[1], meshes[0], rules), meshes)
    with no_host_copies():
        copy, _ = local(params)
    for got, ref in zip(jax.tree.leaves(copy), jax.tree.leaves(params)):
        assert got.sharding.mesh.shape == meshes[0].shape
        assert np.array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("trainer_shape,rollout",
                         [((1, 4, 1), (1, 1, 4)), ((1, 2, 2), (2, 1, 2)), ((1, 2, 1), (1, 1, 4))],
                         ids=["fsdp4_to_tensor4", "fsdp2xtensor2_to_data2xtensor2", "fsdp2_to_tensor4_whole"])
def test_process_local_copy_from_the_trainers_devices_stays_on_device(trainer_shape, rollout):
    """Split placement's move in one process: the trainer's params to a rollout mesh on other devices (one
    program over both device sets hands each rollout device its block), under the guards; every array equal to
    the trainer's and in the rollout mesh's shardings. In the last case four tensor blocks do not fit the two
    trainer devices, so each rollout device receives whole arrays and cuts its own block."""
    cfg = load_config("tiny_llama").model
    rules = load_config("tiny_llama").mesh.logical_axis_rules
    trainer_mesh = create_mesh(MeshConfig(*trainer_shape), D[:int(np.prod(trainer_shape))])
    from flax import nnx

    params = nnx.state(init_model(cfg, trainer_mesh, rules, seed=0))
    n = int(np.prod(rollout))
    mesh = create_mesh(MeshConfig(*rollout), D[8 - n:])
    shardings = state_shardings(abstract_model(cfg)[1], mesh, rules)
    local = ProcessLocalCopy(shardings, (mesh,))
    with no_host_copies():
        copy, _ = local(params)
        again, _ = local(params)  # the compiled programs reused
    for got, same, ref, want in zip(jax.tree.leaves(copy), jax.tree.leaves(again), jax.tree.leaves(params),
                                    jax.tree.leaves(shardings)):
        assert got.sharding.is_equivalent_to(want, got.ndim) and set(got.sharding.device_set) == set(mesh.devices.flat)
        assert np.array_equal(np.asarray(got), np.asarray(ref)) and np.array_equal(np.asarray(same), np.asarray(ref))


def test_process_local_copy_from_the_trainers_devices_moves_a_part_at_a_time(monkeypatch):
    """With a staging budget of 16 KiB per trainer device the move runs in several parts (what it stages at
    once stays within the budget), and the copy is still the trainer's params, under the guards."""
    from flax import nnx

    import dora_jax.sharding as sharding

    cfg = load_config("tiny_llama").model
    rules = load_config("tiny_llama").mesh.logical_axis_rules
    params = nnx.state(init_model(cfg, create_mesh(MeshConfig(1, 4, 1), D[:4]), rules, seed=0))
    mesh = create_mesh(MeshConfig(1, 1, 4), D[4:])
    shardings = state_shardings(abstract_model(cfg)[1], mesh, rules)
    monkeypatch.setattr(sharding, "MOVE_PART_BYTES", 16 << 10)
    leaves, targets = jax.tree.leaves(params), jax.tree.leaves(shardings)
    parts = sharding.move_parts(leaves, targets, 4)
    assert len(parts) > 2 and sorted(i for p in parts for i in p) == list(range(len(leaves)))
    for p in parts:
        staged = [int(np.prod(targets[i].shard_shape(leaves[i].shape))) * leaves[i].dtype.itemsize for i in p]
        assert len(p) == 1 or sum(staged) <= 16 << 10
    with no_host_copies():
        copy, _ = ProcessLocalCopy(shardings, (mesh,))(params)
    for got, ref, want in zip(jax.tree.leaves(copy), leaves, targets):
        assert got.sharding.is_equivalent_to(want, got.ndim)
        assert np.array_equal(np.asarray(got), np.asarray(ref))
