"""Pallas kernels, importable as ``dora_jax.kernels``.

Each kernel file holds the public wrapper (with an ``interpret`` flag for CPU) and a ``reference_*`` oracle
beside it, which is also the XLA implementation the wrapper falls back to.
"""
