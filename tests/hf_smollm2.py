"""transformers' own SmolLM2-135M-Instruct, built from the same GGUF file as ours: the independent reference of
test_smollm2.py and test_tokenizer.py, loaded once per test process.

transformers parses the GGUF file once for the tokenizer, again for the model's config and again for its
weights, and builds ``gguf``'s tensor-name map once per module of the model: about 40 s of its 50 s load on a
2-core machine. The file and the map are the same every time, so while transformers loads, ``gguf.GGUFReader``
and ``gguf.get_tensor_name_map`` return the one parse of each. transformers still dequantizes, maps, un-permutes
and builds everything itself.
"""

from __future__ import annotations

import contextlib
import functools
import os

import gguf

_READERS: dict[tuple[str, str], object] = {}


@contextlib.contextmanager
def _one_parse_per_file():
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in _READERS:
            _READERS[key] = real_reader(path, mode)
        return _READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _where() -> dict[str, str]:
    from dora_jax.models.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    return {"pretrained_model_name_or_path": os.path.dirname(path), "gguf_file": os.path.basename(path)}


@functools.cache
def tokenizer():
    import transformers

    where = _where()
    with _one_parse_per_file():
        return transformers.AutoTokenizer.from_pretrained(**where)


@functools.cache
def model():
    """The float32 model, in eval mode. Callers must not change it: it is shared by every test of the process."""
    import torch
    import transformers

    where = _where()
    with _one_parse_per_file():
        return transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
