"""Opening a GGUF file: its decoded metadata and its tensor table, the table cached after the first open.

gguf's GGUFReader makes a numpy view of every element of every metadata array; the default model's 49k-token
vocabulary and merges cost ~3 s that way, most of a server start. The first open of a file goes through
GGUFReader and saves what it decoded (metadata and, per tensor, type, shape and byte offset) as JSON; later
opens of the unchanged file (same path, size and mtime) read that and memory-map the tensor data directly.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1  # bump when what is cached changes


@dataclass
class GGUFTensorRecord:
    """One tensor, with the attributes iter_gguf_weights reads from a gguf.ReaderTensor."""
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]   # GGUF order, fastest dimension first
    data: np.ndarray         # memory-mapped; quantized types as uint8 [rows, bytes per row], floats typed


@dataclass
class GGUFFile:
    fields: dict[str, Any]            # metadata key -> decoded value (str, int, float, bool, lists)
    tensors: list[GGUFTensorRecord]


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path).resolve()
    cache = _cache_path(path)
    if cache is not None and cache.exists():
        try:
            return _from_cache(path, json.loads(cache.read_text()))
        except (OSError, ValueError, KeyError) as e:  # a damaged cache entry is rebuilt, never trusted
            logger.warning("ignoring the GGUF index cache %s: %s", cache, e)
    from kvserve.models.gguf import read_metadata

    reader = gguf.GGUFReader(str(path))
    opened = GGUFFile(read_metadata(reader), [
        GGUFTensorRecord(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors])
    if cache is not None:
        _save(cache, opened, {t.name: int(t.data_offset) for t in reader.tensors})
    return opened


def cache_dir() -> Path:
    if env := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve"


def _cache_path(path: Path) -> Path | None:
    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{_CACHE_FORMAT}|{importlib.metadata.version('gguf')}|{path}|{st.st_size}|{st.st_mtime_ns}"
    return cache_dir() / "gguf" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _save(cache: Path, opened: GGUFFile, offsets: dict[str, int]) -> None:
    entry = {"fields": opened.fields, "tensors": [
        {"name": t.name, "type": int(t.tensor_type), "shape": list(t.shape), "offset": offsets[t.name],
         "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)} for t in opened.tensors]}
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry))
        tmp.replace(cache)  # atomic: a concurrent reader sees the old state or the whole entry
    except (OSError, TypeError, ValueError) as e:  # a read-only home or an odd value: just no cache
        logger.info("GGUF index not cached (%s): %s", cache, e)
        tmp.unlink(missing_ok=True)


def _from_cache(path: Path, entry: dict[str, Any]) -> GGUFFile:
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for t in entry["tensors"]:
        dtype, shape = np.dtype(t["dtype"]), tuple(t["data_shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if t["offset"] + nbytes > mm.size:
            raise ValueError(f"tensor {t['name']} runs past the end of the file")
        data = mm[t["offset"]:t["offset"] + nbytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensorRecord(t["name"], gguf.GGMLQuantizationType(t["type"]), tuple(t["shape"]), data))
    return GGUFFile(entry["fields"], tensors)
