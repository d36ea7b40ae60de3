"""The shipped YAML presets, installed as the package ``dora_jax.configs`` so ``importlib.resources`` finds them
(``dora_jax.config.configs_dir``)."""
