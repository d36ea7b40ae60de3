"""Run configuration: frozen dataclasses loaded from YAML with ``key=value`` overrides.

Every field is type-checked and validated on load. A bad value stops the program with a
:class:`ConfigError` that names the field (dotted path), the value, and what is allowed, before anything
is built or written. One module per group of sections: :mod:`~dora_jax.config.model` (``model``, ``mesh``),
:mod:`~dora_jax.config.train` (``train``), :mod:`~dora_jax.config.rollout` (``rollout``, ``dora``, ``generate``) and
:mod:`~dora_jax.config.job` (``task``, ``target``, ``roles``, ``run``, ``metrics``); :class:`Config` joins them and
checks what spans sections.

Example::

    cfg = load_config("configs/smollm2_135m.yaml", ["model.num_layers=4", "mesh.fsdp=2"])
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dora_jax.config.job import MetricsConfig, RolesConfig, RunConfig, TargetConfig, TaskConfig, ROLLOUT_SPANS
from dora_jax.config.model import DEFAULT_RULES, MeshConfig, ModelConfig, RopeScaling
from dora_jax.config.rollout import (ATTENTION_IMPLS, MAX_DECODE_STEPS, ROLLOUT_DTYPES, DoraConfig, GenerateConfig,
                                     RolloutConfig)
from dora_jax.config.train import REMAT_POLICIES, TRAIN_ATTENTION_IMPLS, LoraConfig, TrainConfig
from dora_jax.schema import ConfigError, build, fail, to_plain

__all__ = ["ATTENTION_IMPLS", "DEFAULT_RULES", "MAX_DECODE_STEPS", "REMAT_POLICIES", "ROLLOUT_DTYPES", "ROLLOUT_SPANS",
           "TRAIN_ATTENTION_IMPLS", "Config", "ConfigError", "DoraConfig", "GenerateConfig", "LoraConfig",
           "MeshConfig", "MetricsConfig", "ModelConfig", "RolesConfig", "RolloutConfig", "RopeScaling", "RunConfig",
           "TargetConfig", "TaskConfig", "TrainConfig", "configs_dir", "load_config", "resolve_config_path"]

_fail = fail  # the name this module's checks call


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dora: DoraConfig = field(default_factory=DoraConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        d, t = self.dora, self.train
        if d.train_batch % t.group_size:
            _fail("dora.train_batch", d.train_batch, f"must be a multiple of train.group_size ({t.group_size}): "
                  "groups are trained whole")
        if d.mode == "dora" and not d.train_batch <= d.rollout_batch <= (t.max_staleness + 1) * d.train_batch:
            _fail("dora.rollout_batch", d.rollout_batch,
                  f"in dora mode must lie in [train_batch, (train.max_staleness + 1) * train_batch] = "
                  f"[{d.train_batch}, {(t.max_staleness + 1) * d.train_batch}]")
        if d.mode == "one_step_off" and t.max_staleness < 1:
            _fail("train.max_staleness", t.max_staleness, "one_step_off trains every batch one version late: >= 1")
        if self.rollout.max_prompt_len + self.rollout.max_new_tokens > self.model.max_seq_len:
            _fail("rollout.max_new_tokens", self.rollout.max_new_tokens,
                  f"rollout.max_prompt_len + max_new_tokens must fit model.max_seq_len ({self.model.max_seq_len})")
        groups = d.train_batch // t.group_size
        if groups % t.minibatches:
            _fail("train.minibatches", t.minibatches, f"must divide the iteration's {groups} groups "
                  f"(dora.train_batch {d.train_batch} / train.group_size {t.group_size}): updates take whole groups")
        r = self.rollout
        if r.top_k > 0 or r.top_p < 1.0:
            # The trainer's log-probs (current, proximal, recomputed) are those of the temperature-scaled full
            # distribution; a truncated behaviour distribution would bias every ratio and importance weight.
            _fail("rollout.top_k/top_p", (r.top_k, r.top_p), "training rollouts sample the temperature-scaled "
                  "full distribution (top_k 0, top_p 1.0), the one the trainer computes its log-probs under; "
                  "truncated sampling is for `dora-jax generate` (generate.top_k/top_p)")
        if t.dynamic_sampling and t.group_size < 2:
            _fail("train.dynamic_sampling", True, "needs train.group_size >= 2 (a group of one always agrees)")
        if t.overlong_buffer >= self.rollout.max_new_tokens:
            _fail("train.overlong_buffer", t.overlong_buffer,
                  f"must be < rollout.max_new_tokens ({self.rollout.max_new_tokens}), the budget it ends")
        if self.rollout.max_new_tokens > t.max_response_tokens:
            _fail("rollout.max_new_tokens", self.rollout.max_new_tokens,
                  f"must be <= train.max_response_tokens ({t.max_response_tokens})")
        live, groups = t.max_staleness + 1, self.roles.rollout_groups
        if self.roles.versions_per_group == 1 and groups < live:
            # With fewer groups than live versions a version with work can get none; when that is the oldest, the
            # trainer waits on it while newer versions hold every group (docs/design.md, "Load balancing").
            _fail("roles.versions_per_group", 1, f"one version per group needs roles.rollout_groups >= "
                  f"train.max_staleness + 1 = {live} (the live versions), and roles.rollout_groups is {groups}: "
                  f"set roles.rollout_groups to at least {live}, train.max_staleness to at most {groups - 1}, or "
                  "roles.versions_per_group to 'all'")
        if self.roles.placement == "split" and self.roles.trainer_devices >= self.target.num_devices:
            _fail("roles.trainer_devices", self.roles.trainer_devices,
                  f"must leave rollout devices: < target.num_devices ({self.target.num_devices})")
        longest = self.rollout.max_prompt_len + self.rollout.max_new_tokens
        if max(t.length_buckets) < longest:
            _fail("train.length_buckets", list(t.length_buckets),
                  f"the largest must hold the longest sample: rollout.max_prompt_len + rollout.max_new_tokens = "
                  f"{longest}")
        if self.generate.max_new_tokens >= self.model.max_seq_len:
            _fail("generate.max_new_tokens", self.generate.max_new_tokens,
                  f"must be < model.max_seq_len ({self.model.max_seq_len})")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def fingerprint(self) -> str:
        """A short hash of every setting, for checkpoint and snapshot metadata."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def configs_dir() -> str:
    """The folder of shipped YAML presets.

    The repository's top-level ``configs/`` is installed as the package ``dora_jax.configs`` (pyproject.toml),
    found here through ``importlib.resources`` in a wheel or an editable install. Where that package cannot be
    imported (a source checkout put on ``sys.path`` without installing it), the presets are the ``configs/``
    folder beside ``dora_jax/``.

    Returns:
        The folder's path.
    """
    try:
        return str(importlib.resources.files("dora_jax.configs"))
    except ModuleNotFoundError:
        return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def resolve_config_path(name: str) -> str:
    """Accepts a path, or the name of a shipped preset (``smollm2_135m`` or ``smollm2_135m.yaml``)."""
    if os.path.isfile(name):
        return name
    if os.path.isdir(name):
        raise ConfigError(f"config file {name!r} is a directory; name a YAML file in it")
    for cand in (name, f"{name}.yaml"):
        p = os.path.join(configs_dir(), cand)
        if os.path.isfile(p):
            return p
    raise ConfigError(f"config file {name!r} not found (looked in the current directory and {configs_dir()})")


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a YAML config (or the defaults when ``path`` is None), applies overrides, validates.

    Raises:
      ConfigError: naming the field, bad value and what is allowed, and where the value came from: the
        override that set it, else the file.
    """
    from dora_jax.textfiles import TextFileError, load_yaml

    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            data = load_yaml(path) or {}
        except TextFileError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return build(Config, data, overrides, source=path)
