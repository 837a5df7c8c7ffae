"""Our GGUF header index against the gguf package's reader (the reference): same metadata, same tensors at
the same offsets with the same bytes, on the embedded model and on a file holding every value type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tideserve.model.arch_config import ArchConfig
from tideserve.model.loader.gguf_index import GGUFStringArray, read_gguf_index


def reference_value(field: Any) -> Any:
    return field.contents()


def assert_same_as_reader(path: Path) -> None:
    ours = read_gguf_index(str(path))
    reader = gguf.GGUFReader(str(path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # the reader's header pseudo-fields
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        want, got = reference_value(reader.fields[key]), ours.metadata[key]
        if isinstance(got, GGUFStringArray):
            assert got.read() == want, key
        elif isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=key)
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert (mine.data_offset, mine.n_bytes, mine.n_elements) == (
            theirs.data_offset, int(theirs.n_bytes), int(theirs.n_elements))
        array = mine.read_array()
        assert array.dtype == theirs.data.dtype and array.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(array, theirs.data)


@pytest.mark.slow
def test_embedded_model_index_matches_the_reference_reader(smollm2_gguf_path: Path) -> None:
    assert_same_as_reader(smollm2_gguf_path)
    index = read_gguf_index(str(smollm2_gguf_path))
    assert len(index.get("tokenizer.ggml.tokens")) == 49152
    assert ArchConfig.from_gguf_metadata(index).vocab_size == 49152


def every_value_type_file(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 日本語")
    writer.add_array("t.ints", [1, 2, 3, -4])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.empty", [])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        data = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name.lower(), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_matches_the_reference_reader(tmp_path: Path, alignment: int | None) -> None:
    assert_same_as_reader(every_value_type_file(tmp_path / "types.gguf", alignment))


def test_a_bad_or_cut_file_is_a_clear_error(tmp_path: Path) -> None:
    path = every_value_type_file(tmp_path / "types.gguf")
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(str(bad))
    last = read_gguf_index(str(path)).tensors[-1]
    for cut in (30, len(data) // 4, last.data_offset + 10):  # inside the metadata, the tensor infos, the data
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut short"):
            read_gguf_index(str(bad))
    zero = tmp_path / "zero.gguf"
    writer = gguf.GGUFWriter(str(zero), "llama")
    writer.add_uint32("general.alignment", 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.alignment must be a positive integer"):
        read_gguf_index(str(zero))
