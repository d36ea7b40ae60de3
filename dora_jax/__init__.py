"""dora_jax: JAX-native asynchronous RL post-training with DORA multi-version streaming rollout.

Every module imports on its own; this package root pulls in nothing heavy.
"""

__version__ = "0.1.0"
