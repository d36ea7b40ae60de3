"""The rollout driver's counters, and the figures that predict accelerator speed, in one object.

A :class:`~dora_jax.rollout.driver.RolloutDriver` keeps one :class:`DriverStats` (``driver.stats``); several
rollout groups report the sum of theirs (:meth:`DriverStats.total`). The run's meter, the benchmarks and the
simulator's timed engine read these figures; docs/rollout.md defines each.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator

import jax

# The counters a run checkpoint saves and a resume restores (the rest restart from zero with the process).
RESUMED = ("rows_computed", "rows_live", "batch_steps")


@dataclasses.dataclass
class DriverStats:
    rows_computed: int = 0  # rows of every decode step run (live, finished in flight, or empty)
    rows_live: int = 0  # rows that produced a token of a live trajectory
    steps: int = 0  # decode steps run by the programs read back (a program of N steps counts those it ran)
    dispatches: int = 0  # decode dispatches read back (one per launch that decoded, however many programs)
    dispatch_steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by steps run
    steady_steps: int = 0  # steps and dispatches of the steady state: every slot live and able to run the whole
    steady_dispatches: int = 0  # program when dispatched
    # Decode batch-steps: one per device decode program step, however many versions it fuses (versions stepped
    # by separate programs count one each). The device-independent cost of decoding.
    batch_steps: int = 0
    prefill_rows: int = 0  # distinct prompts prefilled (a GRPO group's members count once)
    prefilled_tokens: int = 0  # prompt tokens run through prefill (shared prefixes once per version)
    max_held: int = 0  # the most versions held at once, counted at every load and dispatch
    kv_page_tokens: int = 0  # KV page tokens held, and live tokens, summed over the steady state's dispatches
    kv_live_tokens: int = 0
    page_waits: int = 0  # dispatches of a live row cut short, or to nothing, to wait for KV pages
    host_s: float = 0.0  # the driver thread's CPU time dispatching and reading back, device waits left out
    wait_s: float = 0.0  # wall time waiting for the device's results
    wait_cpu_s: float = 0.0  # the thread's CPU time inside those waits (the runtime may spin before it sleeps)
    kv_steady: bool = False  # whether the KV counts have reached the steady state (they restart there once)

    # -- counting -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def host_time(self) -> Iterator[None]:
        """Counts the thread's CPU time inside the block as ``host_s``, less what :meth:`wait` spent inside it."""
        start, waited = time.thread_time(), self.wait_cpu_s
        try:
            yield
        finally:
            self.host_s += time.thread_time() - start - (self.wait_cpu_s - waited)

    def wait(self, data: Any) -> None:
        """Blocks until ``data`` is computed: wall time to ``wait_s``, the thread's CPU time apart from host time."""
        start, cpu = time.perf_counter(), time.thread_time()
        jax.block_until_ready(data)
        self.wait_cpu_s += time.thread_time() - cpu
        self.wait_s += time.perf_counter() - start

    def count_kv(self, steady: bool, tokens: Callable[[], tuple[int, int]]) -> None:
        """One dispatch's KV pages (as tokens) against its live tokens, ``tokens()``, called only when the dispatch
        counts: the first steady dispatch drops what came before; after it, only steady dispatches count."""
        if steady and not self.kv_steady:
            self.kv_steady, self.kv_page_tokens, self.kv_live_tokens = True, 0, 0
        if steady or not self.kv_steady:
            page_tokens, live_tokens = tokens()
            self.kv_page_tokens += page_tokens
            self.kv_live_tokens += live_tokens

    def count_dispatch(self, steps: int, steady: bool) -> None:
        """A dispatch read back, whose longest program ran ``steps`` decode steps."""
        self.steps += steps
        self.dispatches += 1
        self.dispatch_steps[steps] += 1
        if steady:
            self.steady_steps += steps
            self.steady_dispatches += 1

    def restore(self, counters: dict[str, int]) -> None:
        """Continues a resumed run's :data:`RESUMED` counters."""
        for name in RESUMED:
            setattr(self, name, int(counters[name]))

    @classmethod
    def total(cls, parts: Iterable["DriverStats"]) -> "DriverStats":
        """Several drivers' stats as one: counts and times summed, ``max_held`` the largest."""
        out = cls()
        for p in parts:
            for f in dataclasses.fields(cls):
                if f.name == "kv_steady":
                    continue
                a, b = getattr(out, f.name), getattr(p, f.name)
                setattr(out, f.name, max(a, b) if f.name == "max_held" else a + b)
        return out

    # -- figures --------------------------------------------------------------------------------------------

    @property
    def slot_utilization(self) -> float:
        """Live rows over rows computed."""
        return self.rows_live / max(self.rows_computed, 1)

    @property
    def decode_steps_per_dispatch(self) -> float:
        """Device decode steps per host dispatch, the mean (at most the driver's ``decode_steps``)."""
        return self.steps / max(self.dispatches, 1)

    @property
    def steady_decode_steps_per_dispatch(self) -> float | None:
        """:attr:`decode_steps_per_dispatch` over the steady state's dispatches (None if there was none)."""
        return self.steady_steps / self.steady_dispatches if self.steady_dispatches else None

    @property
    def kv_bytes_ratio(self) -> float | None:
        """KV cache bytes held against the live tokens' own KV bytes, in the steady state (all dispatches when
        there was none): pages held by live slots (a group's shared prompt pages once) over live tokens (prompt,
        tokens produced and in flight)."""
        return self.kv_page_tokens / self.kv_live_tokens if self.kv_live_tokens else None

    @property
    def host_ms_per_dispatch(self) -> float | None:
        """Host milliseconds per decode dispatch: admission, bookkeeping, dispatch and reading results back, as
        the driver thread's CPU time (device waits and other threads' time left out)."""
        return 1e3 * self.host_s / self.dispatches if self.dispatches else None
