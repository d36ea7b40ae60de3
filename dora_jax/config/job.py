"""What a run trains on and where it runs: ``task``, ``target``, ``roles``, ``run`` and ``metrics``."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from dora_jax.sandbox import GRACE_S as SANDBOX_GRACE_S
from dora_jax.schema import fail

_fail = fail  # the name this module's checks call


_TASK_LEVELS = ("add1", "add2", "sub2", "mul1", "mul21", "add3")


@dataclass(frozen=True)
class TaskConfig:
    """What to train on: ``arithmetic`` (built in), ``gsm8k``, ``math`` or ``code`` (all three reading ``path``),
    ``longtail`` (synthetic long-tailed budgets, for benchmarks and tests) or ``package.module:factory``.
    ``reward`` optionally replaces the task's reward: ``math`` (math-verify) or ``package.module:function``.

    ``path``: a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file, or a ``datasets`` name with ``split``
    and ``subset``; ``prompt_field`` / ``answer_field``: a row's fields (dotted paths reach into objects; empty:
    the task's usual names; for ``code`` the tests). ``code_*``: each program's time limit, address space, output
    kept per stream, and interpreter (absolute path; empty: this one, or ``python3`` where the sandbox's user
    cannot run it). ``eval_*``: held-out evaluation before and after training and, with ``eval_every`` N > 0, of
    every N-th version (docs/runner.md, "Evaluation")."""

    name: str = "arithmetic"
    path: str = ""
    reward: str = ""
    prompt_field: str = ""
    answer_field: str = ""
    split: str = "train"
    subset: str = ""
    levels: tuple[str, ...] = _TASK_LEVELS
    eval_size: int = 64
    eval_max_new_tokens: int = 32
    eval_temperature: float = 0.0
    eval_samples: int = 1
    eval_every: int = 0
    longtail_max_len: int = 64
    seed: int = 0
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    code_timeout_s: float = 5.0
    code_memory_mb: int = 1024
    code_output_kb: int = 1024
    code_python: str = ""

    def validate(self, path: str = "task") -> None:
        if self.name not in _TASK_NAMES and ":" not in self.name:
            _fail(f"{path}.name", self.name, f"{', '.join(_TASK_NAMES)}, or an import path 'package.module:factory'")
        if self.reward and self.reward not in _REWARD_NAMES and ":" not in self.reward:
            _fail(f"{path}.reward", self.reward, f"{', '.join(_REWARD_NAMES)}, an import path "
                  "'package.module:function', or empty (the task's own)")
        if self.name in ("gsm8k", "math", "code") and not self.path:
            _fail(f"{path}.path", self.path, f"task {self.name!r} reads its data from here: a .jsonl, .json or "
                  ".parquet file, or a datasets name")
        if not self.split:
            _fail(f"{path}.split", self.split, "must name a split of the data set, e.g. 'train'")
        if not self.levels:
            _fail(f"{path}.levels", list(self.levels), f"at least one of {', '.join(_TASK_LEVELS)}")
        for lv in self.levels:
            if lv not in _TASK_LEVELS:
                _fail(f"{path}.levels", lv, f"allowed: {', '.join(_TASK_LEVELS)}")
        if self.eval_size < 0:
            _fail(f"{path}.eval_size", self.eval_size, "must be >= 0")
        if not 0 <= self.eval_temperature < 100:
            _fail(f"{path}.eval_temperature", self.eval_temperature, "must be in [0, 100) (0: greedy)")
        if self.eval_every < 0:
            _fail(f"{path}.eval_every", self.eval_every, "must be >= 0 (0: evaluate before and after training only)")
        if self.eval_temperature == 0 and self.eval_samples != 1:
            _fail(f"{path}.eval_samples", self.eval_samples, "must be 1 for greedy evaluation (eval_temperature 0)")
        if self.longtail_max_len < 2:
            _fail(f"{path}.longtail_max_len", self.longtail_max_len, "must be >= 2 tokens")
        for name in ("eval_max_new_tokens", "eval_samples", "reward_workers"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")
        if not self.reward_timeout_s > 0:
            _fail(f"{path}.reward_timeout_s", self.reward_timeout_s, "must be > 0 seconds")
        if not self.code_timeout_s > 0:
            _fail(f"{path}.code_timeout_s", self.code_timeout_s, "must be > 0 seconds")
        if self.code_memory_mb < 64:
            _fail(f"{path}.code_memory_mb", self.code_memory_mb, "must be >= 64 MiB (the interpreter alone takes ~30)")
        if self.code_output_kb < 1:
            _fail(f"{path}.code_output_kb", self.code_output_kb, "must be >= 1 KiB")
        if self.code_python and not os.path.isabs(self.code_python):
            _fail(f"{path}.code_python", self.code_python, "must be an absolute path to a Python interpreter, or "
                  "empty")
        margin = SANDBOX_GRACE_S + 1
        if self.name == "code" and self.reward_timeout_s < self.code_timeout_s + margin:
            _fail(f"{path}.reward_timeout_s", self.reward_timeout_s, f"must be at least task.code_timeout_s + "
                  f"{margin:g} s = {self.code_timeout_s + margin:g} (a program's start and clean-up), so the sandbox "
                  "ends a program before the reward pool ends its worker")


_PLACEMENTS = ("shared", "split")
ROLLOUT_SPANS = ("process", "all")  # roles.rollout_span: one engine per process, or one over every process
VERSIONS_PER_GROUP = ("all", 1)  # roles.versions_per_group: every live version in every group, or one per group
_TASK_NAMES = ("arithmetic", "gsm8k", "math", "code", "longtail")
_REWARD_NAMES = ("math",)


@dataclass(frozen=True)
class TargetConfig:
    """The hardware a config is sized for, checked by ``dora-jax check``: device kind (free text, e.g.
    ``"H100 80GB"``, ``"TPU v5p"``), device count, and memory per device in GiB (0: not checked)."""

    device_kind: str = "cpu"
    num_devices: int = 1
    memory_gib: float = 0.0

    def validate(self, path: str = "target") -> None:
        if not self.device_kind:
            _fail(f"{path}.device_kind", self.device_kind, "must name the device, e.g. 'H100 80GB' or 'TPU v5p'")
        if self.num_devices <= 0:
            _fail(f"{path}.num_devices", self.num_devices, "must be a positive integer")
        if self.memory_gib < 0:
            _fail(f"{path}.memory_gib", self.memory_gib, "must be >= 0 GiB (0: not checked)")


@dataclass(frozen=True)
class RolesConfig:
    """Where trainer and rollout run. ``shared``: both time-share every device on ``mesh``. ``split``: the
    trainer's ``mesh`` covers the first ``trainer_devices`` devices and the rest form ``rollout_groups`` equal
    groups, each a ``(data, fsdp=1, tensor)`` mesh of ``rollout_data`` x ``rollout_tensor`` devices (one may be
    -1) holding its own copy of the policy.

    ``rollout_span`` (several processes): ``process`` gives each process its own engine, generating every P-th
    group; ``all`` builds one engine over every process's rollout devices, driven alike by all (shared placement
    only; docs/scale.md). ``versions_per_group``: ``all`` (every live version in every group) or ``1`` (groups
    reassigned between versions by their work; needs ``rollout_groups >= train.max_staleness + 1`` and
    ``split``). Under several processes ``rollout_groups`` counts each process's groups. ``elastic_group``: under
    ``split`` with one version per group, the trainer's devices decode the newest version while the trainer waits.
    docs/design.md, "Load balancing", for both."""

    placement: str = "shared"
    trainer_devices: int = 0
    rollout_groups: int = 1
    rollout_data: int = 1
    rollout_tensor: int = -1
    rollout_span: str = "process"
    versions_per_group: int | str = "all"
    elastic_group: bool = False

    def validate(self, path: str = "roles") -> None:
        if self.placement not in _PLACEMENTS:
            _fail(f"{path}.placement", self.placement, f"allowed: {', '.join(_PLACEMENTS)}")
        if self.placement == "split" and self.trainer_devices <= 0:
            _fail(f"{path}.trainer_devices", self.trainer_devices, "split placement needs a positive device count")
        if self.rollout_groups <= 0:
            _fail(f"{path}.rollout_groups", self.rollout_groups, "must be a positive integer")
        for name in ("rollout_data", "rollout_tensor"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer or -1 (the rest)")
        if self.rollout_data == -1 and self.rollout_tensor == -1:
            _fail(f"{path}.rollout_data", self.rollout_data, "at most one of rollout_data, rollout_tensor is -1")
        if self.rollout_span not in ROLLOUT_SPANS:
            _fail(f"{path}.rollout_span", self.rollout_span, f"allowed: {', '.join(ROLLOUT_SPANS)} (process: an "
                  "engine per process on its own devices; all: one engine over every process's rollout devices)")
        if self.versions_per_group not in VERSIONS_PER_GROUP or isinstance(self.versions_per_group, bool):
            _fail(f"{path}.versions_per_group", self.versions_per_group, "allowed: 'all' (every live version in every "
                  "group) or 1 (one version per group, groups reassigned by work)")
        if not isinstance(self.elastic_group, bool):
            _fail(f"{path}.elastic_group", self.elastic_group, "must be true or false")
        if self.elastic_group and (self.placement != "split" or self.versions_per_group != 1):
            _fail(f"{path}.elastic_group", True, "lends the trainer's devices to rollout as one more group of one "
                  f"version: it needs {path}.placement=split and {path}.versions_per_group=1 (they are "
                  f"{self.placement!r} and {self.versions_per_group!r})")


@dataclass(frozen=True)
class RunConfig:
    """Where a run lives and how it survives a restart. ``checkpoint_every``: updates between run checkpoints in
    ``RUN_DIR/checkpoints`` (0: only on preemption, and no version snapshots); ``keep_checkpoints``: how many of
    the newest are kept; ``resume``: continue from the newest good checkpoint there (false refuses a directory
    holding an unfinished run)."""

    name: str = "run"
    out_dir: str = "runs"
    seed: int = 0
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    resume: bool = True

    def validate(self, path: str = "run") -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            _fail(f"{path}.name", self.name, "must be a non-empty name without '/', not '.' or '..'")
        if self.checkpoint_every < 0:
            _fail(f"{path}.checkpoint_every", self.checkpoint_every,
                  "must be >= 0 (updates between run checkpoints; 0 checkpoints only when preempted)")
        if self.keep_checkpoints < 1:
            _fail(f"{path}.keep_checkpoints", self.keep_checkpoints,
                  "must be >= 1: the newest checkpoint is what a preempted or crashed run resumes from")


@dataclass(frozen=True)
class MetricsConfig:
    """Where a run's metrics go besides ``RUN_DIR/metrics.jsonl`` (always written). ``tensorboard``: to
    ``RUN_DIR/tb`` (with tensorboardX). ``wandb``: the rows and whole config to Weights & Biases project
    ``wandb_project`` (entity ``wandb_entity``, empty: the default), resumed with the run; needs the ``wandb``
    extra (``WANDB_MODE=offline``: under ``RUN_DIR/wandb``)."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "dora-jax"
    wandb_entity: str = ""

    def validate(self, path: str = "metrics") -> None:
        if self.wandb and not self.wandb_project:
            _fail(f"{path}.wandb_project", self.wandb_project, "must name the W&B project when metrics.wandb is true")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            _fail(f"{path}.wandb", self.wandb, "needs the wandb package: pip install 'dora-jax[wandb]'")


