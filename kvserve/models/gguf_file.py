"""Read a GGUF file: its metadata as Python values and its tensors as numpy views of the memory-mapped file.

gguf.GGUFReader builds several numpy views for every element of every metadata array, which takes ~14 s
for Gemma 3's 262,144-token vocabulary (tokens, scores and types) on these machines; this reader decodes
the same metadata with struct in well under a second. Tensor data are shaped as GGUFReader shapes them
(float types by their dims; block-quantized types as uint8 rows of packed blocks), so gguf.quants reads
them unchanged.

Layout (little-endian): "GGUF", version, tensor count, metadata count; metadata as (key, type, value);
tensor infos as (name, dims fastest-first, type, offset); then, aligned, the tensor data.
"""
from __future__ import annotations

import importlib.metadata
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# GGUF metadata value types -> struct format (strings and arrays are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                 gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                 gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                 gguf.GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFFileTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]            # GGUF order: fastest-varying dimension first
    data: np.ndarray                  # read-only view of the file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFFileTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF metadata type {vtype} at byte {self.pos}")
        itype, count = self.unpack("I"), self.unpack("Q")
        if itype in _SCALARS and itype != 7:
            dtype = np.dtype("<" + _SCALARS[itype])
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        return [self.value(itype) for _ in range(count)]


def read_gguf(path: str | Path) -> GGUFFile:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap's own "cannot mmap an empty file" named no file
            raise ValueError(f"{path} is empty (0 bytes), not a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    try:
        return _read_body(cur, buf)
    except UnsupportedTensorType as e:
        raise ValueError(f"{path}: {e}") from None
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        # A file cut short (a download that stopped) or damaged: struct's and numpy's own messages named neither
        # the file nor what was wrong with it, and struct's came as a traceback.
        raise ValueError(f"{path} is a truncated or damaged GGUF file ({e})") from None


class UnsupportedTensorType(ValueError):
    """A tensor type the gguf package does not know: said as such, not as a damaged file."""


_KNOWN_TYPES = {t.value for t in gguf.GGMLQuantizationType}


def _read_body(cur: _Cursor, buf: mmap.mmap) -> GGUFFile:
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        kind = cur.unpack("I")
        if kind not in _KNOWN_TYPES:  # not damage: a format newer than the installed gguf package
            raise UnsupportedTensorType(f"tensor {name!r} has type {kind}, which the installed gguf package "
                                        f"{importlib.metadata.version('gguf')} does not know (upgrade it: "
                                        f"pip install -U gguf)")
        infos.append((name, dims, gguf.GGMLQuantizationType(kind), cur.unpack("Q")))
    align = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // align) * align
    whole = np.frombuffer(buf, np.uint8)
    tensors = [GGUFFileTensor(name, qtype, dims, _tensor_data(whole, data_start + offset, dims, qtype))
               for name, dims, qtype, offset in infos]
    return GGUFFile(metadata, tensors)


def _tensor_data(whole: np.ndarray, start: int, dims: tuple[int, ...], qtype: gguf.GGMLQuantizationType
                 ) -> np.ndarray:
    shape = tuple(reversed(dims))
    n = int(np.prod(dims))
    if qtype in _FLOAT_DTYPES:
        dtype = np.dtype(_FLOAT_DTYPES[qtype])
        return whole[start:start + n * dtype.itemsize].view(dtype).reshape(shape)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = shape[-1] // block * type_size
    return whole[start:start + n // block * type_size].reshape(*shape[:-1], row_bytes)
