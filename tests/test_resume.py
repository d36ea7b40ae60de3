"""Run checkpoints, retention and resume, checked on real processes killed with SIGKILL or preempted with SIGTERM.

Training runs go in child processes (one CPU device, the tiny model, the longtail task) that share a
persistent compilation cache, so a program is compiled once per module, not once per child. The cache is
kept to these single-device children: the suite's own processes, with eight fake CPU devices, do not use one
(tests/conftest.py says why). A child is either killed from outside at a
random moment, or kills itself with SIGKILL right after writing a given metrics line (a deterministic crash
point: the line is on disk, the checkpoint of that update is not). What each test checks:

* killed twice (SIGKILL) and preempted once (SIGTERM: exit 0 after a checkpoint) at random moments in ``dora``
  mode and resumed each time: the saved ledger passes its own check (every sample consumed once or filtered with a reason, groups whole, staleness <= K), metrics
  steps are 1..N once each, samples.jsonl holds each consumed sample once;
* a crashed and resumed run regenerates the lost samples with the same tokens and log-probs: in ``sync`` mode
  equal to an uninterrupted run; in ``one_step_off`` and ``dora`` (also at one version per rollout group) the
  checkpoint holds pending and decoding samples of older versions, which come back from their snapshots and
  reproduce what the crashed run had generated, and the run's running figures continue across the kill;
* a truncated file in the newest checkpoint: the run falls back to the previous one with a warning and still
  ends equal to the uninterrupted run;
* a changed config is refused naming the field, before anything is written.

``Ledger.requeue``, which resume relies on, is tested with the ledger (tests/test_scheduler.py).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import child_cache_env, possible_draws
from dora_jax.config import load_config
from dora_jax.dora.ledger import Ledger
from dora_jax.run.resume import ResumeError, RunStore, truncate_lines
from dora_jax.run import Runner, RunError
from invariants import check_trained_samples
from dora_jax.xla_flags import cpu_test_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["dora.steps=4", "dora.train_batch=8", "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8",
        "rollout.max_new_tokens=24", "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=24",
        "task.eval_size=0", "train.length_buckets=[64]", "train.max_response_tokens=24",
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "task.reward=toy_rewards:varied_reward"]
SYNC = BASE + ["dora.mode=sync", "dora.rollout_batch=8"]

CHILD = """
import json, os, signal, sys
run_dir, overrides, kill_after = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
sys.modules["tensorboardX"] = None  # optional; its import (torch) would cost each child seconds
from dora_jax.run import loop as runner
from dora_jax.config import load_config
if kill_after:
    write = runner.MetricsWriter.write
    def write_then_die(self, row):
        write(self, row)
        if row["step"] == kill_after:  # the line is on disk, this update's checkpoint is not
            os.kill(os.getpid(), signal.SIGKILL)
    runner.MetricsWriter.write = write_then_die
result = runner.Runner(load_config("tiny_llama", overrides), run_dir, progress=False).run()
print(json.dumps({k: result.get(k) for k in ("preempted", "signal", "step", "checkpoint")}))
"""


@pytest.fixture(scope="module")
def child_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_test_flags(devices=1),
               **child_cache_env(),
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    return env


def start(env, run_dir, overrides, kill_after=0):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), json.dumps(overrides), str(kill_after)],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def run_child(env, run_dir, overrides, kill_after=0):
    rc, err = finish(start(env, run_dir, overrides, kill_after))
    want = -signal.SIGKILL if kill_after else 0
    assert rc == want, f"child exited {rc}, expected {want}:\n{err[-3000:]}"
    return err


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def saved_ledger(run_dir):
    return Ledger.from_dict(json.load(open(os.path.join(run_dir, "ledger.json")))["ledger"])


def assert_every_update_changed_the_policy(run_dir):
    metrics = lines(run_dir / "metrics.jsonl")
    assert all(m["train"]["grad_norm"] > 0 and not m["train"]["skipped"] for m in metrics), metrics


def same_samples(a, b):
    """Two lists of samples.jsonl rows are the same samples: ids, versions, tokens, rewards, log-probs."""
    key = lambda r: (r["sample_id"], r["group_id"], r["version"], r["trained_at"], r["prompt_ids"], r["tokens"],  # noqa: E731
                     r["finish_reason"], r["reward"])
    assert [key(r) for r in a] == [key(r) for r in b]
    np.testing.assert_allclose([x for r in a for x in r["logprobs"]], [x for r in b for x in r["logprobs"]],
                               rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def sync_reference(child_env, tmp_path_factory):
    """An uninterrupted sync run: its samples and metrics."""
    d = tmp_path_factory.mktemp("sync_reference")
    run_child(child_env, d, SYNC)
    assert_every_update_changed_the_policy(d)
    return lines(d / "samples.jsonl"), lines(d / "metrics.jsonl"), d


def newest_checkpoint(run_dir):
    d = run_dir / "checkpoints"
    steps = [int(p.name[5:]) for p in d.glob("step_*") if p.name[5:].isdigit()] if d.is_dir() else []
    return max(steps, default=0)


@pytest.fixture(scope="module")
def sync_crashed(child_env, tmp_path_factory):
    """A sync run that died right after writing update 3's metrics line: checkpoints 1 and 2 are on disk,
    update 3's is not. Tests resume from copies of it."""
    d = tmp_path_factory.mktemp("sync_crashed")
    run_child(child_env, d, SYNC, kill_after=3)
    return d


def crashed_copy(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_random_kills_and_a_preemption_resume_to_one_complete_run(child_env, tmp_path):
    """Two SIGKILLs and a SIGTERM at random moments of a dora run, then a resume to the end: the result is one
    complete run. Each stop waits for a checkpoint one or two updates past the newest one (so every attempt
    progresses), then a random fraction of a second more: it lands in rollout, the train step, a metrics or
    samples write, a checkpoint write or a background snapshot write. The SIGTERM (a preemption notice) ends its
    attempt with exit 0 within a grace period, after a checkpoint at the update it reached, which the next
    attempt resumes from."""
    k, steps, tbs, grace = 2, 8, 8, 60
    overrides = BASE + ["dora.mode=dora", f"train.max_staleness={k}", "dora.rollout_batch=16", f"dora.steps={steps}"]
    rng = random.Random(20261123)
    kills, preempted = [], None
    for attempt in range(3):
        target = min(newest_checkpoint(tmp_path) + rng.randint(1, 2), steps - 3)
        proc = start(child_env, tmp_path, overrides)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and newest_checkpoint(tmp_path) < target:
            time.sleep(0.01)
        delay = rng.uniform(0.0, 0.3)
        time.sleep(delay)
        sig = signal.SIGTERM if attempt == 1 else signal.SIGKILL
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=grace if sig == signal.SIGTERM else 300)
        kills.append({"after_checkpoint": target, "delay_s": round(delay, 3), "signal": sig.name,
                      "rc": proc.returncode, "stop_s": round(time.monotonic() - sent, 2)})
        if preempted is not None:  # the attempt after the preemption continued from its checkpoint
            assert f"(step {preempted['step']})" in err and "resume: continuing" in err, (kills, err[-3000:])
            preempted = None
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL, f"the run was to be killed, it exited first: {kills}\n{err[-3000:]}"
            continue
        assert proc.returncode == 0, f"preempted run exited {proc.returncode}: {kills}\n{err[-3000:]}"
        preempted = json.loads(out.strip().splitlines()[-1])
        assert preempted["preempted"] and preempted["signal"] == "SIGTERM", preempted
        assert preempted["step"] >= target and newest_checkpoint(tmp_path) == preempted["step"], (preempted, kills)
        assert f"stopped on SIGTERM at update {preempted['step']} of {steps}" in err
        assert not (tmp_path / "summary.json").exists()  # the run is not over
    err = run_child(child_env, tmp_path, overrides)
    assert "resume: continuing" in err, kills

    ledger = saved_ledger(tmp_path)
    ledger.check(k)  # one state each, groups whole, consumed within K, filtered with a reason
    counts = ledger.counts()
    assert counts["pending"] == counts["in_flight"] == counts["finished"] == 0
    assert counts["consumed"] == steps * tbs and counts["consumed"] + counts["filtered"] == len(ledger.entries)
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), kills
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["staleness_max"] <= k for m in metrics)
    rows = lines(tmp_path / "samples.jsonl")
    assert len(rows) == steps * tbs, kills
    check_trained_samples(rows, ledger, k)  # each consumed sample once, as the ledger has it, groups whole
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps"] == steps and summary["samples"] == steps * tbs and summary["resumed"]
    assert summary["max_resident_versions"] <= k + 1
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 2  # run.keep_checkpoints
    assert summary["run_dir_bytes"] > summary["checkpoint_bytes"] > 0


def test_sync_resume_regenerates_the_same_samples(child_env, tmp_path, sync_reference, sync_crashed):
    ref_samples, ref_metrics, _ = sync_reference
    crashed_copy(sync_crashed, tmp_path)  # newest checkpoint at 2; update 3 was written, then lost
    crashed = lines(tmp_path / "samples.jsonl")
    assert len(crashed) == 24 and len(lines(tmp_path / "metrics.jsonl")) == 3
    err = run_child(child_env, tmp_path, SYNC)
    assert "step_00000002 (step 2)" in err and "dropped 1 lines" in err and "dropped 8 lines" in err
    resumed = lines(tmp_path / "samples.jsonl")
    same_samples(resumed, ref_samples)  # every sample, the regenerated ones included, as if never stopped
    same_samples(resumed[16:24], crashed[16:24])  # update 3's samples regenerated exactly as lost
    assert [m["step"] for m in lines(tmp_path / "metrics.jsonl")] == [m["step"] for m in ref_metrics] == [1, 2, 3, 4]
    saved_ledger(tmp_path).check(0)


def same_generations(a, b, logits_after, sampling):
    """The same samples as generated (ids, versions, prompts, tokens, log-probs, rewards), whenever trained.
    A sample regenerated in another batch than the first time is decoded by another program (another batch
    size and slot), whose rounding can tip a draw at a tie: such a sample may part from the first one at a
    token that both are possible draws of (conftest.possible_draws, on ``logits_after(version, token_ids)``),
    and is compared up to there."""
    key = lambda r: (r["sample_id"], r["group_id"], r["version"], r["prompt_ids"])  # noqa: E731
    a, b = sorted(a, key=lambda r: r["sample_id"]), sorted(b, key=lambda r: r["sample_id"])
    assert [key(r) for r in a] == [key(r) for r in b]
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), None)
        if n is None:
            assert (x["tokens"], x["finish_reason"], x["reward"]) == (y["tokens"], y["finish_reason"], y["reward"])
        else:
            seen = x["prompt_ids"] + x["tokens"][:n]
            pair = {x["tokens"][n], y["tokens"][n]}
            assert pair <= possible_draws(logits_after(x["version"], seen), sampling, x["sample_id"], len(seen))
        np.testing.assert_allclose(x["logprobs"][:n], y["logprobs"][:n], rtol=1e-6, atol=0)


def snapshot_logits(versions_dir, overrides):
    """``logits_after(version, token_ids)``: float64 logits after the tokens on the run's snapshot of that
    version in ``versions_dir``, restored on first use."""
    import jax.numpy as jnp
    from flax import nnx

    from dora_jax.models.build import init_model
    from dora_jax.run.resume import run_fingerprint
    from dora_jax.run.versions import Snapshots

    cfg, models = load_config("tiny_llama", overrides), {}

    def logits_after(version, ids):
        if version not in models:
            graphdef, target = nnx.split(init_model(cfg.model, seed=cfg.run.seed))
            params = Snapshots(versions_dir, fingerprint=run_fingerprint(cfg)).restore(version, target=target)
            models[version] = nnx.merge(graphdef, params)
        return np.asarray(models[version](jnp.asarray([ids])), np.float64)[0, -1]

    return logits_after


# One version per rollout group: the trainer on one device, K + 1 = 3 rollout groups of one device each.
PER_GROUP = ["roles.placement=split", "roles.trainer_devices=1", "target.num_devices=4", "roles.rollout_groups=3",
             "roles.versions_per_group=1"]


@pytest.mark.parametrize("mode,k,rbs,groups", [("one_step_off", 1, 8, []), ("dora", 2, 16, []),
                                               ("dora", 2, 16, PER_GROUP)], ids=["one_step_off", "dora", "per_group"])
def test_resume_regenerates_old_version_samples_from_snapshots(child_env, tmp_path, tmp_path_factory, mode, k, rbs,
                                                               groups):
    """Killed right after update 3's metrics line, resumed from checkpoint 2: the samples that were pending or
    decoding at the checkpoint are generated again on their own (older) versions, restored from snapshots, and
    equal what the killed run had generated and trained at update 3. In one_step_off the schedule is fixed, so
    the resumed run also trains them at the same update; dora's schedule follows reward timing, so only what
    each sample is (its tokens, log-probs, reward, version) is compared. At one version per rollout group the
    groups take their versions again from the balancer's plans; the run's figures (the most versions a group
    held, the balancer's totals) continue from the checkpoint's instead of restarting."""
    # One decode step per program: a sample then takes up to 24 trips of the loop, far longer than its group's
    # rewards take to come back, so under shared placement samples are still decoding at checkpoint 2 however
    # loaded the machine (at 8 steps a program a loaded machine's slow rewards let every dispatched sample finish
    # first). Split placement (the per-group case) completes update 2 as soon as the groups fall idle, often in the
    # trip in which the one long older sample decodes its last token: its reward, answered half a second late
    # there, keeps it outstanding at the checkpoint.
    late = ["task.reward=toy_rewards:late_long_reward"] if groups else []
    overrides = BASE + [f"dora.mode={mode}", f"train.max_staleness={k}", f"dora.rollout_batch={rbs}",
                        "run.checkpoint_every=2", "rollout.decode_steps=1"] + groups + late
    if groups:
        child_env = dict(child_env, XLA_FLAGS=cpu_test_flags(devices=4))
    run_child(child_env, tmp_path, overrides, kill_after=3)
    crashed = lines(tmp_path / "samples.jsonl")
    at_kill = tmp_path_factory.mktemp("versions_at_kill")  # the snapshots as the killed run left them
    shutil.copytree(tmp_path / "versions", at_kill, dirs_exist_ok=True)
    state = json.load(open(tmp_path / "checkpoints" / "step_00000002" / "run_state.json"))
    led = Ledger.from_dict(state["scheduler"]["ledger"])
    redo = {s for s, e in led.entries.items() if e.state in ("pending", "in_flight")}
    assert redo and max(led.entries[s].version for s in redo) <= 2
    if mode == "one_step_off":
        assert {led.entries[s].version for s in redo} == {1}  # the older version: from its snapshot
    killed_rows = lines(tmp_path / "metrics.jsonl")
    assert state["metrics"]["max_versions_per_group"] == killed_rows[1]["max_versions_per_group"]
    if groups:  # the totals as update 2's row reported them
        saved = state["metrics"]["balancer"]
        assert {c: saved[c] for c in ("plans", "changes", "drains")} == {
            c: killed_rows[1]["balancer"][c] for c in ("plans", "changes", "drains")}
        assert sum(saved["loads"]) == killed_rows[1]["balancer"]["loads"] >= 3 and saved["changes"] >= 1
    lost = [r for r in crashed if r["sample_id"] in redo]  # generated and trained after the checkpoint
    assert lost and any(r["version"] < 2 for r in lost)  # some on a version older than the checkpoint's
    err = run_child(child_env, tmp_path, overrides)
    assert "step_00000002 (step 2)" in err
    resumed = lines(tmp_path / "samples.jsonl")
    assert len(resumed) == 32 and len({r["sample_id"] for r in resumed}) == 32
    regenerated = [r for r in resumed if r["sample_id"] in {r["sample_id"] for r in lost}]
    same_generations(regenerated, lost, snapshot_logits(at_kill, overrides),
                     load_config("tiny_llama", overrides).rollout)
    same_samples(resumed[:16], crashed[:16])  # the updates before the checkpoint, kept as they were
    if mode == "one_step_off":
        assert all(r["version"] == 1 and r["trained_at"] == 2 for r in regenerated)
        same_samples(resumed[:24], crashed)
    assert_every_update_changed_the_policy(tmp_path)  # so the older versions differ from the newest
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    check_trained_samples(resumed, saved_ledger(tmp_path), k)
    saved_ledger(tmp_path).check(k)
    summary = json.load(open(tmp_path / "summary.json"))
    most = [m["max_versions_per_group"] for m in metrics]  # a running maximum, across the resume too
    assert most == sorted(most) and summary["max_versions_per_group"] == most[-1] >= killed_rows[1][
        "max_versions_per_group"]
    if groups:
        assert most == [1, 1, 1, 1]
        totals = [m["balancer"] for m in metrics]
        for key in ("plans", "changes", "loads"):
            assert [t[key] for t in totals] == sorted(t[key] for t in totals), key  # totals continue
        assert totals[2]["plans"] > saved["plans"] and sum(summary["balancer"]["loads"]) == totals[-1]["loads"]
        assert summary["balancer"]["moved_requests"] == sum(t["moved_requests"] for t in totals)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(child_env, tmp_path, sync_reference,
                                                                 sync_crashed):
    ref_samples, _, _ = sync_reference
    crashed_copy(sync_crashed, tmp_path)  # checkpoints 1 and 2; update 3 lost
    victim = tmp_path / "checkpoints" / "step_00000002" / "run_state.json"
    victim.write_bytes(victim.read_bytes()[:-10])
    err = run_child(child_env, tmp_path, SYNC)
    assert f"{victim}:" in err and "(truncated or corrupt)" in err  # the warning names the file and the fault
    assert "step_00000001 (step 1)" in err and "dropped 2 lines" in err
    same_samples(lines(tmp_path / "samples.jsonl"), ref_samples)
    assert [m["step"] for m in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (tmp_path / "checkpoints" / "step_00000002.bad-0").is_dir() or not (
        tmp_path / "checkpoints" / "step_00000001").exists()  # set aside, or retention removed it as old


def test_another_config_is_refused_naming_the_field(tmp_path, sync_reference):
    """A run directory with checkpoints (copied from the reference run, without its summary) and a Runner of
    another configuration: refused before anything is built or written, naming the field."""
    shutil.copytree(sync_reference[2] / "checkpoints", tmp_path / "checkpoints")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for change, field in [("train.learning_rate=0.01", "train.learning_rate: 0.003 in the checkpoint, 0.01 now"),
                          ("dora.steps=6", "dora.steps: 4 in the checkpoint, 6 now")]:
        with pytest.raises(ResumeError, match="another configuration") as e:
            Runner(load_config("tiny_llama", SYNC + [change]), str(tmp_path), progress=False)
        assert field in str(e.value) and "step_00000004" in str(e.value)
    with pytest.raises(RunError, match=r"holds an unfinished run \(checkpoints/\) and run.resume is false"):
        Runner(load_config("tiny_llama", SYNC + ["run.resume=false"]), str(tmp_path), progress=False)
    # Where the run lives, its mesh, how often it checkpoints and whether rollout overlaps host and device may
    # change: states restore onto any mesh and hardware.
    same = load_config("tiny_llama", SYNC + ["run.checkpoint_every=3", "run.name=elsewhere", "mesh.data=2",
                                             "rollout.overlap=true"])
    assert RunStore(tmp_path, same).restore(None).step == 4
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_an_unfinished_run_without_checkpoints_is_only_restarted_by_its_own_configuration(tmp_path):
    """A run killed before its first checkpoint (or run with run.checkpoint_every=0) left config.json and
    some lines: another configuration is refused naming the field, before anything is written; the same one
    (placement may differ) starts it over; so does a directory without such lines."""
    cfg = load_config("tiny_llama", SYNC)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    other = load_config("tiny_llama", SYNC + ["model.hidden_size=32"])
    with pytest.raises(ResumeError, match=r"(?s)holds an unfinished run \(metrics.jsonl\) with no checkpoint.*"
                       r"model.hidden_size: 64 in .*config.json, 32 now"):
        Runner(other, str(tmp_path), progress=False)
    with pytest.raises(RunError, match="no checkpoint to continue from"):
        Runner(load_config("tiny_llama", SYNC + ["run.resume=false"]), str(tmp_path), progress=False)
    RunStore(tmp_path, load_config("tiny_llama", SYNC + ["mesh.data=2", "run.name=b"])).check_restart()
    (tmp_path / "config.json").unlink()
    with pytest.raises(ResumeError, match=r"its configuration is unknown \(.*config.json: FileNotFoundError"):
        RunStore(tmp_path, cfg).check_restart()
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ResumeError, match=r"its configuration is unknown"):
        RunStore(tmp_path, cfg).check_restart()
    (tmp_path / "config.json").write_bytes(before[tmp_path / "config.json"])
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    (tmp_path / "metrics.jsonl").write_text("")
    RunStore(tmp_path, other).check_restart()  # nothing of the earlier attempt would be lost


def test_truncate_lines_keeps_the_head_and_refuses_to_grow(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("a\nb\nc\npartial")
    assert truncate_lines(p, 2) == 2 and p.read_text() == "a\nb\n"
    assert truncate_lines(p, 2) == 0
    with pytest.raises(ResumeError, match="m.jsonl has 2 complete lines, but the checkpoint records 3"):
        truncate_lines(p, 3)
    assert p.read_text() == "a\nb\n"


def test_a_cut_off_first_checkpoint_starts_afresh_and_corrupt_ones_only_stop(tmp_path):
    cfg = load_config("tiny_llama", SYNC)
    (tmp_path / "checkpoints" / ".tmp-step_00000001" / "state").mkdir(parents=True)
    assert RunStore(tmp_path, cfg).restore(None) is None  # nothing was ever complete: start afresh
    bad = tmp_path / "checkpoints" / "step_00000001"
    bad.mkdir()
    with pytest.raises(ResumeError, match="(?s)cannot resume: no usable run checkpoint.*step_00000001: no COMPLETE"):
        RunStore(tmp_path, cfg).restore(None)  # a checkpoint that existed and is unusable is not ignored


def test_run_states_and_metadata_the_runner_did_not_write_are_named(tmp_path, monkeypatch):
    """A run state whose metrics lack a counter (another version wrote it) or hold a malformed one, and a
    checkpoint whose meta.json is not a mapping: a ResumeError naming the file and the field, and the config check
    passes over what restore reports. Metrics added later may be absent (an older run's checkpoint)."""
    from dora_jax.run.resume import RUN_METRICS, pack_run_state, unpack_run_state
    from dora_jax.dora.scheduler import SchedulePolicy, Scheduler

    cfg = load_config("tiny_llama", SYNC)
    policy = SchedulePolicy("sync", 0, 8, 8, 4, 32)
    metrics = {k: 0 for k in RUN_METRICS}
    state = pack_run_state(Scheduler(policy), {}, metrics, cfg)
    assert unpack_run_state(policy, state, tmp_path, cfg)[2] == metrics  # without the later fields: an older run's
    totals = {"plans": 3, "changes": 2, "reassigned": 1, "drains": 1, "moved": 0, "loads": [2],
              "moved_requests": 0, "moved_kv_bytes": 0, "move_waits": 0}
    for later, named in [({"max_versions_per_group": -1}, r"metrics.max_versions_per_group: -1 is not a count"),
                         ({"max_versions_per_group": "2"}, r"metrics.max_versions_per_group: '2' is not a count"),
                         ({"balancer": {**totals, "loads": [2, 1]}}, r"metrics.balancer.loads: \[2, 1\] is not a "
                                                                      r"list of 1 counts"),
                         ({"balancer": {**totals, "drains": 0.5}}, r"metrics.balancer.drains: 0.5 is not a count"),
                         ({"balancer": {**totals, "loads": [True]}}, r"metrics.balancer.loads\[0\]: True"),
                         ({"balancer": {"plans": 3}}, r"metrics.balancer: fields \['plans'\], expected"),
                         ({"balancer": [3]}, r"metrics.balancer: \[3\] is not a mapping")]:
        bad = pack_run_state(Scheduler(policy), {}, {**metrics, **later}, cfg)
        with pytest.raises(ResumeError, match=r"run_state.json: not a run state this runner can continue \(" + named):
            unpack_run_state(policy, bad, tmp_path, cfg)
    good = {**metrics, "max_versions_per_group": 2, "balancer": totals}
    assert unpack_run_state(policy, pack_run_state(Scheduler(policy), {}, good, cfg), tmp_path, cfg)[2] == good
    del state["metrics"]["rows_computed"]
    with pytest.raises(ResumeError, match=r"run_state.json: not a run state this runner can continue \(its metrics "
                                          r"lack rows_computed"):
        unpack_run_state(policy, state, tmp_path, cfg)
    store = RunStore(tmp_path, cfg)
    step = store.checkpoints.path(3)
    step.mkdir(parents=True)
    (step / "meta.json").write_text("[]")
    monkeypatch.setattr(store.checkpoints, "steps", lambda: [3])  # as if its completion marker were there
    store.check_config()  # not a mapping: left to restore, which reports it and falls back (was AttributeError)


def test_retention_keeps_the_newest_checkpoints_and_the_snapshots_they_or_resident_versions_need(tmp_path):
    """``run.keep_checkpoints`` newest checkpoints stay; a version's snapshot stays while a kept checkpoint
    records it (other than as its own version, which its train state holds) or it is resident, and goes after.
    A checkpoint that needs a version nobody snapshotted (``run.checkpoint_every`` 0, as when preempted) writes
    that snapshot itself."""
    import jax.numpy as jnp

    params = lambda v: {"w": jnp.full((4,), float(v))}  # noqa: E731
    store = RunStore(tmp_path, load_config("tiny_llama", SYNC + ["run.keep_checkpoints=2"]))
    state = {"w": jnp.zeros(4)}
    # (version published, resident after publishing it, versions its checkpoint needs, snapshots expected after)
    schedule = [(1, {0, 1}, {0, 1}, {0, 1}), (2, {1, 2}, {1, 2}, {0, 1, 2}), (3, {2, 3}, {2, 3}, {1, 2, 3}),
                (4, {3, 4}, {4}, {2, 3, 4}), (5, {5}, {5}, {5})]  # 4: checkpoint 4's own train state
    store.snapshot(0, params(0), {0})
    for v, resident, needed, expected in schedule:
        store.snapshot(v, params(v), resident)
        store.save(v, state, {"v": v}, needed, resident, params)
        assert store.checkpoints.steps() == list(range(max(1, v - 1), v + 1))
        assert set(store.snapshots.versions()) == expected, v
    store.close()

    lean = RunStore(tmp_path / "lean", load_config("tiny_llama", SYNC + ["run.checkpoint_every=0"]))
    lean.snapshot(3, params(3), {2, 3})  # snapshots nothing between checkpoints
    assert lean.snapshots.versions() == []
    lean.save(3, state, {"v": 3}, {2, 3}, {2, 3}, params)
    assert lean.snapshots.versions() == [2]  # version 3 is the checkpoint's own train state
    np.testing.assert_array_equal(lean.restore_version(2, params(0))["w"], np.full(4, 2.0))
    lean.close()


def test_a_checkpoint_that_cannot_be_written_names_the_place_and_keeps_the_others(tmp_path, monkeypatch):
    """A full disk while writing a checkpoint: the error names the directory and its free space, the partial
    write is removed, and the checkpoints already there stay as they were (and still restore)."""
    import errno

    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    store = RunStore(tmp_path, load_config("tiny_llama", SYNC + ["run.keep_checkpoints=2"]))
    state, params = {"w": jnp.ones(4)}, lambda v: {"w": jnp.full((4,), float(v))}  # noqa: E731
    store.save(1, state, {"v": 1}, {1}, {1}, params)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
    with pytest.raises(ResumeError) as e:
        store.save(2, state, {"v": 2}, {2}, {2}, params)
    assert str(tmp_path / "checkpoints") in str(e.value) and "GiB free there" in str(e.value)
    assert "No space left on device" in str(e.value) and "kept: [1]" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before == ["step_00000001"]
    monkeypatch.undo()
    assert store.restore({"w": jnp.zeros(4)}).step == 1
    store.close()


def test_a_run_that_may_not_fit_its_disk_is_warned_at_start(tmp_path, caplog, monkeypatch):
    """The start-up warning compares retention's bound (kept train states and the snapshots they and residency
    need) with the free space, and names the setting to change; a run that fits is not warned."""
    import collections

    store = RunStore(tmp_path / "run", load_config("tiny_llama", SYNC + ["run.keep_checkpoints=2"]))
    assert store.disk_estimate(100, 10, 2) == 2 * 100 + (3 + 2 * 2) * 10
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("dora_jax.run.resume.shutil.disk_usage", lambda p: usage(10**6, 0, 269))
    with caplog.at_level("WARNING"):
        store.warn_if_short_of_disk(100, 10, 2)  # needs 270 bytes, 269 free
    assert "checkpoints may not fit" in caplog.text and "run.keep_checkpoints" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        store.warn_if_short_of_disk(100, 9, 2)  # needs 263
    assert "checkpoints may not fit" not in caplog.text


def test_a_setting_added_at_its_default_keeps_the_fingerprint_of_saved_runs():
    """Checkpoints record the run fingerprint: a config written before a setting existed (its dict without the
    field) fingerprints as the same config with the setting at its default, so the run resumes under newer code;
    a value other than the default is another configuration, as is any changed setting."""
    from dora_jax.run.resume import run_fingerprint

    cfg = load_config("tiny_llama", SYNC)
    now = run_fingerprint(cfg)
    older = cfg.to_dict()
    del older["task"]["code_timeout_s"]
    assert run_fingerprint(older) == now
    assert run_fingerprint(load_config("tiny_llama", SYNC + ["task.code_timeout_s=7"])) != now
    assert run_fingerprint(load_config("tiny_llama", SYNC + ["train.learning_rate=0.004"])) != now
