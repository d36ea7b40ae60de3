"""Counting XLA compilations, and naming the programs compiled after warm-up.

One counter for the whole process (:data:`COUNTER`), fed by ``jax.monitoring``: every backend compilation
(``/jax/core/compile/backend_compile_duration``) and, apart, every program loaded from JAX's persistent
compilation cache (``/jax/compilation_cache/cache_hits``), which costs a read, not a compile. Benchmarks read it
around a timed run (``compiles_during_timing``), the runner after its warm-up.

:class:`Programs` is the registry of one owner's jitted programs (the rollout engine's): once
:meth:`Programs.seal` is called, a call that compiles is logged with its name and argument shapes; it still runs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable

import jax

log = logging.getLogger("dora_jax.compiles")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileCount:
    """Compilations so far: ``compiles`` by the backend, ``cache_loads`` from the persistent cache."""

    compiles: int
    cache_loads: int

    def __sub__(self, other: "CompileCount") -> "CompileCount":
        return CompileCount(self.compiles - other.compiles, self.cache_loads - other.cache_loads)


class CompileCounter:
    """Process-wide compile counts from ``jax.monitoring`` (listeners are registered once, at first use)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compiles = 0
        self._loads = 0
        self.by_name: collections.Counter[str] = collections.Counter()
        self._installed = False

    def install(self) -> "CompileCounter":
        with self._lock:
            if not self._installed:
                jax.monitoring.register_event_duration_secs_listener(self._on_duration)
                jax.monitoring.register_event_listener(self._on_event)
                self._installed = True
        return self

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self._compiles += 1
                self.by_name[str(kwargs.get("fun_name", "?"))] += 1

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self._loads += 1

    def names(self) -> collections.Counter[str]:
        """Compiles so far by program name (a copy)."""
        self.install()
        with self._lock:
            return collections.Counter(self.by_name)

    def count(self) -> CompileCount:
        self.install()
        with self._lock:
            return CompileCount(self._compiles, self._loads)


COUNTER = CompileCounter()


def compile_count() -> CompileCount:
    """The process's compilations so far (:data:`COUNTER`)."""
    return COUNTER.count()


def describe_args(args: tuple, kwargs: dict | None = None) -> str:
    """Argument shapes as ``float32[8,16]``, static values as they are: how a late compile is logged."""
    def one(x: Any) -> str:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"{jax.numpy.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"
        return repr(x)

    leaves = [one(x) for x in jax.tree.leaves((args, kwargs or {}))]
    return ", ".join(leaves[:12]) + (f", ... ({len(leaves)} leaves)" if len(leaves) > 12 else "")


class Programs:
    """Named jitted programs of one owner; compiles them ahead of time (:meth:`compile`) and logs any call that
    compiles after :meth:`seal`.

    Args:
      owner: how the log names the owner (``"rollout engine"``).
      jit: the jit to wrap with (``jax.jit`` or a wrapper of it keeping ``_cache_size``).
    """

    def __init__(self, owner: str, jit: Callable[..., Any] = jax.jit):
        self.owner, self._jit = owner, jit
        self._fns: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.warmed: dict[str, int] = collections.Counter()  # variants compiled ahead of time, per program
        self.sealed = False
        self.late: list[tuple[str, str]] = []  # (program, argument shapes) compiled after seal()

    def jit(self, name: str, fun: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
        """``fun`` jitted under ``name``."""
        return self.add(name, self._jit(fun, **jit_kwargs))

    def add(self, name: str, jitted: Callable[..., Any]) -> Callable[..., Any]:
        """A function already jitted (perhaps shared with other owners), under ``name``."""
        self._fns[name] = jitted

        @functools.wraps(jitted)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.sealed:
                return jitted(*args, **kwargs)
            # Compiles counted around the call, not cache entries: a shape compiled ahead of time by
            # lower().compile() adds an entry at its first call without compiling anything.
            before = COUNTER.count()
            out = jitted(*args, **kwargs)
            if (COUNTER.count() - before).compiles:
                shapes = describe_args(args, kwargs)
                self.late.append((name, shapes))
                log.warning("%s compiled %s after warm-up, for (%s): add this shape to the warm-up", self.owner,
                            name, shapes)
            return out

        call.lower, call._cache_size = jitted.lower, jitted._cache_size
        return call

    def compile(self, name: str, *args: Any) -> None:
        """Compiles program ``name`` for ``args`` (arrays or ``jax.ShapeDtypeStruct``; static arguments as
        values) without running it: its later calls with these shapes compile nothing."""
        self.compile_lowered(name, self.lower(name, *args))

    def lower(self, name: str, *args: Any) -> Any:
        """:meth:`compile`'s first half (tracing, which holds the GIL), for :meth:`compile_lowered` on any thread."""
        return self._fns[name].lower(*args)

    def compile_lowered(self, name: str, lowered: Any) -> None:
        lowered.compile()
        with self._lock:
            self.warmed[name] += 1

    def seal(self) -> None:
        """From now on a new compiled variant is logged (:attr:`late`)."""
        self.sealed = True

    @property
    def total_warmed(self) -> int:
        """Variants compiled ahead of time (:meth:`compile`)."""
        return sum(self.warmed.values())
