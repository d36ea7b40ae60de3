"""Several samples per training row: a deterministic host plan, and the device gathers around it.

Shape letters: ``n`` samples of an update in the batch layout (one sample per row, right-padded to ``t``),
``r`` packed rows of ``s`` positions.

The batch keeps its one-sample-per-row layout: every per-token array the loss reads (masks, behaviour,
proximal and reference log-probs) stays where it is. Only the model's forward runs on packed rows: the
tokens are gathered into them, each sample with its own segment id (1, 2, ... along a row, 0 on padding) and
its rotary positions restarting at 0, and the log-probs come back to the batch layout, where the loss is the
unpacked loss to the letter. Attention is kept within a segment by every training attention path that takes
segment ids; the last token of one sample never predicts the first of the next (column 0 of every sample is
0, as in an unpacked row, and a prompt token carries no loss).

A plan splits the ``n`` rows into ``cells`` equal runs (one per micro-batch and data-parallel device: the
split the train step's micro-batch scan and the batch sharding make), packs each run first-fit decreasing
into rows of ``s`` positions, and gives every run the same number of packed rows, so a micro-batch's samples
and their packed rows stay together and every device gets an equal share. Indices are local to a
micro-batch (``cells // micro_batches`` runs), since the scan hands each micro-batch its own slices.
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
    """Where an update's samples sit in packed rows. Indices are local to a micro-batch."""

    source: jax.Array  # [R, S] int32: index n * t + position of the slot's token in the batch layout (0 on padding)
    segment_ids: jax.Array  # [R, S] int32: 1, 2, ... per sample along a row, 0 on padding
    positions: jax.Array  # [R, S] int32: rotary positions, from 0 in each sample
    row: jax.Array  # [N] int32: the packed row of each sample (0 for a sample left out)
    offset: jax.Array  # [N] int32: its first position there
    length: jax.Array  # [N] int32: its token count (0: left out, e.g. a padding row)


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


def cell_bins(lengths: np.ndarray, cells: int, capacity: int) -> list[list[list[int]]]:
    """The bins of each of ``cells`` equal runs of ``lengths`` (indices local to the run)."""
    n = len(lengths)
    if n % cells:
        raise BatchError(f"{n} rows do not split into {cells} equal runs (micro-batches x data-parallel devices)")
    c = n // cells
    return [first_fit_decreasing(lengths[k * c:(k + 1) * c].tolist(), capacity) for k in range(cells)]


def rows_per_cell(bins: Sequence[Sequence[Sequence[int]]]) -> int:
    """Packed rows each run gets: the most any run needs, up to the next power of two or 1.5 times one (two
    sizes an octave: few programs, and at most a third of the rows left empty where a power of two alone would
    leave up to half)."""
    n = max([len(b) for b in bins] + [1])
    p = bucket_rows(n, 1)
    return 3 * p // 4 if p >= 4 and n <= 3 * p // 4 else p


def make_packing(lengths: np.ndarray, t: int, s: int, bins: Sequence[Sequence[Sequence[int]]], per_cell: int,
                 micro_batches: int) -> Packing:
    """The host arrays of a plan: ``bins`` from :func:`cell_bins` of ``lengths`` (each sample's tokens, a
    right-padded row of the batch layout of length ``t``), ``per_cell`` packed rows of ``s`` positions to a run.

    Raises:
      BatchError: when a run needs more than ``per_cell`` rows, or ``micro_batches`` does not divide the runs.
    """
    cells, n = len(bins), len(lengths)
    if cells % micro_batches:
        raise BatchError(f"{cells} runs do not split into {micro_batches} micro-batches")
    span = cells // micro_batches  # runs per micro-batch: the index space of one micro-batch's slices
    c = n // cells
    r = cells * per_cell
    source = np.zeros((r, s), np.int32)
    seg = np.zeros((r, s), np.int32)
    pos = np.zeros((r, s), np.int32)
    row, offset, length = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    for k, cell in enumerate(bins):
        if len(cell) > per_cell:
            raise BatchError(f"run {k} needs {len(cell)} packed rows, more than the {per_cell} planned")
        for j, members in enumerate(cell):
            g = k * per_cell + j  # the packed row, in the whole update
            at = 0
            for segment, i in enumerate(members, start=1):
                i_local = (k % span) * c + i  # the sample's row within its micro-batch
                m = int(lengths[k * c + i])
                source[g, at:at + m] = i_local * t + np.arange(m)
                seg[g, at:at + m] = segment
                pos[g, at:at + m] = np.arange(m)
                row[k * c + i], offset[k * c + i], length[k * c + i] = g % (span * per_cell), at, m
                at += m
    return Packing(source=source, segment_ids=seg, positions=pos, row=row, offset=offset, length=length)


def iteration_plan(lengths: Sequence[np.ndarray], t: int, cells: int, micro_batches: int) -> list[Packing]:
    """The packings of an iteration's updates (``lengths``: each update's samples' token counts, 0 for a row
    left out) into rows as long as the batch's (``t``, a length bucket). Every update gets as many packed rows
    as the fullest run of any update needs, so an iteration runs one program."""
    bins = [cell_bins(np.asarray(n), cells, t) for n in lengths]
    per_cell = max(rows_per_cell(b) for b in bins)
    return [make_packing(np.asarray(n), t, t, b, per_cell, micro_batches) for n, b in zip(lengths, bins)]


def plan(lengths: np.ndarray, t: int, cells: int, micro_batches: int) -> Packing:
    """One update's packing into rows as long as the batch's (``t``, a length bucket)."""
    return iteration_plan([lengths], t, cells, micro_batches)[0]


def pack_tokens(tokens_nt: jax.Array, packing: Packing) -> jax.Array:
    """The packed rows' tokens [R, S] (0 on padding) from the batch layout's [N, T]."""
    return jnp.where(packing.segment_ids != 0, tokens_nt.reshape(-1)[packing.source], 0)


def unpack(x_rs: jax.Array, packing: Packing, t: int) -> jax.Array:
    """Per-token values of the packed rows [R, S] back in the batch layout [N, t]. Position 0 of each sample
    (predicted from the sample before it, if any) and positions past its length are 0, as an unpacked row's
    log-probs are at position 0."""
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
