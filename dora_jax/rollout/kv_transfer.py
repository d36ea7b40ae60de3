"""Live requests moved between engines with their KV cache: DORA's request migration between rollout groups
(docs/design.md, "Load balancing").

:func:`take_rows` gathers what the requests of some slots have written (their pages' contents) and their decode
rows; :func:`put_rows` places them in another engine of the same architecture and version, on the same devices or
others, where they go on decoding without a prefill. :class:`~dora_jax.rollout.engine.Engine` exposes both as
methods, the calls :class:`~dora_jax.rollout.driver.RolloutDriver` makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np

from dora_jax.rollout.engine_api import DecodeState, EngineError, KVRows, PrefixBatch
from dora_jax.rollout.pages import PageError, bucket, pages_for
from dora_jax.rollout.programs import page_copy_programs
from dora_jax.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from dora_jax.rollout.engine import Engine


def take_rows(engine: Engine, decode_state: DecodeState, slots: Sequence[int]) -> KVRows:
    """Takes the live requests of ``slots`` out of ``decode_state``: their decode rows and the contents of the
    pages holding what they have written, gathered in one program (on ``engine``'s devices), for :func:`put_rows`
    of another engine. A page several of the rows share (a group's prompt, a template head) is gathered once. The
    slots are then empty and their pages back in the pool (a page shared with a request left behind stays with
    it).

    Raises:
      EngineError: an empty slot, or a slot a dispatched program still computes (read its results first).
    """
    rec, b = engine.rows_of(decode_state), decode_state.tokens.shape[0]
    refs = [int(rec.ids[s]) if 0 <= s < b else 0 for s in slots]
    if not all(refs):
        raise EngineError(f"take_rows: slots {list(slots)} of a decode state of {b} include an empty one")
    host = jax.tree.map(lambda x: np.asarray(x)[np.asarray(slots, np.intp)], decode_state)
    written = host.positions.astype(np.int32)
    if (engine.book.dispatched(refs) != written).any():
        raise EngineError(f"take_rows: slots {list(slots)}: a dispatched program still computes a row; read its "
                          "results first")
    pages = np.array([pages_for(int(w), engine.page_tokens) for w in written], np.int32)
    src = [_pool_ids(engine, engine.row_shard(b, s), engine.book.table(ref)[:n])
           for s, ref, n in zip(slots, refs, pages)]
    unique: dict[int, int] = {}  # pool page -> its place among the gathered pages
    page_index = np.array([unique.setdefault(p, len(unique)) for ids in src for p in ids], np.int32)
    gather, _ = page_copy_programs(engine.programs)
    kv = gather(engine.pool, _padded([list(unique)]))
    engine.free_slots(decode_state, slots)
    return KVRows(written, pages, page_index, host.tokens, host.sample_ids, host.versions, host.seeds, host.sampling,
                  kv, engine.token_bytes)


def put_rows(engine: Engine, decode_state: DecodeState, rows: KVRows, slots: Sequence[int],
             limits: Sequence[int]) -> DecodeState:
    """Places row ``i`` of ``rows`` (:func:`take_rows` of an engine of this architecture, serving the same
    version) into ``slots[i]`` of the decode state (donated), growing to ``limits[i]`` tokens: each takes pages
    for what it has written, the pages' contents are copied onto ``engine``'s pool (device to device), and its
    decode row is set; nothing is prefilled. Rows that shared their first pages where they were taken share them
    again where they land in one batch shard (those pages are written once). What a slot held before ends.

    Raises:
      EngineError: a bad slot, or a pool without room for them all now (nothing is placed then; ask
        ``engine.admissible_moved`` with (written tokens, limit, head) per row first).
    """
    b, n = decode_state.tokens.shape[0], len(rows.written)
    if len(slots) != n or len(limits) != n or n > engine.request_rows:
        raise EngineError(f"put_rows: {n} rows for {len(slots)} slots and {len(limits)} limits (at most "
                          f"{engine.request_rows})")
    if not all(0 <= s < b for s in slots) or len(set(slots)) != n:
        raise EngineError(f"put_rows: slots {list(slots)} of a decode state of {b} slots")
    rec = engine.rows_of(decode_state)
    for slot in slots:
        engine.records.release(rec, slot)
    index = np.split(rows.page_index, np.cumsum(rows.pages)[:-1])  # each row's pages among the gathered ones
    heads = [ix[:int(w) // engine.page_tokens].tolist() for ix, w in zip(index, rows.written)]
    shards = [engine.row_shard(b, s) for s in slots]
    done: list[int] = []
    dst: list[int] = []
    src: list[int] = []
    try:
        for i, (slot, written, limit) in enumerate(zip(slots, rows.written.tolist(), limits)):
            fork, shared = best_fork(heads, shards, i)
            rec.ids[slot] = engine.book.admit(shards[i], written, int(limit),
                                              fork=None if fork is None else int(rec.ids[slots[fork]]),
                                              fork_tokens=shared * engine.page_tokens)
            done.append(slot)
            dst += _pool_ids(engine, shards[i], engine.book.table(int(rec.ids[slot]))[shared:])
            src += index[i][shared:].tolist()
    except PageError as e:
        for slot in done[::-1]:
            engine.records.release(rec, slot)
        raise EngineError(f"put_rows: {e}") from None
    shardings = (type(rows.kv)(*(x.sharding for x in engine.pool)) if engine.mesh is None
                 else engine.programs.pool_layout(rows.kv))
    _, scatter = page_copy_programs(engine.programs)
    engine.pool = scatter(engine.pool, _padded([dst]), jax.device_put(rows.kv, shardings), _padded([src]))
    return _set_rows(engine, decode_state, rows, slots)


def written_heads(engine: Engine, decode_state: DecodeState, slots: Sequence[int], written: Sequence[int]
                  ) -> list[tuple[int, ...]]:
    """Pool-wide ids of the full pages each of ``slots`` has written (``written`` tokens each): the pages
    :func:`put_rows` compares to share them again where the rows land (``Engine.admissible_moved`` takes
    them)."""
    rec, b, p = engine.rows_of(decode_state), decode_state.tokens.shape[0], engine.page_tokens
    return [tuple(_pool_ids(engine, engine.row_shard(b, s), engine.book.table(int(rec.ids[s]))[:int(w) // p]))
            for s, w in zip(slots, written)]


def best_fork(heads: Sequence[Sequence[int]], shards: Sequence[int], i: int) -> tuple[int | None, int]:
    """The earlier row that row ``i`` shares its first pages with where it lands (one of the same batch shard whose
    ``heads``, the full pages each row has written, start alike), and how many: ``(None, 0)`` if none."""
    best, most = None, 0
    for j in range(i):
        if shards[j] != shards[i]:
            continue
        n = min(len(heads[i]), len(heads[j]))
        k = next((m for m in range(n) if heads[i][m] != heads[j][m]), n)
        if k > most:
            best, most = j, k
    return best, most


def _set_rows(engine: Engine, decode_state: DecodeState, rows: KVRows, slots: Sequence[int]) -> DecodeState:
    """Sets the decode rows of ``rows`` at ``slots`` with the insertion's program (padded to its rows)."""
    nb, n = engine.request_rows, len(rows.written)

    def col(values, dtype, pad=0):
        out = np.full((nb,), pad, dtype)
        out[:n] = values
        return out

    sp = SamplingParams(col(rows.sampling.temperature, np.float32), col(rows.sampling.top_k, np.int32),
                        col(rows.sampling.top_p, np.float32, 1.0))
    batch = PrefixBatch(None, col(0, np.int32), col(rows.token, np.int32), col(0.0, np.float32),
                        col(rows.written, np.int32), col(rows.sample_id, np.int32), col(rows.version, np.int32),
                        sp, col(rows.seed, np.int32))
    idx = col(slots, np.int32, decode_state.tokens.shape[0])
    return engine.records.handoff(decode_state, engine.fns["set_slots"](batch, decode_state, idx))


def _pool_ids(engine: Engine, shard: int, pages: list[int]) -> list[int]:
    """Pool-wide ids of a shard's pages (the book's ids within the shard, past its scratch page)."""
    return [shard * engine.shard_pages + p + 1 for p in pages]


def _padded(groups: list[list[int]], size: int | None = None) -> np.ndarray:
    """The pages of ``groups`` in order, padded with the scratch page to ``size`` (default: a power of two)."""
    ids = [p for g in groups for p in g]
    out = np.zeros((bucket(len(ids), minimum=1) if size is None else size,), np.int32)
    out[:len(ids)] = ids
    return out
