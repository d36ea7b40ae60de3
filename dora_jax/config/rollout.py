"""How rollouts are decoded and scheduled: the engine (``rollout``), the schedule (``dora``) and the sampling of
``dora-jax generate`` (``generate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dora_jax.config.model import _DTYPES, _REMOVED
from dora_jax.schema import fail

_fail = fail  # the name this module's checks call


ATTENTION_IMPLS = ("xla", "pallas_gpu", "pallas_tpu", "pallas_tpu_ragged", "auto")
MAX_DECODE_STEPS = 256  # rollout.decode_steps: results hold [steps, slots] tokens, compiled in
ROLLOUT_DTYPES = ("auto",) + _DTYPES

_MODES = ("sync", "one_step_off", "dora")


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
    attention kernels, :mod:`dora_jax.kernels.paged_attention`), ``"pallas_tpu_ragged"`` (JAX's ragged paged
    attention, TPU only, over a pool with keys and values interleaved) or ``"auto"`` (xla on every platform until a
    measurement there shows a kernel ahead; where the slots split over batch shards, a kernel runs per shard).
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


