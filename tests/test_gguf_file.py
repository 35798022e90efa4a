"""The GGUF index cache (kvserve/models/gguf_file.py): a later open of an unchanged file gives what gguf's
GGUFReader gives (metadata and tensor data, byte for byte) without running GGUFReader; a changed file or a
damaged cache entry is read again."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.models import gguf_file
from kvserve.models.gguf import read_metadata


def write_small_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list(["<s>", "é", "a b", "\n", "日本"])
    w.add_token_scores([0.0, -1.5, -2.25, 3.0, float("-inf")])
    w.add_token_types([3, 1, 1, 6, 1])
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def small_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    return path


def assert_same_as_reader(opened: gguf_file.GGUFFile, path: Path) -> None:
    reader = gguf.GGUFReader(str(path))
    assert opened.fields == read_metadata(reader)
    assert [t.name for t in opened.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(opened.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8))


def test_second_open_reads_the_cache_not_the_file_header(small_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = gguf_file.open_gguf(small_gguf)
    assert_same_as_reader(first, small_gguf)
    assert len(list((gguf_file.cache_dir() / "gguf").glob("*.json"))) == 1

    def no_reader(*args: object) -> None:
        raise AssertionError("GGUFReader ran although the file is cached")

    monkeypatch.setattr(gguf_file.gguf, "GGUFReader", no_reader)
    second = gguf_file.open_gguf(small_gguf)
    monkeypatch.undo()
    assert_same_as_reader(second, small_gguf)


def test_a_changed_file_is_read_again(small_gguf: Path) -> None:
    gguf_file.open_gguf(small_gguf)
    write_small_gguf(small_gguf)
    stat = small_gguf.stat()
    os.utime(small_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert_same_as_reader(gguf_file.open_gguf(small_gguf), small_gguf)
    assert len(list((gguf_file.cache_dir() / "gguf").glob("*.json"))) == 2


def test_a_damaged_cache_entry_is_rebuilt(small_gguf: Path) -> None:
    gguf_file.open_gguf(small_gguf)
    (entry,) = (gguf_file.cache_dir() / "gguf").glob("*.json")
    entry.write_text(entry.read_text()[:100])
    assert_same_as_reader(gguf_file.open_gguf(small_gguf), small_gguf)
    assert_same_as_reader(gguf_file.open_gguf(small_gguf), small_gguf)  # and the rebuilt entry is whole
