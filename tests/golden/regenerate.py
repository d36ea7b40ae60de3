"""Rewrites the golden sharding dumps (``tests/golden/shardings_<preset>.json``) from the code as it is now.

Run it after an intended change to a preset's mesh, the logical axis rules or the model's parameters, then
review the diff: ``python tests/golden/regenerate.py``. The tests never write these files;
``tests/test_sharding.py`` compares each one with the code and with the shardings derived from the preset's
rules table by a separate, simple function, so a regenerated file that the rules do not explain still fails.

Every preset sized for the CPU is dumped on 8 fake CPU devices (the tests' count); presets sized for
accelerators are checked by ``dora-jax check`` instead.
"""

from __future__ import annotations

import json
import os
import sys

GOLDEN = os.path.dirname(os.path.abspath(__file__))


def dump(name: str) -> dict:
    """``{"mesh": axis sizes, "params": {param: partition spec}}`` of the preset ``name`` (a file in
    ``configs/``) on this process's devices."""
    from dora_jax.config import configs_dir, load_config
    from dora_jax.models.build import abstract_model, state_shardings
    from dora_jax.sharding import create_mesh, describe_shardings

    cfg = load_config(os.path.join(configs_dir(), name))
    mesh = create_mesh(cfg.mesh)
    _, abstract = abstract_model(cfg.model)
    specs = describe_shardings(state_shardings(abstract, mesh, cfg.mesh.logical_axis_rules))
    return json.loads(json.dumps({"mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), "params": specs}))


def names() -> list[str]:
    """The shipped presets that have a model (simulator presets have none)."""
    from dora_jax.config import configs_dir

    return sorted(f for f in os.listdir(configs_dir()) if f.endswith(".yaml") and not f.startswith("sim_"))


def sized_for_cpu(name: str) -> bool:
    """Whether the preset is sized for the CPU (``target.device_kind``): the others are built on their own
    device count by ``dora-jax check``."""
    from dora_jax.config import configs_dir, load_config

    return load_config(os.path.join(configs_dir(), name)).target.device_kind == "cpu"


def path(name: str) -> str:
    return os.path.join(GOLDEN, f"shardings_{name.removesuffix('.yaml')}.json")


def main() -> int:
    from dora_jax.xla_flags import cpu_device_flags

    os.environ["XLA_FLAGS"] = cpu_device_flags(8, os.environ.get("XLA_FLAGS", ""))  # before JAX starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for name in filter(sized_for_cpu, names()):
        with open(path(name), "w") as f:
            json.dump(dump(name), f, indent=1, sort_keys=True)
        print("wrote", path(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
