"""``dora-jax bench profile``: the costs of this machine that the simulator reads (``dora-jax simulate --profile``,
:mod:`dora_jax.sim.profile` for the format).

What is measured, on the engine and trainer a run of the ``bench modes`` workload builds (tiny Llama by default;
trainer on device 0 and rollout on device 1 where there are two devices), each by the code a run calls:

* decode: ``RolloutDriver.step`` of 1, 2 and 4 resident versions x 1, 4, 16 and 32 rows each, at every cache
  length the engine reads up to the workload's longest context: the seconds of one device decode step, after
  the dispatch's own cost (``dispatch_s``: a one-step dispatch against a many-step one at the same point,
  where the engine runs several steps per dispatch) is taken out;
* admission: the driver step that admits 1 .. 8 distinct prompts x ``train.group_size`` requests into a fresh
  decode group (prefill, first tokens, decode state, inserts), less its decode dispatch; the shared chat head's
  prefill (once per version: ``shared_prefix_s``) timed alone;
* the driver's other calls: ``Engine.resize`` and ``free_slots``;
* train: ``Trainer.train_step`` of ``dora.train_batch`` rows at each of ``train.length_buckets`` the workload
  reaches, building the batch (``make_batch`` + ``Trainer.put``: ``train.host_s``) and the call until it returns
  (``train.dispatch_s``);
* publish: what a run does to make a trained version resident: ``Trainer.policy_params``,
  ``VersionStore.publish``, ``Placement.to_rollout`` and ``Engine.prepare_params``;
* overlap: decode dispatches of 2, 8 and 32 rows while a train step runs on the other device, against each
  alone (both share the machine's cores): ``decode_factor`` and ``train_factor`` by rows;
* rewards: a group's samples submitted at once and waited for as the run waits (``poll(0.05)``): latency, and the
  host's share per sample (decoding the text, submitting);
* the host work of an update (its samples and metrics lines) and of a loop iteration (the scheduler's and the
  ledger's calls).

Every time is the median of several calls after one untimed call that compiles.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.record import machine, source_version
from benchmarks.timing import median_of, timed
from benchmarks.workload import OVERRIDES

VERSIONS = (1, 2, 4)
BATCHES = (1, 4, 16, 32)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _sync(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def _driver(engine: Any, head: tuple[int, ...], overlap: bool, steps: int | None = None) -> Any:
    """A rollout driver as a run builds it; ``steps`` decode steps per dispatch (None: the engine's setting)."""
    from dora_jax.rollout.driver import RolloutDriver

    return RolloutDriver(engine, overlap=overlap, shared_prefix=head, decode_steps=steps)


def _sweep(engine: Any, params: Any, prompt: tuple[int, ...], head: tuple[int, ...], overlap: bool, versions: int,
           rows: int, last: int, steps: int | None = None) -> list[tuple[int, int, float]]:
    """``rows`` requests on each of ``versions`` versions, stepped together from the prompt to position ``last``:
    ``(first position read, device steps run, seconds)`` of every dispatch after the one that admitted them."""
    from dora_jax.rollout.engine import RequestSampling
    from dora_jax.rollout.samples import Request

    d = _driver(engine, head, overlap, steps)
    for v in range(versions):
        d.add_version(v, params)
    sampling = RequestSampling(temperature=1.0, seed=0)
    for v in range(versions):  # budgets past ``last``: no row finishes (and frees its slot) in a timed dispatch
        for i in range(rows):
            d.submit(Request(v * rows + i, prompt, version=v, max_new_tokens=last - len(prompt) + 64,
                             sampling=sampling))
    d.step()  # admits, prefills and runs the first dispatch
    out = []
    while len(prompt) + d.stats.steps <= last:
        pos, before = len(prompt) + d.stats.steps, d.stats.steps
        _, seconds = timed(d.step)
        out.append((pos, d.stats.steps - before, seconds))
    return out


def measure_decode(engine: Any, params: Any, prompt: tuple[int, ...], head: tuple[int, ...], overlap: bool,
                   last: int, versions: Sequence[int] = VERSIONS, batches: Sequence[int] = BATCHES,
                   rounds: int = 3) -> dict[str, Any]:
    """The decode grid: seconds of one device step by (versions, rows each, cache slots read), and a dispatch's
    own cost; each point from ``rounds`` sweeps from the prompt to position ``last``."""
    reads = [engine.max_target_length]  # a decode step reads the whole cache
    kv = [r for r in reads if r < last] + [next(r for r in reads if r >= last)]
    # A dispatch's own cost: one step per dispatch against the engine's N steps per dispatch, same rows and
    # reads: t1 = o + p, tN = o + N p.
    per_dispatch = _steps_per_dispatch(engine)
    dispatch_s = 0.0
    if per_dispatch > 1:
        mid = min(kv[0], last)
        one = [s for _, n, s in _sweep(engine, params, prompt, head, overlap, 1, 8, mid, steps=1) if n == 1]
        many = [s for _, n, s in _sweep(engine, params, prompt, head, overlap, 1, 8, mid) if n == per_dispatch]
        if one and many:
            step = max(0.0, (_median(many) - _median(one)) / (per_dispatch - 1))
            dispatch_s = max(0.0, _median(one) - step)
    sweeps: dict[tuple[int, int], list] = {(v, b): [] for v in versions for b in batches}
    for _ in range(rounds):  # every point once per round: the machine's drift spreads over all of them
        for v, b in sweeps:
            sweeps[v, b] += _sweep(engine, params, prompt, head, overlap, v, b, last)
    grid = []
    for v in versions:
        per_v = []
        for b in batches:
            runs = sweeps[v, b]
            row = []
            for i, r in enumerate(kv):
                lo = kv[i - 1] if i else 0
                # dispatches whose every step read ``r`` slots: positions in (lo, r]
                xs = [max(0.0, s - dispatch_s) / n for p, n, s in runs if n and lo < p and p + n - 1 <= r]
                if not xs:  # too short a stretch for a whole dispatch: any that touched it
                    xs = [max(0.0, s - dispatch_s) / n for p, n, s in runs if n and p <= r and p + n - 1 > lo]
                row.append(_median(xs) if xs else float("nan"))
            per_v.append(row)
        grid.append(per_v)
    grid = np.asarray(grid)
    for idx in zip(*np.nonzero(np.isnan(grid))):  # a cache length no dispatch read alone: its neighbour's
        v, b, k = idx
        near = [x for x in grid[v, b] if not np.isnan(x)]
        grid[v, b, k] = near[min(k, len(near) - 1)] if near else 0.0
    return {"versions": list(versions), "batch": list(batches), "kv": kv, "kv_reads": list(reads),
            "step_s": grid.tolist(), "dispatch_s": dispatch_s, "steps_per_dispatch": per_dispatch}


def measure_admission(engine: Any, params: Any, prompt_of: Any, head: tuple[int, ...], overlap: bool, group: int,
                      decode: dict[str, Any], distinct: Sequence[int] = (1, 2, 4, 8), rounds: int = 5
                      ) -> dict[str, Any]:
    """Admitting ``n`` distinct prompts x ``group`` requests into a version's fresh decode group, as the driver
    does at the start of a batch: the chat head prefilled for the version (``shared_prefix_s``, timed alone), the
    prompts prefilled in one program, their first tokens read, the group's decode state made and the requests
    inserted. Timed as the driver step that admits them, less that step's decode dispatch (from ``decode``'s
    grid); by padded prompt tokens (distinct prompts x the prompt bucket, as the engine pads them)."""
    from dora_jax.rollout.engine import RequestSampling, bucket
    from dora_jax.rollout.samples import Request
    from dora_jax.sim.profile import parse_profile

    grid = parse_profile(_skeleton(decode))
    shared_s = median_of(lambda: engine.prefill_shared_prefix(params=params, tokens=head, version=0).cache,
                         repeats=rounds) if head else 0.0
    sampling = RequestSampling(temperature=1.0, seed=0)
    sizes = [n for n in distinct if n * group <= engine.max_concurrent_decodes]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds + 1):  # round by round; the first compiles
        for n in sizes:
            d = _driver(engine, head, overlap)
            d.add_version(0, params)
            prompts = [prompt_of(i) for i in range(n)]
            for i in range(n * group):
                d.submit(Request(i, prompts[i // group], version=0, max_new_tokens=64, sampling=sampling))
            _, seconds = timed(d.step)
            first = d.stats.steps * grid.decode_step(1, bucket(n * group, minimum=1), max(map(len, prompts))) + \
                (grid.dispatch_s if d.stats.steps else 0.0)
            if r:
                times[n].append(max(0.0, seconds - first - shared_s))
    skip = len(head)
    t = bucket(max(len(prompt_of(i)) for i in range(max(sizes))) - skip)
    return {"tokens": [bucket(n, minimum=1) * t for n in sizes], "seconds": [_median(times[n]) for n in sizes],
            "distinct_prompts": sizes, "shared_prefix_s": shared_s}


def _skeleton(decode: dict[str, Any]) -> dict[str, Any]:
    """A profile holding only ``decode`` (the other costs zero), to read the grid while the rest is measured."""
    from dora_jax.sim.profile import FORMAT, KIND

    return {"kind": KIND, "format": FORMAT, "decode": decode, "prefill": {"tokens": [1], "seconds": [0.0]},
            "shared_prefix_s": 0.0, "calls": {"resize_s": 0.0, "free_slot_s": 0.0},
            "train": {"tokens": [1], "seconds": [0.0], "host_s": 0.0, "dispatch_s": 0.0}, "publish_s": 0.0,
            "overlap": {"rows": [1], "decode_factor": [1.0], "train_factor": [1.0]}, "rewards": {"latency_s": 0.0, "host_s": 0.0},
            "update_host_s": 0.0, "iteration_host_s": 0.0}


def measure_calls(engine: Any, repeats: int = 9) -> dict[str, float]:
    """The driver's other engine calls: resizing a decode state (growing it; compacting it) and freeing a slot."""
    sizes = [c for c in (4, 8, 16, 32) if c <= engine.max_concurrent_decodes] or [engine.max_concurrent_decodes]
    resize, free = [], []
    for c in sizes:
        state = engine.init_decode_state(c)
        for i in range(repeats + 1):
            rows = list(range(c // 2))
            state, seconds = timed(lambda: engine.resize(state, rows, c))
            (resize.append(seconds) if i else None)
            state, seconds = timed(lambda: engine.free_slots(state, [0]))
            (free.append(seconds) if i else None)
    return {"resize_s": _median(resize), "free_slot_s": _median(free)}


def measure_train(trainer: Any, state: Any, cfg: Any, prompt_len: int, repeats: int = 5) -> tuple[dict[str, Any], Any,
                                                                                                 dict[str, float]]:
    """``dora.train_batch`` rows at each length bucket the workload can reach: train step seconds by padded
    tokens (from the call to its results), the host's share of building a batch (``host_s``) and the call's
    own time before it returns (``dispatch_s``). Returns the figures, the state (donated on) and a step's
    metrics."""
    import jax

    from dora_jax.trainer import make_batch

    from benchmarks.train import synthetic_samples

    t = cfg.train
    rng = np.random.default_rng(0)
    buckets = reachable_buckets(cfg, prompt_len)
    batches = [trainer.put(make_batch(synthetic_samples(rng, cfg.dora.train_batch, prompt_len, length - prompt_len,
                                                        cfg.model.vocab_size),
                                      group_size=t.group_size, length_buckets=t.length_buckets,
                                      row_multiple=trainer.row_multiple))
               for length in buckets]
    times: list[list[float]] = [[] for _ in buckets]
    for i in range(repeats + 1):  # round by round, every bucket once; the first round compiles
        for j, batch in enumerate(batches):
            (state, metrics), seconds = timed(lambda: trainer.train_step(state, batch))
            (times[j].append(seconds) if i else None)
    host, dispatch = [], []
    samples = synthetic_samples(rng, cfg.dora.train_batch, prompt_len, buckets[-1] - prompt_len, cfg.model.vocab_size)
    for _ in range(repeats + 1):
        batch, seconds = timed(lambda: trainer.put(make_batch(samples, group_size=t.group_size,
                                                              length_buckets=t.length_buckets,
                                                              row_multiple=trainer.row_multiple)))
        host.append(seconds)
        t0 = time.perf_counter()  # not timed(): the call's own time, until it returns with the step in flight
        state, metrics = trainer.train_step(state, batch)  # returns once dispatched
        dispatch.append(time.perf_counter() - t0)
        _sync(metrics)
    tokens = [int(np.shape(b.tokens)[0] * np.shape(b.tokens)[1]) for b in batches]
    seconds = [_median(x) for x in times]
    out = {"tokens": tokens, "seconds": seconds, "host_s": _median(host[1:]), "dispatch_s": _median(dispatch[1:]),
           "length_buckets": buckets, "rows": cfg.dora.train_batch, "samples_s": times}
    return out, state, {k: float(v) for k, v in jax.device_get(metrics).items()}


def reachable_buckets(cfg: Any, prompt_len: int) -> list[int]:
    """The length buckets a batch of the workload can be padded to: up to the first that holds a prompt and the
    longest response."""
    t = cfg.train
    reach = prompt_len + min(cfg.rollout.max_new_tokens, t.max_response_tokens)
    buckets = [b for b in t.length_buckets if b - prompt_len >= 1]
    return [b for b in buckets if b <= reach] + [b for b in buckets if b > reach][:1]


def add_train_samples(profile: dict[str, Any], trainer: Any, state: Any, cfg: Any, repeats: int = 2) -> Any:
    """``repeats`` more train steps at each of ``profile``'s buckets (``bench modes`` takes them before each timed
    round). The train costs become the medians of these interleaved samples alone: on a shared machine whose
    load drifts over minutes, they come from the same stretch of time as the runs compared with them; the
    samples taken with the rest of the profile stay under ``train.profile_samples_s``. Returns the state."""
    extra, state, _ = measure_train(trainer, state, cfg, profile["workload"]["prompt_tokens"], repeats=repeats)
    train = profile["train"]
    if "interleaved_samples_s" not in train:
        train["profile_samples_s"] = train.pop("samples_s")
        train["interleaved_samples_s"] = [[] for _ in train["tokens"]]
    train["interleaved_samples_s"] = [a + b for a, b in zip(train["interleaved_samples_s"], extra["samples_s"])]
    train["seconds"] = [_median(x) for x in train["interleaved_samples_s"]]
    return state


def measure_publish(placement: Any, state: Any, repeats: int = 5) -> float:
    """A trained version made resident, as the run does it: the policy's params, ``VersionStore.publish``,
    the move to the rollout devices and the engine's preparation of the version."""
    from dora_jax.run.versions import VersionStore

    store = VersionStore(2)
    times = []

    def publish(v: int) -> Any:
        params = placement.trainer.policy_params(state)
        store.publish(v, params, step=v, copy=False)
        copies, _ = placement.to_rollout(params)
        return placement.engine.prepare_params(copies[0]).tree

    for v in range(repeats + 1):
        times.append(timed(lambda: publish(v))[1])
    return _median(times[1:])


def measure_overlap(engine: Any, params: Any, trainer: Any, state: Any, cfg: Any, prompt: tuple[int, ...],
                    head: tuple[int, ...], overlap: bool, rows: Sequence[int] = (2, 8, 32), rounds: int = 3
                    ) -> tuple[dict[str, Any], Any]:
    """Decode dispatches while a train step runs on the trainer's devices, against each alone, for ``rows`` rows
    decoding and train steps of the two longest length buckets the workload reaches.

    Returns, by ``rows``: ``decode_factor`` (a decode dispatch's time beside a train step / alone) and
    ``train_factor`` (a train step's time with decoding going on throughout / alone), each the median over the
    two buckets; every setting's figures; and the state."""
    import jax

    from dora_jax.rollout.engine import RequestSampling
    from dora_jax.rollout.samples import Request
    from dora_jax.trainer import make_batch

    from benchmarks.train import synthetic_samples

    t = cfg.train
    lengths = reachable_buckets(cfg, len(prompt))[-2:]
    batches = {n: _sync(trainer.put(make_batch(
        synthetic_samples(np.random.default_rng(1), cfg.dora.train_batch, len(prompt), n - len(prompt),
                          cfg.model.vocab_size), group_size=t.group_size, length_buckets=t.length_buckets,
        row_multiple=trainer.row_multiple))) for n in lengths}
    sampling = RequestSampling(temperature=1.0, seed=0)
    per_dispatch = _steps_per_dispatch(engine)

    def fresh(n: int) -> Any:
        d = _driver(engine, head, overlap)
        d.add_version(0, params)
        for i in range(n):
            d.submit(Request(i, prompt, version=0, max_new_tokens=engine.max_target_length - len(prompt) - 1,
                             sampling=sampling))
        d.step()
        return d

    def dispatch(d: Any, n: int, out: list[float]) -> Any:
        """One full decode dispatch timed into ``out`` (a new driver first when the old one is done)."""
        if d.idle:
            d = fresh(n)
        before = d.stats.steps
        _, seconds = timed(d.step)
        if d.stats.steps - before == per_dispatch:
            out.append(seconds)
        return d

    for n in lengths:  # compiled before timing
        state, m = trainer.train_step(state, batches[n])
        _sync(m)
    settings = []
    for n_rows in rows:
        d = fresh(n_rows)
        for n in lengths:
            alone_d, both_d, alone_t, both_t = [], [], [], []
            for _ in range(rounds):
                for _ in range(8):
                    d = dispatch(d, n_rows, alone_d)
                (state, m), seconds = timed(lambda: trainer.train_step(state, batches[n]))
                alone_t.append(seconds)
                t0 = time.perf_counter()  # not timed(): decoding runs while the step is in flight
                state, m = trainer.train_step(state, batches[n])  # asynchronous: decoding goes on beside it
                while not all(x.is_ready() for x in jax.tree.leaves(m)):
                    d = dispatch(d, n_rows, both_d)
                both_t.append(time.perf_counter() - t0)
            if alone_d and both_d:
                settings.append({"rows": n_rows, "train_length": n, "decode_alone_s": _median(alone_d),
                                 "decode_beside_train_s": _median(both_d), "train_alone_s": _median(alone_t),
                                 "train_beside_decode_s": _median(both_t)})
    got = [n for n in rows if any(x["rows"] == n for x in settings)]

    def factor(n: int, beside: str, alone: str) -> float:
        return max(1.0, _median([x[beside] / x[alone] for x in settings if x["rows"] == n]))

    return {"rows": got or [1], "decode_factor": [factor(n, "decode_beside_train_s", "decode_alone_s") for n in got]
            or [1.0], "train_factor": [factor(n, "train_beside_decode_s", "train_alone_s") for n in got] or [1.0],
            "settings": settings}, state


def _steps_per_dispatch(engine: Any) -> int:
    from dora_jax.rollout.engine import resolve_decode_steps

    return resolve_decode_steps(engine.settings)


def measure_rewards(cfg: Any, task: Any, tokenizer: Any, bursts: int = 24) -> dict[str, float]:
    """The reward pool as the run meets it at the end of a batch: a group's ``train.group_size`` samples finish
    at once (each decoded to text and submitted), then the loop polls (``poll(0.05)``, as the runner waits)
    until every result is back. ``latency_s``: from the last submit to the last result; ``host_s``: the host's
    time per sample to decode and submit it."""
    from dora_jax.rewards import RewardPool
    from dora_jax.run.evaluation import score

    item = task.train_item(0)
    tokens = list(range(48, 58)) * 4
    group = cfg.train.group_size
    pool = RewardPool(cfg.task.reward_workers, cfg.task.reward_timeout_s)
    try:
        pool.submit(-1, score, task, item, "0")  # the workers start
        while not pool.poll(0.05):
            pass
        latency, host = [], []
        for b in range(bursts):
            t0 = time.perf_counter()
            for i in range(group):
                pool.submit(b * group + i, score, task, item, tokenizer.decode(tokens, skip_special_tokens=True))
            t1 = time.perf_counter()
            host.append((t1 - t0) / group)
            got = len(pool.poll(0.0))
            while got < group:
                got += len(pool.poll(0.05))
            latency.append(time.perf_counter() - t1)
    finally:
        pool.close()
    return {"latency_s": _median(latency), "host_s": _median(host), "burst": group}


def measure_update_host(cfg: Any, task: Any, tokens: int, train_metrics: dict[str, float], repeats: int = 5) -> float:
    """The host's work per update besides the train step: the trained samples' lines and the metrics line as the
    runner writes it (the batch's figures, the train step's metrics, the clocks; TensorBoard too, where
    installed)."""
    from dora_jax.metrics import MetricsWriter
    from dora_jax.rollout.samples import Sample
    from dora_jax.run.training import batch_row, write_samples

    item = task.train_item(0)
    done = [Sample(i, i // 4, 0, list(range(22)), [48] * tokens, [-1.0] * tokens, 0.5, "length", item, "0" * tokens,
                   True) for i in range(cfg.dora.train_batch)]
    clocks = ("wall_s", "step_s", "train_s", "rollout_s", "rollout_share", "trainer_idle_fraction", "gen_tok_s",
              "train_tok_s", "slot_occupancy", "decode_batch_steps", "decode_batch_steps_per_sample",
              "trainer_idle_s", "rollout_idle_s", "sync_s", "filtered", "resident_versions", "slot_utilization")
    times = []
    with tempfile.TemporaryDirectory() as d:
        writer = MetricsWriter(d, config=cfg.to_dict())
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            row = batch_row(done, step, {"0": 0})
            write_samples(os.path.join(d, "samples.jsonl"), done, step)
            writer.write({**row, "train": dict(train_metrics), **{k: 0.5 for k in clocks}, "step": step,
                          "version": step})
            times.append(time.perf_counter() - t0)
        writer.close()
    return _median(times[1:])


def measure_iteration_host(cfg: Any, repeats: int = 200) -> float:
    """The scheduler's and the ledger's calls of one loop iteration (dispatch twice, slot sharing, the
    outstanding counts the residency reads, the next batch), on a ledger with a rollout batch outstanding."""
    from dora_jax.run.setup import schedule_policy
    from dora_jax.dora.scheduler import Scheduler

    sched = Scheduler(schedule_policy(cfg))
    sched.dispatch()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sched.dispatch()
        sched.assign_slots(4, {v: n for v, n in sched.ledger.outstanding().items()})
        sched.dispatch()
        sched.ledger.outstanding()
        sched.next_batch()
        times.append(time.perf_counter() - t0)
    return _median(times)


def bench_profile(config: str = "tiny_llama", overrides: Sequence[str] = (), harness: Any = None,
                  versions: Sequence[int] = VERSIONS, batches: Sequence[int] = BATCHES,
                  rounds: int = 3) -> dict[str, Any]:
    """Measures every cost of :mod:`dora_jax.sim.profile` on this machine for the ``bench modes`` workload on
    ``config`` (``overrides`` on top).

    Args:
      harness: a :class:`benchmarks.harness.Harness` already built for the workload (its engine and trainer are
        measured, and their compiled programs shared); default: one built here.
      versions, batches, rounds: the decode grid (versions x rows each, every point swept from the prompt to the
        longest output ``rounds`` times).

    Returns:
      The profile (``kind``, ``format``, the sections, ``workload`` and ``machine``).
    """
    from dora_jax.sim.profile import FORMAT, KIND

    from benchmarks.harness import Harness

    t_start = time.perf_counter()
    h = harness or Harness(config, list(OVERRIDES) + list(overrides), shared_devices=1)
    cfg = h.cfg((), h.split)
    placement = h.placement(cfg, h.split)
    engine = placement.engine
    setup = h.run_setup(cfg, h.split)
    prompt, head = setup.prompt(0), setup.shared_prefix
    last = len(prompt) + cfg.rollout.max_new_tokens
    state = placement.take_state()
    params = engine.prepare_params(placement.to_rollout(placement.trainer.policy_params(state))[0][0])
    parts: dict[str, float] = {}

    def part(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        parts[name] = round(time.perf_counter() - t0, 1)
        print(f"profile: {name} measured in {parts[name]} s", flush=True)
        return out

    decode = part("decode", lambda: measure_decode(engine, params, prompt, head, setup.overlap, last, versions,
                                                   batches, rounds))
    admission = part("admission", lambda: measure_admission(engine, params, setup.prompt, head, setup.overlap,
                                                            cfg.train.group_size, decode))
    calls = part("calls", lambda: measure_calls(engine))
    train, state, train_metrics = part("train", lambda: measure_train(placement.trainer, state, cfg, len(prompt)))
    publish_s = part("publish", lambda: measure_publish(placement, state))
    if placement.disjoint:
        overlap, state = part("overlap", lambda: measure_overlap(engine, params, placement.trainer, state, cfg,
                                                                 prompt, head, setup.overlap))
    else:  # one device set: the loop never decodes while a train step runs
        overlap = {"rows": [1], "decode_factor": [1.0], "train_factor": [1.0]}
    rewards = part("rewards", lambda: measure_rewards(cfg, h.task, h.tokenizer))
    update_host_s = part("update_host", lambda: measure_update_host(cfg, h.task, 16, train_metrics))
    iteration_host_s = part("iteration_host", lambda: measure_iteration_host(cfg))
    return {
        "kind": KIND, "format": FORMAT, "config": h.config, "overrides": list(h.overrides),
        "workload": {"slots": cfg.rollout.slots, "max_target_length": engine.max_target_length,
                     "max_prefill_length": engine.max_prefill_length, "decode_steps": decode["steps_per_dispatch"],
                     "overlap": setup.overlap, "placement": "split" if placement.disjoint else "shared",
                     "train_devices": int(placement.trainer.mesh.devices.size), "train_batch": cfg.dora.train_batch,
                     "group_size": cfg.train.group_size, "prompt_tokens": len(prompt), "shared_prefix": len(head),
                     "length_buckets": list(cfg.train.length_buckets)},
        "decode": {k: v for k, v in decode.items() if k != "steps_per_dispatch"},
        "prefill": {k: admission[k] for k in ("tokens", "seconds", "distinct_prompts")},
        "shared_prefix_s": admission["shared_prefix_s"], "calls": calls, "train": train, "publish_s": publish_s,
        "overlap": overlap, "rewards": rewards, "update_host_s": update_host_s, "iteration_host_s": iteration_host_s,
        "measured_in_s": round(time.perf_counter() - t_start, 1), "parts_s": parts, "machine": machine(),
        "source": source_version(),
    }
