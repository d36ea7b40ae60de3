"""End-to-end runs of a tiny model in each mode, checked from what the run saved.

Promise 1: every trained token's recorded log-prob is its own version's (recomputed with that version's
params). Promise 2: staleness within K. Promise 3: every dispatched sample consumed once or filtered with a
reason, groups whole (the saved ledger's own check, and the samples file). Promise 4: resident versions
<= K + 1. Promise 5: sync mode is reproducible. Failing or hanging reward functions filter samples with the
reason and the run goes on.
"""

import collections
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err, same_updates_up_to_a_tie
from invariants import check_trained_samples
from dora_jax.config import ConfigError, load_config
from dora_jax.dora.ledger import Ledger
from dora_jax.run import Placement, Runner, RunError
from dora_jax.run.evaluation import EVAL_IDS, evaluate
from dora_jax.run.setup import check_multiprocess
from dora_jax.tasks import load_task
from dora_jax.trainer import make_batch, Sample

BASE = ["dora.steps=4", "dora.train_batch=8", "dora.rollout_batch=16", "train.max_staleness=2",
        "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8", "rollout.max_new_tokens=24",
        "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=24", "task.eval_size=4",
        "train.length_buckets=[64]", "train.max_response_tokens=24", "run.checkpoint_every=0"]


def tiny(*overrides):
    return load_config("tiny_llama", BASE + list(overrides))


@pytest.fixture(scope="module")
def shared():
    """One placement (model, trainer and engine) for every run of this module, so their compiled functions are
    shared; each run starts from a copy of the same initial state. Trainer settings (K = 2 for its staleness
    mask, the learning rate) are the same in every run here; the schedule's own bound is set per run."""
    placement = Placement.build(tiny(), keep_initial=True, progress=False)
    return lambda: dict(placement=placement, progress=False)


SPLIT = ["roles.placement=split", "roles.trainer_devices=4", "target.num_devices=8", "mesh.data=1", "mesh.fsdp=2",
         "mesh.tensor=2"]


def read_samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mode,k,rbs,placement,overlap", [
    ("sync", 0, 8, "shared", False), ("one_step_off", 1, 8, "shared", False), ("dora", 2, 24, "shared", False),
    ("dora", 2, 24, "shared", True), ("dora", 2, 24, "split", False), ("dora", 2, 24, "split2", False)])
def test_each_mode_keeps_the_promises(tmp_path, request, published, mode, k, rbs, placement, overlap):
    # split: the trainer on devices 0-3, the engine on 4-7 (tensor 2); split2: two rollout groups, one engine on
    # devices 4-5 and one on 6-7. Both built by the runner from the config; shared: the module's parts. Sync and
    # split2 evaluate version 2 during training: in sync (one resident version) the update to version 3 waits
    # for that evaluation's answers (eight questions of 32 tokens, in at most half the slots: they outlast the
    # batch's short samples); in split2 they decode in the first rollout group only.
    evaluates = mode == "sync" or placement == "split2"
    cfg = tiny(f"dora.mode={mode}", f"dora.rollout_batch={rbs}", f"rollout.overlap={str(overlap).lower()}",
               *(SPLIT if placement.startswith("split") else []),
               *(["roles.rollout_groups=2"] if placement == "split2" else []),
               *(["task.eval_every=2"] if evaluates else []), *(["task.eval_size=8"] if mode == "sync" else []))
    parts = request.getfixturevalue("shared")() if placement == "shared" else dict(progress=False)
    runner = Runner(cfg, str(tmp_path), **parts)
    assert runner.driver.overlap is overlap  # the rollout driver dispatches ahead only when asked
    submitted = collections.defaultdict(list)  # rollout group -> sample ids
    for group, driver in enumerate(getattr(runner.driver, "drivers", [runner.driver])):
        def recording(req, group=group, submit=driver.submit):
            submitted[group].append(req.sample_id)
            return submit(req)
        driver.submit = recording
    summary = runner.run()
    # The rollout side holds a sample's item only until it is generated: nothing grows with the run's length.
    led = runner.sched.ledger
    assert set(runner.rollout.items) <= {s for s, e in led.entries.items() if e.state in ("pending", "in_flight")}
    assert summary["placement"] == {"split2": "split"}.get(placement, placement)
    assert summary["rollout_groups"] == len(runner.engines)
    if placement.startswith("split"):
        # Trainer and rollout on disjoint devices; every version crossed over device to device, to every group.
        trainer_devices = set(runner.trainer.mesh.devices.flat)
        group_devices = [set(e.mesh.devices.flat) for e in runner.engines]
        rollout_devices = set().union(*group_devices)
        assert len(trainer_devices) == len(rollout_devices) == 4 and not trainer_devices & rollout_devices
        assert sum(map(len, group_devices)) == 4  # the groups are disjoint
        for v in runner.versions.resident():
            for params, devices in zip(runner.versions.rollout_params(v), group_devices):
                assert all(set(x.sharding.device_set) <= devices for x in jax.tree.leaves(params))
        assert summary["sync_s"] > 0
    if placement == "split2":  # two engines, both decoded: the work was shared
        assert len(runner.engines) == 2 and all(d.stats.rows_live > 0 for d in runner.driver.drivers)
    bound = {"sync": 0, "one_step_off": 1}.get(mode, k)
    assert summary["steps"] == 4 and summary["samples"] == 32
    assert summary["max_resident_versions"] <= bound + 1
    # Promise 4 where the weights are: the rollout driver's own count, taken at every load and every decode step
    # (the fullest rollout group under split2). A sample trained one version late kept its version loaded
    # beside the next one, so the asynchronous modes reach two; sync never holds more than one.
    held = runner.versions.rollout_max_resident
    assert held <= bound + 1 and (held == 1 if mode == "sync" else held >= 2)
    assert summary["max_resident_versions"] >= held
    assert runner.driver.held() == sorted(runner.versions.resident())  # the two sides agree at the end

    with open(tmp_path / "ledger.json") as f:
        saved = json.load(f)
    ledger = Ledger.from_dict(saved["ledger"])
    ledger.check(bound)  # one state each, groups whole, staleness within the bound
    counts = ledger.counts()
    assert counts["pending"] == counts["in_flight"] == counts["finished"] == 0
    assert counts["consumed"] == 32 and counts["consumed"] + counts["filtered"] == len(ledger.entries)

    rows = read_samples(tmp_path)
    assert len(rows) == 32
    check_trained_samples(rows, ledger, bound)  # each consumed sample once, as the ledger has it, groups whole
    lags = [r["trained_at"] - r["version"] for r in rows]
    if mode == "sync":
        assert set(lags) == {0}
    else:
        assert max(lags) >= 1  # the schedule overlapped rollout with training

    # Promise 1: recompute every trained token's log-prob with its own version's params.
    trainer = runner.trainer
    samples = [Sample(r["sample_id"], r["group_id"], r["version"], r["prompt_ids"], r["tokens"], r["logprobs"],
                      r["reward"]) for r in rows]
    batch = trainer.put(make_batch(samples, group_size=4, length_buckets=(64,), row_multiple=trainer.row_multiple))
    mask = np.asarray(batch.loss_mask) > 0
    recorded = np.asarray(batch.behaviour_logprobs)
    seen = published(runner.versions.store)
    own = np.asarray(trainer.with_recomputed_behaviour(batch, seen).recomputed_logprobs)
    assert rel_err(own[mask], recorded[mask]) <= 1e-4
    versions = sorted(seen)
    other = {v: seen[versions[-1] if v != versions[-1] else versions[0]] for v in versions}
    wrong = np.asarray(trainer.with_recomputed_behaviour(batch, other).recomputed_logprobs)
    assert rel_err(wrong[mask], recorded[mask]) > 1e-3  # another version's log-probs are detectably different

    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = [m["version"] for m in metrics if "eval" in m]
    metrics = [m for m in metrics if "eval" not in m]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    held_out = {g: [s for s in ids if s >= EVAL_IDS] for g, ids in submitted.items()}
    if evaluates:
        assert evals == [0, 2, 4] and summary["eval_curve"][1][0] == 2
        assert len(held_out[0]) == cfg.task.eval_size and not held_out.get(1)  # the first group's only
    else:
        assert evals == [] and "eval_curve" not in summary and not any(held_out.values())
    assert all(0 <= m["rollout_share"] <= 1 and m["staleness_max"] <= bound for m in metrics)
    assert json.load(open(tmp_path / "summary.json"))["samples"] == 32


def test_sync_mode_is_reproducible(tmp_path, shared, published):
    """Two runs give the same samples, bit for bit (the same programs on one machine); so does a third whose
    rollout dispatches each decode step before reading the previous one back (``rollout.overlap``): overlap
    changes when results are read, not what. A fourth prefills every prompt whole instead of after the template
    head (``rollout.shared_prefix``): the same samples, log-probs equal up to float rounding (another program:
    its tokens are compared up to a tie, conftest.TIE). Runs with another ``rollout.seed`` or ``run.seed`` give
    other samples of the same prompts."""
    cfg = tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2")
    first = Runner(cfg, str(tmp_path / "a"), **shared())
    assert first.shared_prefix == tuple(b"Q: ")  # the byte tokenizer's template head, prefilled once per version
    first.run()
    Runner(cfg, str(tmp_path / "b"), **shared()).run()
    Runner(tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2", "rollout.overlap=true"),
           str(tmp_path / "c"), **shared()).run()
    whole = Runner(tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2", "rollout.shared_prefix=false"),
                   str(tmp_path / "d"), **shared())
    assert whole.shared_prefix == ()
    whole.run()
    a, b, c, d = (read_samples(tmp_path / x) for x in "abcd")
    assert a == b  # every field of every sample, log-probs included
    trainer, versions = first.trainer, published(first.versions.store)

    def logits_after(version, ids):  # on the first run's weights of that version
        return np.asarray(nnx.merge(trainer.graphdef, versions[version])(jnp.asarray([ids])), np.float64)[0, -1]

    for other, rtol, atol in ((c, 1e-6, 0.0), (d, 1e-5, 1e-6)):
        # Prefix or whole: another float computation of the same prefill (the engine's tests hold it to 1e-5).
        same = same_updates_up_to_a_tie(a, other, logits_after, cfg.rollout)
        np.testing.assert_allclose(*([x for r in rows if r["trained_at"] < same for x in r["logprobs"]]
                                     for rows in (a, other)), rtol=rtol, atol=atol)
    # The seeds matter: another rollout.seed draws other tokens from the same model; another run.seed starts
    # from another model (a placement of its own: the initial weights are the placement's). Same prompts.
    Runner(tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2", "rollout.seed=1"), str(tmp_path / "e"),
           **shared()).run()
    other = tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2", "run.seed=1")
    Runner(other, str(tmp_path / "f"), placement=Placement.build(other, progress=False), progress=False).run()
    e, f = read_samples(tmp_path / "e"), read_samples(tmp_path / "f")
    for rows in (e, f):
        assert [(r["sample_id"], r["prompt_ids"]) for r in rows] == [(r["sample_id"], r["prompt_ids"]) for r in a]
    assert sum(r["tokens"] == s["tokens"] for r, s in zip(e, a)) <= 2  # of 16, from 256 tokens at temperature 1
    # The random models' distributions are near uniform, so the same random numbers often pick the same token
    # under either model; their log-probs tell them apart on every sample.
    assert sum(r["tokens"] == s["tokens"] for r, s in zip(f, a)) < len(a)
    assert all(np.max(np.abs(np.subtract(r["logprobs"][:1], s["logprobs"][:1]))) > 1e-4 for r, s in zip(f, a))


@pytest.mark.parametrize("reward,reason", [
    ("raise_on_some_responses", "reward function raised ValueError: cannot score this response"),
    ("hang_on_some_responses", "reward function timed out after 0.5s")])
def test_failing_rewards_filter_samples_and_the_run_goes_on(tmp_path, shared, reward, reason):
    cfg = tiny("dora.mode=dora", "dora.rollout_batch=16", "dora.steps=2",
               f"task.reward=toy_rewards:{reward}", "task.reward_timeout_s=0.5", "task.eval_size=0")
    t0 = time.perf_counter()
    summary = Runner(cfg, str(tmp_path), **shared()).run()
    assert time.perf_counter() - t0 < 120  # hung calls are abandoned, not waited for
    assert summary["samples"] == 16 and summary["filtered"] > 0
    assert reason in summary["filtered_reasons"]
    ledger = Ledger.from_dict(json.load(open(tmp_path / "ledger.json"))["ledger"])
    ledger.check(2)
    for e in ledger.entries.values():
        assert e.state == "consumed" or (e.state == "filtered" and (e.reason == reason or
                                                                   e.reason.startswith("group member")))
    trained = {r["sample_id"] for r in read_samples(tmp_path)}
    assert trained == {s for s, e in ledger.entries.items() if e.state == "consumed"}


def test_a_reward_that_always_fails_stops_the_run_with_the_reason(tmp_path, shared):
    cfg = tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=1", "task.reward=toy_rewards:always_raise",
               "task.eval_size=0")
    with pytest.raises(RunError, match="RuntimeError: broken reward"):
        Runner(cfg, str(tmp_path), **shared()).run()


def test_evaluation_counts_failed_scores_as_wrong_and_names_them(tmp_path, shared, caplog):
    cfg = tiny("dora.mode=sync", "dora.rollout_batch=8", "task.reward=toy_rewards:raise_on_even_prompt",
               "task.eval_size=8", "task.eval_samples=2", "task.eval_temperature=1.0")
    runner = Runner(cfg, str(tmp_path), **shared())
    even = sum(sum(it.prompt.encode()) % 2 == 0 for it in runner.task.eval_items())
    assert 0 < even < 8  # both kinds among the held-out questions
    with caplog.at_level("WARNING"):
        ev = runner.evaluate(0)
    assert ev["n"] == 16 and ev["score_errors"] == 2 * even
    assert ev["reward"] == (16 - 2 * even) / 16  # every answer that scored got 1.0; the failed ones 0
    assert f"scoring failed on {2 * even} of 16 held-out answers" in caplog.text
    assert "reward function raised ValueError: even prompt" in caplog.text
    # A hung reward function is timed out under task.reward_timeout_s in evaluation too (it used to hang the run).
    caplog.clear()
    hung = Runner(tiny("dora.mode=sync", "dora.rollout_batch=8", "task.reward=toy_rewards:hang_on_even_prompt",
                       "task.eval_size=8", "task.reward_timeout_s=0.5"), str(tmp_path / "h"), **shared())
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        ev = hung.evaluate(0)
    assert time.perf_counter() - t0 < 25 and ev["score_errors"] == even and ev["reward"] == (8 - even) / 8
    assert "reward function timed out after 0.5s" in caplog.text
    # Held-out questions the engine cannot take are named with the settings, before anything is decoded.
    runner.task = load_task(tiny("task.name=arithmetic").task)  # prompts of 50-60 characters, bytes as tokens
    with pytest.raises(RunError, match=r"'arithmetic': held-out question 0 has \d\d prompt tokens and may generate "
                       r"32 \(task.eval_max_new_tokens = 32\), but the rollout engine takes prompts of at most 32 "
                       r"tokens \(rollout.max_prompt_len\) and 64 positions in all"):
        runner.evaluate(0)
    runner = Runner(tiny("dora.mode=sync", "dora.rollout_batch=8", "task.reward=toy_rewards:always_raise",
                         "task.eval_size=4"), str(tmp_path / "b"), **shared())
    with pytest.raises(RunError, match=r"scoring failed on 4 of 4 held-out answers \(version 0\); the first: "
                       r"held-out question 0: reward function raised RuntimeError: broken reward"):
        runner.evaluate(0)


def test_bad_run_configs_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"dora.rollout_batch.*\[8, 16\]"):
        tiny("dora.mode=dora", "train.max_staleness=1", "dora.rollout_batch=40")
    with pytest.raises(ConfigError, match=r"one_step_off.*>= 1"):
        tiny("dora.mode=one_step_off", "train.max_staleness=0")
    with pytest.raises(ConfigError, match="dora.train_batch.*multiple of train.group_size"):
        tiny("dora.train_batch=6")
    with pytest.raises(ConfigError, match="dora.mode.*allowed: sync, one_step_off, dora"):
        tiny("dora.mode=async")
    with pytest.raises(ConfigError, match="task.name"):
        tiny("task.name=nonsense")
    with pytest.raises(ConfigError, match="rollout.temperature"):
        tiny("rollout.temperature=0")
    with pytest.raises(ConfigError, match="task.reward: cannot import module 'no_such_module'"):
        Runner(tiny("task.reward=no_such_module:f"), str(tmp_path / "r"), progress=False)
    with pytest.raises(ConfigError, match="module 'toy_rewards' has no attribute 'missing'"):
        Runner(tiny("task.reward=toy_rewards:missing"), str(tmp_path / "r2"), progress=False)
    with pytest.raises(RunError, match=r"roles.rollout_groups = 2: .* not with roles.placement='shared'"):
        Runner(tiny("roles.rollout_groups=2"), str(tmp_path / "r3"), progress=False)
    # Checked under several processes only (one process has no engine to span), before anything is built.
    with pytest.raises(RunError, match=r"roles.rollout_span=all with roles.placement='split': .* Use "
                                       r"roles.placement=shared, or roles.rollout_span=process"):
        check_multiprocess(tiny("roles.rollout_span=all", "roles.placement=split", "roles.trainer_devices=4",
                                "target.num_devices=8"), None)
    with pytest.raises(RunError, match=r"rollout.attention_impl='pallas_tpu' with roles.rollout_span=all: .* set "
                                       r"rollout.attention_impl=xla"):
        check_multiprocess(tiny("roles.rollout_span=all", "rollout.attention_impl=pallas_tpu"), None)
    with pytest.raises(ConfigError, match=r"roles.rollout_span' = 'host': allowed: process, all"):
        tiny("roles.rollout_span=host")


def test_an_iteration_with_no_applied_update_publishes_nothing_and_loses_nothing(tmp_path, shared, monkeypatch):
    """Every update of the second iteration is non-finite (its behaviour log-probs are NaN): no version comes of
    it anywhere, the groups already dispatched for it move back to the version before, every sample is still
    trained exactly once, and no later sample is masked as stale (the trainer and the schedule agree)."""
    import jax.numpy as jnp

    from dora_jax.trainer import Trainer

    real, calls = Trainer.train_step, []

    def poisoned(self, state, batch, iteration=0):
        calls.append(iteration)
        if len(calls) == 2:
            batch = batch.replace(behaviour_logprobs=batch.behaviour_logprobs * jnp.nan)
        return real(self, state, batch, iteration)

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    runner = Runner(tiny("dora.mode=dora", "dora.rollout_batch=16"), str(tmp_path), **shared())
    summary = runner.run()
    assert summary["samples"] == 32 and summary["steps"] == 3  # four iterations, three versions
    assert calls == [0, 1, 1, 2]  # the retracted iteration's number is the next one's
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["train"]["applied"] for m in metrics] == [1, 0, 1, 1]
    assert all(m["train"]["kept_samples"] == m["train"]["samples"] for m in metrics)  # nothing masked
    ledger = Ledger.from_dict(json.load(open(tmp_path / "ledger.json"))["ledger"])
    ledger.check(2)
    assert ledger.counts()["consumed"] == 32
    assert max(e.version for e in ledger.entries.values()) <= 3  # nothing on a version that never existed


@pytest.mark.parametrize("mode,rbs", [("sync", 8), ("dora", 16)])
def test_dynamic_sampling_trains_only_groups_that_disagree(tmp_path, shared, mode, rbs):
    """DAPO's dynamic sampling: a group whose rewards are all equal is filtered with the reason and another is
    drawn, so every trained batch is full and every trained group has an advantage to learn from."""
    cfg = tiny(f"dora.mode={mode}", f"dora.rollout_batch={rbs}", "train.dynamic_sampling=true",
               "task.reward=toy_rewards:constant_on_even_prompt")
    summary = Runner(cfg, str(tmp_path), **shared()).run()
    assert summary["samples"] == 32 and summary["filtered"] > 0
    assert any(r.startswith("dynamic sampling: all 4 rewards equal (1)") for r in summary["filtered_reasons"])
    rows = read_samples(tmp_path)
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r["reward"])
    assert all(len(set(v)) > 1 for v in by_group.values())  # no trained group without an advantage
    ledger = Ledger.from_dict(json.load(open(tmp_path / "ledger.json"))["ledger"])
    ledger.check({"sync": 0}.get(mode, 2))
    assert all(m["train"]["samples"] == 8 for m in map(json.loads, open(tmp_path / "metrics.jsonl")))  # full batches


def test_decode_batch_steps_are_counted_from_the_run_and_repeat(tmp_path, shared):
    """The device-independent cost of a run: in sync mode with every request of a batch decoding at once, an
    update costs as many decode batch-steps as its longest response has tokens after the first (which the
    prefill gives); the same config and seed count the same steps."""
    cfg = tiny("dora.mode=sync", "dora.rollout_batch=8", "dora.steps=2")
    summaries = [Runner(cfg, str(tmp_path / name), **shared()).run() for name in ("a", "b")]
    rows = [[json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in ("a", "b")]
    samples = read_samples(tmp_path / "a")
    for m in rows[0]:
        longest = max(len(r["tokens"]) for r in samples if r["trained_at"] == m["step"] - 1)
        assert m["decode_batch_steps"] == longest - 1
        assert m["decode_batch_steps_per_sample"] == (longest - 1) / 8
    assert [m["decode_batch_steps"] for m in rows[0]] == [m["decode_batch_steps"] for m in rows[1]]
    assert summaries[0]["decode_batch_steps"] == summaries[1]["decode_batch_steps"] == sum(
        m["decode_batch_steps"] for m in rows[0])
    assert summaries[0]["decode_batch_steps_per_sample"] == summaries[0]["decode_batch_steps"] / 16


def test_a_placement_built_for_another_model_is_refused(tmp_path, shared):
    """A run on a given placement uses the placement's model, initial weights and devices: a config that says
    otherwise is refused, naming the setting, before anything is written."""
    for override, name in (("run.seed=7", "run.seed"), ("model.num_layers=3", "model")):
        with pytest.raises(RunError, match=rf"placement was built for another {name}"):
            Runner(tiny(override), str(tmp_path / name), **shared())
        assert not (tmp_path / name).exists()


def test_a_warmed_up_run_compiles_nothing_after_its_first_update(tmp_path, shared, published, monkeypatch):
    """With ``rollout.warmup`` the engine compiles every program it can dispatch before the first update: ten
    updates of a dora run (two versions in flight, evaluation before and after, and of every second version
    during training, ``task.eval_every``) compile nothing after the first, counted through ``jax.monitoring``
    (persistent-cache loads included), and the engine logs no late compile. The warm-up's progress bar counts
    each program once, the prefill chain (compiled while planning, shared prefix included) with the rest.

    The evaluations during training decode in the run's own driver beside its rollout: each version's result
    is what ``evaluate`` gives for that version's params; their answers never reach the ledger or the trainer;
    the driver never held more than K + 1 versions."""
    import tqdm.auto

    bars = []

    class Recorded(tqdm.auto.tqdm):
        def close(self):
            if not self.disable:  # a bar is closed once more when it is collected
                bars.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    runner = Runner(tiny("dora.mode=dora", "dora.steps=10", "rollout.warmup=true", "task.eval_every=2"),
                    str(tmp_path), **{**shared(), "progress": True})
    assert runner.warmup["programs"] > 0 and runner.warmup["seconds"] > 0
    warm = [(n, total) for desc, n, total in bars if desc == "compiling rollout programs"]
    assert warm and runner.shared_prefix
    assert all(n == total for n, total in warm) and sum(n for n, _ in warm) == runner.warmup["programs"], warm
    summary = runner.run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows, evals = [r for r in lines if "eval" not in r], {r["version"]: r for r in lines if "eval" in r}
    assert [r["step"] for r in rows] == list(range(1, 11))
    late = [(r["step"], r["compiles"], r["compile_cache_loads"]) for r in rows[1:]
            if r["compiles"] or r["compile_cache_loads"]]
    assert late == [], late
    assert all(not engine.compiled.late for engine in runner.engines)
    assert summary["warmup_programs"] == runner.warmup["programs"]

    # Before training, every second version during it, the last one by the final evaluation.
    assert sorted(evals) == [0, 2, 4, 6, 8, 10]
    assert (evals[10]["eval"]["accuracy"], evals[0]["eval"]["accuracy"]) == (summary["accuracy_after"],
                                                                              summary["accuracy_before"])
    assert sorted(summary["eval_curve"]) == [[v, evals[v]["eval"]["accuracy"]] for v in sorted(evals)]
    seen = published(runner.versions.store)
    for v in (2, 8):
        alone = evaluate(runner.cfg, runner.task, runner.placement.engine, runner.tokenizer, seen[v], v,
                         runner.shared_prefix)
        assert evals[v]["eval"] == alone, v
    assert runner.versions.rollout_max_resident <= 3 and summary["max_resident_versions"] <= 3
    ledger = Ledger.from_dict(json.loads((tmp_path / "ledger.json").read_text())["ledger"])
    trained = [r["sample_id"] for r in read_samples(tmp_path)]
    assert len(trained) == 80 and max(trained) < EVAL_IDS and max(ledger.entries) < EVAL_IDS
