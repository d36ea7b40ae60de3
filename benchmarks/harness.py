"""Runs of one config side by side: what ``bench modes`` and ``bench convergence`` share.

A :class:`Harness` loads the model once, builds one :class:`~dora_jax.run.Placement` per layout and trainer
setting (runs that share one share its compiled programs, and each starts from a copy of the same initial
state), and runs named variants (``key=value`` overrides) through the real :class:`~dora_jax.run.Runner`, each
in a directory of its own. :meth:`Harness.rounds` runs a plan round by round, every variant once per round, so
that a shared machine's drift spreads over all of them alike. :meth:`Harness.run_setup` describes the same run
to the run simulator (:mod:`dora_jax.sim.local`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any



def split_overrides(groups: int = 1) -> list[str]:
    """Split placement's settings: the trainer on device 0, then ``groups`` rollout groups of one device each
    (devices 1 to ``groups``)."""
    return (["roles.placement=split", "roles.trainer_devices=1", f"target.num_devices={1 + groups}",
             "roles.rollout_tensor=1"] + ([f"roles.rollout_groups={groups}"] if groups > 1 else []))


# Split placement on two devices: trainer on device 0, the rollout engine on device 1.
SPLIT = split_overrides()


@dataclasses.dataclass
class Variant:
    """One run of a plan: its name, its overrides, and whether it runs under split placement."""

    name: str
    overrides: list[str]
    split: bool = False


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def compile_time():
    """Counts JAX's compilation inside the block: yields ``[seconds, programs]``, filled in as programs compile
    (tracing, lowering and XLA's compile; one program per XLA compile)."""
    import jax

    out = [0.0, 0]

    def count(event: str, secs: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            out[0] += secs
            out[1] += event == _COMPILE_EVENTS[-1]

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield out
    finally:
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:  # JAX versions without it keep a listener that only counts
            unregister(count)


class Harness:
    """Runs variants of ``config`` (with ``overrides``) on this process's devices.

    Args:
      config: a shipped preset or YAML file.
      overrides: ``key=value`` settings every variant starts from.
      out_dir: where run directories go (default: a new temporary directory).
      split: whether split placement is available (default: two or more devices).
      shared_devices: how many devices a shared placement uses (default: all).
      groups: rollout groups under split placement, one device each after the trainer's (default 1: every device
        after the trainer's device 0, which must then be one); needs ``groups + 1`` devices.

    Raises:
      ValueError: when there are fewer than ``groups + 1`` devices.
    """

    def __init__(self, config: str, overrides: Sequence[str] = (), out_dir: str | None = None,
                 split: bool | None = None, shared_devices: int | None = None, groups: int = 1):
        import jax

        from dora_jax.config import load_config
        from dora_jax.models.weights import load_model
        from dora_jax.run.setup import byte_tokenizer
        from dora_jax.sharding import create_mesh
        from dora_jax.tasks import load_task

        self.config, self.overrides = config, list(overrides)
        devices = jax.devices()
        self.device_count = len(devices)
        if groups > 1 and len(devices) < groups + 1:
            raise ValueError(f"{groups} rollout groups of one device and the trainer's need {groups + 1} devices, "
                             f"{len(devices)} present")
        self.split = len(devices) >= 2 if split is None else split
        self.groups = groups
        # One group (the default) decodes on every device after the trainer's; several take one device each.
        self.split_devices = None if groups == 1 else devices[:groups + 1]
        self.devices = devices[:shared_devices] if shared_devices else devices
        self.base = load_config(config, self.overrides)
        mesh = create_mesh(self.base.mesh, self.devices)
        self.model, tokenizer = load_model(self.base.model, mesh, self.base.mesh.logical_axis_rules,
                                           seed=self.base.run.seed, progress=False)
        self.tokenizer = tokenizer or byte_tokenizer(self.base)
        self.task = load_task(self.base.task)
        self.out_dir = out_dir or tempfile.mkdtemp(prefix="dora_bench_")
        self._placements: dict[tuple, Any] = {}
        self._count = 0

    def cfg(self, extra: Sequence[str] = (), split: bool = False) -> Any:
        """The config of a variant: the harness's overrides, then ``extra``, then split placement's."""
        from dora_jax.config import load_config

        return load_config(self.config, self.overrides + list(extra) + (split_overrides(self.groups) if split else []))

    def placement(self, cfg: Any, split: bool) -> Any:
        """The placement for ``cfg``'s layout and trainer settings (built once, shared by every run of them)."""
        from dora_jax.run import Placement

        # The trainer's settings are part of its compiled step (the staleness bound masks staler samples, the
        # correction picks the loss): runs differing there need their own trainer. The rollout seed is not.
        key = (split, repr(cfg.train), repr(cfg.roles), repr(dataclasses.replace(cfg.rollout, seed=0)), repr(cfg.mesh))
        if key not in self._placements:
            self._placements[key] = Placement.build(cfg, self.model, self.split_devices if split else self.devices,
                                                    keep_initial=True, progress=False)
        return self._placements[key]

    def forget(self) -> None:
        """Drops every placement built so far and JAX's compiled programs: what a new set of runs that shares none
        of them frees (on XLA:CPU each program holds memory mappings, limited per process)."""
        import gc

        import jax

        self._placements.clear()
        gc.collect()
        jax.clear_caches()

    def run(self, v: Variant, extra: Sequence[str] = ()) -> dict[str, Any]:
        """Runs one variant to the end; returns its ``summary``, its metrics ``rows``, ``run_dir``, ``bench_s``
        (the whole call, evaluations included) and ``compile_s`` (the seconds JAX spent compiling inside it)."""
        from dora_jax.metrics import read_metrics
        from dora_jax.run import Runner

        from benchmarks.timing import timed

        cfg = self.cfg(v.overrides + list(extra), v.split)
        self._count += 1
        run_dir = os.path.join(self.out_dir, f"{self._count:03d}_{v.name}")
        with compile_time() as compile_s:
            summary, bench_s = timed(Runner(cfg, run_dir, placement=self.placement(cfg, v.split),
                                            tokenizer=self.tokenizer, progress=False).run)
        if summary.get("preempted"):  # stopped on SIGTERM or SIGINT: the benchmark stops too, without a result
            raise KeyboardInterrupt(f"{v.name}: stopped on {summary['signal']} at update {summary['step']}")
        return {"summary": summary, "rows": read_metrics(run_dir), "run_dir": run_dir, "bench_s": bench_s,
                "compile_s": compile_s[0]}

    def warm(self, plan: Sequence[Variant], max_rounds: int = 4) -> list[int]:
        """Untimed rounds of every variant of ``plan`` until one compiles no program, at most ``max_rounds``.

        One round does not always meet every shape a run can: which programs a run calls (how many decode steps a
        dispatch runs, how far its page tables reach, the trainer's length bucket) follows its schedule, and
        under split placement the schedule follows the machine's timing. A program compiled inside a timed run
        adds its compile time (about a second each on a CPU) to that run alone.

        Returns:
          The programs compiled in each round.
        """
        per_round = []
        while len(per_round) < max_rounds and (not per_round or per_round[-1]):
            with compile_time() as compiled:
                for v in plan:
                    s = self.run(v)["summary"]
                    # Progress: on an accelerator one untimed round of long outputs takes minutes.
                    print(f"untimed round {len(per_round) + 1}: {v.name:>19}: wall {s['wall_s']:.2f} s (compiling "
                          f"included), {s['decode_batch_steps_per_sample']:.2f} decode batch-steps/sample", flush=True)
            per_round.append(compiled[1])
        return per_round

    def rounds(self, plan: Sequence[Variant], rounds: int, on_run: Any = None) -> dict[str, list[dict[str, Any]]]:
        """Every variant of ``plan`` once per round, ``rounds`` rounds; ``on_run(variant, round, run)`` after each.
        Rounds to be compared come after untimed ones (:meth:`warm`); what a timed run still compiles is in its
        ``compile_s``.

        Returns:
          Each variant's runs (:meth:`run`'s results), in order.
        """
        out: dict[str, list[dict[str, Any]]] = {v.name: [] for v in plan}
        for r in range(rounds):
            for v in plan:
                out[v.name].append(self.run(v))
                if on_run is not None:
                    on_run(v, r, out[v.name][-1])
        return out

    def run_setup(self, cfg: Any, split: bool) -> Any:
        """The run simulator's description of a run of ``cfg`` on this harness's engine
        (:class:`dora_jax.sim.local.RunSetup`): slots, prompt and cache lengths, the task's prompts and length
        budgets (each completion runs to its budget: exact for a tokenizer without end-of-sequence), the
        trainer's padding, and the driver's settings as a run resolves them."""
        from dora_jax.rollout.driver import RolloutDriver
        from dora_jax.run.evaluation import prompt_ids
        from dora_jax.sim.local import RunSetup
        from dora_jax.tokenizer import chat_template_head

        p = self.placement(cfg, split)
        engine = p.engine
        head = tuple(chat_template_head(self.tokenizer)) if cfg.rollout.shared_prefix else ()
        head = head if 0 < len(head) < engine.max_prefill_length else ()
        probe = RolloutDriver(engine, overlap=cfg.rollout.overlap, shared_prefix=head)
        r = cfg.rollout
        prompts: dict[int, tuple[int, ...]] = {}
        items: dict[int, Any] = {}

        def prompt(i: int) -> tuple[int, ...]:
            if i not in prompts:
                prompts[i] = tuple(prompt_ids(self.tokenizer, self.task.train_item(i).prompt))
            return prompts[i]

        def length(i: int, member: int) -> int:
            if i not in items:
                items[i] = self.task.train_item(i)
            return items[i].budget(member, r.max_new_tokens)

        return RunSetup(slots=r.slots * len(p.engines), max_prefill_length=engine.max_prefill_length,
                        max_target_length=engine.max_target_length, prompt=prompt, length=length,
                        length_buckets=tuple(cfg.train.length_buckets), row_multiple=p.trainer.row_multiple,
                        shared_prefix=head, decode_steps=probe.decode_steps,
                        overlap=bool(probe.overlap), split=bool(p.disjoint))
