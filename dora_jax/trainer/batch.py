"""The training batch (:class:`TrainBatch`): finished samples in padded, bucketed arrays, one sample per row,
made and checked by :func:`make_batch` before anything is traced. Layout and buckets: docs/trainer.md, 'The batch'.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import flax.struct
import jax
import numpy as np

from dora_jax.rollout.samples import Sample


class BatchError(ValueError):
    """A batch that cannot be trained on: mismatched shapes, split groups, non-finite rewards, bad lengths."""


@flax.struct.dataclass
class TrainBatch:
    """Arrays of one update. ``B`` rows, ``T`` positions; per-token arrays aligned with ``tokens``."""

    tokens: jax.Array  # [B, T] int32
    segment_ids: jax.Array  # [B, T] int32: 1 on real tokens, 0 on padding
    loss_mask: jax.Array  # [B, T] float32: 1 on response tokens
    behaviour_logprobs: jax.Array  # [B, T] float32: the engine's, 0 off the response
    recomputed_logprobs: jax.Array  # [B, T] float32: training forward on the behaviour version (or zeros)
    ref_logprobs: jax.Array  # [B, T] float32: reference policy for the KL term (or zeros)
    prox_logprobs: jax.Array  # [B, T] float32: the policy at the iteration's start (decoupled PPO), or zeros
    versions: jax.Array  # [B] int32
    group_ids: jax.Array  # [B] int32 in [0, B)
    rewards: jax.Array  # [B] float32
    valid: jax.Array  # [B] bool: False on padding rows

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise BatchError(f"a sample of {n} tokens exceeds the largest length bucket {buckets[-1]} "
                     f"(train.length_buckets)")


def bucket_rows(n: int, multiple: int) -> int:
    """``multiple * 2**k``, the smallest such count >= n."""
    return multiple * (1 << max(0, math.ceil(math.log2(max(1, math.ceil(n / multiple))))))


def make_batch(samples: Sequence[Sample], *, group_size: int, length_buckets: Sequence[int],
               row_multiple: int = 1) -> TrainBatch:
    """Packs samples into a :class:`TrainBatch` (host numpy arrays): the length padded to the next of
    ``length_buckets``, the row count to ``row_multiple * 2**k`` (padding rows have ``valid`` False).

    Raises:
      BatchError: naming the sample or group at fault: an empty batch or prompt, log-probs that do not match
        the response, a non-finite reward or log-prob, a negative version, a duplicate sample id, a group
        without exactly ``group_size`` samples here, a sample longer than the largest bucket.
    """
    if not samples:
        raise BatchError("empty batch: no samples")
    for s in samples:
        where = f"sample {s.sample_id} (group {s.group_id})"
        if len(s.logprobs) != len(s.response_ids):
            raise BatchError(f"{where}: {len(s.logprobs)} log-probs for {len(s.response_ids)} response tokens")
        if not s.prompt_ids:
            raise BatchError(f"{where}: empty prompt")
        if not math.isfinite(s.reward):
            raise BatchError(f"{where}: reward is {s.reward}; reward functions must return finite numbers")
        if not np.all(np.isfinite(np.asarray(s.logprobs, np.float64))):
            raise BatchError(f"{where}: non-finite behaviour log-prob")
        if s.version < 0:
            raise BatchError(f"{where}: negative policy version {s.version}")
    ids = Counter(s.sample_id for s in samples)
    dup = [i for i, c in ids.items() if c > 1]
    if dup:
        raise BatchError(f"sample {dup[0]} appears {ids[dup[0]]} times in one batch")
    sizes = Counter(s.group_id for s in samples)
    for g, c in sizes.items():
        if c != group_size:
            raise BatchError(f"group {g} has {c} of {group_size} samples in this batch: groups must be whole "
                             f"(train.group_size = {group_size})")

    t = bucket_length(max(len(s.prompt_ids) + len(s.response_ids) for s in samples), length_buckets)
    b = bucket_rows(len(samples), row_multiple)
    tokens = np.zeros((b, t), np.int32)
    seg = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.float32)
    blp = np.zeros((b, t), np.float32)
    versions = np.zeros((b,), np.int32)
    group_ids = np.zeros((b,), np.int32)
    rewards = np.zeros((b,), np.float32)
    valid = np.zeros((b,), bool)
    group_index = {g: i for i, g in enumerate(sizes)}
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = s.prompt_ids
        tokens[i, p:p + r] = s.response_ids
        seg[i, :p + r] = 1
        mask[i, p:p + r] = 1.0
        blp[i, p:p + r] = s.logprobs
        versions[i], group_ids[i], rewards[i], valid[i] = s.version, group_index[s.group_id], s.reward, True
    zeros = np.zeros((b, t), np.float32)
    return TrainBatch(tokens=tokens, segment_ids=seg, loss_mask=mask, behaviour_logprobs=blp,
                      recomputed_logprobs=zeros, ref_logprobs=zeros.copy(), prox_logprobs=zeros.copy(), versions=versions,
                      group_ids=group_ids, rewards=rewards, valid=valid)


def check_batch(batch: TrainBatch) -> None:
    """Shape and value checks for a hand-built batch (``make_batch`` output always passes).

    Raises:
      BatchError: naming the field whose shape or values are wrong.
    """
    b, t = np.shape(batch.tokens)
    for name in ("segment_ids", "loss_mask", "behaviour_logprobs", "recomputed_logprobs", "ref_logprobs",
                 "prox_logprobs"):
        if np.shape(getattr(batch, name)) != (b, t):
            raise BatchError(f"batch.{name} has shape {np.shape(getattr(batch, name))}, expected {(b, t)} "
                             f"like batch.tokens")
    for name in ("versions", "group_ids", "rewards", "valid"):
        if np.shape(getattr(batch, name)) != (b,):
            raise BatchError(f"batch.{name} has shape {np.shape(getattr(batch, name))}, expected {(b,)}")
    rewards = np.asarray(batch.rewards)
    if not np.all(np.isfinite(rewards[np.asarray(batch.valid)])):
        bad = int(np.flatnonzero(~np.isfinite(rewards) & np.asarray(batch.valid))[0])
        raise BatchError(f"batch.rewards[{bad}] is {rewards[bad]}; rewards must be finite")
    gids = np.asarray(batch.group_ids)
    if gids.min(initial=0) < 0 or gids.max(initial=0) >= b:
        raise BatchError(f"batch.group_ids must lie in [0, {b}); got range [{gids.min()}, {gids.max()}]")
