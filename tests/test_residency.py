"""Promise 4 where the weights are: the versions the rollout driver holds, counted by the driver itself, never
exceed K + 1, and a drained version leaves before the new one arrives.

The run-level check (every mode and placement) is ``tests/test_runner.py::test_each_mode_keeps_the_promises``;
here the order of events inside one publish, the hard cap on the rollout side, the reported figure, and the
driver's release of a removed version's weights while a decode step that used it is still in flight.
"""

import gc
import types
import weakref

import jax
import pytest
from flax import nnx

from dora_jax.config import ModelConfig
from dora_jax.models.build import init_model
from dora_jax.models.decoder import DecodeSettings
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.groups import DriverGroups
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.samples import Request
from dora_jax.run.residency import Residency
from dora_jax.run.versions import VersionError


class Recording(RolloutDriver):
    """A driver over an engine that only prepares params (nothing decodes), recording every load and unload
    with the versions it holds right after."""

    def __init__(self, events, *, unload=True):
        engine = types.SimpleNamespace(max_prefill_length=8, max_concurrent_decodes=4, prepare_params=lambda p: p,
                                       shards=1, settings=DecodeSettings())
        super().__init__(engine, overlap=False)
        self.events, self.unload = events, unload

    def add_version(self, version, params):
        super().add_version(version, params)
        self.events.append(("add", version, self.held()))

    def remove_version(self, version):
        if self.unload:
            super().remove_version(version)
        self.events.append(("remove", version, self.held()))


class Placement:
    """One rollout group on the trainer's devices; records each move with what the driver held then."""

    def __init__(self, events, driver=None):
        self.events, self.driver, self.engines = events, driver, [None]

    def to_rollout(self, params):
        self.events.append(("move", int(params["w"][0]), self.driver.held()))
        return [params], 0.0


def residency(cap, *, unload=True):
    events = []
    driver = Recording(events, unload=unload)
    return Residency(cap, Placement(events, driver), driver), events


def params(v):
    return {"w": jax.numpy.full((2,), v, jax.numpy.int32)}


def test_drained_versions_leave_before_the_new_one_arrives():
    """K = 0: version 0 is drained when version 1 is published; it leaves the store and the driver before
    version 1 is moved to the rollout devices. K = 2: only the drained version leaves."""
    res, events = residency(1)
    res.load(0, params(0), newest=True)
    res.count({})  # version 0's samples are all trained
    res.load(1, params(1), newest=True)
    assert events == [("move", 0, []), ("add", 0, [0]), ("remove", 0, []), ("move", 1, []), ("add", 1, [1])]
    assert res.resident() == {1} and res.max_resident == res.rollout_max_resident == res.store_max_resident == 1

    res, events = residency(3)
    for v in range(3):
        res.count({0: 4, 1: 4})
        res.load(v, params(v), newest=True)
    res.count({1: 4, 2: 8})  # version 0 drained, 1 still has samples
    res.load(3, params(3), newest=True)
    assert events[-3:] == [("remove", 0, [1, 2]), ("move", 3, [1, 2]), ("add", 3, [1, 2, 3])]
    assert res.max_resident == 3 and all(len(held) <= 3 for _, _, held in events)
    res.evict_drained({2: 8, 3: 2})  # version 1 drained: it leaves the store and the driver in the same call
    assert events[-1] == ("remove", 1, [2, 3]) and res.resident() == {2, 3}


def test_the_rollout_side_cap_is_a_hard_limit():
    """A driver that does not let a version go: the next load would put K + 2 versions on the rollout devices
    and is refused, naming what each side holds, before the new version is moved there."""
    res, events = residency(1, unload=False)
    res.load(0, params(0), newest=True)
    res.count({})
    with pytest.raises(VersionError, match=r"loading version 1 into the rollout engines would make 2 versions "
                                           r"resident there, above the cap of 1; they hold versions \[0\], the "
                                           r"store \[1\]"):
        res.load(1, params(1), newest=True)
    assert [e[0] for e in events] == ["move", "add", "remove"]  # version 1 never moved


def test_the_reported_figure_is_the_larger_side_and_survives_a_resume():
    """The store evicts version 0, the (broken) driver keeps it: the run reports the driver's 2, not the
    store's 1. A resumed run's figure is at least the one its checkpoint recorded."""
    res, _ = residency(3, unload=False)
    res.load(0, params(0), newest=True)
    res.count({})
    res.load(1, params(1), newest=True)
    assert res.store_max_resident == 1 and res.driver.held() == [0, 1]
    assert res.rollout_max_resident == 2 and res.max_resident == 2
    res.max_resident = 3  # restored from a checkpoint
    assert res.max_resident == 3


def test_driver_groups_report_the_fullest_group():
    events = []
    a, b = Recording(events), Recording(events)
    groups = DriverGroups([a, b])
    groups.add_version(0, [params(0), params(0)])
    a.add_version(1, params(1))  # one group alone holds two
    assert groups.held() == [0, 1] and groups.stats.max_held == 2
    groups.add_version(2, [params(2), params(2)])
    assert groups.stats.max_held == 3 and b.stats.max_held == 2


CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8, init_std=0.3)


def test_a_removed_version_leaves_the_devices_while_a_step_that_used_it_is_in_flight():
    """With overlap, the decode program dispatched before version 0's last token (a stop token, early in a
    budget of 20) was read still has a row of it when version 0 is removed. Removal waits for that program and
    drops the weights: the driver holds one version, and nothing keeps version 0's weights alive."""
    engine = Engine(init_model(CFG, seed=0), max_concurrent_decodes=4, max_prefill_length=8, max_target_length=32)
    greedy = RequestSampling(temperature=0.0)
    v0 = nnx.state(init_model(CFG, seed=1))  # its only holders: this name and the drivers it is loaded into
    probe = RolloutDriver(engine, overlap=False)
    probe.add_version(0, v0)
    (t,) = probe.run([Request(0, (3, 4, 5), max_new_tokens=20, sampling=greedy)])
    stop = next(tok for i, tok in enumerate(t.tokens) if 2 <= i <= 5 and tok not in t.tokens[:i])
    d = RolloutDriver(engine, overlap=True)
    d.add_version(0, v0)
    d.add_version(1, nnx.state(init_model(CFG, seed=2)))
    del v0, probe
    d.submit(Request(0, (3, 4, 5), version=0, max_new_tokens=20, sampling=greedy, stop_ids=(stop,)))
    d.submit(Request(1, (6, 7), version=1, max_new_tokens=24, sampling=greedy))
    done = []
    while not any(t.sample_id == 0 for t in done):
        done += d.step()
    in_flight = d.results_in_flight(0)
    assert in_flight, "the scenario needs a step in flight that computes a row of version 0"
    weights = [weakref.ref(x) for x in jax.tree.leaves(d.params(0))]
    assert d.held() == [0, 1] and d.stats.max_held == 2
    d.remove_version(0)
    assert all(r.is_ready() for r in in_flight)
    assert d.held() == [1]
    gc.collect()
    assert all(w() is None for w in weights)  # no copy of version 0 left (the step in flight kept none)
    while not d.idle:
        done += d.step()
    assert sorted(t.sample_id for t in done) == [0, 1] and d.stats.max_held == 2
