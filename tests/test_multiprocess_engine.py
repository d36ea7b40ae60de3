"""One rollout engine over the devices of two processes (multi-controller ``jax.distributed``, gloo on CPU).

Two processes on localhost with two fake CPU devices each build one engine on a mesh of all four devices and
run the same driver calls. Its greedy trajectories (two policy versions, requests submitted at staggered steps,
a shared prompt head) are compared with those of the single-process engine on one device, given the same
weights gathered to the host. The same processes then run a short training run whose one rollout engine spans
both (``roles.rollout_span=all``)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import child_cache_env
from dora_jax.dora.ledger import Ledger
from dora_jax.xla_flags import cpu_test_flags

STEPS, TBS, K = 2, 8, 2
# The run on the spanning engine: dora with staleness bound K, the trainer on fsdp over the four devices, the
# engine's data x tensor mesh over the same four; no checkpoints (the engine is what is tried here).
RUN = ["dora.mode=dora", f"dora.steps={STEPS}", f"dora.train_batch={TBS}", "dora.rollout_batch=16",
       f"train.max_staleness={K}", "train.group_size=4", "train.learning_rate=0.003", "rollout.slots=8",
       "rollout.max_new_tokens=16", "rollout.max_prompt_len=32", "task.name=longtail", "task.longtail_max_len=16",
       "task.eval_size=2", "train.length_buckets=[64]", "train.max_response_tokens=16", "run.checkpoint_every=0",
       "metrics.tensorboard=false",  # tensorboardX imports torch where it is installed: seconds per process
       "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1", "roles.rollout_span=all", "roles.rollout_data=2",
       "roles.rollout_tensor=2"]

_WORKER = textwrap.dedent("""
    import json, sys
    from dora_jax.distributed import initialize
    initialize()
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from dora_jax.config import DEFAULT_RULES, MeshConfig, load_config
    from dora_jax.models.build import abstract_model, init_model, state_shardings
    from dora_jax.rollout.driver import RolloutDriver
    from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
    from dora_jax.rollout.samples import Request
    from dora_jax.sharding import create_mesh, reshard

    out = sys.argv[1]
    cfg = load_config("tiny_llama").model
    # Rows split over "data" within each process, heads over "tensor" across the processes: each tensor pair is
    # one device of process 0 and one of process 1, so every decode step's matmuls reduce across processes.
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    devices = [d for pair in zip(*by_process) for d in pair]
    mesh = create_mesh(MeshConfig(data=2, fsdp=1, tensor=2), devices)
    rng = np.random.default_rng(0)
    head = tuple(int(x) for x in rng.integers(1, cfg.vocab_size, 5))  # every prompt starts with it (a chat head)
    prompts = [head + tuple(int(x) for x in rng.integers(1, cfg.vocab_size, rng.integers(2, 12))) for _ in range(5)]
    greedy = RequestSampling(temperature=0.0)
    # (sample id, prompt, version, max new tokens) in three waves, each submitted while the earlier ones decode:
    # the last finds three of the four slots taken (only sample 1 can have ended), so one of its requests waits
    # for a slot. Sample 2 is sample 0's prompt on the other version.
    waves = [[(0, prompts[0], 0, 20), (1, prompts[1], 0, 6)],
             [(2, prompts[0], 1, 14), (3, prompts[2], 1, 19)],
             [(4, prompts[3], 0, 9), (5, prompts[4], 1, 11)]]
    sizes = dict(max_concurrent_decodes=4, max_prefill_length=32, max_target_length=64)

    def decode(engine, params):
        driver = RolloutDriver(engine, shared_prefix=head)
        for v, p in enumerate(params):
            driver.add_version(v, p)
        done = []
        for wave in waves:
            for sid, prompt, v, n in wave:
                driver.submit(Request(sid, prompt, version=v, max_new_tokens=n, sampling=greedy))
            done += driver.step()
        while not driver.idle:
            done += driver.step()
        return [{"id": t.sample_id, "version": t.version, "tokens": t.tokens, "logprobs": t.logprobs,
                 "reason": t.finish_reason} for t in sorted(done, key=lambda t: t.sample_id)]

    # Both versions born on a trainer's mesh (fsdp over the same four devices, in the same order) and moved to
    # the rollout mesh's layout device to device, as a run publishes a version.
    trainer_mesh = create_mesh(MeshConfig(data=1, fsdp=4, tensor=1), devices)
    models = [init_model(cfg, trainer_mesh, DEFAULT_RULES, seed=s) for s in (0, 1)]
    engine = Engine(models[0], mesh=mesh, **sizes)
    rollout_shardings = state_shardings(abstract_model(cfg)[1], mesh, DEFAULT_RULES)
    params = [reshard(nnx.split(m)[1], rollout_shardings)[0] for m in models]
    rec = {"pid": jax.process_index(), "spans": engine.spans_processes,
           "moved": all(x.sharding.is_equivalent_to(t, x.ndim) for p in params
                        for x, t in zip(jax.tree.leaves(p), jax.tree.leaves(rollout_shardings))),
           "tensor_pairs": [[d.process_index for d in row] for row in mesh.devices.reshape(2, 2)],
           "trajectories": decode(engine, params)}
    rec["cache_processes"] = sorted({d.process_index for d in engine.pool.k.sharding.device_set})
    rec["cache_shape"] = list(engine.pool.k.shape)
    rec["cache_shard"] = list(engine.pool.k.addressable_shards[0].data.shape)
    rec["shards"] = engine.shards
    other = [d for d in jax.devices() if d.process_index != jax.process_index()]
    try:  # a mesh of the other process's devices alone: this process cannot run that engine
        Engine(models[0], mesh=create_mesh(MeshConfig(data=1, fsdp=1, tensor=2), other), **sizes)
        rec["refused"] = None
    except EngineError as e:
        rec["refused"] = str(e)
    host = [jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), p) for p in params]
    if jax.process_index() == 0:  # the reference: the engine of one process on one device, the same weights
        local = [jax.device_put(p, jax.local_devices()[0]) for p in host]
        rec["reference"] = decode(Engine(nnx.merge(nnx.split(models[0])[0], local[0]), **sizes), local)

    # A short dora run whose one rollout engine spans both processes (roles.rollout_span=all): the trainer's fsdp
    # mesh and the engine's data x tensor mesh over the same four devices, tensor pairs across the processes.
    import os
    from dora_jax.models.build import abstract_model
    from dora_jax.rollout.driver import RolloutDriver as Driver
    from dora_jax.run import Runner
    from dora_jax.run.placement import make_engine
    run_dir = os.path.join(os.path.dirname(out), "run")
    runner = Runner(load_config("tiny_llama", json.loads(sys.argv[2])), run_dir, devices=devices, progress=False)
    first = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                         runner.versions.params(0))
    summary = runner.run()
    v, eng = runner.sched.version, runner.placement.engine
    copy = runner.versions.rollout_params(v)[0]
    gathered = lambda t: [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(t)]
    rec["run"] = {"spans": runner.placement.spans and eng.spans_processes, "generated": runner.rollout.generated,
                  "updates": list(runner.updates), "ledger": runner.sched.state_dict(), "summary": summary,
                  "engine_processes": sorted({d.process_index for d in eng.mesh.devices.flat}),
                  # The moved version is the trainer's, every array on the engine's own mesh (none left on the
                  # trainer's, which would compile the engine's programs again).
                  "copy_max_diff": max(float(np.max(np.abs(a - b)))
                                       for a, b in zip(gathered(copy), gathered(runner.versions.params(v)))),
                  "copy_on_engine_mesh": all(x.sharding.mesh == eng.mesh for x in jax.tree.leaves(copy))}
    if jax.process_index() == 0:  # version 0's trained samples again on one device of one process, same weights
        with open(os.path.join(run_dir, "samples.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if r["version"] == 0]
        led, cfg = runner.sched.ledger, runner.cfg
        one = make_engine(cfg, nnx.merge(abstract_model(cfg.model)[0], jax.device_put(first, jax.local_devices()[0])))
        driver = Driver(one)
        driver.add_version(0, jax.device_put(first, jax.local_devices()[0]))
        for r in rows:
            e = led.entries[r["sample_id"]]
            member = led.groups[e.group_id].sample_ids.index(r["sample_id"])
            budget = runner.task.train_item(e.prompt_index).budget(member, cfg.rollout.max_new_tokens)
            driver.submit(Request(r["sample_id"], tuple(r["prompt_ids"]), version=0, max_new_tokens=budget,
                                  sampling=runner.rollout.sampling))
        done = []
        while not driver.idle:
            done += driver.step()
        ref = {t.sample_id: t for t in done}
        rec["run"]["version0"] = [[r["tokens"], ref[r["sample_id"]].tokens, r["logprobs"], ref[r["sample_id"]].logprobs]
                                  for r in rows]
    with open(out, "w") as f:
        json.dump(rec, f)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, timeout=180):
    """The worker in two processes of two CPU devices each; returns each process's record."""
    port, procs = _free_port(), []
    for pid in range(2):
        # The suite's compiler settings: compiling dominates a run this small (both processes compile everything).
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": cpu_test_flags(devices=2),
               **child_cache_env(), "DORA_COORDINATOR": f"127.0.0.1:{port}", "DORA_NUM_PROCESSES": "2",
               "DORA_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"rec{pid}.json"),
                                       json.dumps(RUN)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0] + f"\n(killed after {timeout} s)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for pid, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {pid} failed:\n{out[-6000:]}"
    return [json.loads((tmp_path / f"rec{pid}.json").read_text()) for pid in range(2)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """One launch of the worker serves both tests (each start of two processes compiles everything)."""
    return _launch(tmp_path_factory.mktemp("engine"))


def test_an_engine_spanning_two_processes_decodes_like_one_process(records):
    recs = records
    reference = recs[0]["reference"]
    assert [t["id"] for t in reference] == list(range(6))
    assert reference[0]["tokens"][:14] != reference[2]["tokens"]  # the versions decode apart: a mix-up would show
    for r in recs:
        assert r["spans"] and r["moved"] and r["cache_processes"] == [0, 1]
        assert r["tensor_pairs"] == [[0, 1], [0, 1]]  # each tensor pair spans both processes
        heads, layers, pages, page, head_dim = r["cache_shape"]
        # The slots split over the 2 batch shards, and with them the pool: each device holds half the pages
        # (its shard's) and half the heads, not the whole of it.
        assert r["shards"] == 2 and r["cache_shard"] == [heads // 2, layers, pages // 2, page, head_dim]
        assert r["refused"].startswith(f"the engine's mesh holds devices of processes [{1 - r['pid']}] only"), r
    # Both processes read the same results, bit for bit (replicated copies of one result).
    assert recs[0]["trajectories"] == recs[1]["trajectories"]
    for got, want in zip(recs[0]["trajectories"], reference, strict=True):
        where = f"sample {want['id']}"
        assert (got["id"], got["version"], got["reason"]) == (want["id"], want["version"], want["reason"]), where
        assert got["tokens"] == want["tokens"], where
        # Sums split over devices round apart from one device's.
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=0, atol=1e-5, err_msg=where)


def test_a_run_decodes_on_one_engine_spanning_both_processes(records):
    """``roles.rollout_span=all``: every process drives the same engine over both processes' devices and generates
    every group; the run keeps its promises, the processes agree, and the samples of the first version are the
    single-process engine's."""
    recs = [r["run"] for r in records]
    assert recs[0]["updates"] == recs[1]["updates"] and recs[0]["ledger"] == recs[1]["ledger"]
    ledger = Ledger.from_dict(recs[0]["ledger"]["ledger"])
    ledger.check(K)  # every sample consumed once or filtered with a reason, groups whole, staleness <= K
    counts = ledger.counts()
    assert counts["consumed"] == STEPS * TBS and counts["pending"] == counts["in_flight"] == 0
    for r in recs:
        assert r["spans"] and r["engine_processes"] == [0, 1]
        # One engine: each process's driver returned every sample (none was split off to the other process).
        assert r["generated"] == counts["consumed"] + counts["finished"]
        assert [u["step"] for u in r["updates"]] == list(range(1, STEPS + 1))
        assert all(0 <= u["step"] - 1 - v <= K for u in r["updates"] for _, v in u["samples"])
        s = r["summary"]
        assert (s["placement"], s["processes"], s["steps"], s["samples"]) == ("shared", 2, STEPS, STEPS * TBS)
        assert s["max_resident_versions"] <= K + 1 and s["sync_s"] > 0
        assert r["copy_max_diff"] == 0.0 and r["copy_on_engine_mesh"]
    assert max(u["step"] - 1 - v for u in recs[0]["updates"] for _, v in u["samples"]) >= 1  # versions overlapped
    # Version 0's trained samples, decoded again from their prompts and sampling streams on one device of one
    # process with the same weights: the same tokens, log-probs within the cross-device rounding.
    assert recs[0]["version0"], "no sample of version 0 was trained"
    for tokens, ref_tokens, logprobs, ref_logprobs in recs[0]["version0"]:
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5)
