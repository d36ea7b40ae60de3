"""Stopping a run cleanly on a preemption notice: SIGTERM (TPU VMs, SLURM's ``--signal``, Kubernetes) or SIGINT.

The first notice asks the run to stop: the train step in flight finishes, a checkpoint is written at the next
point where no train step is in flight, and :meth:`~dora_jax.run.Runner.run` returns. A second SIGINT stops at
once (``KeyboardInterrupt``), for a person at a terminal who does not want to wait.

Under several processes JAX's preemption service (``jax.distributed``) already owns SIGTERM: it spreads a notice
received by any process to all of them and names one loop step at which every process sees it
(``multihost_utils.reached_preemption_sync_point``). :class:`StopSignals` then leaves SIGTERM to it and asks it
at every loop step, so the processes stop at the same step and write the same checkpoint; SIGINT, which the
service does not watch, is agreed through the run's own decision exchange (any process asking stops all).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


def _jax_preemption_service() -> bool:
    """Whether JAX's preemption sync manager runs in this process: ``jax.distributed`` starts it on connecting
    (unless ``jax_enable_preemption_service`` is off)."""
    import jax

    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class StopSignals:
    """Catches SIGTERM and SIGINT while a run is inside ``with``; :meth:`asked` says whether to stop now.

    Args:
      multi: the run spans several processes (SIGTERM is then left to JAX's preemption service, if it runs).
    """

    def __init__(self, multi: bool = False):
        self.multi = multi
        self.signal: str | None = None  # the name of the first notice received here
        self._previous: dict[int, Any] = {}
        self._service = False
        self._step = 0

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: a run in another thread is not stopped
        self._service = self.multi and _jax_preemption_service()
        watched = [signal.SIGINT] if self._service else [signal.SIGTERM, signal.SIGINT]
        for sig in watched:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop without the checkpoint
        if self.signal is None:
            self.signal = name
            log.warning("%s received: finishing the step in flight, then writing a checkpoint and stopping "
                        "(send SIGINT again to stop at once)", name)

    def asked(self) -> bool:
        """Whether this process asks to stop at this loop step. Called once per loop step, on every process
        alike (the service counts them); under several processes the run stops when any process asks, decided
        in the loop's own exchange of decisions."""
        self._step += 1
        if self._service and self.signal is None:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(self._step):
                self.signal = "SIGTERM"
                log.warning("preemption notice from JAX's preemption service: writing a checkpoint and stopping")
        return self.signal is not None
