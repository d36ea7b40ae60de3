"""A run's clocks and counters: what each update's metrics row and the summary report about time and tokens."""

from __future__ import annotations

import time
from typing import Any


class Meter:
    """Time and token counters of one run, continued across a resume from a checkpoint's ``counters``.

    ``step_s`` of an update is the wall time since the previous update, less the time spent writing a
    checkpoint in between, so that it counts rollout and training only. Besides times, each update reports
    the decode batch-steps it took (per trained sample too): counts that do not depend on the machine, and that
    are the same for a fixed seed and configuration.
    """

    def __init__(self, counters: dict[str, Any]):
        self.last = time.perf_counter()
        self.t0 = self.last - counters["wall_s"]  # wall_s continues across a resume
        self.train_total, self.checkpoint_s, self.total_gen = (counters["train_s"], counters["checkpoint_s"],
                                                               counters["gen_tokens"])
        self._interval()

    def _interval(self) -> None:
        self.rollout_s, self.gen_tokens, self.live_rows, self.slot_rows, self.batch_steps = 0.0, 0, 0, 0, 0

    def decoded(self, secs: float, rows: int, batch_steps: int, slots: int) -> None:
        """One loop iteration's decoding: ``rows`` tokens generated in ``secs`` by ``batch_steps`` device decode
        steps, out of ``slots`` decode slots (nothing when the rollout side had nothing to decode: ``secs`` 0)."""
        if secs > 0:
            self.rollout_s += secs
            self.gen_tokens += rows
            self.live_rows += rows
            self.slot_rows += slots
            self.batch_steps += batch_steps

    def update(self, row: dict[str, Any], train_s: float) -> dict[str, Any]:
        """``row`` with the time and throughput figures of the update that just completed; starts the next."""
        now = time.perf_counter()
        self.train_total += train_s
        self.total_gen += self.gen_tokens
        step_s, wall = now - self.last, now - self.t0
        row.update({"wall_s": wall, "step_s": step_s, "train_s": train_s, "rollout_s": self.rollout_s,
                    "rollout_share": max(0.0, 1 - train_s / step_s),
                    "trainer_idle_fraction": 1 - self.train_total / wall, "gen_tok_s": self.gen_tokens / step_s,
                    "train_tok_s": row["trained_tokens"] / step_s,
                    "slot_occupancy": self.live_rows / max(self.slot_rows, 1),
                    # Device-independent: what the update cost in decode batch-steps, whatever the hardware.
                    "decode_batch_steps": self.batch_steps,
                    "decode_batch_steps_per_sample": self.batch_steps / max(row["samples"], 1),
                    "trainer_idle_s": max(0.0, step_s - train_s), "rollout_idle_s": max(0.0, step_s - self.rollout_s)})
        self.last = now
        self._interval()
        return row

    def checkpointed(self, secs: float) -> None:
        """A checkpoint took ``secs``: counted apart, and not in the next update's ``step_s``."""
        self.checkpoint_s += secs
        self.last += secs

    def counters(self, **extra: Any) -> dict[str, Any]:
        """What a checkpoint saves to continue these counters."""
        return {**extra, "wall_s": time.perf_counter() - self.t0, "train_s": self.train_total,
                "gen_tokens": self.total_gen, "checkpoint_s": self.checkpoint_s}
