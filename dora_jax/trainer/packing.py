"""Several samples per training row: a deterministic host plan, and the device gathers around it.

Shape letters: ``n`` samples of an update in the batch layout (one per row, right-padded to ``t``), ``m``
packed micro-batches of ``r`` rows of ``s`` positions. Only the forward runs on packed rows (:func:`pack_tokens`,
each sample its own segment id, 0 on padding, and positions from 0); log-probs come back to the batch layout
(:func:`unpack`), where the loss is the unpacked one. :func:`iteration_plan` and :func:`plan` make the
:class:`Packing`. docs/trainer.md, "Packing", gives the plan's rules and why the loss is exact.
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
    """Bins of sample indices whose lengths sum to at most ``capacity``: longest first (ties by index), each into
    the first bin with room. Deterministic; zero lengths are left out."""
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
    """The smallest power of two or 1.5 times one that is at least ``n``."""
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
    """The host arrays of a plan: each device's ``bins`` (:func:`device_bins` of ``lengths``, token counts in a
    layout of rows of ``t``) dealt into ``micro_batches`` micro-batches of ``rows`` rows of ``t`` per device.

    Raises:
      BatchError: a device's bins need more than ``micro_batches x rows`` rows.
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
    """The packings of an iteration's updates (``lengths``: each update's token counts in its batch layout, 0 for
    a row left out) into micro-batches of at most ``rows`` rows of ``t`` per device. One shape for the
    iteration, set by its fullest device: as few micro-batches (on :func:`grid`, at most ``micro_batches``), then
    as few rows each (on :func:`grid`, at most ``rows``), as hold its packed rows."""
    bins = [device_bins(np.asarray(n), devices, t) for n in lengths]
    most = max([len(b) for update in bins for b in update] + [1])
    m = min(grid(-(-most // rows)), micro_batches)
    r = grid(-(-most // m))
    return [make_packing(np.asarray(n), t, b, r, m) for n, b in zip(lengths, bins)]


def plan(lengths: np.ndarray, t: int, devices: int) -> Packing:
    """All rows in one micro-batch (as the unpacked forward of a whole batch): each device's rows packed, as many
    packed rows per device as the fullest needs, on :func:`grid`."""
    return iteration_plan([lengths], t, devices, len(lengths) // devices, 1)[0]


def pack_tokens(tokens_nt: jax.Array, packing: Packing) -> jax.Array:
    """One micro-batch's packed tokens [R, S] (0 on padding) from the batch layout's [N, T] (``packing``: that
    micro-batch's, without the M axis)."""
    return jnp.where(packing.segment_ids != 0, tokens_nt.reshape(-1)[packing.source], 0)


def unpack(x_rs: jax.Array, packing: Packing, t: int) -> jax.Array:
    """Per-token values of one micro-batch's packed rows [R, S] back in the batch layout [N, t]; 0 at each
    sample's position 0, past its length, and for other micro-batches' samples."""
    r, s = x_rs.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = packing.row[:, None] * s + jnp.minimum(packing.offset[:, None] + pos, s - 1)
    inside = (pos >= 1) & (pos < packing.length[:, None])
    return jnp.where(inside, x_rs.reshape(-1)[idx], 0.0)


def padding_fraction(segment_ids: jax.Array, valid_rows: jax.Array | None = None) -> jax.Array:
    """Padding slots / all token slots of the rows a forward runs on: a slot is a token where its segment id is
    non-zero (and, with ``valid_rows``, its row a real sample)."""
    real = segment_ids != 0
    if valid_rows is not None:
        real = real & valid_rows[:, None]
    return 1.0 - real.sum().astype(jnp.float32) / segment_ids.size
