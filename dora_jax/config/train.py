"""The trainer's settings (``train``, with its LoRA adapters)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dora_jax.schema import fail

_fail = fail  # the name this module's checks call

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

