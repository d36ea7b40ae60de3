"""Optional adapter: the rollout :class:`~dora_jax.rollout.engine.Engine` as a JetStream engine.

When google-jetstream is installed, :func:`as_jetstream_engine` wraps an engine in a subclass of
``jetstream.engine.engine_api.Engine`` (the 0.2.2 abstract API), so JetStream's orchestrator and tools can
drive it. dora_jax never needs JetStream: its engine implements the same calls natively, and JetStream pulls
TensorFlow, so it stays an optional extra. Without it, :func:`as_jetstream_engine` raises
:class:`JetStreamUnavailable` naming the missing package.

Mapping: ``prefill`` / ``insert`` / ``generate`` / ``init_decode_state`` and the capacity properties delegate
one to one; ``load_params`` is :meth:`Engine.prepare_params` (weights in decode layout, once per version);
``samples_per_slot`` is 1; ``colocated_cpus`` is ``None``; ``get_prefix_destination_sharding`` gives the
sharding of every leaf of a prefix. The RL extensions (``sample_id``, ``version``, ``sampling`` keywords of
``prefill``, ``filtered`` of ``generate``) pass through; other attributes fall through to the wrapped engine.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from dora_jax.rollout.engine import Engine, EngineError
from dora_jax.rollout.sampling import SamplingParams

_PACKAGE = "google-jetstream"
_MODULE = "jetstream.engine.engine_api"
_CLASSES: dict[int, type] = {}  # one adapter class per imported engine_api module


class JetStreamUnavailable(ImportError):
    """google-jetstream is not importable, so no JetStream engine can be made."""


def _engine_api():
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise JetStreamUnavailable(
            f"the JetStream adapter needs the optional package {_PACKAGE!r} (module {_MODULE!r}), which could not "
            f"be imported ({e}). Install it with `pip install {_PACKAGE}`, or use dora_jax.rollout.engine.Engine "
            "directly: it has the same calls without JetStream.") from e


def _make_class(engine_api) -> type:
    class DoraJetStreamEngine(engine_api.Engine):
        """A dora_jax rollout engine behind JetStream's abstract ``Engine`` interface."""

        def __init__(self, engine: Engine, tokenizer: Any = None, tokenizer_params: Any = None):
            self.engine = engine
            self._tokenizer = tokenizer
            self._tokenizer_params = tokenizer_params

        # -- computation -------------------------------------------------------------------------------------

        def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens: Any, true_length: int,
                    sampler: Any = None, **extensions: Any):
            if sampler is not None:
                raise EngineError("prefill: custom `sampler` callables are not supported; pass per-request "
                                  "settings as sampling=RequestSampling(...)")
            return self.engine.prefill(params=params, existing_prefix=existing_prefix, padded_tokens=padded_tokens,
                                       true_length=true_length, **extensions)

        def insert(self, prefix: Any, decode_state: Any, slot: int):
            return self.engine.insert(prefix, decode_state, slot)

        def generate(self, params: Any, decode_state: Any, sampler: Any = None, **extensions: Any):
            if sampler is not None:
                raise EngineError("generate: custom `sampler` callables are not supported; sampling settings "
                                  "live in each slot (set at prefill)")
            return self.engine.generate(params, decode_state, **extensions)

        def free_resource(self, slot: int) -> Any:
            return None  # a contiguous cache: a finished slot is simply overwritten by the next insert

        def load_params(self, params: Any = None, *args: Any, **kwargs: Any):
            return self.engine.prepare_params(self.engine.params if params is None else params)

        def init_decode_state(self, *args: Any, **kwargs: Any):
            return self.engine.init_decode_state(*args, **kwargs)

        def get_prefix_destination_sharding(self) -> Any:
            mesh = self.engine.mesh
            sharding = (NamedSharding(mesh, PartitionSpec()) if mesh is not None
                        else SingleDeviceSharding(jax.devices()[0]))
            eng = self.engine
            params = jax.eval_shape(lambda: eng.prepare_params(eng.params))
            i32 = jax.ShapeDtypeStruct((), np.int32)
            shapes = jax.eval_shape(eng._prefill_impl, params, jax.ShapeDtypeStruct((16,), np.int32), i32, i32, i32,
                                    i32, SamplingParams.make(1))[0]  # (prefix, first result): the prefix
            return jax.tree.map(lambda _: sharding, shapes)

        # -- tokenizer -----------------------------------------------------------------------------------------

        def get_tokenizer(self) -> Any:
            if self._tokenizer_params is None:
                raise EngineError("get_tokenizer: no tokenizer_params were given to as_jetstream_engine")
            return self._tokenizer_params

        def build_tokenizer(self, metadata: Any) -> Any:
            if self._tokenizer is None:
                raise EngineError("build_tokenizer: no tokenizer was given to as_jetstream_engine")
            return self._tokenizer

        # -- capacity ------------------------------------------------------------------------------------------

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
        def mesh(self) -> Any:
            return self.engine.mesh

        @property
        def colocated_cpus(self) -> Any:
            return None

        def __getattr__(self, name: str) -> Any:
            # Only reached for names the adapter lacks: the engine's extensions (resize, free_slot, ...).
            if name == "engine":
                raise AttributeError(name)
            return getattr(self.engine, name)

    return DoraJetStreamEngine


def jetstream_engine_class() -> type:
    """The adapter class, a subclass of ``jetstream.engine.engine_api.Engine``.

    Raises:
      JetStreamUnavailable: google-jetstream is not installed.
    """
    api = _engine_api()
    if id(api) not in _CLASSES:
        _CLASSES[id(api)] = _make_class(api)
    return _CLASSES[id(api)]


def as_jetstream_engine(engine: Engine, *, tokenizer: Any = None, tokenizer_params: Any = None) -> Any:
    """Wraps ``engine`` as a JetStream engine.

    Args:
      engine: the rollout engine to serve.
      tokenizer: returned by ``build_tokenizer`` (JetStream's detokenizing loop uses it).
      tokenizer_params: returned by ``get_tokenizer`` (a ``tokenizer_pb2.TokenizerParameters``).

    Returns:
      An instance of :func:`jetstream_engine_class`.

    Raises:
      JetStreamUnavailable: google-jetstream is not installed.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"as_jetstream_engine: expected a dora_jax.rollout.engine.Engine, got {type(engine).__name__}")
    return jetstream_engine_class()(engine, tokenizer=tokenizer, tokenizer_params=tokenizer_params)
