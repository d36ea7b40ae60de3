"""One-off measurements that compare forms of the decode step and of the engine side by side, each run from the
repository root as ``.venv/bin/python -m benchmarks.experiments.NAME [ARGS]``. They time with
:mod:`benchmarks.timing` and share the engine benchmark's prompts and fixed batch (:mod:`benchmarks.engine`)."""
