"""Package list for setuptools; everything else is in pyproject.toml.

Every ``dora_jax*`` package under ``dora_jax/`` is found automatically, so a new subpackage needs no entry here.
``dora_jax.kernels`` and ``dora_jax.configs`` are named explicitly: their sources are the repository's top-level
``kernels/`` and ``configs/`` folders (``[tool.setuptools.package-dir]`` in pyproject.toml), which a search of
``dora_jax/`` cannot see.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["dora_jax", "dora_jax.*"]) + ["dora_jax.kernels", "dora_jax.configs"])
