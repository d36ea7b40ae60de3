"""One rollout engine over the devices of two processes (multi-controller ``jax.distributed``, gloo on CPU).

Two processes on localhost with two fake CPU devices each build one engine on a mesh of all four devices and
run the same driver calls. Its greedy trajectories (two policy versions, requests submitted at staggered steps,
a shared prompt head) are compared with those of the single-process engine on one device, given the same
weights gathered to the host."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np

from dora_jax.xla_flags import cpu_device_flags

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
    from dora_jax.rollout.driver import Request, RolloutDriver
    from dora_jax.rollout.engine import Engine, EngineError, RequestSampling
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
    state = engine.init_decode_state(4)
    rec["cache_processes"] = sorted({d.process_index for d in state.cache.k.sharding.device_set})
    rec["cache_shape"] = list(state.cache.k.shape)
    rec["cache_shard"] = list(state.cache.k.addressable_shards[0].data.shape)
    rec["one_slot_shard"] = list(engine.init_decode_state(1).cache.k.addressable_shards[0].data.shape)
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
        # LLVM's optimizations off: compiling dominates a run this small (both processes compile every program).
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": cpu_device_flags(2, "--xla_backend_optimization_level=0"),
               "DORA_COORDINATOR": f"127.0.0.1:{port}", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"rec{pid}.json")], env=env,
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


def test_an_engine_spanning_two_processes_decodes_like_one_process(tmp_path):
    recs = _launch(tmp_path)
    reference = recs[0]["reference"]
    assert [t["id"] for t in reference] == list(range(6))
    assert reference[0]["tokens"][:14] != reference[2]["tokens"]  # the versions decode apart: a mix-up would show
    for r in recs:
        assert r["spans"] and r["moved"] and r["cache_processes"] == [0, 1]
        assert r["tensor_pairs"] == [[0, 1], [0, 1]]  # each tensor pair spans both processes
        layers, rows, heads, head_dim, length = r["cache_shape"]
        # Each device holds half the rows and half the heads of the cache, not the whole of it.
        assert r["cache_shard"] == [layers, rows // 2, heads // 2, head_dim, length]
        assert r["one_slot_shard"] == [layers, 1, heads // 2, head_dim, length]  # one row is not split
        assert r["refused"].startswith(f"the engine's mesh holds devices of processes [{1 - r['pid']}] only"), r
    # Both processes read the same results, bit for bit (replicated copies of one result).
    assert recs[0]["trajectories"] == recs[1]["trajectories"]
    for got, want in zip(recs[0]["trajectories"], reference, strict=True):
        where = f"sample {want['id']}"
        assert (got["id"], got["version"], got["reason"]) == (want["id"], want["version"], want["reason"]), where
        assert got["tokens"] == want["tokens"], where
        # Sums split over devices round apart from one device's.
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=0, atol=1e-5, err_msg=where)
