"""The cluster simulator: hand-computed timelines for every policy, the real scheduler's invariants under random
runs, the paper preset against the paper's published figures, and bad configs.

Hand cases share one small cluster unless stated: 2 rollout instances x 2 slots, groups of 2, a train batch of
4 samples (2 groups), every completion 6 tokens, prompts of 0 tokens, one decode step = 1 s whatever the batch,
an update = 3 s of training + 1 s of weight sync. An instance holds one version's weights; switching to another
version stalls it for the weight sync (1 s; the first load, before the run, is free), except under colocated
sync. Events at the same time run in the order they were queued. Under dora the runner's Balancer places the
versions (dora_jax/sim/balancing.py): it plans after a publish (once that update's prompts are dispatched), when
a version or a draining instance drains, and on imbalance; an instance no version needs goes to the newest.
"""

import copy
import dataclasses
import random

import pytest

from dora_jax.dora.ledger import Ledger
from dora_jax.sim.config import Costs, SimConfigError, load_sim_config, parse_config
from dora_jax.sim.engine import Instance, Placement, Row, SimLedger
from dora_jax.sim.lengths import length_dist
from dora_jax.sim.report import compare_versions, format_report, run_one
from dora_jax.sim.run import SimulationError, Simulation, simulate

COSTS = Costs(decode_step_s=1.0, train_fixed_s=3.0, weight_sync_s=1.0)
SIX = length_dist({"kind": "fixed", "value": 6})


def run(mode, costs=COSTS, colocated=False, **kw):
    args = dict(train_batch=4, group_size=2, prompt_tokens=0, steps=3, warmup_steps=1, max_staleness=1,
                rollout_batch=8)
    args.update(kw)
    return simulate(mode, costs, Placement(2, 2, 1, colocated), SIX, **args)


def spans(r):
    return [(u["start"], u["end"]) for u in r["updates"]]


def test_sync_colocated_timeline():
    # 4 samples fill the 4 slots: 6 steps = 6 s; train 3 s + sync 1 s; the next batch starts after the update.
    # (0-6 rollout, 6-10 update), (10-16, 16-20), (20-26, 26-30).
    r = run("sync", colocated=True, warmup_steps=0)
    assert spans(r) == [(6, 10), (16, 20), (26, 30)]
    assert r["rollout_share"] == pytest.approx(18 / 30)  # 3 x 6 s of waiting over 30 s
    assert r["staleness"] == {"0": 12} and r["max_live_versions"] == 1
    # Slots busy 18 s of the 30 - 12 s of training the rollout GPUs are free for.
    assert r["slot_utilization"] == pytest.approx(1.0)


def test_one_step_off_timeline():
    # b0 (v0) decodes 0-6. At 6 b1 is dispatched on v0 (before the trainer takes b0) and decodes 6-12 on the
    # weights already loaded, while b0 trains 6-10 (-> v1). At 12 b2 goes out on v1: both instances load v1
    # (12-13) and decode 13-19; b1 trains 12-16. At 19 b3 goes out on v2 (load 19-20, decode 20-26), b2 trains
    # 19-23; b3 trains 26-30 (the extra batch that keeps the measured steps free of drain effects).
    r = run("one_step_off")
    assert spans(r) == [(6, 10), (12, 16), (19, 23), (26, 30)]
    assert r["staleness"] == {"0": 4, "1": 12}  # b0 at lag 0, b1..b3 one version late
    # Measured steps 1 and 2 (after one warm-up step): waits 12-10 and 19-16 over 23-10.
    assert r["rollout_share"] == pytest.approx(5 / 13)
    assert r["samples_per_s"] == pytest.approx(8 / 13)
    assert r["weight_loads"] == 4 and r["migrated_rows"] == 0  # 2 instances x (v1 at 12, v2 at 19)


def test_partial_rollout_timeline_pays_reprefill():
    # RBS 8: 8 samples (4 groups, v0) dispatched; s0-s3 decode 0-6, s4-s7 take the freed slots at 6 (-> 12).
    # g0, g1 train 6-10 (-> v1). At 10 every instance loads v1 (1 s) and re-prefills its live rows (4 tokens
    # generated): 0.1 s x 4 tokens x 2 rows = 0.8 s, so s4-s7 end at 10 + 1.8 + 2 = 13.8, not 12. g2, g3 train
    # 13.8-17.8; s8-s11 (v1, admitted at 13.8 on the v1 weights) are at 4 tokens at 17.8: load v2 + re-prefill
    # (+1.8), end at 21.6; g4, g5 train 21.6-25.6; s12-s15 (v2, from 21.6) likewise end at 29.4; g6, g7 train
    # 29.4-33.4.
    costs = Costs(decode_step_s=1.0, train_fixed_s=3.0, weight_sync_s=1.0, prefill_token_s=0.1)
    r = run("partial", costs=costs, steps=1, warmup_steps=0)
    assert [t for span in spans(r) for t in span] == pytest.approx([6, 10, 13.8, 17.8, 21.6, 25.6, 29.4, 33.4])
    assert r["staleness"] == {"0": 4, "1": 12}


def test_dora_timeline_and_window():
    # K = 1, RBS 8: 8 samples (v0) dispatched, 4 decode 0-6 and 4 more 6-12. At 6 g0, g1 are ready; training
    # them leaves 4 samples of v0, within (0 + K - 0) x TBS = 4: train 6-10 (-> v1), then 4 samples go out on
    # v1 (pending: every slot holds a v0 row until 12). At 12 both instances empty, load v1 (12-13) and decode
    # it 13-19, and g2, g3 (v0) train 12-16; v2 is dispatched at 16, loaded at 19 (19-20) and decoded 20-26.
    # Updates (6,10) (12,16) (19,23) (26,30), every sample trained one version late but the first batch.
    # The balancer at 10: v0 (4 rows) and v1 (4 waiting) are owed one instance each; both hold v0 rows and neither
    # has a free slot for the other's, so instance 0 drains (and at 16 the same for v1 -> v2): 2 drains, no move.
    r = run("dora", steps=1, warmup_steps=0)
    assert spans(r) == [(6, 10), (12, 16), (19, 23), (26, 30)]
    assert r["balancer"]["drains"] == 2 and r["moved_rows"] == 0
    assert r["staleness"] == {"0": 4, "1": 12} and r["max_live_versions"] == 2
    # Live versions after each update: the newest plus those still outstanding (v0's g2, g3 at the first).
    assert [e["live"] for e in r["timeline"]] == [[0, 1], [1, 2], [2, 3], [4]]


class Lengths:
    """Completion lengths handed out in dispatch (sample id) order."""

    def __init__(self, *xs):
        self.xs = iter(xs)

    def sample(self, rng):
        return next(self.xs)


def test_dora_hands_a_fragmented_old_version_over_and_reuses_the_instance():
    # Groups of 1, TBS 2, K = 1, RBS 4, 0.1 s per migrated token, lengths s0..s7 = 2 10 2 10 3 3 1 1.
    # t=0: s0-s3 on v0; instance 0 takes s0, s1, instance 1 s2, s3. t=2: s0, s2 done; training them leaves 2
    # v0 samples (<= K x TBS): train 2-6 -> v1. t=6: s4, s5 dispatched on v1 and nothing holds v1 weights;
    # v0 has one row on each instance (s1, s3 at 6 tokens) and one instance has room for the other's row, so
    # instance 0 (fewest rows, lowest index) hands s1 over: it loads v1 (6-7) and decodes s4, s5 7-10, while
    # instance 1 takes s1 with its 6 generated tokens (0.1 s x 6 = 0.6 s, no re-prefill) and decodes s1 and s3
    # (4 tokens left each) 6.6-10.6. t=10: s4, s5 done but the window holds them (v0 must drain first).
    # t=10.6: s1, s3 train 10.6-14.6 -> v2; s6, s7 dispatched on v2; s4, s5 train 14.6-18.6; instance 0 loads
    # v2 (14.6-15.6) and decodes s6, s7 15.6-16.6; they train 18.6-22.6.
    # The balancer's plan at 6 (work v0: 2 in flight, v1: 2 waiting; one instance each) gives up instance 0 (the
    # fewest rows, then the lower index) and moves its row to instance 1, which has the room. Weight loads: instance
    # 0 -> v1 at 6; v0 drained at 10.6: instance 1, idle, -> the newest (v1); at 14.6 and 18.6 (publishes) both go
    # to the newest: 1 + 1 + 2 + 2 = 6. The last publish (22.6) ends the run and places nothing.
    costs = Costs(decode_step_s=1.0, train_fixed_s=3.0, weight_sync_s=1.0, migrate_token_s=0.1)
    r = simulate("dora", costs, Placement(2, 2, 1), Lengths(2, 10, 2, 10, 3, 3, 1, 1), train_batch=2,
                 group_size=1, prompt_tokens=0, steps=1, max_staleness=1, rollout_batch=4)
    assert spans(r) == [(2, 6), (pytest.approx(10.6), pytest.approx(14.6)), (pytest.approx(14.6),
                                                                              pytest.approx(18.6)),
                        (pytest.approx(18.6), pytest.approx(22.6))]
    assert r["migrated_rows"] == 1 and r["weight_loads"] == 6
    assert r["moved_kv_tokens"] == 6 and r["moved_kv_bytes"] is None  # the costs give no bytes per token
    assert r["staleness"] == {"0": 2, "1": 6}


def test_dora_balancer_splits_a_busy_instances_rows_over_two_and_reassigns_it():
    # 3 instances x 4 slots, groups of 1, TBS 4, K = 2, RBS 12, 0.1 s per moved token and 1000 B of KV per token.
    # Lengths s0..s19 = 1 1 8 8 | 1 8 8 8 | 1 8 8 8 | 2 2 2 2 | 1 1 1 1.
    # t=0: 12 samples of v0; the plan gives every instance v0 (loads before the run are free); instance 0 takes
    # s0-s3, instance 1 s4-s7, instance 2 s8-s11. t=1: s0, s1, s4, s8 done: train 1-5 -> v1, leaving 8 of v0
    # (<= (0 + K - 0) x TBS). t=5: s12-s15 dispatched on v1; the plan (work v0 8 in flight, v1 4 waiting, 3
    # instances) owes v0 2 instances and v1 1 (shares 2 and 1; v0's the larger remainder after one each). Every
    # instance is busy with v0 (2, 3, 3 rows): instance 0, the fewest, gives up its 2 rows, one to each of the
    # others (1 free slot each), and changes to v1. At its step boundary (t=5, 5 tokens per row) it hands s2 to
    # instance 1 and s3 to instance 2, loads v1 (5-6) and takes s12-s15 (decoded 6-8). Instances 1 and 2 take
    # the moved row at 5 (5 tokens x 0.1 s = 0.5 s, no prefill) and decode 4 rows 5.5-8.5 (3 steps to 8 tokens).
    # t=8: v1's rows are done but the window holds them (v0 must drain first). t=8.5: v0 is done; s2, s5, s6, s7
    # train 8.5-12.5 -> v2 (4 of v0 left <= (0 + K - 1) x TBS); v0 drained: the idle instances 1, 2 -> the newest
    # (v1). t=12.5: s16-s19 on v2: instance 0 -> v2 (v2's one instance), 1 and 2 -> the newest (v2): 3 loads
    # (12.5-13.5); instance 0 takes all four, done at 14.5. v0's last 4 train 12.5-16.5 -> v3, v1's 16.5-20.5 ->
    # v4, v2's 20.5-24.5 -> v5; the publishes at 16.5 and 20.5 move the 3 idle instances to the newest.
    costs = Costs(decode_step_s=1.0, train_fixed_s=3.0, weight_sync_s=1.0, migrate_token_s=0.1,
                  kv_bytes_per_token=1000)
    lengths = Lengths(1, 1, 8, 8, 1, 8, 8, 8, 1, 8, 8, 8, 2, 2, 2, 2, 1, 1, 1, 1)
    r = simulate("dora", costs, Placement(3, 4, 1), lengths, train_batch=4, group_size=1, prompt_tokens=0,
                 steps=1, max_staleness=2, rollout_batch=12)
    assert spans(r) == [(1, 5), (8.5, 12.5), (12.5, 16.5), (16.5, 20.5), (20.5, 24.5)]
    assert r["staleness"] == {"0": 4, "1": 4, "2": 12}
    assert r["weight_loads"] == 1 + 2 + 3 + 3 + 3
    assert r["moved_rows"] == 2 and r["moved_kv_tokens"] == 10 and r["moved_kv_bytes"] == 10_000
    assert r["transfer_share"] == pytest.approx(1.0 / (3 * 24.5))  # 2 x 0.5 s over 3 instances x 24.5 s
    b = r["balancer"]
    # Plans at 0, 5, 8 (v1 drained: nothing to change), 8.5, 12.5, 14.5 (v2 drained: nothing), 16.5, 20.5.
    assert (b["plans"], b["changes"], b["moved"], b["drains"], b["reassigned"]) == (8, 6, 2, 0, 3 + 1 + 2 + 3 + 3 + 3)
    assert b["decisions_per_update"] == 6 / 5
    assert "t=5.0: version 1 published: version 1 has work and no group" in b["last_decisions"]


def test_dora_with_every_version_on_every_instance():
    # One instance x 4 slots holding every live version; a step costs 1 s plus 1 s of weight reads per version
    # among its rows. Groups of 1, TBS 2, K = 1, RBS 4, lengths s0..s7 = 1 1 5 5 1 1 1 1.
    # t=0: s0-s3 (v0) admitted; one version: 2 s per step. t=2: s0, s1 done: train 2-6 -> v1. t=6 (publish): s4,
    # s5 dispatched on v1; the instance stops at its next boundary (6, s2 and s3 at 3 tokens), loads v1 beside v0
    # (6-7) and takes s4, s5: two versions, 3 s per step: s4, s5 done at 10; then v0 alone: s2, s3 done at 12.
    # s2, s3 train 12-16 -> v2; s6, s7 on v2: the empty instance loads v2 (16-17) and decodes them 17-19; s4, s5
    # train 16-20 -> v3 (load 20-21), s6, s7 20-24. Nothing moves and the balancer has no part.
    costs = Costs(decode_step_s=1.0, decode_weights_s=1.0, train_fixed_s=3.0, weight_sync_s=1.0)
    r = simulate("dora", costs, Placement(1, 4, 1), Lengths(1, 1, 5, 5, 1, 1, 1, 1), train_batch=2, group_size=1,
                 prompt_tokens=0, steps=1, max_staleness=1, rollout_batch=4, versions_per_instance="all")
    assert spans(r) == [(2, 6), (12, 16), (16, 20), (20, 24)]
    assert r["weight_loads"] == 3 and r["moved_rows"] == 0 and r["balancer"] is None
    assert r["versions_per_instance"] == "all" and r["staleness"] == {"0": 2, "1": 6}


def test_versions_per_instance_is_refused_where_it_does_not_apply():
    with pytest.raises(SimulationError, match=r"versions_per_instance 'some': dora takes 1 or 'all'"):
        run("dora", versions_per_instance="some")
    with pytest.raises(SimulationError, match=r"versions_per_instance 'all': .* other modes 1"):
        run("sync", versions_per_instance="all")
    # K = 2 needs 3 live versions: at one version per instance 2 instances cannot hold them.
    with pytest.raises(SimulationError, match=r"2 rollout instances cannot serve K \+ 1 = 3 live versions"):
        run("dora", max_staleness=2)
    assert run("dora", max_staleness=2, versions_per_instance="all")["max_live_versions"] <= 3


def test_decode_weight_read_overlaps_the_row_compute():
    # One step reads the weights once while computing every row: max(weights, n x row), not their sum.
    c = Costs(decode_step_s=1.0, decode_weights_s=2.0, decode_row_s=0.5, decode_ctx_s=0.01)
    assert c.decode_time(2, 100) == pytest.approx(1 + 2 + 1)  # 2 rows x 0.5 s < 2 s of weight reads
    assert c.decode_time(6, 100) == pytest.approx(1 + 3 + 1)  # 6 rows x 0.5 s > 2 s
    # Derived costs keep the fixed overhead apart from the weight read: Qwen2.5-32B at TP 4 on H800 figures.
    cfg = load_sim_config("sim_dora_paper")
    assert cfg.costs.decode_step_s == pytest.approx(0.003)
    assert cfg.costs.decode_weights_s == pytest.approx(3.28e10 * 2 / (4 * 0.8 * 3.35e12))  # 6.12 ms
    assert cfg.costs.decode_row_s == pytest.approx(2 * 3.28e10 / (4 * 9.89e14 * 0.5))  # 33.2 us
    assert cfg.costs.migrate_token_s == pytest.approx(2 * 64 * 8 * 128 * 2 / (4 * 5e10))  # 1.31 us


def test_decode_prefill_and_train_costs_combine_as_documented():
    # One instance, 2 slots, prompts of 2 tokens, completions of 2. Prefill 0.5 s/token: 2 rows x 2 tokens = 2 s.
    # Step 1: 2 rows, contexts 2 + 2 = 4: 1 + 2 x 0.5 + 4 x 0.25 = 3 s (t = 5). Step 2: contexts 6: 3.5 s
    # (t = 8.5). Update: 2 x (2 + 2) = 8 tokens x 0.25 GPU-s / 1 GPU + pairs 2 x 4^2/2 x 0.01 = 2.16 s, + 0.5 s
    # sync: ends at 11.16.
    costs = Costs(decode_step_s=1.0, decode_row_s=0.5, decode_ctx_s=0.25, prefill_token_s=0.5,
                  train_token_gpu_s=0.25, train_pair_gpu_s=0.01, weight_sync_s=0.5)
    r = simulate("sync", costs, Placement(1, 2, 1, True), length_dist({"kind": "fixed", "value": 2}),
                 train_batch=2, group_size=2, prompt_tokens=2, steps=1)
    assert spans(r) == [(pytest.approx(8.5), pytest.approx(11.16))]


def test_closed_form_decode_time_matches_a_step_by_step_sum():
    costs = Costs(decode_step_s=0.01, decode_row_s=0.002, decode_ctx_s=1e-5)
    inst = Instance(slots=8)
    for sid, (prompt, before) in enumerate([(10, 0), (300, 25), (7, 1000)]):
        inst.add(sid, Row(0, prompt, 0, before, 50))
    ctx = 10 + 325 + 1007
    expected = sum(0.01 + 3 * 0.002 + (ctx + 3 * j) * 1e-5 for j in range(37))
    assert inst.steps_time(costs, 37) == pytest.approx(expected, rel=1e-12)
    assert inst.steps_by(costs, expected) == 37 and inst.steps_by(costs, expected + 1e-9) == 38


def test_sim_ledger_answers_like_the_ledger():
    led = SimLedger()
    rng = random.Random(3)
    for gid in range(30):
        led.add_group(gid, range(3 * gid, 3 * gid + 3), version=gid // 7, prompt_index=gid)
    for sid in rng.sample(range(90), 60):
        led.start(sid)
        if rng.random() < 0.1:
            led.filter(sid, "reward raised")
        elif led.entries[sid].state == "in_flight":
            led.finish(sid)
    ready = [g for g in led.groups if Ledger.group_ready(led, g)]
    led.consume(ready[: len(ready) // 2], 5)
    assert led.outstanding() == Ledger.outstanding(led)
    assert all(led.group_ready(g) == Ledger.group_ready(led, g) for g in led.groups)
    assert sorted(led.ready_group_ids()) == Ledger.ready_group_ids(led)
    led.check()


def one_version_per_instance(sim):
    """Raises AssertionError unless every instance's rows, and the rows handed to it and not yet taken, are of the
    version it holds, and no instance is promised more rows than its slots."""
    for i, inst in enumerate(sim.insts):
        held = {r.version for r in inst.rows.values()} | {sim.led.entries[sid].version for sid, _ in inst.inbox}
        assert held <= {inst.loaded}, f"instance {i} holds version {inst.loaded} and rows of versions {held}"
        assert len(inst.rows) + len(inst.inbox) + inst.incoming <= inst.slots, f"instance {i} over its slots"


def test_the_one_version_check_catches_an_instance_with_two_versions():
    sim = Simulation("dora", COSTS, Placement(2, 2, 1), SIX, train_batch=4, group_size=2, prompt_tokens=0,
                      steps=1, max_staleness=1, rollout_batch=8, seed=0)
    one_version_per_instance(sim)
    sim.insts[0].loaded = 3
    sim.insts[0].add(0, Row(3, 0, 0, 0, 6))
    one_version_per_instance(sim)
    sim.insts[0].add(1, Row(4, 0, 0, 0, 6))
    with pytest.raises(AssertionError, match=r"instance 0 holds version 3 and rows of versions \{3, 4\}"):
        one_version_per_instance(sim)
    sim.insts[0].remove(1)
    sim.insts[1].incoming = 3
    with pytest.raises(AssertionError, match="instance 1 over its slots"):
        one_version_per_instance(sim)


@pytest.mark.parametrize("seed", range(12))
def test_invariants_hold_in_random_runs(seed, monkeypatch):
    random_run(seed, monkeypatch)


@pytest.mark.parametrize("seed", range(12, 24))
def test_invariants_hold_in_random_runs_at_one_version_per_instance(seed, monkeypatch):
    # Checked after every event (the loop dispatches after each): one version per instance, slots not overbooked.
    dispatch = Simulation.dispatch

    def checked(sim):
        one_version_per_instance(sim)
        dispatch(sim)

    monkeypatch.setattr(Simulation, "dispatch", checked)
    r = random_run(seed, monkeypatch, mode="dora", versions=1)
    assert r["balancer"]["plans"] >= 1 and r["versions_per_instance"] == 1


def random_run(seed, monkeypatch, mode=None, versions=None):
    """A run with random policy, batch, window, lengths, costs and cluster; checks the ledger's counts, the
    staleness bound and the shares, and (but for partial and every version per instance) that each row joins an
    instance holding its version."""
    add = Instance.add

    def one_version(inst, sid, row):
        assert inst.mix is not None or mode == "partial" or row.version == inst.loaded, \
            "an instance decodes two versions at once"
        assert len(inst.rows) < inst.slots
        add(inst, sid, row)

    monkeypatch.setattr(Instance, "add", one_version)
    rng = random.Random(seed)
    mode = mode or rng.choice(["sync", "one_step_off", "partial", "dora"])
    versions = versions or rng.choice([1, "all"])
    g = rng.randint(1, 4)
    tbs = g * rng.randint(1, 4)
    k = rng.randint(1, 3)
    rb = min((k + 1) * tbs, tbs + g * rng.randint(0, 6))
    lengths = length_dist({"kind": "lognormal", "mean": rng.uniform(5, 40), "sigma": rng.uniform(0, 1.5),
                           "max": 200})
    costs = Costs(decode_step_s=rng.uniform(0.01, 1), decode_weights_s=rng.uniform(0, 0.5),
                  decode_row_s=rng.uniform(0, 0.1), decode_ctx_s=rng.uniform(0, 1e-3),
                  prefill_token_s=rng.uniform(0, 0.01), train_token_gpu_s=rng.uniform(0, 0.05),
                  train_fixed_s=rng.uniform(0, 5), weight_sync_s=rng.uniform(0, 2),
                  migrate_token_s=rng.uniform(0, 1e-3))
    fewest = k + 1 if mode == "dora" and versions == 1 else 1  # one version per instance: one per live version
    place = Placement(rng.randint(fewest, fewest + 3), rng.randint(1, 6), rng.randint(1, 8),
                      mode == "sync" and rng.random() < .5)
    r = simulate(mode, costs, place, lengths, train_batch=tbs, group_size=g, prompt_tokens=rng.randint(0, 50),
                 steps=rng.randint(1, 5), max_staleness=k, rollout_batch=rb, seed=seed,
                 versions_per_instance=versions if mode == "dora" else 1)
    # simulate() already ran Ledger.check(bound) and refused abandoned samples; check the report agrees.
    counts = r["ledger"]
    assert counts["consumed"] == len(r["updates"]) * tbs and counts["pending"] == counts["in_flight"] == 0
    bound = {"sync": 0, "one_step_off": 1, "dora": k}.get(mode)
    if bound is not None:
        assert max(int(s) for s in r["staleness"]) <= bound and r["max_live_versions"] <= bound + 1
    assert 0 <= r["rollout_share"] <= 1 and 0 <= r["slot_utilization"] <= 1 + 1e-9
    return r


# -- the paper preset -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paper():
    cfg = load_sim_config("sim_dora_paper")
    return cfg, {(g, m): run_one(cfg, g, m) for g in (64, 128) for m in ("sync", "dora")}


def within(sim, published, tol=0.25):
    return abs(sim - published) / published <= tol


def test_paper_sync_rollout_share_at_64_gpus(paper):
    cfg, runs = paper
    assert within(runs[64, "sync"]["rollout_share"], cfg.paper["64"]["sync_rollout_share"])  # 65%


@pytest.mark.xfail(strict=True, reason="at the balanced split (7 rollout instances, 36 trainer GPUs) the simulated "
                   "dora pipeline is nearly trainer-bound at 64 GPUs: its trainer waits 3.2% of each step against the "
                   "paper's 12% (0% under the earlier hand-over rule, 11.2% while the balancer drained busy "
                   "instances); the paper's split is not public, and one instance fewer (40 trainer GPUs) gives "
                   "20.9% (docs/simulator.md)")
def test_paper_dora_rollout_share_at_64_gpus(paper):
    cfg, runs = paper
    assert within(runs[64, "dora"]["rollout_share"], cfg.paper["64"]["dora_rollout_share"])  # 12%


def test_paper_speedup_at_64_gpus(paper):
    cfg, runs = paper
    speedup = runs[64, "dora"]["samples_per_s"] / runs[64, "sync"]["samples_per_s"]
    assert within(speedup, cfg.paper["64"]["speedup"])  # 1.65x


def test_paper_speedup_at_128_gpus(paper):
    cfg, runs = paper
    speedup = runs[128, "dora"]["samples_per_s"] / runs[128, "sync"]["samples_per_s"]
    assert within(speedup, cfg.paper["128"]["speedup"])  # 2.12x


def test_paper_preset_rollout_side_is_one_version_per_instance(paper):
    # The dora runs move rows between instances (the balancer's moves) and reload weights as instances change
    # version; sync (colocated) does neither. Each moved token's KV cache weighs Qwen2.5-32B's 2 x 64 layers x 8 KV
    # heads x 128 x 2 B.
    cfg, runs = paper
    assert cfg.costs.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    for g in (64, 128):
        d = runs[g, "dora"]
        assert d["versions_per_instance"] == 1 and d["migrated_rows"] > 0 and d["weight_loads"] > 0
        assert d["moved_kv_bytes"] == d["moved_kv_tokens"] * 262_144
        # Every moved token costs its receiver migrate_token_s, over instances x the run's wall time; 0.019% and
        # 0.114% of instance time at 64 and 128 GPUs (docs/simulator.md).
        assert d["transfer_share"] == pytest.approx(d["moved_kv_tokens"] * cfg.costs.migrate_token_s
                                                    / (d["instances"] * d["wall_s"]))
        assert 0 < d["transfer_share"] < 2e-3
        # The balancer counts rows planned to move; a row that finishes before its instance's next step boundary,
        # where the moves are made, never moves.
        assert d["balancer"]["plans"] >= d["balancer"]["changes"] > 0 and d["balancer"]["moved"] >= d["moved_rows"]
        assert runs[g, "sync"]["migrated_rows"] == runs[g, "sync"]["weight_loads"] == 0
        assert runs[g, "sync"]["balancer"] is None


def test_paper_preset_scheduler_invariants(paper):
    _, runs = paper
    for r in runs.values():
        bound = 0 if r["mode"] == "sync" else 5
        assert max(int(s) for s in r["staleness"]) <= bound <= 5 and r["max_live_versions"] <= bound + 1


def test_a_config_compares_dora_at_one_and_every_version_per_instance():
    from dora_jax.sim.report import run_config

    raw = bad("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": [1, "all"]})
    raw["cluster"]["trainer_gpus"] = 2  # 3 rollout instances: one per live version (K + 1)
    cfg = parse_config(raw)
    assert cfg.policy("dora").versions_per_instance == (1, "all")
    result = run_config(cfg, progress=False)
    runs = result["runs"]["8"]
    assert set(runs) == {"sync", "dora", "dora_all"}
    assert runs["dora"]["versions_per_instance"] == 1 and runs["dora_all"]["versions_per_instance"] == "all"
    rows = result["versions_per_instance"]
    assert rows == compare_versions(result["runs"]) and [r["versions_per_instance"] for r in rows] == [1, "all"]
    assert rows[0]["vs_first"] == 1 and rows[1]["vs_first"] == runs["dora_all"]["samples_per_s"] / \
        runs["dora"]["samples_per_s"]
    assert rows[1]["moved_rows"] == 0 and rows[1]["plans_per_update"] is None
    assert rows[0]["plans_per_update"] == runs["dora"]["balancer"]["plans_per_update"]
    text = format_report(result)
    assert "| GPUs | dora versions per instance |" in text and "| 8 | dora (all per inst.) |" in text
    # Too few rollout instances for one version per instance is refused naming the setting.
    with pytest.raises(SimConfigError, match=r"'policies.dora.versions_per_instance' = 1: at 8 GPUs the split "
                                             r"leaves 2 rollout instances for K \+ 1 = 3 live versions"):
        run_one(dataclasses.replace(cfg, trainer_gpus=4), 8, "dora")


# -- configs ----------------------------------------------------------------------------------------------------

GOOD = {
    "workload": {"prompts_per_step": 4, "group_size": 2, "prompt_tokens": 8,
                 "lengths": {"kind": "lognormal", "mean": 20, "sigma": 1.0, "max": 100}},
    "cluster": {"gpus": [8], "gpus_per_instance": 2, "slots_per_instance": 4},
    "costs": {"decode_step_s": 0.01, "train_token_gpu_s": 0.001},
    "policies": {"sync": {}, "dora": {"max_staleness": 2, "rollout_batches": 2.0}},
}


def bad(path, value):
    raw = copy.deepcopy(GOOD)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return raw


def test_good_config_parses_and_lognormal_mean_is_the_clipped_mean():
    cfg = parse_config(copy.deepcopy(GOOD))
    assert parse_config(bad("paper", {8: {"speedup": 1.5}})).paper == {"8": {"speedup": 1.5}}
    assert parse_config(bad("cluster.gpus", 8)).gpus == (8,)  # one count is one cluster size
    assert cfg.train_batch == 8 and cfg.policy("dora").max_staleness == 2
    assert cfg.lengths.mean() == pytest.approx(20, rel=1e-9)
    rng = random.Random(0)
    xs = [cfg.lengths.sample(rng) for _ in range(40000)]
    assert sum(xs) / len(xs) == pytest.approx(20, rel=0.02) and max(xs) <= 100


@pytest.mark.parametrize("path,value,message", [
    ("cluster.gpus", [8, 5], r"'cluster.gpus' = \[8, 5\]: .*multiple of gpus_per_instance \(2\)"),
    ("cluster.gpus_per_instance", 0, r"'cluster.gpus_per_instance' = 0: must be an integer > 0"),
    ("cluster.trainer_gpus", 8, r"'cluster.trainer_gpus' = 8: .*leaves at least one rollout instance"),
    ("cluster.sync_placement", "shared", r"'cluster.sync_placement' = 'shared': allowed: colocated"),
    ("costs.decode_step_s", -1, r"'costs.decode_step_s' = -1.0: must be a finite number >= 0"),
    ("costs.weight_sync_s", float("inf"), r"'costs.weight_sync_s' = inf: must be a finite number"),
    ("costs.decode_ctx_s", float("nan"), r"'costs.decode_ctx_s' = nan: must be a finite number"),
    ("workload.lengths", {"kind": "lognormal", "p50": 10, "p99": float("inf"), "max": 100},
     r"'workload.lengths.p99' = inf: must be a finite number"),
    ("workload.lengths", {"kind": "fixed", "value": 6, "max": 9},
     r"'workload.lengths.max' = 9: unknown for kind fixed; allowed: kind, value"),
    ("paper", {"8": "x"}, r"'paper.8' = 'x': must be a mapping"),
    ("paper", {"8": {"speedup": 0}}, r"'paper.8.speedup' = 0.0: must be a number > 0"),
    ("paper", {"8": {"dora_rollout_share": 12}},
     r"'paper.8.dora_rollout_share' = 12.0: must be a fraction in \(0, 1\]"),
    ("paper", {"8": {"tokens": 1.0}}, r"'paper.8.tokens' = 1.0; fields of 'paper.8' are: sync_rollout_share"),
    ("paper", {"64": {"speedup": 1.5}}, r"'paper.64' = .*must be a GPU count that is simulated .*\[8\]"),
    ("paper", [1.65], r"'paper' = \[1.65\]: must be a mapping"),
    ("costs.decode_step_s", KeyError, r"'costs.decode_step_s' = None: required"),
    ("costs.warp_s", 1, r"unknown config field 'costs.warp_s' = 1; fields of 'costs' are: decode_step_s"),
    ("workload.lengths.kind", "weibull", r"'workload.lengths.kind' = 'weibull': allowed: fixed, lognormal, jsonl"),
    ("workload.lengths.mean", 500, r"'workload.lengths.mean' = 500.0: must be < max \(100\)"),
    ("workload.lengths.sigma", "wide", r"'workload.lengths.sigma' = 'wide': must be a number"),
    ("workload.lengths.sigma", 5, r"'workload.lengths.sigma' = 5.0: must be a number in \[0, 4\]"),
    ("workload", KeyError, r"^config field 'workload' = None: required"),
    ("cluster.gpus", "eight", r"'cluster.gpus' = 'eight': must be an integer or a list \(an integer each\)"),
    ("cluster.trainer_gpus", True, r"'cluster.trainer_gpus' = True: must be a string or an integer or a number"),
    ("workload.group_size", 0, r"'workload.group_size' = 0: must be an integer > 0"),
    ("policies.dora", {"max_staleness": 1, "rollout_batches": 3.0},
     r"'policies.dora.rollout_batches' = 3.0: must be <= max_staleness \+ 1 = 2"),
    ("policies.async", {}, r"'policies.async' = \{\}: unknown policy"),
    ("policies.sync", {"max_staleness": 2}, r"'policies.sync' = \{'max_staleness': 2\}: takes no options"),
    ("policies.partial", {"max_staleness": 2, "rollout_batches": 2.0},
     r"'policies.partial.max_staleness' = 2: not an option of partial; allowed: rollout_batches"),
    ("policies", {}, r"'policies' = \{\}: must be a mapping of policy names"),
    ("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": 2},
     r"'policies.dora.versions_per_instance' = 2: allowed: 1 \(one version per rollout instance, placed by the "
     r"balancer\), 'all'"),
    ("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": "every"},
     r"'policies.dora.versions_per_instance' = 'every': allowed: 1 "),
    ("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": [1, "all", 1]},
     r"'policies.dora.versions_per_instance' = \[1, 'all', 1\]: .*without repeats"),
    ("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": []},
     r"'policies.dora.versions_per_instance' = \[\]: allowed"),
    ("policies.dora", {"max_staleness": 2, "rollout_batches": 2.0, "versions_per_instance": 1.5},
     r"'policies.dora.versions_per_instance' = 1.5: must be an integer or a string or a list"),
    ("policies.partial", {"rollout_batches": 2.0, "versions_per_instance": "all"},
     r"'policies.partial.versions_per_instance' = 'all': not an option of partial; allowed: rollout_batches"),
    ("hardware", {"peak_flops": 1e15}, r"^config field 'model' = None: model and hardware go together"),
])
def test_bad_config_values_are_named(path, value, message):
    with pytest.raises(SimConfigError, match=message):
        parse_config(bad(path, value))


def test_bad_length_files_are_named(tmp_path):
    f = tmp_path / "lengths.jsonl"
    f.write_text('{"length": 12}\n{"length": 0}\n')
    with pytest.raises(SimConfigError, match=r"lengths.jsonl line 2: length 0 must be an integer >= 1"):
        length_dist({"kind": "jsonl", "path": str(f)})
    f.write_text('{"new_tokens": 12}\n7\n\n')
    d = length_dist({"kind": "jsonl", "path": str(f)})
    assert d.table == (12, 7) and d.mean() == 9.5
    with pytest.raises(SimConfigError, match=r"'workload.lengths.path' = 'nope.jsonl': no such file"):
        length_dist({"kind": "jsonl", "path": "nope.jsonl"}, base_dir=str(tmp_path))


def test_bad_config_files_are_named(tmp_path):
    f = tmp_path / "sim.yaml"
    f.write_text("steps: 4\nworkload:\n  group_size: 4\nsteps: 8\n")
    with pytest.raises(SimConfigError, match=r"sim.yaml: .*key 'steps' appears twice .*first on line 1"):
        load_sim_config(str(f))
    f.write_bytes(b"name: \xff\n")
    with pytest.raises(SimConfigError, match=r"sim.yaml: line 1 is not UTF-8 text"):
        load_sim_config(str(f))
    with pytest.raises(SimConfigError, match=r"^config field 'steps' = 0: must be an integer >= 1"):
        parse_config(bad("steps", 0))
    bench = tmp_path / "bench.json"
    bench.write_text('{"engine_tok_s": 100.0}')
    with pytest.raises(SimConfigError,
                       match=r"'costs.from_bench' = '.*bench.json': its 'batch' = None must be a finite number > 0"):
        parse_config(bad("costs", {"from_bench": str(bench)}))
    bench.write_text('{"engine_tok_s": Infinity, "batch": 32}')
    with pytest.raises(SimConfigError, match=r"its 'engine_tok_s' = inf must be a finite number > 0"):
        parse_config(bad("costs", {"from_bench": str(bench)}))
    bench.write_text("[1]")
    with pytest.raises(SimConfigError, match=r"costs.from_bench.*must hold a JSON object"):
        parse_config(bad("costs", {"from_bench": str(bench)}))


def test_cli_runs_the_small_config_calibrated_from_a_measured_bench(tmp_path):
    import json

    from dora_jax.cli import main

    cfg = load_sim_config("sim_small")
    # benchmarks/results/bench_engine_cpu_2026-11-22.json: 32 rows at 96.95 tokens/s -> one step = 32 / 96.95 s.
    assert cfg.costs.decode_step_s == pytest.approx(32 / 96.95051391960808)
    out = tmp_path / "sim.json"
    assert main(["simulate", "--config", "sim_small", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["table"]
    assert {(r["gpus"], r["mode"]) for r in table} == {(g, m) for g in (8, 16)
                                                         for m in ("sync", "one_step_off", "partial", "dora")}
    assert main(["simulate", "--config", "no_such_preset"]) == 2


def test_derived_costs_that_overflow_name_the_formula():
    import os

    from dora_jax.textfiles import load_yaml

    preset = os.path.join(os.path.dirname(__file__), "..", "configs", "sim_dora_paper.yaml")
    raw = load_yaml(preset)
    raw["hardware"]["peak_flops"] = 1e-300
    with pytest.raises(SimConfigError, match=r"'costs.decode_row_s' = inf: must be a finite number >= 0 "
                                             r"\(derived: 2 x 3.28e\+10 / \(4 x 1e-300 x 0.5\)\)"):
        parse_config(raw)
