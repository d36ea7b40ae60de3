"""A `dora` run under multi-controller ``jax.distributed``: two processes on localhost with four CPU devices
each (gloo collectives). The trainer's mesh spans both processes' eight devices; each process decodes its
share of the groups on its own four, and the finished samples are shared. Both processes must take the same
decisions and end with the same ledger, which keeps its
invariants; only process 0 writes the run directory's files, and both write the run checkpoints and version
snapshots together; held-out evaluations during training (``task.eval_every``) decode beside rollout, each
process its share, and every process records the same results; two processes resumed from a checkpoint finish
the run exactly as the uninterrupted one.
Under split placement each process trains on some of its devices and decodes on the others; such a run killed
at a random moment resumes to one complete run."""

import shutil

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import child_cache_env
from dora_jax.dora.ledger import Ledger
from dora_jax.xla_flags import cpu_test_flags

STEPS, TBS, K = 3, 8, 2
OVERRIDES = ["dora.mode=dora", f"dora.steps={STEPS}", f"dora.train_batch={TBS}", "dora.rollout_batch=16",
             f"train.max_staleness={K}", "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8",
             "rollout.max_new_tokens=16", "rollout.max_prompt_len=32", "task.name=longtail",
             "task.longtail_max_len=16", "task.eval_size=2", "train.length_buckets=[64]",
             "train.max_response_tokens=16", "run.checkpoint_every=1",
             # tensorboardX imports torch where it is installed (as here): seconds per process, and not tried here.
             "metrics.tensorboard=false",
             # The trainer shards params and optimizer state over all eight devices of both processes; each
             # process decodes on its own four devices (data-parallel rows, weights replicated).
             "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "roles.rollout_data=4", "roles.rollout_tensor=1"]

_WORKER = textwrap.dedent("""
    import json, sys
    from dora_jax.distributed import initialize
    initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from dora_jax.config import MeshConfig, load_config
    from dora_jax.models.build import abstract_model, state_shardings
    from dora_jax.run import Runner
    from dora_jax.sharding import ProcessLocalCopy, process_meshes

    run_dir, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    runner = Runner(load_config("tiny_llama", overrides), run_dir, progress=False)
    resumed_at = runner.sched.version
    evals, record_eval = [], runner._record_eval  # every evaluation's result as this process measured it
    runner._record_eval = lambda version, result, *rest: (evals.append([version, result]),
                                                          record_eval(version, result, *rest))
    summary = runner.run()
    # This process's rollout copy of the newest version against the trainer's (global) params.
    v = runner.sched.version
    local = jax.tree.leaves(runner.versions.rollout_params(v)[0])
    full = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(runner.versions.params(v))]
    # The same move onto a tensor-sharded mesh of each process's devices: every shard is the right slice.
    cfg = runner.cfg
    meshes = process_meshes(MeshConfig(data=1, fsdp=1, tensor=4))
    to_tp = ProcessLocalCopy(state_shardings(abstract_model(cfg.model)[1], meshes[jax.process_index()],
                                             cfg.mesh.logical_axis_rules), meshes)
    tp = jax.tree.leaves(to_tp(runner.versions.params(v))[0])
    tp_ok = all(x.is_fully_addressable and {d.process_index for d in x.sharding.device_set} == {jax.process_index()}
                and np.array_equal(np.asarray(x), b) for x, b in zip(tp, full))
    tp_sharded = sum(not x.sharding.is_fully_replicated for x in tp)
    rec = {"pid": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
           "resumed_at": resumed_at, "generated": runner.rollout.generated,
           "trainer_devices": int(runner.trainer.mesh.devices.size),
           "rollout_devices": sorted(d.id for d in runner.placement.engine.mesh.devices.flat),
           "local_devices": sorted(d.id for d in jax.local_devices()),
           "updates": list(runner.updates), "ledger": runner.sched.state_dict(),
           "copy_max_diff": max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(local, full)),
           "tp_ok": tp_ok, "tp_sharded": tp_sharded, "evals": evals,
           "copy_sum": sum(float(np.asarray(a, np.float64).sum()) for a in local),
           "summary": {k: summary[k] for k in ("steps", "samples", "accuracy_before", "accuracy_after",
                                                "max_resident_versions", "processes", "sync_s")}}
    with open(out, "w") as f:
        json.dump(rec, f)
""")


# Split placement: each process gives one of its four devices to the trainer (whose mesh spans both processes)
# and decodes on the other three, three rollout groups of one device, each holding one policy version (group g of
# both processes the same one) while the trainer trains; decoupled PPO on recomputed behaviour log-probs, two
# minibatches per iteration (so the proximal policy is not the current one), a reward that differs within groups.
SPLIT_STEPS = 5
SPLIT = [o for o in OVERRIDES if not o.startswith(("mesh.", "roles.", "dora.steps", "task.eval_size", "rollout.slots",
                                                   "dora.rollout_batch", "rollout.max_new_tokens", "task.longtail_max_len",
                                                   "train.max_response_tokens", "train.length_buckets"))] + [
    f"dora.steps={SPLIT_STEPS}", "task.eval_size=0",  # the held-out evaluation is the other test's
    # Two slots per group and answers of up to 48 tokens: groups are still busy when versions are published, so
    # groups drain and requests move between the groups of a process.
    "rollout.slots=2", "dora.rollout_batch=16", "rollout.max_new_tokens=48", "task.longtail_max_len=48",
    "train.max_response_tokens=48", "train.length_buckets=[128]",
    "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=1", "roles.placement=split", "roles.trainer_devices=2",
    "roles.rollout_data=1", "roles.rollout_tensor=1", "roles.rollout_groups=3", "roles.versions_per_group=1",
    "target.num_devices=8", "train.correction=decoupled",
    "train.behaviour_logprobs=recompute", "train.minibatches=2", "task.reward=toy_rewards:spread_reward",
    # Every checkpoint kept, and with them a snapshot of every version that had samples in flight: the worker
    # recomputes trained samples' log-probs from their own versions.
    f"run.keep_checkpoints={SPLIT_STEPS}"]

_SPLIT_WORKER = textwrap.dedent("""
    import json, sys
    from dora_jax.distributed import initialize
    initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from dora_jax.config import load_config
    from dora_jax.run import Runner
    from dora_jax.run.resume import ResumeError
    from dora_jax.trainer import Sample, make_batch

    run_dir, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    runner = Runner(load_config("tiny_llama", overrides), run_dir, progress=False)
    resumed_at = runner.sched.version
    summary = runner.run()
    if summary.get("preempted"):  # stopped on a signal, checkpoint written: what the command would report
        with open(out, "w") as f:
            json.dump({"pid": jax.process_index(), "resumed_at": resumed_at, "preempted": summary}, f)
        sys.exit(0)
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    v, trainer = runner.sched.version, runner.trainer
    local = [x for copy in runner.versions.rollout_params(v) for x in jax.tree.leaves(copy)]  # each group's
    full = [gather(x) for x in jax.tree.leaves(runner.versions.params(v))] * len(runner.engines)
    # Every trained token's behaviour log-prob recomputed on the trainer's devices from its own version's
    # snapshot, against the log-prob the engine recorded when it sampled the token; and from another version.
    with open(f"{run_dir}/samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    like, snaps = trainer.policy_params(runner.state), {}
    for u in sorted({r["version"] for r in rows}):
        try:
            snaps[u] = runner.store.restore_version(u, like)
        except ResumeError:  # an old version's snapshot, let go by the retention
            pass
    # Whole groups of the versions still snapshotted (a group's samples share their version).
    rows = [r for r in rows if r["version"] in snaps]
    samples = [Sample(r["sample_id"], r["group_id"], r["version"], r["prompt_ids"], r["tokens"], r["logprobs"],
                      r["reward"]) for r in rows]
    host = make_batch(samples, group_size=4, length_buckets=(128,), row_multiple=trainer.row_multiple)
    batch = trainer.put(host)
    own = gather(trainer.with_recomputed_behaviour(batch, snaps.__getitem__, host).recomputed_logprobs)
    newest = max(snaps)
    other = gather(trainer.with_recomputed_behaviour(batch, lambda u: snaps[newest if u != newest else min(snaps)],
                                                     host).recomputed_logprobs)
    mask, recorded = np.asarray(host.loss_mask) > 0, np.asarray(host.behaviour_logprobs)
    err = lambda a: float(np.max(np.abs(a[mask] - recorded[mask])) / np.max(np.abs(recorded[mask])))
    rec = {"pid": jax.process_index(), "resumed_at": resumed_at, "generated": runner.rollout.generated,
           "trainer_devices": sorted(d.id for d in runner.trainer.mesh.devices.flat),
           "rollout_devices": [sorted(d.id for d in e.mesh.devices.flat) for e in runner.engines],
           "local_devices": sorted(d.id for d in jax.local_devices()),
           "updates": list(runner.updates), "ledger": runner.sched.state_dict(),
           "copy_max_diff": max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(local, full)),
           "copy_on_own_devices": all({d.process_index for d in x.sharding.device_set} == {jax.process_index()}
                                      for x in local),
           "own_err": err(own), "other_err": err(other), "versions_trained": sorted(snaps),
           "summary": summary}
    with open(out, "w") as f:
        json.dump(rec, f)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, overrides_of, worker=_WORKER, devices=4):
    """Starts ``worker`` in two processes of ``devices`` CPU devices each (``overrides_of(pid)`` each)."""
    port, run_dir = _free_port(), tmp_path / "run"
    procs = []
    for pid in range(2):
        # The suite's compiler settings: compiling dominates a run this small, and both processes compile the same
        # programs with the same flags.
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": cpu_test_flags(devices=devices),
               **child_cache_env(), "DORA_COORDINATOR": f"127.0.0.1:{port}", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": str(pid),
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", worker, str(run_dir), str(tmp_path / f"rec{pid}.json"),
             json.dumps(overrides_of(pid))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs, timeout=240):
    """Waits for the processes; returns their return codes and outputs (fails naming the late ones)."""
    deadline, outs, late = time.monotonic() + timeout, [], []
    try:
        for pid, p in enumerate(procs):
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
                late.append(pid)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if late:
        pytest.fail(f"process(es) {late} still running after {timeout}s; output of each:\n"
                    + "\n".join(f"--- process {pid}:\n{out[-3000:]}" for pid, out in enumerate(outs)))
    return [p.returncode for p in procs], outs


def _launch(tmp_path, overrides_of, timeout=240, worker=_WORKER, devices=4):
    """Runs ``worker`` in two processes of ``devices`` CPU devices each (``overrides_of(pid)`` each); returns
    their return codes and outputs."""
    return _finish(_start(tmp_path, overrides_of, worker, devices), timeout)


# Held-out evaluations during training too: versions 1 and 2 (3, the last, is the final evaluation's), each
# process decoding its share of the held-out requests beside rollout, the answers exchanged with the samples.
EVALS = ["task.eval_every=1"]


def test_two_processes_run_dora_end_to_end_and_agree(tmp_path):
    run_dir = tmp_path / "run"
    codes, outs = _launch(tmp_path, lambda pid: OVERRIDES + EVALS)
    for pid, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, f"process {pid} failed:\n{out[-6000:]}"
    recs = [json.loads((tmp_path / f"rec{pid}.json").read_text()) for pid in range(2)]

    for pid, r in enumerate(recs):
        assert (r["pid"], r["processes"], r["devices"], r["trainer_devices"]) == (pid, 2, 8, 8)
        # Each process decodes on its own four devices.
        assert r["rollout_devices"] == r["local_devices"] and len(r["local_devices"]) == 4
        ledger = Ledger.from_dict(r["ledger"]["ledger"])
        ledger.check(K)  # every sample consumed once or filtered with a reason, groups whole, staleness <= K
        counts = ledger.counts()
        assert counts["consumed"] == STEPS * TBS and counts["pending"] == counts["in_flight"] == 0
        assert [u["step"] for u in r["updates"]] == list(range(1, STEPS + 1))
        for u in r["updates"]:
            assert len(u["samples"]) == TBS and all(0 <= u["step"] - 1 - v <= K for _, v in u["samples"])
        assert r["summary"]["steps"] == STEPS and r["summary"]["samples"] == STEPS * TBS
        assert r["summary"]["max_resident_versions"] <= K + 1 and r["summary"]["sync_s"] > 0
        assert r["copy_max_diff"] == 0.0  # the process's rollout copy is the trainer's newest version
        assert r["tp_ok"] and r["tp_sharded"] > 0  # and a tensor-sharded local copy holds the right slices
    assert len({r["local_devices"][0] for r in recs}) == 2  # different devices
    # Each process generated its own share of the groups; together, every finished sample exactly once, and each
    # held-out answer of the two evaluations during training.
    counts = Ledger.from_dict(recs[0]["ledger"]["ledger"]).counts()
    assert all(r["generated"] > 0 for r in recs)
    assert sum(r["generated"] for r in recs) == counts["consumed"] + counts["finished"] + 2 * 2

    # Both processes agree on every decision: the same steps, groups, samples and versions, the same train
    # metrics, the same final ledger, the same weights and evaluations.
    assert recs[0]["updates"] == recs[1]["updates"]
    assert recs[0]["ledger"] == recs[1]["ledger"]
    assert recs[0]["copy_sum"] == recs[1]["copy_sum"]
    assert recs[0]["summary"]["accuracy_after"] == recs[1]["summary"]["accuracy_after"]
    assert max(lag for u in recs[0]["updates"] for lag in [u["step"] - 1 - v for _, v in u["samples"]]) >= 1

    # Only process 0 wrote the (shared) run directory: one line per update and per consumed sample, and one per
    # evaluation (before training, of versions 1 and 2 during it, and after), in the order they finished; every
    # process measured the same accuracies.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval" not in m] == list(range(1, STEPS + 1))
    evals = [[m["version"], m["eval"]] for m in lines if "eval" in m]
    assert [v for v, _ in evals] == list(range(STEPS + 1)) and all(e["n"] == 2 and e["len_mean"] > 0 for _, e in evals)
    assert recs[0]["evals"] == recs[1]["evals"] == evals
    assert evals[-1][1]["accuracy"] == recs[0]["summary"]["accuracy_after"]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["sample_id"] for s in samples) == sorted(sid for u in recs[0]["updates"] for sid, _ in u["samples"])
    saved = json.loads((run_dir / "ledger.json").read_text())
    assert saved == recs[0]["ledger"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes"] == 2 and "accuracy_before" in summary and "accuracy_after" in summary

    # Both processes wrote a run checkpoint after every update (the newest two kept: run.keep_checkpoints) and a
    # snapshot of every version (Orbax; each process its shards). Take the last update's checkpoint and the
    # run's end away and resume with two processes: they restore the trainer state onto the global mesh, the
    # in-flight versions from their snapshots, and redo update 3 exactly as the uninterrupted run did.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step_{s:08d}" for s in range(STEPS - 1, STEPS + 1)], ckpts
    assert sorted(p.name for p in (run_dir / "versions").iterdir() if p.name.startswith("v_"))[-1] == f"v_{STEPS:08d}"
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    (run_dir / "summary.json").unlink()
    codes, outs = _launch(tmp_path, lambda pid: OVERRIDES + EVALS + ["run.resume=true"])
    for pid, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, f"resumed process {pid} failed:\n{out[-6000:]}"
    again = [json.loads((tmp_path / f"rec{pid}.json").read_text()) for pid in range(2)]
    for r in again:
        assert r["resumed_at"] == STEPS - 1
        assert r["updates"] == recs[0]["updates"][STEPS - 1:]  # the redone update: same samples, versions, loss
        assert r["ledger"] == recs[0]["ledger"] and r["copy_sum"] == recs[0]["copy_sum"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The redone update's line replaced, not added. Evaluations in flight at checkpoint 2 are dropped with it
    # (version 2's; version 1's too when it had not finished by then): the lines kept are the checkpoint's, and
    # the final evaluation is the same again.
    assert [m["step"] for m in lines if "eval" not in m] == list(range(1, STEPS + 1))
    again_evals = [[m["version"], m["eval"]] for m in lines if "eval" in m]
    assert again_evals in ([evals[0], evals[-1]], [evals[0], evals[1], evals[-1]])
    assert again[0]["evals"] == again[1]["evals"] == evals[-1:]


@pytest.mark.parametrize("extra_of,message", [
    # Process 1 runs another config: both stop at startup, naming the difference.
    (lambda pid: ["rollout.seed=1"] * pid,
     "RunError: at startup: config fingerprint differs between processes: process 0 has"),
    # Rewards that differ between processes: process 0 has a first batch, process 1 none; both stop, naming it.
    # (No evaluation: it scores on its own, and a process that raises alone leaves the other waiting.)
    (lambda pid: ["task.reward=toy_rewards:reward_refused_on_process_1", "task.eval_size=0"],
     "RunError: before update 1: the batch to train differs between processes: process 0 has ["),
], ids=["config_differs", "rewards_differ"])
def test_processes_that_cannot_agree_stop_together_naming_the_cause(tmp_path, extra_of, message):
    codes, outs = _launch(tmp_path, lambda pid: OVERRIDES + extra_of(pid), timeout=120)
    for pid, (code, out) in enumerate(zip(codes, outs)):
        assert code != 0, f"process {pid} did not fail:\n{out[-3000:]}"
        assert message in out, out[-3000:]
    if "startup" in message:
        assert not (tmp_path / "run" / "config.json").exists()  # stopped before anything was written


def _newest_checkpoint(run_dir) -> int:
    d = run_dir / "checkpoints"
    steps = [int(p.name[5:]) for p in d.glob("step_*") if p.name[5:].isdigit()] if d.is_dir() else []
    return max(steps, default=0)


def test_split_placement_with_one_version_per_group_across_processes_survives_a_preemption_and_kills(tmp_path):
    """Each process trains on one device and decodes on the other three, three rollout groups of one version
    each, which the balancer plans from both processes' groups together. One process gets SIGTERM past the first
    checkpoint: JAX's preemption service tells the other, and both stop at the same update, write one checkpoint
    and exit 0. Resumed, one process is killed at a random moment past the next checkpoint, then the other (as a
    cluster manager ends a job that lost a member); two processes resume to the end. The run keeps every
    promise, the processes agree (on the groups' versions and moves too), no group held two versions, every
    group's rollout copy is the trainer's newest version on the process's own devices, decoupled PPO runs on behaviour log-probs recomputed on the trainer's devices from each sample's own
    version, and its ratio statistics are in the metrics. (Repeated kills of resumed runs: tests/test_resume.py,
    in one process.)"""
    run_dir, rng = tmp_path / "run", random.Random(20261125)

    def wait_for_checkpoint_past(step, procs):
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline and _newest_checkpoint(run_dir) <= step:
            time.sleep(0.01)

    procs = _start(tmp_path, lambda pid: SPLIT, _SPLIT_WORKER)
    wait_for_checkpoint_past(0, procs)
    noticed = rng.randrange(2)
    procs[noticed].send_signal(signal.SIGTERM)
    codes, outs = _finish(procs)
    assert codes == [0, 0], (noticed, [out[-3000:] for out in outs])
    stops = [json.loads((tmp_path / f"rec{pid}.json").read_text())["preempted"] for pid in range(2)]
    same = [{k: v for k, v in s.items() if k != "checkpoint_s"} for s in stops]  # each process timed its own save
    assert same[0] == same[1], stops
    stop = stops[0]["step"]
    # Stopped early enough that the attempts after it still generate: one ends past the next checkpoint (killed),
    # the last trains at least two more updates.
    assert stops[0]["signal"] == "SIGTERM" and 1 <= stop <= SPLIT_STEPS - 3, stops
    assert _newest_checkpoint(run_dir) == stop and stops[0]["checkpoint"].endswith(f"step_{stop:08d}"), stops

    procs = _start(tmp_path, lambda pid: SPLIT + ["run.resume=true"], _SPLIT_WORKER)
    wait_for_checkpoint_past(stop, procs)
    delay, first = rng.uniform(0.0, 0.5), rng.randrange(2)
    time.sleep(delay)
    procs[first].kill()
    time.sleep(rng.uniform(0.0, 0.5))
    procs[1 - first].kill()
    codes, outs = _finish(procs)
    kills = [{"preempted_at": stop, "after_checkpoint": stop + 1, "delay_s": round(delay, 3), "first": first,
              "codes": codes}]
    # The first one killed died of it; the other of its kill, or it stopped on its own when the lost process's
    # heartbeats ended; none had finished.
    assert codes[first] == -signal.SIGKILL and codes[1 - first] != 0, (kills, outs[1 - first][-3000:])
    codes, outs = _launch(tmp_path, lambda pid: SPLIT + ["run.resume=true"], worker=_SPLIT_WORKER)
    for pid, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, f"resumed process {pid} failed after {kills}:\n{out[-6000:]}"
    recs = [json.loads((tmp_path / f"rec{pid}.json").read_text()) for pid in range(2)]
    assert recs[0]["updates"] == recs[1]["updates"] and recs[0]["ledger"] == recs[1]["ledger"], kills
    for pid, r in enumerate(recs):
        # The trainer's mesh: the first device of each process; this process decodes on each of the other three.
        assert len(r["trainer_devices"]) == 2 and r["trainer_devices"][pid] == r["local_devices"][0]
        assert r["rollout_devices"] == [[d] for d in r["local_devices"][1:]] and r["generated"] > 0, kills
        assert stop < r["resumed_at"] < SPLIT_STEPS, kills
        assert [u["step"] for u in r["updates"]] == list(range(r["resumed_at"] + 1, SPLIT_STEPS + 1))
        s = r["summary"]
        assert (s["placement"], s["processes"], s["steps"]) == ("split", 2, SPLIT_STEPS)
        assert s["samples"] == SPLIT_STEPS * TBS
        assert s["max_resident_versions"] <= K + 1 and s["sync_s"] > 0 and s["resumed"]
        # One version per group, measured by each process's drivers; both processes gave group g the same versions
        # and counted the same moves (each moves its own requests, within the process).
        assert s["max_versions_per_group"] == 1 and s["rollout_groups"] == 3
        assert s["balancer"] == recs[0]["summary"]["balancer"] and s["balancer"]["changes"] >= 1
        assert r["copy_max_diff"] == 0.0 and r["copy_on_own_devices"]
        # Recomputed from each sample's own version: the engine's log-probs up to float32 rounding (the
        # single-process runner test's bound); another version's are detectably different.
        assert r["own_err"] <= 1e-4 and r["other_err"] > 1e-3, (r["own_err"], r["other_err"], r["versions_trained"])
        # Decoupled PPO's ratio statistics in every update's metrics; an update that trained samples of an
        # older version (whose weights had moved since) has weights other than 1.
        for u in r["updates"]:
            t = u["train"]
            assert 0 < t["is_weight_mean_min"] <= t["is_weight_mean"] <= t["is_weight_mean_max"]
            assert 0 <= t["is_dropped_frac"] <= 1
            if max(u["step"] - 1 - v for _, v in u["samples"]) >= 1:
                assert abs(t["is_weight_mean"] - 1) > 1e-6, u

    # The ledger's audit over both attempts: every sample consumed once or filtered with a reason, groups
    # whole, staleness within K; each update's line and samples once in the run directory.
    ledger = Ledger.from_dict(recs[0]["ledger"]["ledger"])
    ledger.check(K)
    counts = ledger.counts()
    assert counts["consumed"] == SPLIT_STEPS * TBS and counts["pending"] == counts["in_flight"] == 0, kills
    trained = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len({t["sample_id"] for t in trained}) == len(trained) == SPLIT_STEPS * TBS, kills
    assert all(0 <= t["trained_at"] - t["version"] <= K for t in trained)
    assert max(t["trained_at"] - t["version"] for t in trained) >= 1  # the schedule overlapped versions
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, SPLIT_STEPS + 1)), kills
