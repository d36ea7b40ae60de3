"""Pallas kernels, importable as ``dora_jax.kernels``.

Each kernel file holds the public wrapper (with an ``interpret`` flag for CPU) and beside it the XLA
implementation of the same contract, the one the engine runs where no kernel is chosen. Their oracle is not
here: the tests check every implementation against float64 NumPy references of their own.
"""
