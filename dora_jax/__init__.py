"""dora_jax: JAX-native asynchronous RL post-training with DORA multi-version streaming rollout.

Every module imports on its own; this package root pulls in nothing heavy.
"""

import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _map_checkout_kernels() -> None:
    """Makes ``dora_jax.kernels`` the checkout's ``kernels/`` when this package runs from a source checkout on
    ``sys.path`` without an install (an accelerator machine that was handed the tree, not a wheel). An install
    maps that folder itself (pyproject.toml's ``package-dir``), and then this does nothing."""
    name = __name__ + ".kernels"
    if name in _sys.modules or _util.find_spec(name) is not None:
        return
    folder = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kernels")
    init = _os.path.join(folder, "__init__.py")
    if not _os.path.isfile(init):
        return
    spec = _util.spec_from_file_location(name, init, submodule_search_locations=[folder])
    module = _util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module


_map_checkout_kernels()
