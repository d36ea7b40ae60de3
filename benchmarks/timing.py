"""The one timer every benchmark uses.

A call is timed until its result is ready on the device (``jax.block_until_ready`` on whatever it returns), so
asynchronous dispatch does not hide the work. The machines these benchmarks run on are shared and noisy: a
figure is the best (or the median) of several calls, and forms that are compared run alternately, round by
round, so the machine's drift spreads over all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Calls ``fn()`` once.

    Args:
      fn: the work; its result is waited on with ``jax.block_until_ready``.

    Returns:
      ``(result, seconds)``: what ``fn`` returned and the wall time until it was ready.
    """
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def time_calls(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, seconds: float = 0.0) -> list[float]:
    """Seconds of each of several timed calls of ``fn()``.

    Args:
      fn: the work (a closure may carry state from call to call, such as a donated cache).
      repeats: timed calls at least.
      warmup: untimed calls first (the first call compiles).
      seconds: keep timing calls until this long has passed since the warm-up, ``repeats`` or more of them.

    Returns:
      Every timed call's seconds, in order.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < repeats or time.perf_counter() < t_end:
        times.append(timed(fn)[1])
    return times


def best_of(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, seconds: float = 0.0) -> float:
    """The fastest call's seconds of :func:`time_calls` (same arguments)."""
    return min(time_calls(fn, repeats, warmup, seconds))


def median_of(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, seconds: float = 0.0) -> float:
    """The median call's seconds of :func:`time_calls` (same arguments)."""
    return float(statistics.median(time_calls(fn, repeats, warmup, seconds)))


def alternated(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of ``runs`` in turn, ``rounds`` times over, for callables that measure themselves.

    Args:
      runs: name -> a callable returning its own figure (tokens/s of one run, say).
      rounds: calls of each.

    Returns:
      Every figure by name, in the order they were measured.
    """
    seen: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            seen[name].append(fn())
    return seen


def best_alternated(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """:func:`alternated`, each one's largest figure (the best rate)."""
    return {k: max(v) for k, v in alternated(runs, rounds).items()}


def alternated_times(runs: dict[str, Callable[[], Any]], rounds: int, warmup: int = 0) -> dict[str, list[float]]:
    """Times each of ``runs`` in turn, ``rounds`` times over.

    Args:
      runs: name -> the work; its result is waited on with ``jax.block_until_ready``.
      rounds: timed rounds; each calls every one of ``runs`` once.
      warmup: untimed rounds first, alternated the same way.

    Returns:
      Every timed call's seconds by name.
    """
    for _ in range(warmup):
        for fn in runs.values():
            jax.block_until_ready(fn())
    return alternated({name: lambda fn=fn: timed(fn)[1] for name, fn in runs.items()}, rounds)
