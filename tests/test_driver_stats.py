"""DriverStats: the counters' arithmetic against hand-derived values."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dora_jax.rollout.stats import RESUMED, DriverStats


def test_dispatches_and_their_figures():
    s = DriverStats()
    for steps, steady in ((8, True), (8, True), (3, False), (1, False)):
        s.count_dispatch(steps, steady)
    s.rows_computed, s.rows_live, s.host_s = 40, 30, 0.008
    assert (s.steps, s.dispatches, dict(s.dispatch_steps)) == (20, 4, {8: 2, 3: 1, 1: 1})
    assert s.decode_steps_per_dispatch == 5.0 and s.steady_decode_steps_per_dispatch == 8.0
    assert s.slot_utilization == 0.75 and s.host_ms_per_dispatch == pytest.approx(2.0)
    empty = DriverStats()
    assert empty.steady_decode_steps_per_dispatch is None and empty.host_ms_per_dispatch is None
    assert empty.kv_bytes_ratio is None and empty.slot_utilization == 0.0


def test_kv_counts_restart_at_the_steady_state_and_keep_only_it():
    s = DriverStats()
    s.count_kv(False, lambda: (64, 32))  # before the steady state: counted until it begins
    assert s.kv_bytes_ratio == 2.0
    s.count_kv(True, lambda: (48, 40))  # the first steady dispatch drops what came before
    s.count_kv(False, lambda: pytest.fail("a drain dispatch was counted"))  # the drain: left out
    s.count_kv(True, lambda: (52, 40))
    assert (s.kv_page_tokens, s.kv_live_tokens) == (100, 80) and s.kv_bytes_ratio == 1.25


def test_host_time_leaves_out_the_cpu_time_spent_waiting(monkeypatch):
    s = DriverStats()

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    monkeypatch.setattr("jax.block_until_ready", lambda data: spin(0.05))
    with s.host_time():
        spin(0.02)
        s.wait(np.zeros(1))
    assert s.wait_s >= 0.05 and s.wait_cpu_s >= 0.05
    assert 0.015 <= s.host_s < 0.04  # the 0.02 s of host work, not the 0.05 s inside the wait


def test_total_sums_counts_and_takes_the_largest_held():
    a, b = DriverStats(rows_computed=10, rows_live=7, batch_steps=3, max_held=1, host_s=0.5),\
        DriverStats(rows_computed=6, rows_live=5, batch_steps=2, max_held=2, host_s=0.25)
    a.count_dispatch(4, True)
    b.count_dispatch(2, False)
    t = DriverStats.total([a, b])
    assert (t.rows_computed, t.rows_live, t.batch_steps, t.max_held, t.host_s) == (16, 12, 5, 2, 0.75)
    assert (t.steps, t.dispatches, dict(t.dispatch_steps), t.steady_dispatches) == (6, 2, {4: 1, 2: 1}, 1)
    assert t.slot_utilization == 12 / 16


def test_restore_continues_the_resumed_counters_only():
    s = DriverStats(steps=9)
    s.restore({"rows_computed": 100, "rows_live": 80, "batch_steps": 12})
    assert tuple(getattr(s, k) for k in RESUMED) == (100, 80, 12) and s.steps == 9
    with pytest.raises(KeyError):
        s.restore({"rows_computed": 1})
