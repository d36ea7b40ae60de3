"""The rollout engine's data types (sampling settings, prefilled requests, decode states, per-step results),
the counterparts of ``jetstream.engine.engine_api``'s with a log-prob and a policy version per token;
:mod:`dora_jax.rollout.engine` re-exports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from dora_jax.models.decoder import KVCache
from dora_jax.models.paged import Pool
from dora_jax.rollout.pages import bucket
from dora_jax.rollout.sampling import SamplingParams


class EngineError(ValueError):
    """A request or call the engine cannot serve (prompt too long, unknown slot, bad sampling settings)."""


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """Sampling settings of one request. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise EngineError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
            raise EngineError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}")


class PreparedParams(NamedTuple):
    """One policy version's weights in the engine's dtype and the layout decode runs on
    (``Decoder.decode_params(fuse=True)``)."""

    tree: dict


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPrefix:
    """Tokens that many prompts start with (a chat template's fixed head), prefilled once for one policy
    version (:meth:`Engine.prefill_shared_prefix`); :meth:`Engine.prefill_batch` given one prefills only what
    follows it in each prompt."""

    tokens: tuple[int, ...]
    cache: KVCache  # k [L, 1, K, d, n], v [L, 1, K, n, d]: exactly n = len(tokens) slots, no padding
    version: int

    def covers(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` starts with the prefix and has at least one token after it."""
        return continues(self.tokens, prompt)


def continues(prefix: Sequence[int], prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` starts with a non-empty ``prefix`` and has at least one token after it."""
    n = len(prefix)
    return 0 < n < len(prompt) and tuple(int(x) for x in prompt[:n]) == tuple(prefix)


class PrefixBatch(NamedTuple):
    """Several prefilled requests of one policy version (:meth:`Engine.prefill_batch`). Requests with the same
    prompt share one cache row (a GRPO group's members are prefilled once); each has its own first token."""

    cache: KVCache  # k [L, P, K, d, T], v [L, P, K, T, d]: one row per distinct prompt, T = the prompt bucket
    rows: jax.Array  # [N] int32: each request's cache row
    token: jax.Array  # [N] int32
    logprob: jax.Array  # [N] float32
    length: jax.Array  # [N] int32: true prompt length = position of `token`
    sample_id: jax.Array  # [N]
    version: jax.Array  # [N]
    sampling: SamplingParams  # [N] each
    seed: jax.Array  # [N]
    # On the host: (each request's prompt length, its cache row, the SharedPrefix the batch was prefilled after
    # or None): what insert writes, and which head's pages it may share.
    host: tuple | None = None


class DecodeState(NamedTuple):
    """Every slot's next token to feed and its request. ``positions[b]`` is where ``tokens[b]`` sits. The keys
    and values are in the engine's page pool (:attr:`Engine.pool`), not here."""

    tokens: jax.Array  # [B] int32
    positions: jax.Array  # [B] int32
    sample_ids: jax.Array  # [B] int32
    versions: jax.Array  # [B] int32 policy version of each slot
    seeds: jax.Array  # [B] int32
    active: jax.Array  # [B] bool
    sampling: SamplingParams  # [B] each


@dataclasses.dataclass(frozen=True)
class KVRows:
    """Live requests taken out of an engine's decode state with their KV cache (:meth:`Engine.take_rows`), for
    :meth:`Engine.put_rows` of an engine of the same architecture and version, on the same devices or others.

    Row ``i`` has written ``written[i]`` tokens to its cache (the position of its next token to feed, ``token[i]``)
    over ``pages[i]`` whole pages. ``kv`` holds the rows' distinct pages (a pool of M pages in the engine's layout,
    M a power of two, the rest padding): a page rows shared is there once, and ``page_index`` (the rows' pages in
    order, ``pages[0]`` of row 0's first) says where in ``kv`` each row's page is. ``sample_id``, ``seed`` and ``sampling`` are its
    sampling state."""

    written: np.ndarray  # [n] int32
    pages: np.ndarray  # [n] int32
    page_index: np.ndarray  # [sum(pages)] int32
    token: np.ndarray  # [n] int32
    sample_id: np.ndarray  # [n] int32
    version: np.ndarray  # [n] int32
    seed: np.ndarray  # [n] int32
    sampling: SamplingParams  # [n] each, on the host
    kv: Pool
    token_bytes: int  # one token's keys and values over every layer

    @property
    def kv_bytes(self) -> int:
        """Bytes of the rows' distinct pages (padding left out): what moves."""
        distinct = int(self.page_index.max()) + 1 if self.page_index.size else 0
        return distinct * self.kv.page_tokens * self.token_bytes


class SlotResult(NamedTuple):
    token: int
    valid: bool
    position: int
    logprob: float
    version: int


class ResultTokens:
    """One step's results for all slots, packed as int32 [B, 5]: token, valid, position, logprob bits,
    version. Fetch with one copy (:meth:`to_host`), then read slots (:meth:`get_result_at_slot`)."""

    def __init__(self, data: jax.Array | np.ndarray):
        self.data = data

    def to_host(self) -> "ResultTokens":
        return ResultTokens(np.asarray(self.data))

    def get_result_at_slot(self, slot: int) -> SlotResult:
        row = np.asarray(self.data[slot])
        return SlotResult(int(row[0]), bool(row[1]), int(row[2]), float(row[3:4].view(np.float32)[0]), int(row[4]))

    def columns(self) -> dict[str, np.ndarray]:
        d = np.asarray(self.data)
        return {"token": d[:, 0], "valid": d[:, 1].astype(bool), "position": d[:, 2],
                "logprob": np.ascontiguousarray(d[:, 3]).view(np.float32), "version": d[:, 4]}


class ResultSteps:
    """The results of :meth:`Engine.generate_steps`: every slot's token of each of N steps, packed as int32
    [N, B, 5] (the columns of :class:`ResultTokens`) and fetched with one copy (:meth:`to_host`). A slot's valid
    tokens are its first ``counts()[b]`` steps: once a slot stops or uses up its budget it produces no more."""

    def __init__(self, data: jax.Array | np.ndarray, on_read: Any = None, granted: Sequence[np.ndarray] = ()):
        self.data = data
        self._on_read = on_read  # the engine's bookkeeping of what the program wrote, run at the first read
        # Per decode state, int32 [B]: the tokens each slot was allowed to produce, its budget cut to what the
        # page pool could serve.
        self.granted = tuple(granted)

    def _host(self) -> np.ndarray:
        d = np.asarray(self.data)
        if self._on_read is not None:
            on_read, self._on_read = self._on_read, None
            on_read(d)
        return d

    def to_host(self) -> "ResultSteps":
        return ResultSteps(self._host(), granted=self.granted)

    def columns(self) -> dict[str, np.ndarray]:
        """Each column as [N, B]."""
        d = self._host()
        return {"token": d[..., 0], "valid": d[..., 1].astype(bool), "position": d[..., 2],
                "logprob": np.ascontiguousarray(d[..., 3]).view(np.float32), "version": d[..., 4]}

    def counts(self) -> np.ndarray:
        """Tokens each slot produced, [B]."""
        return self._host()[..., 1].sum(axis=0)

    def steps_run(self) -> int:
        """Decode steps the program ran: every step it runs has a slot that produces a token."""
        return int(self._host()[..., 1].any(axis=1).sum())


def stop_table(stop_ids: Sequence[Sequence[int]], minimum: int = 4) -> np.ndarray:
    """Each slot's stop ids as int32 [B, M], padded with -1 (never a token); M a power of two >= ``minimum``,
    so the compiled programs stay few."""
    width = bucket(max((len(s) for s in stop_ids), default=0), minimum=minimum)
    out = np.full((len(stop_ids), width), -1, np.int32)
    rows: dict[tuple[int, ...], list[int]] = {}  # slots share a few lists (the eos ids): one write per list
    for b, ids in enumerate(stop_ids):
        rows.setdefault(tuple(ids), []).append(b)
    for ids, at in rows.items():
        if ids:
            out[at, :len(ids)] = ids
    return out


class RolloutEngine(Protocol):
    """What :class:`~dora_jax.rollout.driver.RolloutDriver` asks of an engine: the rollout
    :class:`~dora_jax.rollout.engine.Engine`, and the simulator's timed engine (:mod:`dora_jax.sim.local`),
    which has no KV cache (``pages_held`` is ``None`` there and every request is admissible)."""

    max_concurrent_decodes: int
    max_prefill_length: int
    max_target_length: int
    settings: Any  # its decode_steps
    mesh: Any
    shards: int  # batch shards the slots split over, each with pages of its own
    shard_pages: int  # pages per shard, its scratch page included
    page_tokens: int
    pages_held: int | None

    def prepare_params(self, params: Any = None) -> Any: ...
    def init_decode_state(self, capacity: int | None = None) -> Any: ...
    def prefill_shared_prefix(self, *, params: Any = None, tokens: Sequence[int], version: int = 0) -> Any: ...
    def prefill_batch(self, *, params: Any = None, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int],
                      version: int = 0, samplings: Sequence[RequestSampling], shared_prefix: Any = None) -> Any: ...
    def insert_batch(self, batch: Any, decode_state: Any, slots: Sequence[int | None],
                     limits: Sequence[int] | None = None) -> Any: ...
    def generate_steps(self, params_seq: Sequence[Any], states_seq: Sequence[Any], *, steps: int,
                       budgets: Sequence[Any], stop_ids: Sequence[Any], final: Sequence[Any] | None = None,
                       end_after: Sequence[int] | None = None, limit: int | None = None,
                       filtered: bool | None = None) -> Any: ...
    def free_slots(self, decode_state: Any, slots: Sequence[int]) -> Any: ...
    def resize(self, decode_state: Any, rows: list[int], capacity: int) -> Any: ...
    def pages_needed(self, limit: int) -> int: ...
    def admissible(self, requests: Sequence[tuple[int, int]]) -> list[int] | None: ...
    def admissible_moved(self, requests: Sequence[tuple[int, int, tuple[int, ...]]],
                         shards: Sequence[int] | None = None) -> list[int] | None: ...
    def shard_pages_available(self, shard: int) -> int: ...
    def row_shard(self, capacity: int, row: int) -> int: ...
    # Moving live requests between engines (an engine without a KV cache moves none).
    def take_rows(self, decode_state: Any, slots: Sequence[int]) -> KVRows: ...
    def written_heads(self, decode_state: Any, slots: Sequence[int],
                      written: Sequence[int]) -> list[tuple[int, ...]]: ...
    def put_rows(self, decode_state: Any, rows: KVRows, slots: Sequence[int], limits: Sequence[int]) -> Any: ...
