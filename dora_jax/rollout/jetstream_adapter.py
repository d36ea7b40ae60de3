"""Optional adapter: the rollout :class:`~dora_jax.rollout.engine.Engine` behind JetStream's engine API.

:func:`as_jetstream_engine` wraps an engine in a subclass of ``jetstream.engine.engine_api.Engine``
(google-jetstream 0.2.2) that keeps that class's contract (``prefill``, ``insert``, one-step ``generate``,
``load_params``, ...). Prefill samples no token: the first ``generate`` after ``insert`` samples it, from the
same ``(seed, sample_id, position)`` stream as the engine's own prefill. ``generate``'s ``ResultTokens.data``
is int32 [slots, 5]: token, valid, tokens generated, then log-prob bits and version (read them with
:func:`logprobs` and :func:`versions`); a slot is invalid when empty or past its cache's end. RL extensions,
keyword-only: ``prefill(..., sample_id=0, version=0, sampling=RequestSampling())``, ``generate(...,
filtered=None)``; the wrapped engine is ``.engine``. Without google-jetstream, :class:`JetStreamUnavailable`.
docs/rollout.md, "JetStream adapter", has the full contract.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from dora_jax.models.decoder import KVCache
from dora_jax.rollout.engine import DecodeState, Engine, EngineError, PrefixBatch, RequestSampling, SharedPrefix
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.sharding import serial_jit

_PACKAGE = "google-jetstream"
_MODULE = "jetstream.engine.engine_api"
_CLASSES: dict[int, tuple[Any, type]] = {}  # one adapter class per imported engine_api module (kept with it)
# Columns of ResultTokens.data.
TOKEN, VALID, LENGTH, LOGPROB, VERSION = range(5)


class JetStreamUnavailable(ImportError):
    """google-jetstream is not importable, so no JetStream engine can be made."""


class Prefix(NamedTuple):
    """A prefilled request: its cache row and the token the first ``generate`` after ``insert`` feeds (at ``length``)."""

    cache: KVCache  # k [L, 1, K, d, S], v [L, 1, K, S, d] (after an existing prefix: its n slots + the bucket)
    token: jax.Array  # [] int32
    logprob: jax.Array  # [] float32
    length: jax.Array  # [] int32: position of `token`
    sample_id: jax.Array
    version: jax.Array
    sampling: SamplingParams  # fields of shape [1]
    seed: jax.Array
    host_length: int | None = None  # the prompt's length on the host: the tokens insert writes
    head: SharedPrefix | None = None  # on the host: the shared prefix the request was prefilled after


class JetStreamDecodeState(NamedTuple):
    """The engine's decode state with what JetStream's results report per slot."""

    engine: DecodeState
    starts: jax.Array  # [B] int32: position of each slot's first generated token
    lengths: jax.Array  # [B] int32: tokens each slot has generated


def logprobs(result: Any) -> np.ndarray:
    """Each slot's log-prob of its token in a ``ResultTokens`` of the adapter, float32 [slots]."""
    return np.ascontiguousarray(np.asarray(result.data)[:, LOGPROB]).view(np.float32)


def versions(result: Any) -> np.ndarray:
    """Each slot's policy version in a ``ResultTokens`` of the adapter, int32 [slots]."""
    return np.asarray(result.data)[:, VERSION]


def _engine_api():
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise JetStreamUnavailable(
            f"the JetStream adapter needs the optional package {_PACKAGE!r} (module {_MODULE!r}), which could not "
            f"be imported ({e}). Install it with `pip install {_PACKAGE}`, or use dora_jax.rollout.engine.Engine "
            "directly: it has the same calls without JetStream.") from e


def _rewind(prefix: Prefix, last_token) -> Prefix:
    """The prefix with its last prompt token to feed (at its own position) instead of a sampled first token."""
    return prefix._replace(token=last_token.astype(prefix.token.dtype), logprob=jnp.zeros_like(prefix.logprob),
                           length=prefix.length - 1)


class _AdapterMethods:
    """The adapter's methods, put before JetStream's ``Engine`` in a subclass by :func:`_make_class` (which
    imports google-jetstream)."""

    _result_tokens: type

    def __init__(self, engine: Engine, tokenizer: Any = None, tokenizer_params: Any = None):
        self.engine = engine
        self._tokenizer = tokenizer
        self._tokenizer_params = tokenizer_params
        self._rewind_jit = serial_jit(_rewind)
        self._start_jit = serial_jit(self._start_impl, donate_argnums=(0, 1))
        self._lengths_jit = serial_jit(self._lengths_impl, donate_argnums=(0,))

    # -- pure implementations --------------------------------------------------------------------------------

    @staticmethod
    def _start_impl(starts, lengths, slot, length):
        return starts.at[slot].set(length + 1), lengths.at[slot].set(0)

    def _lengths_impl(self, lengths, starts, packed):
        packed = packed[0]  # the one step of the engine's [steps, B, 5] results
        active = packed[:, 1] == 1
        lengths = lengths + active.astype(jnp.int32)
        # The token of this step sits at position starts + lengths - 1; the cache holds positions up to
        # max_target_length - 1, and a step past them (the engine holds the row there) reports nothing.
        valid = active & (starts + lengths <= self.engine.max_target_length)
        data = jnp.stack([packed[:, 0], valid.astype(jnp.int32), lengths, packed[:, 3], packed[:, 4]], axis=-1)
        return lengths, data

    # -- computation -----------------------------------------------------------------------------------------

    def prefill(self, *, params: Any, existing_prefix: SharedPrefix | None = None, padded_tokens: Any,
                true_length: int, sample_id: int = 0, version: int = 0,
                sampling: RequestSampling = RequestSampling()) -> Prefix:
        """The engine's ``prefill_batch`` of one request (after ``existing_prefix``, a shared prefix of this version,
        when given), rewound to feed its last prompt token."""
        padded = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 0 < true_length <= padded.shape[0]:
            raise EngineError(f"true_length {true_length} must be in [1, {padded.shape[0]}] (the padded length)")
        if existing_prefix is not None and not isinstance(existing_prefix, SharedPrefix):
            raise EngineError(f"existing_prefix must be a SharedPrefix (Engine.prefill_shared_prefix), got "
                              f"{type(existing_prefix).__name__}")
        head = () if existing_prefix is None else existing_prefix.tokens
        batch, _ = self.engine.prefill_batch(params=params, prompts=[head + tuple(padded[:true_length].tolist())],
                                             sample_ids=[sample_id], version=version, samplings=[sampling],
                                             shared_prefix=existing_prefix)
        row = jax.tree.map(lambda x: x[0], (batch.token, batch.logprob, batch.length, batch.sample_id,
                                            batch.version, batch.seed))
        prefix = Prefix(batch.cache, *row[:5], SamplingParams(*(x[:1] for x in batch.sampling)), row[5])
        return self._rewind_jit(prefix, padded[true_length - 1])._replace(host_length=int(batch.host[0][0]),
                                                                          head=existing_prefix)

    def insert(self, prefix: Prefix, decode_state: JetStreamDecodeState, slot: int) -> JetStreamDecodeState:
        b = decode_state.starts.shape[0]
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < b):
            raise EngineError(f"slot {slot!r} does not exist (decode state has slots 0..{b - 1})")
        if prefix.host_length is None:
            raise EngineError("insert: the prefix has no host length; pass what prefill returned")
        # The engine writes the prompt into the slot's pages; the adapter keeps where its tokens start.
        batch = PrefixBatch(prefix.cache, np.zeros((1,), np.int32),
                            *(jnp.reshape(x, (1,)) for x in (prefix.token, prefix.logprob, prefix.length,
                                                              prefix.sample_id, prefix.version)),
                            prefix.sampling, jnp.reshape(prefix.seed, (1,)),
                            (np.array([prefix.host_length], np.int32), np.zeros((1,), np.int32), prefix.head))
        state = self.engine.insert_batch(batch, decode_state.engine, [int(slot)])
        starts, lengths = self._start_jit(decode_state.starts, decode_state.lengths, np.int32(slot),
                                          prefix.length)
        return JetStreamDecodeState(state, starts, lengths)

    def generate(self, params: Any, decode_state: JetStreamDecodeState, *, filtered: bool | None = None
                 ) -> tuple[JetStreamDecodeState, Any]:
        """One decode step of every slot: the engine's ``generate_steps`` of one step, no stop ids."""
        b = decode_state.starts.shape[0]
        (state,), result = self.engine.generate_steps([params], [decode_state.engine], steps=1,
                                                      budgets=[np.ones((b,), np.int32)],
                                                      stop_ids=[np.full((b, 4), -1, np.int32)], filtered=filtered)
        lengths, data = self._lengths_jit(decode_state.lengths, decode_state.starts, result.data)
        state = JetStreamDecodeState(state, decode_state.starts, lengths)
        return state, self._result_tokens(data=data, tokens_idx=(TOKEN, TOKEN + 1),
                                          valid_idx=(VALID, VALID + 1), length_idx=(LENGTH, LENGTH + 1),
                                          samples_per_slot=1)

    def load_params(self, params: Any = None) -> Any:
        return self.engine.prepare_params(params)

    def init_decode_state(self, capacity: int | None = None) -> JetStreamDecodeState:
        state = self.engine.init_decode_state(capacity)
        b = state.tokens.shape[0]
        return JetStreamDecodeState(state, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))

    def get_prefix_destination_sharding(self) -> Any:
        """Where a prefix goes for :meth:`insert`: every leaf replicated over the engine's mesh (one device without
        one), in the structure of :class:`Prefix`."""
        s = NamedSharding(self.mesh, PartitionSpec())
        if self.engine.mesh is None:
            s = SingleDeviceSharding(self.mesh.devices.flat[0])
        return Prefix(KVCache(s, s), s, s, s, s, s, SamplingParams(s, s, s), s, s)

    # -- tokenizer ---------------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self._tokenizer_params

    def build_tokenizer(self, metadata: Any) -> Any:
        if self._tokenizer is None:
            raise EngineError("build_tokenizer: no tokenizer was given to as_jetstream_engine")
        return self._tokenizer

    # -- capacity ----------------------------------------------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> Mesh:
        if self.engine.mesh is not None:
            return self.engine.mesh
        device = next(iter(jax.tree.leaves(self.engine.params)[0].devices()))
        return Mesh(np.array([device]), ("data",))

    @property
    def colocated_cpus(self) -> None:
        return None


def _make_class(engine_api) -> type:
    class DoraJetStreamEngine(_AdapterMethods, engine_api.Engine):
        """A dora_jax rollout engine behind JetStream's abstract ``Engine`` interface."""

        _result_tokens = engine_api.ResultTokens

    return DoraJetStreamEngine


def jetstream_engine_class() -> type:
    """The adapter class, a subclass of ``jetstream.engine.engine_api.Engine``.

    Raises:
      JetStreamUnavailable: google-jetstream is not importable.
    """
    api = _engine_api()
    known = _CLASSES.get(id(api))
    if known is None or known[0] is not api:  # an id may be reused once its module is gone
        _CLASSES[id(api)] = known = (api, _make_class(api))
    return known[1]


def as_jetstream_engine(engine: Engine, *, tokenizer: Any = None, tokenizer_params: Any = None) -> Any:
    """Wraps ``engine`` as a JetStream engine (an instance of :func:`jetstream_engine_class`).

    ``tokenizer`` is returned by ``build_tokenizer`` (JetStream's detokenizing loop uses it), ``tokenizer_params``
    by ``get_tokenizer`` (a ``tokenizer_pb2.TokenizerParameters``).

    Raises:
      JetStreamUnavailable: google-jetstream is not importable.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"as_jetstream_engine: expected a dora_jax.rollout.engine.Engine, got {type(engine).__name__}")
    return jetstream_engine_class()(engine, tokenizer=tokenizer, tokenizer_params=tokenizer_params)
