"""Rewards computed off the decode loop, in a pool of worker processes, with a time limit per call.

:class:`RewardPool` runs each call in a ``forkserver`` worker; a call that raises, returns a non-finite number,
runs past ``timeout_s`` (its worker is killed and replaced) or takes its worker down yields a
:class:`RewardResult` with ``error`` set, and the run goes on. What callers must know: the function travels by
reference (module-level) and each argument by value; a top-level argument that is not plain data (such as the
task) is sent to each worker once and reused by identity, so it must not change while the pool uses it; each
worker imports the main script, which must keep its work under ``if __name__ == "__main__":``. Why processes
and the start-up costs: docs/runner.md, "Rewards".
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

_FLOAT32_MAX = 3.4028234663852886e38
_PLAIN = (str, bytes, int, float, bool, type(None), tuple, list, dict)
_PRELOAD = ["dora_jax.rewards", "dora_jax.tasks"]
# How long a call may take to load in a worker (unpickling it imports the modules of its function and arguments
# there, once per worker) before the worker is taken for hung; the call's own time limit starts after it.
LOAD_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class RewardResult:
    key: int  # the sample id
    reward: float = 0.0
    correct: bool = False
    error: str = ""  # non-empty: the sample is filtered with this reason
    seconds: float = 0.0
    reason: str = ""  # why the reward is what it is, when the reward function said (a third returned value)


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts; a running server keeps its own
        return ctx
    return multiprocessing.get_context("spawn")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _worker(conn: multiprocessing.connection.Connection, path: list[str], environ: dict[str, str]) -> None:
    """A worker process: runs one call at a time, answering ``(key, reward, correct, error, seconds, reason)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    sys.path[:] = path  # user modules import as they do in the parent
    # The parent's environment as of the worker's start, as a forked or spawned child would see it: a forkserver
    # started earlier hands its children its own, which lacks what the parent has set since.
    os.environ.clear()
    os.environ.update(environ)
    shared: dict[int, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        key, payload = msg
        t0 = time.perf_counter()
        try:
            try:
                fn, args, new = pickle.loads(payload)
                shared.update(new)
                args = [shared[a.token] if isinstance(a, _Shared) else a for a in args]
            except Exception as e:  # noqa: BLE001 - e.g. the function's module cannot be imported here
                raise RuntimeError(f"the reward call could not be loaded in the worker process "
                                   f"({_describe(e)})") from None
            conn.send(key)  # loaded: the call's time limit starts now (a first call may have imported modules)
            t0 = time.perf_counter()
            try:
                reward, correct, *why = fn(*args)
                reward, reason = float(reward), str(why[0]) if why else ""
            except Exception as e:  # noqa: BLE001 - any failure of user code filters the sample
                raise RuntimeError(f"reward function raised {_describe(e)}") from None
            if not (math.isfinite(reward) and abs(reward) <= _FLOAT32_MAX):  # the trainer works in float32
                raise RuntimeError(f"reward function returned a reward {reward} that is not a finite float32 number")
            answer = (key, reward, bool(correct), "", time.perf_counter() - t0, reason)
        except RuntimeError as e:
            answer = (key, 0.0, False, str(e), time.perf_counter() - t0, "")
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return


@dataclasses.dataclass(frozen=True)
class _Shared:
    token: int


@dataclasses.dataclass
class _Slot:
    """One worker process and what it is doing."""

    process: Any
    conn: Any
    has: set[int] = dataclasses.field(default_factory=set)  # shared-object tokens it holds
    job: tuple[int, Callable, tuple] | None = None
    started: float = 0.0
    loaded: bool = False  # the worker has loaded the call and runs it: timeout_s applies from ``started``


def _exit_reason(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RewardPool:
    """``submit(key, fn, *args)`` runs ``fn(*args) -> (reward, correct)`` (or ``(reward, correct, reason)``) in a
    worker process; ``poll()`` returns what has finished, failed or timed out since the last call. Workers start
    on demand (at most ``workers``), are replaced when one dies or is killed, and end at :meth:`close`."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.workers, self.timeout_s = workers, timeout_s
        self._ctx = _context()
        self._jobs: collections.deque = collections.deque()
        self._done: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._slots: list[_Slot] = []
        self._shared: dict[int, tuple[int, Any]] = {}  # id(obj) -> (token, obj): the obj held so ids stay unique
        self._tokens = itertools.count()
        self._outstanding = 0
        self._sent_bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------------

    def submit(self, key: int, fn: Callable[..., tuple[float, bool]], *args: Any) -> None:
        if self._closed:
            raise RuntimeError("RewardPool.submit after close()")
        self._outstanding += 1
        with self._lock:
            self._jobs.append((key, fn, args))
        self._wake()

    @property
    def outstanding(self) -> int:
        """Submitted and not yet returned by :meth:`poll`."""
        return self._outstanding

    @property
    def sent_bytes(self) -> int:
        """Bytes of pickled calls sent to the workers so far (an argument calls share goes once per worker)."""
        return self._sent_bytes

    def poll(self, wait_s: float = 0.0) -> list[RewardResult]:
        """Finished results (failures and timeouts included); waits up to ``wait_s`` when none is ready."""
        out: list[RewardResult] = []
        try:
            out.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._outstanding -= len(out)
        return out

    def close(self) -> None:
        """Ends every worker (a call still running is killed) and the pool's thread; waits for both."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the pool's thread ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b".")
        except OSError:
            pass

    def _start_worker(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker, args=(child, list(sys.path), dict(os.environ)), name="reward-worker", daemon=True)
        p.start()
        child.close()
        slot = _Slot(p, parent)
        self._slots.append(slot)
        return slot

    def _stop(self, slot: _Slot, kill: bool) -> None:
        if kill and slot.process.is_alive():
            slot.process.kill()
        else:
            try:
                slot.conn.send(None)
            except OSError:
                pass
        slot.process.join(5)
        if slot.process.is_alive():
            slot.process.kill()
            slot.process.join()
        slot.conn.close()
        slot.process.close()
        self._slots.remove(slot)

    def _payload(self, slot: _Slot, fn: Callable, args: tuple) -> bytes:
        new, sent = {}, []
        for a in args:
            if isinstance(a, _PLAIN) or dataclasses.is_dataclass(a):
                sent.append(a)
                continue
            token, _ = self._shared.setdefault(id(a), (next(self._tokens), a))
            if token not in slot.has:
                new[token] = a
            sent.append(_Shared(token))
        payload = pickle.dumps((fn, sent, new), protocol=pickle.HIGHEST_PROTOCOL)
        slot.has.update(new)
        return payload

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                idle = next((s for s in self._slots if s.job is None), None)
                if idle is None and len(self._slots) >= self.workers:
                    return
                job = self._jobs.popleft()
            key, fn, args = job
            try:
                slot = idle or self._start_worker()
            except Exception as e:  # noqa: BLE001 - no process could be started: this call fails, named
                self._done.put(RewardResult(key, error=f"no reward worker process could be started "
                                                       f"({_describe(e)})"))
                continue
            try:
                payload = self._payload(slot, fn, args)
            except Exception as e:  # noqa: BLE001 - e.g. a lambda or a function defined in __main__
                self._done.put(RewardResult(key, error=f"the reward call cannot be sent to a worker process "
                                                       f"({_describe(e)}); reward functions and tasks must be "
                                                       "picklable, e.g. defined at module level in an importable "
                                                       "module"))
                continue
            slot.job, slot.started, slot.loaded = job, time.perf_counter(), False
            try:
                slot.conn.send((key, payload))
                self._sent_bytes += len(payload)
            except OSError:
                pass  # the worker is gone: its sentinel reports it below

    def _limit(self, slot: _Slot) -> float:
        return self.timeout_s if slot.loaded else LOAD_TIMEOUT_S

    def _run(self) -> None:
        while not self._closed:
            self._dispatch()
            busy = [s for s in self._slots if s.job is not None]
            now = time.perf_counter()
            wait = min((s.started + self._limit(s) - now for s in busy), default=None)
            ready = multiprocessing.connection.wait(
                [self._wake_r] + [s.conn for s in busy] + [s.process.sentinel for s in busy],
                timeout=None if wait is None else max(0.0, wait))
            if self._wake_r in ready:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            now = time.perf_counter()
            for slot in busy:
                key = slot.job[0]
                answer = None
                if slot.conn in ready or slot.process.sentinel in ready:
                    try:
                        while slot.conn.poll():
                            answer = slot.conn.recv()
                            if answer == key:  # loaded; the answer follows
                                slot.loaded, slot.started, answer = True, time.perf_counter(), None
                                continue
                            break
                    except (EOFError, OSError):
                        pass
                if answer is not None:
                    self._done.put(RewardResult(*answer))
                    slot.job = None
                elif slot.process.sentinel in ready or not slot.process.is_alive():
                    slot.process.join(1)
                    self._done.put(RewardResult(key, error=f"the reward worker process died while scoring "
                                                           f"({_exit_reason(slot.process)})",
                                                seconds=now - slot.started))
                    self._stop(slot, kill=True)
                elif now - slot.started >= self._limit(slot):
                    error = (f"reward function timed out after {self.timeout_s:g}s" if slot.loaded else
                             f"the reward call did not load in its worker process within {LOAD_TIMEOUT_S:g}s "
                             "(importing its modules hung?)")
                    self._done.put(RewardResult(key, error=error, seconds=now - slot.started))
                    self._stop(slot, kill=True)
        for slot in list(self._slots):
            self._stop(slot, kill=slot.job is not None)
        with self._lock:
            self._jobs.clear()
