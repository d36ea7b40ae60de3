"""Several samples per training row: a deterministic host plan, and the device gathers around it.

Shape letters: ``n`` samples of an update in the batch layout (one sample per row, right-padded to ``t``),
``m`` packed micro-batches of ``r`` rows of ``s`` positions.

The batch keeps its one-sample-per-row layout: every per-token array the loss reads (masks, behaviour,
proximal and reference log-probs) stays where it is. Only the model's forward runs on packed rows: the
tokens are gathered into them, each sample with its own segment id (1, 2, ... along a row, 0 on padding) and
its rotary positions restarting at 0, and the log-probs come back to the batch layout, where the loss is the
unpacked loss to the letter. Attention is kept within a segment by every training attention path that takes
segment ids. The log-prob of a sample's first token, which the row computes from the sample before it, is set
to 0, as an unpacked row's column 0 is (a prompt token: it carries no loss).

An update is packed per data-parallel device (its rows of the batch, first-fit decreasing into rows of ``s``
positions), and its micro-batches are made of packed rows: never more rows per device than an unpacked
micro-batch holds, so the peak memory is at most the unpacked one's, in as few micro-batches as the fullest
device's packed rows need (a power of two or 1.5 times one, at most ``train.micro_batches``), and as few rows
per micro-batch as those need: short samples cost fewer micro-batches and fewer rows. A micro-batch's loss is
taken on the whole update's batch layout with the samples of the other micro-batches masked out (elementwise
work, no vocabulary), so it is an exact share of the unpacked loss.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.trainer.batch import BatchError, bucket_rows


@flax.struct.dataclass
class Packing:
    """Where an update's samples sit in its packed micro-batches (``M`` of them, ``R`` rows each)."""

    source: jax.Array  # [M, R, S] int32: index n * t + position of the slot's token in the batch layout (0: padding)
    segment_ids: jax.Array  # [M, R, S] int32: 1, 2, ... per sample along a row, 0 on padding
    positions: jax.Array  # [M, R, S] int32: rotary positions, from 0 in each sample
    row: jax.Array  # [M, N] int32: the sample's packed row in micro-batch m
    offset: jax.Array  # [M, N] int32: its first position there
    length: jax.Array  # [M, N] int32: its token count, 0 where micro-batch m does not hold it


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of sample indices whose lengths sum to at most ``capacity``: longest first (ties by index), each
    into the first bin with room. Deterministic; zero lengths are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise BatchError(f"a sample of {n} tokens does not fit a packed row of {capacity}")
        for j, free in enumerate(room):
            if n <= free:
                bins[j].append(i)
                room[j] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def grid(n: int) -> int:
    """The next power of two or 1.5 times one, at least ``n``: two sizes an octave, so programs stay few and at
    most a third of what is sized is left empty (a power of two alone would leave up to half)."""
    p = bucket_rows(max(n, 1), 1)
    return 3 * p // 4 if p >= 4 and n <= 3 * p // 4 else p


def device_bins(lengths: np.ndarray, devices: int, capacity: int) -> list[list[list[int]]]:
    """Each data-parallel device's bins (indices into ``lengths``) of its equal share of the rows."""
    n = len(lengths)
    if n % devices:
        raise BatchError(f"{n} rows do not split over {devices} data-parallel devices")
    c = n // devices
    return [[[d * c + i for i in b] for b in first_fit_decreasing(lengths[d * c:(d + 1) * c].tolist(), capacity)]
            for d in range(devices)]


def make_packing(lengths: np.ndarray, t: int, bins: Sequence[Sequence[Sequence[int]]], rows: int,
                 micro_batches: int) -> Packing:
    """The host arrays of a plan: each device's ``bins`` (from :func:`device_bins` of ``lengths``, the samples'
    token counts in a batch layout of rows of ``t``) dealt ``rows`` at a time into ``micro_batches`` packed
    micro-batches of ``rows`` rows of ``t`` positions per device.

    Raises:
      BatchError: when a device's bins need more than ``micro_batches x rows`` rows.
    """
    devices, n = len(bins), len(lengths)
    shape = (micro_batches, devices * rows, t)
    source, seg, pos = np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    row, offset, length = (np.zeros((micro_batches, n), np.int32) for _ in range(3))
    for d, device in enumerate(bins):
        if len(device) > micro_batches * rows:
            raise BatchError(f"device {d} needs {len(device)} packed rows, more than {micro_batches} micro-batches "
                             f"of {rows}")
        for j, members in enumerate(device):
            m, r = j // rows, d * rows + j % rows  # the micro-batch, and the row in it
            at = 0
            for segment, i in enumerate(members, start=1):
                k = int(lengths[i])
                source[m, r, at:at + k] = i * t + np.arange(k)
                seg[m, r, at:at + k] = segment
                pos[m, r, at:at + k] = np.arange(k)
                row[m, i], offset[m, i], length[m, i] = r, at, k
                at += k
    return Packing(source=source, segment_ids=seg, positions=pos, row=row, offset=offset, length=length)


def iteration_plan(lengths: Sequence[np.ndarray], t: int, devices: int, rows: int, micro_batches: int
                   ) -> list[Packing]:
    """The packings of an iteration's updates (``lengths``: each update's samples' token counts in its batch
    layout, 0 for a row left out) into micro-batches of at most ``rows`` rows of ``t`` positions per device
    (an unpacked micro-batch's). The fullest device of any update sets the shape, so an iteration runs one
    program: as few micro-batches as hold its packed rows (on :func:`grid`, at most ``micro_batches``, the
    unpacked count, which always suffices), then as few rows per micro-batch as hold them (on :func:`grid`,
    so at most ``rows``: ``rows`` is on it)."""
    bins = [device_bins(np.asarray(n), devices, t) for n in lengths]
    most = max([len(b) for update in bins for b in update] + [1])
    m = min(grid(-(-most // rows)), micro_batches)
    r = grid(-(-most // m))
    return [make_packing(np.asarray(n), t, b, r, m) for n, b in zip(lengths, bins)]


def plan(lengths: np.ndarray, t: int, devices: int) -> Packing:
    """One pass over all rows at once (one micro-batch, as the unpacked forward of a whole batch runs): each
    device's rows packed, as many packed rows per device as the fullest needs, on :func:`grid`."""
    return iteration_plan([lengths], t, devices, len(lengths) // devices, 1)[0]


def pack_tokens(tokens_nt: jax.Array, packing: Packing) -> jax.Array:
    """One micro-batch's packed tokens [R, S] (0 on padding) from the batch layout's [N, T] (``packing``: that
    micro-batch's, without the leading M axis)."""
    return jnp.where(packing.segment_ids != 0, tokens_nt.reshape(-1)[packing.source], 0)


def unpack(x_rs: jax.Array, packing: Packing, t: int) -> jax.Array:
    """Per-token values of one micro-batch's packed rows [R, S] back in the batch layout [N, t]. Position 0 of
    each sample (predicted from the sample before it, if any), positions past its length and the samples of
    other micro-batches are 0, as an unpacked row's log-probs are at position 0."""
    r, s = x_rs.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = packing.row[:, None] * s + jnp.minimum(packing.offset[:, None] + pos, s - 1)
    inside = (pos >= 1) & (pos < packing.length[:, None])
    return jnp.where(inside, x_rs.reshape(-1)[idx], 0.0)


def padding_fraction(segment_ids: jax.Array, valid_rows: jax.Array | None = None) -> jax.Array:
    """Padding slots / all token slots of the rows a forward runs on: a slot counts as a token when its
    segment id is non-zero (and, with ``valid_rows``, its row is a real sample; the batch's padding rows carry
    a copy of a sample that weighs nothing)."""
    real = segment_ids != 0
    if valid_rows is not None:
        real = real & valid_rows[:, None]
    return 1.0 - real.sum().astype(jnp.float32) / segment_ids.size
