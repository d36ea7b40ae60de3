"""Pallas kernels, importable as ``dora_jax.kernels``.

Each kernel file holds the public wrapper (with an ``interpret`` flag for CPU), a ``reference_*`` oracle beside
it, and its block sizes in a frozen dataclass.
"""
