"""The train state pytree and the optimizer built from config."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax

from dora_jax.config import TrainConfig


@flax.struct.dataclass
class TrainState:
    """Everything a train step reads and writes; a pytree of arrays, so it shards and donates.

    ``params`` are the trainable leaves: the model's whole :class:`flax.nnx.State` under full fine-tuning, or
    the LoRA adapters (``{param_name: {"a", "b"}}``) with the base weights in ``frozen``. ``version`` is the
    policy version these params are: it advances with every applied update, not with skipped ones.
    """

    step: jax.Array  # int32 scalar: batches consumed
    version: jax.Array  # int32 scalar: updates applied
    params: Any
    frozen: Any  # LoRA base weights; None under full fine-tuning
    opt_state: optax.OptState
    rng: jax.Array


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1), end_value=0.0)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with the configured schedule, after global-norm clipping (``grad_clip`` 0 disables it)."""
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
