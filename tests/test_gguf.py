"""GGUF files through ``dora_jax.models.gguf`` (the ``gguf`` library's reader and dequantizer) against the
``gguf`` library used directly."""


import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from dora_jax.models.gguf import GGUFError, read_gguf, smollm2_gguf_path
from dora_jax.models.hf_io import WeightsError


def _round_trip_types() -> list[str]:
    """Every type the installed gguf library can both quantize and dequantize."""
    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
    names = []
    for qtype in Q:
        try:
            gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
        except (NotImplementedError, KeyError, ValueError, AssertionError):
            continue
        names.append(qtype.name)
    return names


ROUND_TRIP = _round_trip_types()


def test_round_trip_covers_the_common_types():
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= set(ROUND_TRIP)


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_every_quant_type_round_trips(tmp_path, name):
    """A small tensor quantized by gguf, written to a file, loads as gguf's own dequantization of it."""
    x = np.random.default_rng(len(name)).normal(size=(4, 256)).astype(np.float32)
    q = gguf.quants.quantize(x, Q[name])
    path = tmp_path / f"{name}.gguf"
    _write(path, {"w": (q, None if name in ("F32", "F16") else Q[name])})
    f = read_gguf(str(path))
    assert f.tensors["w"].ggml_type == name and f.tensors["w"].shape == (4, 256)
    got = f.load("w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(gguf.quants.dequantize(q, Q[name]), np.float32).reshape(4, 256))
    if name not in ("F32",):
        assert np.abs(got - x).max() < 0.5 * np.abs(x).max()  # a quantization of x, not noise


def _random_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes whose f16 scale fields hold small finite values, so every element is finite (for a type
    gguf dequantizes but cannot quantize)."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype.name]:
        raw[:, off:off + 2] = rng.uniform(-0.1, 0.1, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


def _write(path, tensors, metadata=None):
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (metadata or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
    for name, (arr, qtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def small_gguf(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.normal(size=(4, 8)).astype(np.float32)
    f16 = rng.normal(size=(3, 32)).astype(np.float16)
    q8 = gguf.quants.quantize(rng.normal(size=(2, 64)).astype(np.float32), Q.Q8_0)
    q4k = _random_blocks(Q.Q4_K, 2, seed=2)
    path = tmp_path / "small.gguf"
    _write(path, {"a": (f32, None), "b": (f16, None), "c": (q8, Q.Q8_0), "d": (q4k, Q.Q4_K)},
           {"test.str": "héllo", "test.int": 7, "test.float": 0.5, "test.flag": True,
            "test.ints": [1, 2, 3], "test.strs": ["x", "yy"]})
    return path, {"a": f32, "b": f16, "c": gguf.quants.dequantize(q8, Q.Q8_0),
                  "d": gguf.quants.dequantize(q4k, Q.Q4_K)}


def test_read_written_file(small_gguf):
    path, expected = small_gguf
    f = read_gguf(str(path))
    md = f.metadata
    assert (md["test.str"], md["test.int"], md["test.float"], md["test.flag"]) == ("héllo", 7, 0.5, True)
    assert md["test.ints"] == [1, 2, 3] and md["test.strs"] == ["x", "yy"]
    assert f.architecture == "llama"
    assert {n: t.ggml_type for n, t in f.tensors.items()} == {"a": "F32", "b": "F16", "c": "Q8_0", "d": "Q4_K"}
    for name, ref in expected.items():
        np.testing.assert_allclose(f.load(name), np.asarray(ref, np.float32).reshape(f.tensors[name].shape),
                                   rtol=1e-6)
    assert f.tensors["d"].shape == (2, 256) and f.tensors["c"].shape == (2, 64)


def test_bad_files(tmp_path, small_gguf):
    path, _ = small_gguf
    with pytest.raises(GGUFError, match=str(tmp_path / "missing.gguf")):
        read_gguf(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match=f"{bad}: not a GGUF file"):
        read_gguf(str(bad))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match=f"{cut}: tensor 'd' runs past the end of the file"):
        read_gguf(str(cut))
    cut.write_bytes(data[:60])
    with pytest.raises(GGUFError, match=f"{cut}: truncated or corrupt GGUF header"):
        read_gguf(str(cut))


def test_smollm2_file_matches_gguf_reader():
    path = smollm2_gguf_path()
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert len(ours.tensors) == len(ref.tensors) == 272
    types = {t.ggml_type for t in ours.tensors.values()}
    assert types == {"F32", "Q4_1", "Q8_0"}
    picked = [t for t in ref.tensors if t.name in ("token_embd.weight", "blk.3.attn_q.weight",
                                                   "blk.29.ffn_down.weight", "output_norm.weight")]
    assert len(picked) == 4
    for t in picked:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.tensors[t.name].shape)
        np.testing.assert_array_equal(ours.load(t.name), expected)
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.model"] == "gpt2"


@pytest.mark.parametrize("changes,message", [
    ({"llama.attention.head_count": None}, r"metadata: no 'llama.attention.head_count', which the model needs"),
    ({"llama.attention.head_count": 0}, r"metadata: 'llama.attention.head_count' = 0 must be an integer > 0"),
    ({"llama.attention.head_count": "nine"}, r"metadata: 'llama.attention.head_count' = 'nine' must be an integer > 0"),
    ({"general.alignment": 0}, r"truncated or corrupt GGUF header \(ValueError: .*alignment"),
])
def test_bad_model_metadata_is_named(tmp_path, changes, message):
    from dora_jax.models.weights import model_config_from_weights

    md = {"llama.embedding_length": 32, "llama.attention.head_count": 4, "llama.feed_forward_length": 48,
          "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 64}
    md.update(changes)
    path = tmp_path / "m.gguf"
    _write(path, {"token_embd.weight": (np.zeros((64, 32), np.float32), None)},
           {k: v for k, v in md.items() if v is not None})
    with pytest.raises(GGUFError if "alignment" in message else WeightsError, match=f"{path}: {message}"):
        model_config_from_weights(str(path))
