"""The training run on one machine, simulated with a measured cost profile: ``dora-jax train``'s loop
(:mod:`dora_jax.run.loop`) with its devices replaced by a clock.

:func:`simulate_run` drives the real :class:`~dora_jax.dora.scheduler.Scheduler` and
:class:`~dora_jax.rollout.driver.RolloutDriver` on a :class:`TimedEngine`, which does no arithmetic and charges
a :class:`Clock` what the profile says each call costs; so decode batch-steps, rows computed and versions held
are a real run's, whatever the profile. docs/simulator.md, "The run on one machine", gives the timing model and
what is not modelled.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from dora_jax.dora.ledger import Ledger
from dora_jax.dora.scheduler import SchedulePolicy, Scheduler
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import RequestSampling, bucket, prompt_rows
from dora_jax.rollout.samples import Request
from dora_jax.sim.profile import Profile
from dora_jax.trainer.batch import bucket_length, bucket_rows


class Clock:
    """Simulated seconds, with at most one train step in flight beside the rollout side.

    ``work(dt, what, factors)``: the rollout side works ``dt`` seconds. While a train step is in flight, engine
    work with ``factors = (decode_factor, train_factor)`` takes ``dt x decode_factor`` and the train step gets
    through ``1 / train_factor`` of its seconds per second; host work does not slow it. ``wait_train()``: wait
    for the train step, which runs alone.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.spent: dict[str, float] = {}  # wall seconds by what the rollout side did (or waited for)
        self.train_left: float | None = None  # the train step's own seconds still to run (None: none in flight)
        self.train_end: float | None = None  # when it finished (it stays in flight until the loop notices)

    def start_train(self, seconds: float) -> None:
        self.train_left, self.train_end = seconds, None if seconds > 0 else self.now

    def work(self, dt: float, what: str = "host", factors: tuple[float, float] = (1.0, 1.0)) -> None:
        if dt <= 0:
            return
        start, (df, tf) = self.now, factors
        if self.train_left is None or self.train_end is not None:
            self.now += dt
        elif (both := self.train_left * tf) >= dt * df:  # both work until the rollout's work is done
            self.now += dt * df
            self.train_left -= dt * df / tf
        else:  # the train step ends part way; the rest of the work runs alone
            self.now += both
            self.train_left, self.train_end = 0.0, self.now
            self.now += dt - both / df
        self.spent[what] = self.spent.get(what, 0.0) + self.now - start

    def train_ready(self) -> bool:
        return self.train_end is not None

    def wait_train(self) -> None:
        if self.train_end is None:
            self.now += self.train_left
            self.spent["train_wait"] = self.spent.get("train_wait", 0.0) + self.train_left
            self.train_left, self.train_end = 0.0, self.now

    def end_train(self) -> None:
        self.train_left = self.train_end = None


class _Result:
    """An engine call's results as the driver reads them (already on the host)."""

    def __init__(self, cols: dict[str, np.ndarray], granted: Sequence[np.ndarray] = ()):
        self.cols = cols
        self.data = cols["token"]
        self.granted = tuple(granted)  # generate_steps: every budget in full (no page pool to wait for)

    def to_host(self) -> "_Result":
        return self

    def columns(self) -> dict[str, np.ndarray]:
        return self.cols

    def counts(self) -> np.ndarray:
        return self.cols["valid"].sum(axis=0)

    def steps_run(self) -> int:
        return int(self.cols["valid"].any(axis=1).sum())


@dataclasses.dataclass
class _State:
    positions: np.ndarray
    active: np.ndarray
    versions: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Prefix:
    tokens: tuple[int, ...]
    version: int

    def covers(self, prompt: Sequence[int]) -> bool:
        n = len(self.tokens)
        return 0 < n < len(prompt) and tuple(prompt[:n]) == self.tokens


class TimedEngine:
    """The rollout engine's interface as :class:`~dora_jax.rollout.driver.RolloutDriver` calls it, without the
    model: slots, positions and versions only, each call charged to ``clock``. Every sampled token is 0 (no eos):
    a request runs to its ``max_new_tokens``."""

    def __init__(self, profile: Profile, clock: Clock, *, slots: int, max_prefill_length: int,
                 max_target_length: int, decode_steps: int = 1, beside_train: bool = True):
        self.profile, self.clock = profile, clock
        self.beside_train = beside_train  # whether a train step can run beside this engine's work (split)
        self._slots, self._max_prefill = slots, max_prefill_length
        self.max_target_length = max_target_length
        self.settings = SimpleNamespace(decode_steps=decode_steps)  # the driver reads its steps per dispatch here
        self.mesh = None
        self.calls: dict[str, int] = {}
        # No KV cache is simulated: the pool never holds admission back, and no page ratio is reported.
        self.shards, self.page_tokens, self.pages_held = 1, 16, None
        self.shard_pages = 2 ** 62

    def pages_needed(self, limit: int) -> int:
        return 0

    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int]:
        return [0] * len(requests)  # no pool to wait for

    def admissible_moved(self, requests: Sequence[tuple], shards: Sequence[int] | None = None) -> list[int]:
        return [0] * len(requests) if shards is None else list(shards)

    def written_heads(self, decode_state: Any, slots: Sequence[int], written: Sequence[int]) -> list[tuple[int, ...]]:
        return [()] * len(slots)  # no pages

    def shard_pages_available(self, shard: int) -> int:
        return self.shard_pages

    def row_shard(self, capacity: int, row: int) -> int:
        return 0

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    def _charge(self, what: str, seconds: float, rows: int = 1) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1
        self.clock.work(seconds, what, self.profile.overlap(rows) if self.beside_train else (1.0, 1.0))

    def prepare_params(self, params: Any) -> Any:
        return params  # publish_s covers preparing a version

    def init_decode_state(self, capacity: int | None = None) -> _State:
        b = capacity or self._slots
        return _State(np.zeros(b, np.int64), np.zeros(b, bool), np.zeros(b, np.int64))

    def resize(self, state: _State, rows: list[int], capacity: int) -> _State:
        idx = np.full(capacity, -1)
        idx[:len(rows)] = rows
        take, keep = np.maximum(idx, 0), idx >= 0
        self._charge("resize", self.profile.resize_s, capacity)
        return _State(state.positions[take], state.active[take] & keep, state.versions[take])

    def free_slots(self, state: _State, slots: Sequence[int]) -> _State:
        state.active[list(slots)] = False
        self._charge("free_slot", self.profile.free_slot_s)
        return state

    def prefill_shared_prefix(self, *, params: Any = None, tokens: Sequence[int], version: int = 0) -> _Prefix:
        self._charge("shared_prefix", self.profile.shared_prefix_s)
        return _Prefix(tuple(int(t) for t in tokens), int(version))

    def prefill_batch(self, *, params: Any = None, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int],
                      version: int = 0, samplings: Sequence[Any], shared_prefix: _Prefix | None = None
                      ) -> tuple[np.ndarray, _Result]:
        skip = 0 if shared_prefix is None else len(shared_prefix.tokens)
        distinct = {tuple(p) for p in prompts}
        t = min(bucket(max(len(p) for p in distinct) - skip), self.max_target_length - skip)
        self._charge("prefill", self.profile.prefill(prompt_rows(len(distinct), self.max_concurrent_decodes) * t),
                     len(prompts))
        n = len(prompts)
        lengths = np.asarray([len(p) for p in prompts], np.int64)
        return lengths, _Result({"token": np.zeros(n, np.int64), "valid": np.ones(n, bool), "position": lengths,
                                 "logprob": np.zeros(n, np.float32), "version": np.full(n, version)})

    def insert_batch(self, batch: np.ndarray, decode_state: _State, slots: Sequence[int | None],
                     limits: Sequence[int] | None = None) -> _State:
        for length, slot in zip(batch, slots):
            if slot is not None:
                decode_state.positions[slot], decode_state.active[slot] = length, True
        return decode_state  # its cost is in the prefill's (measured together)

    def _versions_of(self, params_seq: Sequence[Any]) -> list[int]:
        return [int(p) for p in params_seq]  # the simulated params of a version are its number

    def _step_cost(self, states: Sequence[_State]) -> float:
        kv = max((int(s.positions[s.active].max()) for s in states if s.active.any()), default=0)
        return self.profile.decode_step(len(states), max(len(s.active) for s in states), kv)

    def _one_step(self, version: int, state: _State, on: np.ndarray) -> np.ndarray:
        state.positions[on] += 1
        return np.stack([np.zeros(len(on)), on, state.positions, np.zeros(len(on)), np.full(len(on), version)], -1)

    def _pack(self, rows: list[np.ndarray]) -> _Result:
        d = np.concatenate(rows, axis=-2)
        return _Result({"token": d[..., 0].astype(np.int64), "valid": d[..., 1].astype(bool),
                        "position": d[..., 2].astype(np.int64), "logprob": d[..., 3].astype(np.float32),
                        "version": d[..., 4].astype(np.int64)})

    def generate_steps(self, params_seq: Sequence[Any], states_seq: Sequence[_State], *, steps: int,
                       budgets: Sequence[Any], stop_ids: Sequence[Any], final: Sequence[Any] | None = None,
                       end_after: Sequence[int] | None = None, limit: int | None = None,
                       filtered: bool | None = None, **_: Any) -> tuple[tuple[_State, ...], _Result]:
        """Up to ``steps`` steps, as :meth:`dora_jax.rollout.engine.Engine.generate_steps` runs them (budgets,
        ``final``, ``end_after``, ``limit``); nothing samples a stop id here."""
        limit = steps if limit is None else limit
        versions = self._versions_of(params_seq)
        produced = [np.zeros(len(s.active), np.int64) for s in states_seq]
        budgets = [np.asarray(b, np.int64) for b in budgets]
        final = [np.zeros(len(s.active), bool) if final is None else np.asarray(f, bool)
                 for s, f in zip(states_seq, final if final is not None else [None] * len(states_seq))]
        end_after = np.zeros(len(states_seq), np.int64) if end_after is None else np.asarray(end_after, np.int64)
        freed = np.zeros(len(states_seq), np.int64)
        out = [[np.zeros((len(s.active), 5)) for s in states_seq] for _ in range(steps)]
        cost, i = self.profile.dispatch_s, 0
        while i < limit and not np.any((end_after > 0) & (freed >= end_after)):
            live = [s.active & (n < b) for s, n, b in zip(states_seq, produced, budgets)]
            if not any(on.any() for on in live):
                break
            cost += self._step_cost(states_seq)
            for j, (v, s, on) in enumerate(zip(versions, states_seq, live)):
                freed[j] += int(np.sum(on & final[j] & (produced[j] + 1 == budgets[j])))
                out[i][j] = self._one_step(v, s, on)
                produced[j] += on
            i += 1
        self._charge("decode", cost, sum(len(s.active) for s in states_seq))
        result = self._pack([np.stack([out[t][j] for t in range(steps)]) for j in range(len(states_seq))])
        result.granted = tuple(np.asarray(b, np.int32) for b in budgets)
        return tuple(states_seq), result


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What a simulated run needs besides the schedule: the engine's shape, the prompts and completion lengths,
    and the trainer's padding. ``prompt(i)``: token ids of prompt ``i`` (shared by its group);
    ``length(i, m)``: completion length of its group's member ``m``."""

    slots: int
    max_prefill_length: int
    max_target_length: int
    prompt: Callable[[int], tuple[int, ...]]
    length: Callable[[int, int], int]
    length_buckets: tuple[int, ...]
    row_multiple: int = 1
    shared_prefix: tuple[int, ...] = ()
    decode_steps: int = 1
    overlap: bool = False
    split: bool = True


def _padded_tokens(rows: int, longest: int, setup: RunSetup) -> int:
    """Rows x length bucket of a train batch (as ``dora_jax.trainer.batch.make_batch`` pads it)."""
    return bucket_rows(rows, setup.row_multiple) * bucket_length(longest, setup.length_buckets)


def simulate_run(profile: Profile, setup: RunSetup, policy: SchedulePolicy) -> dict[str, Any]:
    """Simulates one run of ``policy`` (mode, K, RBS, TBS, group size, samples) with ``profile``'s costs.

    Returns:
      ``wall_s`` (first dispatch to last publish), ``samples_per_s``, ``train_s`` (dispatch to the loop noticing
      the end), ``decode_batch_steps`` (and per trained sample), ``slot_utilization``, ``max_resident_versions``,
      the engine calls made and one record per update.
    """
    run = _LocalRun(profile, setup, policy)
    run.publish(0)
    while not run.sched.done() or run.in_flight is not None:
        run.iteration()
    run.led.check(policy.bound)
    return run.result()


class _LocalRun:
    """One simulated run's state (scheduler, driver on a :class:`TimedEngine`, clock, queues) and the steps of the
    runner's loop iteration, in :mod:`dora_jax.run.loop`'s order."""

    def __init__(self, profile: Profile, setup: RunSetup, policy: SchedulePolicy) -> None:
        self.profile, self.setup, self.policy = profile, setup, policy
        self.clock = Clock()
        self.engine = TimedEngine(profile, self.clock, slots=setup.slots, max_prefill_length=setup.max_prefill_length,
                                  max_target_length=setup.max_target_length, decode_steps=setup.decode_steps,
                                  beside_train=setup.split)
        self.driver = RolloutDriver(self.engine, overlap=setup.overlap, shared_prefix=setup.shared_prefix)
        self.sched = Scheduler(policy, Ledger())
        self.led = self.sched.ledger
        self.sampling = RequestSampling()
        self.waiting: dict[int, deque] = {}
        self.prompt_of: dict[int, int] = {}
        self.length_of: dict[int, int] = {}
        self.resident: set[int] = set()
        self.rewards: deque = deque()  # (ready at, sample id)
        self.updates: list[dict[str, Any]] = []
        self.in_flight: dict[str, Any] | None = None  # the train step dispatched and not yet noticed done
        self.max_resident = 0

    def iteration(self) -> None:
        """One iteration of the runner's loop."""
        sched, led, clock = self.sched, self.led, self.clock
        self.dispatch()
        started = self.admit()
        self.decode()
        for sid in started:
            led.start(sid)
        self.collect()
        self.dispatch()
        self.drop_versions()
        if self.in_flight is None and not sched.done():
            batch = sched.next_batch()
            if batch is not None:
                self.train(batch)
        nothing_to_decode = self.driver.idle and not self.has_waiting()
        f = self.in_flight
        if f is not None and (clock.train_ready() or not self.setup.split or nothing_to_decode):
            self.end_train(f)
        elif nothing_to_decode and f is None:
            self.stall()
        clock.work(self.profile.iteration_host_s, "iteration_host")

    def publish(self, version: int) -> None:
        out = self.led.outstanding()
        for v in sorted(self.resident):
            if not out.get(v):
                self.resident.discard(v)
                self.driver.remove_version(v)
        self.resident.add(version)
        self.driver.add_version(version, version)
        self.max_resident = max(self.max_resident, len(self.resident), len(self.driver.held()))

    def dispatch(self) -> int:
        groups = self.sched.dispatch()
        for g in groups:
            ids = self.setup.prompt(g.prompt_index)
            for m, sid in enumerate(g.sample_ids):
                self.prompt_of[sid] = g.prompt_index
                self.length_of[sid] = self.setup.length(g.prompt_index, m)
                self.waiting.setdefault(g.version, deque()).append(Request(
                    sid, ids, version=g.version, max_new_tokens=self.length_of[sid], sampling=self.sampling))
        return len(groups)

    def has_waiting(self) -> bool:
        return any(q for v, q in self.waiting.items() if v in self.resident)

    def admit(self) -> list[int]:
        free = self.setup.slots - sum(self.driver.in_flight().values())
        pending = {v: len(q) for v, q in self.waiting.items() if q and v in self.resident}
        started = []
        for v, n in self.sched.assign_slots(free, pending).items():
            for _ in range(n):
                req = self.waiting[v].popleft()
                self.driver.submit(req)
                started.append(req.sample_id)
        return started

    def decode(self) -> None:
        """A driver step; each sample it finishes has its reward back ``reward_latency_s`` later."""
        if not self.driver.idle:
            finished = self.driver.step()
            for t in finished:
                self.rewards.append((self.clock.now + self.profile.reward_latency_s, t.sample_id))
            self.clock.work(self.profile.reward_host_s * len(finished), "reward_host")

    def collect(self, wait: bool = False) -> None:
        rewards, clock = self.rewards, self.clock
        if wait and rewards and rewards[0][0] > clock.now:
            clock.work(rewards[0][0] - clock.now, "reward_wait")
        while rewards and rewards[0][0] <= clock.now:
            self.led.finish(rewards.popleft()[1])

    def drop_versions(self) -> None:
        """Evicts versions no sample needs, except the newest published one (while a train step is in flight,
        the one before the version it makes)."""
        out = self.led.outstanding()
        newest = self.sched.version if self.in_flight is None else self.in_flight["version"] - 1
        for v in sorted(self.resident):
            if v != newest and not out.get(v):
                self.resident.discard(v)
                self.driver.remove_version(v)

    def train(self, group_ids: list[int]) -> None:
        profile, setup, clock, sched = self.profile, self.setup, self.clock, self.sched
        ids = [s for g in group_ids for s in self.led.groups[g].sample_ids]
        longest = max(len(setup.prompt(self.prompt_of[s])) + self.length_of[s] for s in ids)
        tokens = _padded_tokens(len(ids), longest, setup)
        # The batch built and put on the trainer's devices, the step called (the host's share), then the step runs.
        clock.work(profile.train_host_s + profile.train_dispatch_s, "train_host")
        seconds = max(0.0, profile.train(tokens) - profile.train_dispatch_s)
        dispatched = clock.now
        clock.start_train(seconds)
        sched.trained(group_ids)
        self.in_flight = {"version": sched.version, "dispatched": dispatched, "tokens": tokens,
                          "samples": len(ids), "train_alone_s": seconds}
        if not setup.split:
            clock.wait_train()

    def end_train(self, f: dict[str, Any]) -> None:
        """The loop notices the train step ``f`` done (waiting for it if need be) and publishes its version."""
        clock = self.clock
        clock.wait_train()
        clock.end_train()
        self.updates.append({**f, "train_s": clock.now - f["dispatched"], "end": clock.now})
        self.in_flight = None
        clock.work(self.profile.publish_s, "publish")
        clock.work(self.profile.update_host_s, "update_host")
        self.publish(f["version"])

    def stall(self) -> None:
        """Nothing to decode and no train step in flight: waits for the next reward.

        Raises:
          RuntimeError: no progress is possible.
        """
        led, sched = self.led, self.sched
        if self.rewards:
            self.collect(wait=True)
        elif not self.dispatch() and not led.count("finished") and not sched.done():
            raise RuntimeError(f"simulated run: no progress possible at version {sched.version}: "
                               f"ledger {led.counts()}")

    def result(self) -> dict[str, Any]:
        driver, policy = self.driver, self.policy
        wall = self.clock.now
        samples = self.led.count("consumed")
        return {"mode": policy.mode, "max_staleness": policy.bound, "wall_s": wall, "samples": samples,
                "samples_per_s": samples / wall if wall else 0.0, "train_s": sum(u["train_s"] for u in self.updates),
                "decode_batch_steps": driver.stats.batch_steps,
                "decode_batch_steps_per_sample": driver.stats.batch_steps / max(samples, 1),
                "slot_utilization": driver.stats.slot_utilization,
                "max_resident_versions": max(self.max_resident, driver.stats.max_held),
                "engine_calls": dict(self.engine.calls), "spent_s": dict(sorted(self.clock.spent.items())),
                "updates": self.updates}
