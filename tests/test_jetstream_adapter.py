"""The JetStream adapter against JetStream's own ``engine_api`` module.

``tests/vendor/jetstream/engine/engine_api.py`` is that file from google-jetstream 0.2.2, unchanged (its
Apache-2.0 header kept; its hash is the one the 0.2.2 wheel's RECORD lists). The package itself is not
installed: ``engine_api`` imports ``jetstream.engine.token_utils``, which imports seqio and with it TensorFlow,
and ``tokenizer_pb2``, which needs protobuf. The two are stood in for here: ``engine_api`` uses
``tokenizer_pb2.TokenizerParameters`` in annotations only, and ``token_utils`` in the default
``build_tokenizer``, which the adapter replaces.
"""

import base64
import hashlib
import importlib.util
import inspect
import os
import sys
import types

import chex
import jax
import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.models.build import init_model
from dora_jax.rollout import jetstream_adapter
from dora_jax.rollout.engine import Engine, EngineError, PreparedParams, RequestSampling
from dora_jax.rollout.jetstream_adapter import Prefix
from engine_helpers import prefill_one, step_once

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, init_std=0.3)
ENGINE_API = os.path.join(os.path.dirname(__file__), "vendor", "jetstream", "engine", "engine_api.py")
ENGINE_API_SHA256 = "L--4Ey76fIQzajamntxeiOwq4SmnIgmOlbFTBPtnQus"  # google_jetstream-0.2.2.dist-info/RECORD
PROMPT = [3, 9, 4]


@pytest.fixture
def api(monkeypatch):
    """JetStream 0.2.2's ``jetstream.engine.engine_api``, imported from the vendored file."""
    pkg, sub = types.ModuleType("jetstream"), types.ModuleType("jetstream.engine")
    pkg.__path__, sub.__path__ = [], []
    pb2 = types.ModuleType("jetstream.engine.tokenizer_pb2")
    pb2.TokenizerParameters = type("TokenizerParameters", (), {})
    token_utils = types.ModuleType("jetstream.engine.token_utils")
    pkg.engine, sub.tokenizer_pb2, sub.token_utils = sub, pb2, token_utils
    for mod in (pkg, sub, pb2, token_utils):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    spec = importlib.util.spec_from_file_location("jetstream.engine.engine_api", ENGINE_API)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    sub.engine_api = module
    return module


@pytest.fixture(scope="module")
def engine():
    return Engine(init_model(CFG, seed=0), max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)


def test_the_vendored_engine_api_is_jetstream_0_2_2s():
    with open(ENGINE_API, "rb") as f:
        digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
    assert digest == ENGINE_API_SHA256


def _accepts_every_call(impl, abstract) -> None:
    """``impl`` takes every call the abstract method's signature allows: the same positional parameters in
    order, the same keyword-only ones, no default dropped; its own additions optional. What JetStream passes
    through ``*args`` / ``**kwargs`` (nothing, in its orchestrator) is the implementation's to define."""
    a, i = inspect.signature(abstract).parameters, inspect.signature(impl).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [p for p in a.values() if p.kind not in variadic]
    positional = [p.name for p in named if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in i.values() if p.kind not in variadic and
            p.kind != inspect.Parameter.KEYWORD_ONLY][:len(positional)] == positional, impl
    for p in named:
        q = i[p.name]
        assert q.kind == p.kind, (impl, p.name)
        assert p.default is inspect.Parameter.empty or q.default == p.default, (impl, p.name)
    for q in i.values():
        if q.name not in a and q.kind not in variadic:
            assert q.default is not inspect.Parameter.empty, (impl, q.name)


def test_the_adapter_satisfies_the_abstract_engine(api, engine):
    cls = jetstream_adapter.jetstream_engine_class()
    assert issubclass(cls, api.Engine) and not cls.__abstractmethods__
    for name in sorted(api.Engine.__abstractmethods__ | {"build_tokenizer"}):
        abstract, impl = inspect.getattr_static(api.Engine, name), inspect.getattr_static(cls, name)
        if isinstance(abstract, property):
            assert isinstance(impl, property), name
        else:
            assert impl is not abstract, name
            _accepts_every_call(impl, abstract)
    js = jetstream_adapter.as_jetstream_engine(engine, tokenizer="tok", tokenizer_params="meta")
    assert (js.max_concurrent_decodes, js.max_prefill_length, js.samples_per_slot) == (2, 16, 1)
    assert isinstance(js.mesh, jax.sharding.Mesh) and js.colocated_cpus is None
    assert js.get_tokenizer() == "meta" and js.build_tokenizer("meta") == "tok"
    assert isinstance(js.load_params(), PreparedParams)


def _engine_tokens(eng: Engine, params, sampling: RequestSampling, steps: int):
    """The bare engine: the first token from prefill, then one per one-step program."""
    batch, first = prefill_one(eng, PROMPT, params=params, sample_id=5, version=2, sampling=sampling)
    state = eng.insert_batch(batch, eng.init_decode_state(), [1])
    rows = [(int(first["token"]), float(first["logprob"]), int(first["position"]))]
    for _ in range(steps - 1):
        state, cols = step_once(eng, params, state)
        rows.append((int(cols["token"][1]), float(cols["logprob"][1]), int(cols["position"][1])))
    return [r[0] for r in rows], np.array([r[1] for r in rows]), [r[2] for r in rows]


@pytest.mark.parametrize("sampling", [RequestSampling(temperature=0.0), RequestSampling(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_prefill_insert_generate_gives_the_engines_tokens(api, engine, sampling):
    """JetStream's loop (prefill -> device_put -> insert -> generate, one step per call, results read with one
    host copy) gives the tokens and log-probs the engine gives on its own: the first one from the first
    generate, drawn from the same stream."""
    steps = 6
    js = jetstream_adapter.as_jetstream_engine(engine)
    params = js.load_params()
    want_tokens, want_logprobs, positions = _engine_tokens(engine, params, sampling, steps)
    assert positions == list(range(3, 3 + steps))
    prefix = js.prefill(params=params, padded_tokens=np.array(PROMPT + [0]), true_length=3, sample_id=5, version=2,
                        sampling=sampling)
    assert isinstance(prefix, Prefix)
    chex.assert_trees_all_equal_structs(prefix, js.get_prefix_destination_sharding())
    prefix = jax.device_put(prefix, js.get_prefix_destination_sharding())  # the orchestrator's transfer
    state = js.insert(prefix, js.init_decode_state(), 1)
    tokens, lps = [], []
    for step in range(steps):
        state, result = js.generate(params, state)
        assert isinstance(result, api.ResultTokens)
        result.copy_to_host_async()
        host = result.convert_to_numpy()
        assert isinstance(host, api.ResultTokens) and isinstance(host.data, np.ndarray)
        assert (host.tokens_idx, host.valid_idx, host.length_idx, host.samples_per_slot) == ((0, 1), (1, 2), (2, 3), 1)
        chex.assert_shape(host.data, (2, 5))
        slot, empty = host.get_result_at_slot(1), host.get_result_at_slot(0)
        assert isinstance(slot, api.SlotData)
        chex.assert_shape([slot.tokens, slot.valid], (1, 1))
        chex.assert_shape(slot.lengths, (1,))
        assert slot.valid[0, 0] == 1 and slot.lengths[0] == step + 1 and empty.valid[0, 0] == 0
        assert jetstream_adapter.versions(host)[1] == 2
        tokens.append(int(slot.tokens[0, 0]))
        lps.append(jetstream_adapter.logprobs(host)[1])
    assert tokens == want_tokens
    np.testing.assert_allclose(lps, want_logprobs, rtol=1e-4, atol=1e-5)


def test_a_prefix_moves_onto_the_engines_mesh(api, engine):
    """With a mesh, the prefix goes to every device of it (replicated) and decoding goes on there."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    js = jetstream_adapter.as_jetstream_engine(Engine(init_model(CFG, seed=0), max_concurrent_decodes=2,
                                                      max_prefill_length=16, max_target_length=32, mesh=mesh))
    assert js.mesh is mesh
    params = js.load_params()
    prefix = js.prefill(params=params, padded_tokens=np.array(PROMPT), true_length=3,
                        sampling=RequestSampling(temperature=0.0))
    prefix = jax.device_put(prefix, js.get_prefix_destination_sharding())
    assert all(x.sharding.device_set == set(mesh.devices.flat) for x in jax.tree.leaves(prefix))
    state = js.insert(prefix, js.init_decode_state(), 0)
    tokens = []
    for _ in range(3):
        state, result = js.generate(params, state)
        tokens.append(int(result.convert_to_numpy().get_result_at_slot(0).tokens[0, 0]))
    assert tokens == _engine_tokens(engine, engine.prepare_params(engine.params), RequestSampling(temperature=0.0),
                                    3)[0]


def test_a_full_cache_ends_the_slot(api, engine):
    """A slot's tokens are valid while they fit its cache (positions up to max_target_length - 1); the step
    after reports the slot invalid, which ends it in JetStream's loop."""
    js = jetstream_adapter.as_jetstream_engine(engine)
    params = js.load_params()
    state = js.insert(js.prefill(params=params, padded_tokens=np.array(PROMPT), true_length=3), js.init_decode_state(),
                      0)
    fits = engine.max_target_length - len(PROMPT)  # positions 3 .. 31
    for step in range(fits + 1):
        state, result = js.generate(params, state)
        valid = result.convert_to_numpy().get_result_at_slot(0).valid[0, 0]
        assert valid == (step < fits), step


def test_bad_calls_are_named(api, engine):
    js = jetstream_adapter.as_jetstream_engine(engine)
    with pytest.raises(EngineError, match="slot 2 does not exist"):
        js.insert(js.prefill(params=None, padded_tokens=np.array(PROMPT), true_length=3), js.init_decode_state(), 2)
    with pytest.raises(EngineError, match="true_length 4 must be in"):
        js.prefill(params=None, padded_tokens=np.array(PROMPT), true_length=4)
    with pytest.raises(EngineError, match="existing_prefix must be a SharedPrefix"):
        js.prefill(params=None, existing_prefix=object(), padded_tokens=np.array(PROMPT), true_length=3)
    with pytest.raises(EngineError, match="no tokenizer was given"):
        js.build_tokenizer(None)
    with pytest.raises(TypeError, match="expected a dora_jax.rollout.engine.Engine"):
        jetstream_adapter.as_jetstream_engine(object())


def test_missing_package_error_names_it(monkeypatch, engine):
    monkeypatch.setitem(sys.modules, "jetstream", None)  # import of jetstream fails as if not installed
    monkeypatch.setitem(sys.modules, "jetstream.engine", None)
    monkeypatch.setitem(sys.modules, "jetstream.engine.engine_api", None)
    with pytest.raises(jetstream_adapter.JetStreamUnavailable, match="google-jetstream"):
        jetstream_adapter.as_jetstream_engine(engine)
    with pytest.raises(ImportError, match="pip install google-jetstream"):
        jetstream_adapter.jetstream_engine_class()
