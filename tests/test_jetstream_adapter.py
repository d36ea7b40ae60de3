"""The optional JetStream adapter, against a stand-in ``jetstream.engine.engine_api`` with JetStream 0.2.2's
abstract ``Engine`` (google-jetstream itself pulls TensorFlow and is not a dependency)."""

import abc
import sys
import types

import jax
import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.models.build import init_model
from dora_jax.rollout import jetstream_adapter
from dora_jax.rollout.engine import Engine, EngineError, PreparedParams, RequestSampling

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, init_std=0.3)


def _stand_in_engine_api() -> types.ModuleType:
    """JetStream 0.2.2's abstract Engine: the abstract methods and properties an implementation must define."""

    class Engine(abc.ABC):
        @abc.abstractmethod
        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length): ...

        @abc.abstractmethod
        def generate(self, params, decode_state): ...

        @abc.abstractmethod
        def insert(self, prefix, decode_state, slot): ...

        def free_resource(self, slot):
            return None

        @abc.abstractmethod
        def load_params(self, *args, **kwargs): ...

        @abc.abstractmethod
        def get_prefix_destination_sharding(self): ...

        @abc.abstractmethod
        def get_tokenizer(self): ...

        def build_tokenizer(self, metadata):
            raise NotImplementedError

        @abc.abstractmethod
        def init_decode_state(self, *args, **kwargs): ...

        @property
        @abc.abstractmethod
        def max_concurrent_decodes(self): ...

        @property
        @abc.abstractmethod
        def samples_per_slot(self): ...

        @property
        @abc.abstractmethod
        def max_prefill_length(self): ...

        @property
        @abc.abstractmethod
        def mesh(self): ...

        @property
        @abc.abstractmethod
        def colocated_cpus(self): ...

    api = types.ModuleType("jetstream.engine.engine_api")
    api.Engine = Engine
    return api


@pytest.fixture
def jetstream(monkeypatch):
    api = _stand_in_engine_api()
    pkg, sub = types.ModuleType("jetstream"), types.ModuleType("jetstream.engine")
    pkg.engine, sub.engine_api = sub, api
    for name, mod in (("jetstream", pkg), ("jetstream.engine", sub), ("jetstream.engine.engine_api", api)):
        monkeypatch.setitem(sys.modules, name, mod)
    return api


@pytest.fixture(scope="module")
def engine():
    return Engine(init_model(CFG, seed=0), max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)


def _greedy_run(eng, params, steps=4):
    state = eng.init_decode_state()
    prefix, first = eng.prefill(params=params, padded_tokens=np.array([3, 9, 4, 0]), true_length=3,
                                sampling=RequestSampling(temperature=0.0))
    state = eng.insert(prefix, state, 1)
    tokens = [first.to_host().get_result_at_slot(0).token]
    for _ in range(steps):
        state, res = eng.generate(params, state)
        tokens.append(res.to_host().get_result_at_slot(1).token)
    return tokens


def test_subclass_is_instantiable_and_delegates(jetstream, engine):
    js = jetstream_adapter.as_jetstream_engine(engine, tokenizer="tok", tokenizer_params="meta")
    assert isinstance(js, jetstream.Engine)
    assert not getattr(type(js), "__abstractmethods__", None)
    assert (js.max_concurrent_decodes, js.max_prefill_length, js.samples_per_slot) == (2, 16, 1)
    assert js.mesh is None and js.colocated_cpus is None and js.free_resource(0) is None
    assert js.get_tokenizer() == "meta" and js.build_tokenizer("meta") == "tok"
    params = js.load_params()
    assert isinstance(params, PreparedParams)
    # The JetStream-driven loop gives exactly the tokens the bare engine gives.
    assert _greedy_run(js, params) == _greedy_run(engine, engine.prepare_params(engine.params))
    # Extensions fall through to the engine.
    assert js.free_slot.__self__ is engine and js.resize.__self__ is engine
    shardings = js.get_prefix_destination_sharding()
    assert all(isinstance(s, jax.sharding.Sharding) for s in jax.tree.leaves(shardings))
    with pytest.raises(EngineError, match="custom `sampler`"):
        js.generate(params, js.init_decode_state(), sampler=lambda x: x)


def test_missing_package_error_names_it(monkeypatch, engine):
    monkeypatch.setitem(sys.modules, "jetstream", None)  # import of jetstream fails as if not installed
    monkeypatch.setitem(sys.modules, "jetstream.engine", None)
    monkeypatch.setitem(sys.modules, "jetstream.engine.engine_api", None)
    with pytest.raises(jetstream_adapter.JetStreamUnavailable, match="google-jetstream"):
        jetstream_adapter.as_jetstream_engine(engine)
    with pytest.raises(ImportError, match="pip install google-jetstream"):
        jetstream_adapter.jetstream_engine_class()
