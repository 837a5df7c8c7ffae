"""A GGUF file's table of contents, read straight from its header: metadata and tensor infos.

Why not ``gguf.GGUFReader``: it turns every element of every metadata array into numpy objects, so a
49k-token vocabulary (tokens, scores, types, merges) becomes ~150 MiB of small Python objects, and glibc keeps
that heap after they are freed; a 151k vocabulary costs three times more. The engine needs the scalars, the
tensor list and, of the vocabulary, its length (the tokenizer reads the vocabulary itself). So numeric arrays
come as one numpy array each, string arrays stay in the file (``GGUFStringArray``: a length and an offset),
and a tensor's bytes are read only when its weight is loaded, into memory the caller owns (never through a
memory map whose pages would count as the process's while it stays open).

The ``gguf`` package still supplies the tensor types, their block sizes and dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types: fixed-width scalars (struct formats), strings and arrays.
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Tensor types whose elements are plain numbers (read as that dtype); every other type is blocks of bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFStringArray:
    """A metadata array of strings, left in the file: its length, and ``read()`` for the strings."""

    path: str
    offset: int  # of the first string's length field
    count: int

    def __len__(self) -> int:
        return self.count

    def read(self) -> list[str]:
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            out, pos = [], self.offset
            for _ in range(self.count):
                text, pos = _read_str(buf, pos)
                out.append(text)
            return out


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry: ``shape`` lists dimensions innermost first, as GGUF (and gguf's reader) do;
    ``data_offset`` is absolute in the file."""

    path: str
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def read_into(self, out: memoryview) -> None:
        """Fill ``out`` (exactly ``n_bytes`` long) with the tensor's bytes from the file."""
        if len(out) != self.n_bytes:
            raise ValueError(f"GGUF tensor {self.name!r} has {self.n_bytes} bytes, the buffer {len(out)}")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_offset)
            view = out
            while view:
                got = f.readinto(view)
                if not got:
                    raise ValueError(f"GGUF tensor {self.name!r} is cut short in {self.path}")
                view = view[got:]

    def read_array(self) -> np.ndarray:
        """The tensor as numpy in row-major (HF) order: plain types as their numbers, shape reversed; block
        types as bytes, [rows..., row bytes] (what ``gguf.quants.dequantize`` takes)."""
        raw = np.empty(self.n_bytes, dtype=np.uint8)
        self.read_into(memoryview(raw))
        dims = tuple(reversed(self.shape))
        plain = _PLAIN.get(self.tensor_type)
        if plain is not None:
            return raw.view(plain).reshape(dims)
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * type_size)


@dataclass(frozen=True)
class GGUFIndex:
    path: str
    version: int
    metadata: dict[str, Any]  # scalars as Python values, numeric arrays as numpy, string arrays lazily
    tensors: list[GGUFTensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def read_gguf_index(path: str) -> GGUFIndex:
    """Parse the header of the GGUF file at ``path`` (milliseconds; the tensor data is not touched)."""
    path = str(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes).")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0 and version != 0:
            raise ValueError(f"{path} is a big-endian GGUF file; only little-endian files are supported.")
        if version < 2:
            raise ValueError(f"{path} is GGUF v{version}; only v2 and later are supported.")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        metadata: dict[str, Any] = {}
        try:
            for _ in range(kv_count):
                key, pos = _read_str(buf, pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                metadata[key], pos = _read_value(buf, pos + 4, kind, path, key)
            infos = []
            for _ in range(tensor_count):
                name, pos = _read_str(buf, pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, tuple(int(d) for d in dims), kind, offset))
        except struct.error as e:
            raise ValueError(f"{path}: the GGUF header is cut short ({e}).") from None
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            raise ValueError(f"{path}: general.alignment must be a positive integer, got {alignment!r}.")
        data_start = -(-pos // alignment) * alignment
        size = len(buf)
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {kind}.") from None
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
        start = data_start + offset
        if start + n_bytes > size:
            raise ValueError(f"GGUF tensor {name!r} is cut short in {path}")
        tensors.append(GGUFTensorInfo(path, name, tensor_type, dims, start, n_bytes))
    return GGUFIndex(path, version, metadata, tensors)


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    start = pos + 8
    if start + length > len(buf):
        raise struct.error("string past the end of the file")
    return buf[start:start + length].decode("utf-8", errors="replace"), start + length


def _read_value(buf: mmap.mmap, pos: int, kind: int, path: str, key: str) -> tuple[Any, int]:
    if kind in _SCALARS:
        (value,) = struct.unpack_from(_SCALARS[kind], buf, pos)
        return value, pos + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return _read_str(buf, pos)
    if kind != _ARRAY:
        raise ValueError(f"{path}: metadata key {key!r} has unknown GGUF type {kind}.")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _NUMPY:
        dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
        end = pos + count * dtype.itemsize
        if end > len(buf):
            raise struct.error("array past the end of the file")
        return np.frombuffer(buf[pos:end], dtype=dtype).copy(), end
    if item == _STRING:
        start = pos
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + length
        if pos > len(buf):
            raise struct.error("strings past the end of the file")
        return GGUFStringArray(path, start, count), pos
    values = []  # arrays of arrays: rare, small; parsed as they are
    for _ in range(count):
        value, pos = _read_value(buf, pos, item, path, key)
        values.append(value)
    return values, pos
