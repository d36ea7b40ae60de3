"""Rewards computed off the decode loop, in a pool of worker threads, with a time limit per call.

The runner submits each trajectory as it finishes and polls for results between decode steps, so a slow
reward function never stalls decoding. A reward function that raises, returns something that is not a finite
number, or runs past ``timeout_s`` yields a :class:`RewardResult` with ``error`` set: the runner marks that
sample filtered with the reason and the run goes on. A worker stuck in a hung call is abandoned (it is a
daemon thread, so it never blocks the process from exiting) and replaced, so the pool keeps its size.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Any, Callable

_FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class RewardResult:
    key: int  # the sample id
    reward: float = 0.0
    correct: bool = False
    error: str = ""  # non-empty: the sample is filtered with this reason
    seconds: float = 0.0


class RewardPool:
    """``submit(key, fn, *args)`` runs ``fn(*args) -> (reward, correct)`` on a worker; ``poll()`` returns what
    has finished or timed out since the last call."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.timeout_s = timeout_s
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._running: dict[int, tuple[float, int]] = {}  # key -> (start time, worker id)
        self._reported: set[int] = set()
        self._outstanding = 0
        self._next_worker = 0
        self._abandoned: set[int] = set()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        wid = self._next_worker
        self._next_worker += 1
        threading.Thread(target=self._work, args=(wid,), name=f"reward-{wid}", daemon=True).start()

    def _work(self, wid: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # close()
                return
            key, fn, args = job
            t0 = time.perf_counter()
            with self._lock:
                self._running[key] = (t0, wid)
            try:
                reward, correct = fn(*args)
                reward = float(reward)
                if not (math.isfinite(reward) and abs(reward) <= _FLOAT32_MAX):  # the trainer works in float32
                    raise ValueError(f"returned a reward {reward} that is not a finite float32 number")
                result = RewardResult(key, reward, bool(correct), "", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - any failure of user code filters the sample
                result = RewardResult(key, error=f"reward function raised {type(e).__name__}: {e}",
                                      seconds=time.perf_counter() - t0)
            with self._lock:
                self._running.pop(key, None)
                if wid in self._abandoned:
                    return  # this worker was replaced while it hung; its late result is dropped
            self._done.put(result)

    def submit(self, key: int, fn: Callable[..., tuple[float, bool]], *args: Any) -> None:
        self._outstanding += 1
        self._jobs.put((key, fn, args))

    def close(self) -> None:
        """Lets the idle workers exit (a hung one exits when its call returns)."""
        with self._lock:
            live = self._next_worker - len(self._abandoned)
        for _ in range(live):
            self._jobs.put(None)

    @property
    def outstanding(self) -> int:
        """Submitted and not yet returned by :meth:`poll`."""
        return self._outstanding

    def poll(self, wait_s: float = 0.0) -> list[RewardResult]:
        """Finished results, plus a timeout result for every call running past ``timeout_s``. Waits up to
        ``wait_s`` for the first result when none is ready."""
        out: list[RewardResult] = []
        deadline = time.perf_counter() + wait_s
        while True:
            try:
                while True:
                    r = self._done.get_nowait()
                    if r.key not in self._reported:
                        out.append(r)
            except queue.Empty:
                pass
            now = time.perf_counter()
            with self._lock:
                for key, (t0, wid) in list(self._running.items()):
                    if now - t0 > self.timeout_s and wid not in self._abandoned:
                        self._abandoned.add(wid)
                        del self._running[key]
                        out.append(RewardResult(key, error=f"reward function timed out after {self.timeout_s:g}s",
                                                seconds=now - t0))
                        self._spawn()
            if out or now >= deadline:
                break
            time.sleep(min(0.01, max(0.0, deadline - now)))
        for r in out:
            self._reported.add(r.key)
        self._outstanding -= len(out)
        return out
