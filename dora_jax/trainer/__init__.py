"""Staleness-masked GRPO-family training as pure, sharded, donated JAX functions."""

from dora_jax.trainer.batch import BatchError, Sample, TrainBatch, check_batch, make_batch
from dora_jax.trainer.losses import group_advantages, policy_loss, staleness, token_logprobs
from dora_jax.trainer.state import TrainState, make_optimizer
from dora_jax.trainer.step import Trainer, make_train_step, policy_params, sequence_logprobs

__all__ = ["BatchError", "Sample", "TrainBatch", "TrainState", "Trainer", "check_batch", "group_advantages",
           "make_batch", "make_optimizer", "make_train_step", "policy_loss", "policy_params",
           "sequence_logprobs", "staleness", "token_logprobs"]
