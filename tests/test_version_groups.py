"""One policy version per rollout group (``roles.versions_per_group: 1``): :class:`VersionGroups` applying plans over
real decoding, the run's balancing (:class:`GroupBalancing`) through a drain with drivers that only count, and runs
of the runner driving the balancer: a dora run keeps the promises with no group ever holding two versions, and a
sync run gives the samples of ``versions_per_group: all``.

The runs use test_runner.py's settings (its ``split2`` case) on a trainer of two devices and three rollout groups
of two devices each (K = 2 needs K + 1 groups).
"""

import dataclasses
import json
import os
import types

import jax
import pytest
from flax import nnx

from engine_helpers import GREEDY, assert_same_trajectory, make_engine, make_requests
from invariants import check_trained_samples
from dora_jax.config import load_config
from dora_jax.dora.balancer import Move, Plan
from dora_jax.dora.ledger import Ledger
from dora_jax.models.decoder import DecodeSettings
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import EngineError, RequestSampling
from dora_jax.rollout.groups import VersionGroups
from dora_jax.rollout.samples import Request
from dora_jax.run import Placement, Runner
from dora_jax.run.balancing import GroupBalancing, GroupsView
from dora_jax.run.evaluation import EVAL_IDS, RunError
from dora_jax.run.residency import Residency

BASE = ["dora.steps=4", "dora.train_batch=8", "dora.rollout_batch=16", "train.max_staleness=2",
        "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8", "rollout.max_new_tokens=24",
        "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=24", "task.eval_size=4",
        "train.length_buckets=[64]", "train.max_response_tokens=24", "run.checkpoint_every=0",
        "roles.placement=split", "roles.trainer_devices=2", "target.num_devices=8", "mesh.data=1", "mesh.fsdp=2",
        "mesh.tensor=1", "roles.rollout_groups=3", "roles.versions_per_group=1"]


def plan(*versions, drain=()):
    return Plan(tuple(versions), tuple(drain), (), (), "test")


def test_version_groups_decode_each_request_with_the_version_of_its_group(models):
    """Two groups over one tiny engine: a request goes to a group serving its version (the freer one), a draining
    group takes none, a group changes version only once empty (its old weights dropped before the new ones load),
    and every trajectory is the one a single driver holding its version gives (sampling depends on (seed, sample
    id, position) only)."""
    m0, m1 = models
    engine = make_engine(m0, slots=4)
    weights = {0: nnx.state(m0), 1: nnx.state(m1)}
    groups = VersionGroups([RolloutDriver(engine), RolloutDriver(engine)])
    loads = []

    def load(group, version):
        loads.append((group, version, groups.drivers[group].held()))
        return weights[version]

    sampled = RequestSampling(temperature=1.0, seed=2)
    reqs = [r if i % 2 else dataclasses.replace(r, sampling=sampled)
            for i, r in enumerate(make_requests(12, seed=14, sampling=GREEDY))]
    # The first four outlast a decode program (20 tokens, no eos): group 1 is still busy after one step.
    first = [dataclasses.replace(r, max_new_tokens=20) if i < 4 else r for i, r in enumerate(reqs[:8])]
    later = [dataclasses.replace(r, version=1) for r in reqs[8:]]
    with pytest.raises(EngineError, match="not into every group"):
        groups.add_version(0, [weights[0]] * 2)
    assert groups.apply(plan(0, 0), load) == [0, 1] and groups.serving == [0, 0]
    with pytest.raises(EngineError, match="no rollout group takes requests of policy version 1"):
        groups.submit(later[0])
    for r in first[:4]:
        groups.submit(r)
    assert [groups.group_in_flight(i) for i in (0, 1)] == [2, 2]  # the freer group, ties to the lower
    groups.step()
    groups.apply(plan(0, 0, drain=(1,)), load)  # group 1 drains: version 0's requests go to group 0 only
    assert groups.admitting(0) == [0] and groups.free_slots(0) == 4 - groups.group_in_flight(0)
    busy = groups.group_in_flight(1)
    assert busy == 2
    for r in first[4:]:
        groups.submit(r)
    assert groups.group_in_flight(1) == busy
    with pytest.raises(EngineError, match=r"changes the version of groups \[1\], which still have requests"):
        groups.apply(plan(0, 1), load)
    with pytest.raises(EngineError, match=r"the groups serve \[0, 0\]"):
        groups.apply(Plan((0, 0), (), (Move(1, 0, 1, 2),), (), "move"), load)
    out = []
    while groups.group_in_flight(1):
        out += groups.step()
    assert groups.apply(plan(0, 1), load) == [1] and groups.draining == set()
    for r in later:
        groups.submit(r)
    out += groups.run()
    assert sorted(t.sample_id for t in out) == list(range(12))
    assert loads == [(0, 0, []), (1, 0, []), (1, 1, [])]  # group 1 dropped version 0 before loading version 1
    assert groups.stats.max_held == 1 and all(d.stats.max_held == 1 for d in groups.drivers)
    assert groups.max_versions == 2 and groups.held() == [0, 1] and groups.loads == [1, 2]
    want = {}
    for v, reqs in ((0, first), (1, later)):  # one version each, as the groups hold them
        single = RolloutDriver(engine)
        single.add_version(v, weights[v])
        want.update({t.sample_id: t for t in single.run(reqs)})
    for t in out:
        assert t.version == want[t.sample_id].version
        assert_same_trajectory(t, want[t.sample_id], (first + later)[t.sample_id], models[t.version])


def test_the_elastic_group_serves_while_lent_and_hands_its_requests_over_with_their_kv_when_reclaimed(models):
    """An elastic group beside one regular group: not lent, it takes nothing; lent, it takes its version's
    requests once the regular group is full; reclaimed, it takes nothing more and its requests move to the regular
    group as room appears there (a move that does not fit waits while it decodes on), and it drops its version
    once empty. Every trajectory is the one a single driver gives: moved mid-way, nothing was prefilled again."""
    m0, _ = models
    engine = make_engine(m0, slots=4)
    groups = VersionGroups([RolloutDriver(engine)], elastic=RolloutDriver(make_engine(m0, slots=4)))
    assert (groups.regular, groups.elastic, len(groups.states())) == (1, 1, 1)
    groups.apply(plan(0), lambda g, v: nnx.state(m0))
    # The regular group's requests end at 10, 12, 30 and 30 tokens, the elastic group's later: room appears in
    # the regular group while the elastic group still decodes.
    budgets = [10, 12, 30, 30, 40, 40, 40, 40]
    reqs = [dataclasses.replace(r, max_new_tokens=n) for n, r in
            zip(budgets, make_requests(8, seed=21, sampling=RequestSampling(temperature=1.0, seed=4)))]
    for r in reqs[:4]:
        groups.submit(r)
    assert groups.free_slots(0) == 0 and groups.admitting(0) == [0]  # the elastic group is not lent
    loads = []
    groups.lend(0, lambda g, v: loads.append((g, v)) or nnx.state(m0))
    assert loads == [(1, 0)] and groups.admitting(0) == [0, 1] and groups.free_slots(0) == 4
    for r in reqs[4:]:
        groups.submit(r)
    assert [groups.group_in_flight(i) for i in (0, 1)] == [4, 4]
    out = groups.step()
    assert not groups.reclaim() and groups.admitting(0) == [0]  # the regular group is full: the moves wait
    assert groups.group_in_flight(1) == 4 and groups.elastic_moved == 0
    prefilled = groups.drivers[0].stats.prefill_rows + groups.drivers[1].stats.prefill_rows
    while not groups.reclaim():
        out += groups.step()
    assert groups.serving == [0, None] and groups.held() == [0] and groups.elastic_loads == 1
    out += groups.run()
    assert sorted(t.sample_id for t in out) == list(range(8))
    assert groups.drivers[0].stats.prefill_rows + groups.drivers[1].stats.prefill_rows == prefilled
    assert groups.elastic_moved == groups.moved_requests and groups.elastic_moved > 0, "no request moved"
    single = RolloutDriver(engine)
    single.add_version(0, nnx.state(m0))
    want = {t.sample_id: t for t in single.run(reqs)}
    for t in out:
        assert_same_trajectory(t, want[t.sample_id], reqs[t.sample_id], m0)
    with pytest.raises(EngineError, match="no elastic group"):
        VersionGroups([RolloutDriver(engine)]).lend(0, lambda g, v: None)


class Counting(RolloutDriver):
    """A driver that decodes nothing: it holds versions and counts the requests it was given until told they
    finished."""

    def __init__(self, slots=4):
        engine = types.SimpleNamespace(max_prefill_length=8, max_concurrent_decodes=slots, prepare_params=lambda p: p,
                                       shards=1, settings=DecodeSettings())
        super().__init__(engine, overlap=False)
        self.requests = []

    def submit(self, request):
        self.requests.append(request)

    def in_flight(self):
        out = {}
        for r in self.requests:
            out[r.version] = out.get(r.version, 0) + 1
        return out


class GroupPlacement:
    """Rollout groups' copies: records which version reaches which group, and what that group held then."""

    def __init__(self, groups, events):
        self.groups, self.events, self.engines = groups, events, [None] * len(groups.drivers)

    def to_group(self, params, group):
        self.events.append(("move", group, int(params["w"][0]), self.groups.drivers[group].held()))
        return params, 0.0


def weights(v):
    return {"w": jax.numpy.full((2,), v, jax.numpy.int32)}


def test_balancing_drains_a_busy_group_and_gives_it_the_waiting_version_once_empty():
    """K = 2, three full groups of version 0 when version 1 is published with work: the group with the fewest
    requests drains (no move), admits nothing, and is given version 1 at the first plan after it empties (its
    trigger: "group 0 drained"), its old version dropped before the new one is copied to it. Inputs that have
    not changed make no new plan. A drained version leaves the groups with the store."""
    events = []
    groups = VersionGroups([Counting(), Counting(), Counting()])
    res = Residency(3, GroupPlacement(groups, events), groups)
    bal = GroupBalancing(groups, res, max_live=3)
    res.load(0, weights(0), newest=True)
    bal.rebalance({}, "version 0 published")
    assert groups.serving == [0, 0, 0] and [e[:3] for e in events] == [("move", i, 0) for i in range(3)]
    for i in range(11):  # the freest group each time, ties to the lower: groups 0 and 1 get 4, group 2 gets 3
        groups.submit(Request(i, (1, 2), version=0))
    assert [groups.group_in_flight(i) for i in range(3)] == [4, 4, 3]
    res.count({0: 11})
    res.load(1, weights(1), newest=True)
    assert bal.trigger({1: 8}) == "version 1 waits with no group"
    bal.rebalance({1: 8}, "version 1 published")
    assert groups.serving == [0, 0, 0] and groups.draining == {2} and groups.driver_for(1) is None
    assert groups.free_slots(0) == 0 and groups.admitting(0) == [0, 1]
    assert bal.rebalance({1: 8}) is None  # the same inputs: the same plan
    groups.drivers[2].requests.clear()  # group 2's requests finished
    assert bal.trigger({1: 8}) == "group 2 drained"
    bal.rebalance({1: 8})
    assert groups.serving == [0, 0, 1] and groups.draining == set() and groups.free_slots(1) == 4
    assert events[-1] == ("move", 2, 1, [])  # version 0 left group 2 before version 1 was copied there
    assert groups.stats.max_held == 1 and groups.max_versions == 2 and res.rollout_max_resident == 2
    report = bal.report()
    assert report["drains"] == 1 and report["loads"] == 4 and report["versions"] == [0, 0, 1]
    assert report["decisions"][1] == "version 1 published: version 1 has work and no group; draining [2]"
    assert report["decisions"][2] == "group 2 drained: version 1 has work and no group (group 2 -> version 1)"
    assert bal.report()["decisions"] == []  # each decision is reported once
    for d in groups.drivers[:2]:
        d.requests.clear()
    assert res.evict_drained({1: 8}) == [0] and groups.serving == [None, None, 1]
    assert bal.trigger({1: 8}) == "group 0 holds no version"
    bal.rebalance({1: 8}, "version 0 drained")
    assert groups.serving == [1, 1, 1] and res.resident() == {1}


@pytest.fixture(scope="module")
def placement():
    """One split placement (trainer on devices 0-1, rollout groups on 2-3, 4-5 and 6-7) for every run here, so
    their compiled programs are shared; each run starts from a copy of the same initial state."""
    return Placement.build(load_config("tiny_llama", BASE), keep_initial=True, progress=False)


def read_samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_dora_run_at_one_version_per_group_keeps_the_promises(tmp_path, placement):
    """K = 2 over three groups, with an evaluation during training: the ledger's audit passes, every sample is
    trained once within the bound, each request (held-out ones too) went to a group serving its version and not
    draining, no group ever held two versions (the drivers' own counts) and each loaded a version only once its
    old one was gone, groups changed version, busy groups handed their requests with their KV pages to another
    group of their version or drained, and every update's metrics name the balancer's decisions and the requests
    and KV bytes moved."""
    cfg = load_config("tiny_llama", BASE + ["dora.mode=dora", "dora.rollout_batch=24", "task.eval_every=2"])
    runner = Runner(cfg, str(tmp_path), placement=placement, progress=False)
    groups = runner.driver
    assert isinstance(groups, VersionGroups) and groups.serving == [0, 0, 0]
    submitted, loads = [], []
    for g, d in enumerate(groups.drivers):
        def submit(req, g=g, submit=d.submit):
            assert groups.serving[g] == req.version and g not in groups.draining, (g, req, groups.serving)
            submitted.append((g, req.sample_id, req.version))
            return submit(req)

        def add_version(version, params, d=d, g=g, add=d.add_version):
            loads.append((g, version, d.held()))
            return add(version, params)
        d.submit, d.add_version = submit, add_version
    summary = runner.run()

    ledger = Ledger.from_dict(json.load(open(tmp_path / "ledger.json"))["ledger"])
    ledger.check(2)
    assert ledger.counts()["consumed"] == summary["samples"] == 32
    rows = read_samples(tmp_path)
    check_trained_samples(rows, ledger, 2)
    assert max(r["trained_at"] - r["version"] for r in rows) >= 1  # rollout overlapped training
    assert {s for _, s, _ in submitted if s < EVAL_IDS} >= {r["sample_id"] for r in rows if r["version"] > 0}
    assert len([s for _, s, _ in submitted if s >= EVAL_IDS]) == cfg.task.eval_size  # version 2's, in its groups

    assert [d.stats.max_held for d in groups.drivers] == [1, 1, 1] and summary["max_versions_per_group"] == 1
    assert 2 <= groups.max_versions <= summary["max_resident_versions"] <= 3
    assert loads and all(held == [] for _, _, held in loads)  # old weights gone before new ones load
    assert any(v > 0 for _, v, _ in loads)  # every group started on version 0: a group changed version
    assert summary["balancer"]["loads"] == groups.loads and max(groups.loads) >= 2
    assert set(groups.held()) <= runner.versions.resident()

    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["version"] for m in metrics if "eval" in m] == [0, 2, 4]
    updates = [m for m in metrics if "eval" not in m]
    assert [m["step"] for m in updates] == [1, 2, 3, 4]
    assert all(m["max_versions_per_group"] == 1 and "balancer" in m for m in updates)
    decisions = [d for m in updates for d in m["balancer"]["decisions"]]
    assert any("published" in d for d in decisions) and all(": " in d for d in decisions)
    assert sum(m["balancer"]["decided"] for m in updates) >= 2
    assert 2 <= updates[-1]["balancer"]["changes"] <= summary["balancer"]["changes"]
    # Whether a group is still busy when a version is published depends on how long the train step takes against
    # decoding on this machine, so moves may or may not happen here (tests/test_moves.py moves requests on
    # purpose); what moved is accounted for either way.
    moved = summary["balancer"]["moved_requests"]
    assert moved == sum(m["balancer"]["moved_requests"] for m in updates) >= 0
    assert summary["balancer"]["moved_kv_bytes"] == sum(m["balancer"]["moved_kv_bytes"] for m in updates)
    assert (moved > 0) == (summary["balancer"]["moved_kv_bytes"] > 0)
    assert moved == 0 or any("; moving " in d for d in decisions)
    print(f"group loads {groups.loads}, counters {summary['balancer']}, most versions at once "
          f"{groups.max_versions}, decode batch-steps per sample {summary['decode_batch_steps_per_sample']:.3f}, "
          f"slot utilization {summary['slot_utilization']:.3f}")


def test_a_sync_run_gives_the_same_samples_at_one_version_per_group(tmp_path, placement):
    """Sync mode (K = 0) on three groups: one version per group and every version in every group give the same
    samples, tokens and log-probs bit for bit (the same requests reach the same groups: at one version per group
    every group serves the one live version)."""
    runs = {}
    for vpg in ("1", "all"):
        cfg = load_config("tiny_llama", BASE + ["dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2",
                                                f"roles.versions_per_group={vpg}"])
        runner = Runner(cfg, str(tmp_path / vpg), placement=placement, progress=False)
        summary = runner.run()
        assert summary["max_versions_per_group"] == 1 and isinstance(runner.driver, VersionGroups) == (vpg == "1")
        runs[vpg] = read_samples(tmp_path / vpg)
    assert len(runs["1"]) == 16 and runs["1"] == runs["all"]


def test_a_dora_run_lends_the_trainers_devices_as_an_elastic_group_between_train_steps(tmp_path):
    """dora, K = 2, three regular groups of 4 slots and 24 samples in flight: the trainer's devices decode the
    newest version as one more group while the trainer waits. Every request the elastic group took was of the
    version lent to it, while lent; every train step found it empty, handed back and without weights; the
    ledger's audit holds; the metrics account for its work, which counts against the trainer devices' idle time."""
    cfg = load_config("tiny_llama", BASE + ["dora.mode=dora", "dora.rollout_batch=24", "rollout.slots=4",
                                            "roles.elastic_group=true"])
    runner = Runner(cfg, str(tmp_path), progress=False)
    groups, e = runner.driver, runner.driver.elastic
    assert e == groups.regular == 3 and len(runner.engines) == 3
    assert set(runner.placement.elastic_engine.mesh.devices.flat) == set(runner.trainer.mesh.devices.flat)
    taken, steps = [], []

    def submit(req, submit=groups.drivers[e].submit):
        assert groups.lent and req.version == groups.serving[e], (req, groups.serving, groups.lent)
        taken.append(req.sample_id)
        return submit(req)

    def train_step(*args, step=runner.trainer.train_step):
        assert groups.group_in_flight(e) == 0 and groups.serving[e] is None and not groups.lent
        steps.append(groups.drivers[e].held())
        return step(*args)
    groups.drivers[e].submit, runner.trainer.train_step = submit, train_step
    summary = runner.run()

    ledger = Ledger.from_dict(json.load(open(tmp_path / "ledger.json"))["ledger"])
    ledger.check(2)
    assert ledger.counts()["consumed"] == summary["samples"] == 32
    check_trained_samples(read_samples(tmp_path), ledger, 2)
    assert steps == [[]] * 4  # four train steps, each with the elastic group's weights dropped
    elastic = summary["elastic"]
    assert taken and elastic["lends"] >= 1 and elastic["rows"] > 0 and elastic["busy_s"] > 0
    assert groups.drivers[e].stats.max_held == 1 and summary["max_versions_per_group"] == 1
    assert summary["trainer_devices_idle_fraction"] < summary["trainer_idle_fraction"]
    updates = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in updates] == [1, 2, 3, 4]
    for k in ("lends", "moved_out", "rows"):
        assert sum(m["elastic"][k] for m in updates) == elastic[k], k
    assert elastic["moved_out"] <= summary["balancer"]["moved_requests"]


def test_the_elastic_group_is_refused_where_it_cannot_work():
    from dora_jax.config import ConfigError
    from dora_jax.run.setup import RunError, check_multiprocess

    for bad in (["roles.versions_per_group=all"], ["roles.placement=shared", "roles.rollout_groups=1"]):
        with pytest.raises(ConfigError, match="roles.elastic_group"):
            load_config("tiny_llama", BASE + bad + ["roles.elastic_group=true"])
    cfg = load_config("tiny_llama", BASE + ["roles.elastic_group=true"])
    with pytest.raises(RunError, match="roles.elastic_group under several processes .* agreed by every process"):
        check_multiprocess(cfg, None)


class Moving(Counting):
    """A counting driver whose requests can be taken and put (no pages: each counts 100 KV bytes)."""

    def read_in_flight(self):
        return []

    def take_sizes(self, version, count):
        return []

    def fits(self, version, count, sizes):
        return count <= self.engine.max_concurrent_decodes - len(self.requests)

    def take(self, version, count):
        mine = sorted((r for r in self.requests if r.version == version), key=lambda r: r.sample_id)[:count]
        self.requests = [r for r in self.requests if r not in mine]
        return types.SimpleNamespace(count=len(mine), kv_bytes=100 * len(mine), requests=mine)

    def put(self, departing):
        self.requests += departing.requests


@pytest.mark.parametrize("other_waited", [False, True])
def test_balancing_under_several_processes_plans_from_every_processs_groups_and_agrees_on_waits(
        monkeypatch, other_waited):
    """Two processes, simulated: this one's exchanges return its own values and another process's. Both hold
    requests [2, 2, 1] of version 0 in three groups of 4 slots when version 1 is published with 8 requests
    waiting: the plan sees the groups together ([4, 4, 2] in 8 slots each) and gives group 2 to version 1, its
    requests moving to groups of version 0, each process its own. When the other process's move waited, group 2
    keeps version 0 and drains here too, though its request here has moved; the move totals are both processes'.
    A process whose groups serve other versions stops the run, naming both."""
    import dora_jax.run.balancing as balancing

    groups = VersionGroups([Moving(), Moving(), Moving()])
    res = Residency(3, GroupPlacement(groups, []), groups)
    bal = GroupBalancing(groups, res, max_live=3, multi=True)
    exchanged, other_moves = [], {"waited": [], "moved": [0, 0, 0]}

    def gather(obj):  # the other process's groups hold what this one's do
        exchanged.append(obj)
        return [obj, json.loads(json.dumps(other_moves if "waited" in obj else obj))]

    monkeypatch.setattr(balancing, "gather_decisions", gather)
    res.load(0, weights(0), newest=True)
    bal.rebalance({}, "version 0 published")
    assert groups.serving == [0, 0, 0]
    for i, g in enumerate([0, 0, 1, 1, 2]):
        groups.drivers[g].requests.append(Request(i, (1, 2), version=0))
    res.count({0: 10})
    res.load(1, weights(1), newest=True)
    assert GroupsView.of(groups, {1: 8}).in_flight == (2, 2, 1)
    assert bal.view({1: 8}, "").in_flight == (4, 4, 2) and bal.view({1: 8}, "").slots == (8, 8, 8)
    # The other process moves its request out of group 2, or its move waits.
    other_moves.update({"waited": [2], "moved": [0, 0, 1]} if other_waited else {"waited": [], "moved": [1, 100, 0]})
    plan = bal.rebalance({1: 8}, "version 1 published")
    assert plan.versions == (0, 0, 1) and sum(m.count for m in plan.moves) == 2
    assert groups.group_in_flight(2) == 0 and groups.group_in_flight(0) + groups.group_in_flight(1) == 5
    if other_waited:
        assert groups.serving == [0, 0, 0] and groups.draining == {2} and groups.free_slots(1) == 0
        assert (groups.moved_requests, groups.moved_kv_bytes, groups.move_waits) == (1, 100, 1)
    else:
        assert groups.serving == [0, 0, 1] and groups.draining == set() and groups.admitting(1) == [2]
        assert (groups.moved_requests, groups.moved_kv_bytes, groups.move_waits) == (2, 200, 0)
    assert sum("waited" in e for e in exchanged) == 2  # once per plan applied

    def disagree(obj):
        return [obj, dict(obj, serving=[1, 1, 1])] if "serving" in obj else [obj, obj]
    monkeypatch.setattr(balancing, "gather_decisions", disagree)
    with pytest.raises(RunError, match=r"processes disagree on the rollout groups at an admission: process 0's "
                                       r"serve \[0, 0, .\] .* process 1's serve \[1, 1, 1\]"):
        bal.rebalance({1: 8})


def test_a_plans_moves_are_split_by_each_processs_own_free_slots():
    """Under several processes a plan's moves count every process's requests: a process moves all of a source
    group's requests it holds, over the plan's destinations for that source, most free slots here first, the
    last destination taking what does not fit elsewhere (and waiting). Taken as they are, the moves would send
    a request to a group that is full here."""
    groups = VersionGroups([Moving(), Moving(), Moving()])
    groups.serving = [0, 0, 0]
    for i, g in enumerate([0, 0, 1, 1, 1, 1, 2, 2]):  # room 2, 0 and 2
        groups.drivers[g].requests.append(Request(i, (1, 2), version=0))
    plan_moves = [Move(2, 1, 0, 2), Move(2, 0, 0, 2)]  # as planned from both processes' groups
    assert groups.local_moves(plan_moves) == [Move(2, 0, 0, 2)]
    assert groups.local_moves([Move(2, 1, 0, 4)]) == [Move(2, 1, 0, 2)]  # no room here: it will wait
    assert groups.move(plan_moves) == {2} and groups.move_waits == 1  # as planned: group 1 is full here
    assert groups.move(groups.local_moves(plan_moves)) == set()
    assert [groups.group_in_flight(i) for i in range(3)] == [4, 4, 0] and groups.moved_requests == 2
