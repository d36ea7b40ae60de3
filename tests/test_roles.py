"""Role submeshes on 8 fake devices: trainer on 4, rollout on 4; a policy moves between them on device."""

import jax
import numpy as np
import pytest
from flax import nnx

from dora_jax.config import ConfigError, MeshConfig, RolesConfig, load_config
from dora_jax.models.build import init_model, state_shardings
from dora_jax.sharding import reshard, role_meshes


def _ids(mesh):
    return sorted(d.id for d in mesh.devices.flat)


def test_split_trainer_and_rollout_groups_are_disjoint():
    roles = RolesConfig(placement="split", trainer_devices=4, rollout_groups=2, rollout_data=1, rollout_tensor=-1)
    meshes = role_meshes(MeshConfig(data=1, fsdp=2, tensor=2), roles)
    assert dict(meshes.trainer.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert len(meshes.rollout) == 2 and not meshes.shared
    sets = [_ids(meshes.trainer)] + [_ids(m) for m in meshes.rollout]
    assert sets == [[0, 1, 2, 3], [4, 5], [6, 7]]
    for m in meshes.rollout:
        assert dict(m.shape) == {"data": 1, "fsdp": 1, "tensor": 2}


def test_shared_is_one_mesh():
    meshes = role_meshes(MeshConfig(data=2, fsdp=-1, tensor=2), RolesConfig(rollout_groups=3))
    assert meshes.shared and len(meshes.rollout) == 3 and _ids(meshes.trainer) == list(range(8))


@pytest.mark.parametrize("roles, field", [
    (RolesConfig(placement="split", trainer_devices=8), "roles.trainer_devices"),
    (RolesConfig(placement="split", trainer_devices=2, rollout_groups=4), "roles.rollout_groups"),
    (RolesConfig(placement="split", trainer_devices=4, rollout_groups=1, rollout_data=3, rollout_tensor=-1),
     "roles.rollout_data/rollout_tensor"),
])
def test_bad_split_names_the_field(roles, field):
    with pytest.raises(ConfigError, match=field):
        role_meshes(MeshConfig(data=1, fsdp=-1, tensor=1), roles)


def test_weights_move_trainer_to_rollout_on_device():
    cfg = load_config("tiny_llama", ["roles.placement=split", "roles.trainer_devices=4", "roles.rollout_groups=1",
                                     "target.num_devices=8", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"])
    meshes = role_meshes(cfg.mesh, cfg.roles)
    rules = cfg.mesh.logical_axis_rules
    model = init_model(cfg.model, meshes.trainer, rules, seed=3)
    _, params = nnx.split(model)
    rollout_mesh = meshes.rollout[0]
    target = state_shardings(params, rollout_mesh, rules)
    moved, seconds = reshard(params, target)
    assert seconds > 0
    src, dst = jax.tree.leaves(params), jax.tree.leaves(moved)
    want = jax.tree.leaves(target, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert len(src) == len(dst) == len(want) > 0
    sharded_over_tensor = 0
    for a, b, s in zip(src, dst, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding == s  # the rollout mesh's shardings, not the trainer's
        assert {d.id for d in b.devices()} == {4, 5, 6, 7}
        assert {d.id for d in a.devices()} <= {0, 1, 2, 3}
        sharded_over_tensor += "tensor" in str(s.spec)
    assert sharded_over_tensor > 0  # at least some leaves are actually split over the rollout mesh
