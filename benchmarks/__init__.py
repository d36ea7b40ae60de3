"""Benchmarks of dora_jax, outside the installed package: they run from a source checkout (``git clone``, then
``pip install -e .``), through ``dora-jax bench WHAT`` (:mod:`benchmarks.cli`).

One module per benchmark: :mod:`~benchmarks.load`, :mod:`~benchmarks.engine`, :mod:`~benchmarks.prefill`,
:mod:`~benchmarks.decode`, :mod:`~benchmarks.train`, :mod:`~benchmarks.snapshot`, :mod:`~benchmarks.modes` and
:mod:`~benchmarks.kernel` (with the kernel's tile sweep). Every one times with :mod:`benchmarks.timing`, measures
the machine's own rates with :mod:`benchmarks.rates` where it divides by them, and its result carries what
:mod:`benchmarks.record` adds; :mod:`~benchmarks.workload` is the workload ``modes`` and ``profile`` share.
``learning_seeds.py`` runs :mod:`~benchmarks.digit_task`, the task of the trainer's learning test, over many seeds.
``experiments/`` holds one-off scripts that compare forms of the decode step (``python -m
benchmarks.experiments.NAME`` from the repository root); ``results/`` holds the JSON behind docs/performance.md.
"""
