"""ctypes front of qgemm.c: weights kept in their GGUF block formats, multiplied by native kernels.

A layer's weight is described once as a ``QMat`` (pointers to its segments' bytes, which the Python
object owning the tensors keeps alive) and handed to ``qmatmul`` on every call, or to decode_forward.c
through the layer table (model/native_decode.py). ``qgemm_isa`` says which path the CPU gets (scalar,
avx2, avx512 (VNNI), amx); ``TIDESERVE_QGEMM_ISA`` or ``forced_isa`` caps it, so tests can run the lower
paths on a CPU that has the higher ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

from tideserve import native
from tideserve.native.cores import intra_op_threads

# GGUF (ggml) type ids of the formats qgemm.c multiplies, by the names the gguf package uses.
QTYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13,
          "q6_k": 14, "iq4_nl": 20, "iq4_xs": 23}
# values per storage unit and bytes per unit (ggml's block sizes)
QUNITS = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
          "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
          "iq4_nl": (32, 18), "iq4_xs": (256, 136)}
ISA_NAMES = ("scalar", "avx2", "avx512", "amx")
MAX_SEGMENTS = 4


# How a segment's rows lie in memory (qgemm_formats.h): as in the GGUF file, or each whole group of 8 rows
# interleaved for AVX2's matrix-vector kernel and tiles, which then read 8 rows' blocks with plain loads.
LAYOUTS = {"rows": 0, "x8": 1}


class QSeg(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("data", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("layout", ctypes.c_int64)]


class QMat(ctypes.Structure):
    _fields_ = [("seg", QSeg * MAX_SEGMENTS), ("num_segs", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k values in ``qtype``; ValueError when k is not a whole number of units."""
    unit, nbytes = QUNITS[qtype]
    if k % unit:
        raise ValueError(f"a {qtype} row needs a multiple of {unit} values, got {k}")
    return k // unit * nbytes


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The native library with this module's signatures set, and the ISA cap from the environment."""
    lib = native.load_library()
    if lib is None:
        return None
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.ts_qmatmul_f32.restype = cint
    lib.ts_qmatmul_f32.argtypes = [ctypes.POINTER(QMat), ptr, i64, i64, cint, ptr, i64, cint]
    lib.ts_qdequant_rows_f32.restype = cint
    lib.ts_qdequant_rows_f32.argtypes = [i64, ptr, i64, i64, i64, ptr, i64, ptr, cint]
    lib.ts_qgemm_x8_preferred.restype = cint
    lib.ts_qgemm_x8_preferred.argtypes = [i64]
    lib.ts_qgemm_relayout.restype = cint
    lib.ts_qgemm_relayout.argtypes = [i64, ptr, ptr, i64, i64, cint]
    lib.ts_qgemm_isa.restype = cint
    lib.ts_qgemm_isa.argtypes = []
    lib.ts_qgemm_set_isa.restype = cint
    lib.ts_qgemm_set_isa.argtypes = [cint]
    lib.ts_qgemm_active_isa.restype = cint
    lib.ts_qgemm_active_isa.argtypes = []
    lib.ts_qgemm_kernel_for.restype = cint
    lib.ts_qgemm_kernel_for.argtypes = [i64, i64]
    lib.ts_qgemm_set_tile_min_rows.restype = cint
    lib.ts_qgemm_set_tile_min_rows.argtypes = [cint]
    lib.ts_qgemm_set_gemv.restype = cint
    lib.ts_qgemm_set_gemv.argtypes = [cint]
    lib.ts_qgemm_set_amx_one_list.restype = cint
    lib.ts_qgemm_set_amx_one_list.argtypes = [cint]
    lib.ts_qgemm_amx_tasks_taken.restype = i64
    lib.ts_qgemm_amx_tasks_taken.argtypes = []
    lib.ts_qgemm_tile_chunk_bytes.restype = i64
    lib.ts_qgemm_tile_chunk_bytes.argtypes = []
    lib.ts_qgemm_set_tile_chunk_bytes.restype = i64
    lib.ts_qgemm_set_tile_chunk_bytes.argtypes = [i64]
    forced = os.environ.get("TIDESERVE_QGEMM_ISA", "").strip().lower()
    if forced:
        if forced not in ISA_NAMES:
            raise ValueError(f"TIDESERVE_QGEMM_ISA must be one of {', '.join(ISA_NAMES)}, got {forced!r}")
        lib.ts_qgemm_set_isa(ISA_NAMES.index(forced))
    return lib


def available() -> bool:
    return _lib() is not None


def qgemm_isa() -> str | None:
    """The path the quantized kernels take now (the CPU's best, capped by TIDESERVE_QGEMM_ISA or
    ``forced_isa``); None without the native library."""
    lib = _lib()
    return None if lib is None else ISA_NAMES[lib.ts_qgemm_active_isa()]


KERNELS = ("rows", "avx2-tiles", "amx-tiles", "avx2-gemv", "avx512-tiles", "avx512-gemv")  # qgemm.c's TS_K_*


def kernel_for(rows: int, qtype: str = "q4_1") -> str | None:
    """Which kernel a product of ``rows`` input rows over a ``qtype`` weight takes now: "rows" (the row
    kernels), "avx2-gemv" / "avx512-gemv" (the matrix-vector kernel, in AVX2's byte products or VNNI's),
    "avx2-tiles" / "avx512-tiles" (the integer tiles, likewise) or "amx-tiles"; None without the native
    library."""
    lib = _lib()
    return None if lib is None else KERNELS[lib.ts_qgemm_kernel_for(rows, QTYPES[qtype])]


def _kernel_plan(qtype: str) -> str:
    """"<kernel> to N rows, <kernel> from N + 1" for one format (up to 4096 rows)."""
    spans: list[tuple[str, int]] = []  # (kernel, first row count)
    for rows in range(1, 4097):
        kernel = kernel_for(rows, qtype)
        if not spans or spans[-1][0] != kernel:
            spans.append((kernel, rows))
    parts = [f"{kernel} to {spans[i + 1][1] - 1} rows" for i, (kernel, _) in enumerate(spans[:-1])]
    last, first = spans[-1]
    parts.append(f"{last} from {first} rows" if len(spans) > 1 else last)
    return ", ".join(parts)


def kernels_summary() -> str | None:
    """The path and which kernel takes which batch sizes, per group of formats where they differ: for the
    start-up log, e.g. "avx2: q4_0, q4_1: avx2-gemv to 12 rows, avx2-tiles from 13 rows; ..."."""
    isa = qgemm_isa()
    if isa is None:
        return None
    plans: dict[str, list[str]] = {}
    for qtype in QTYPES:
        plans.setdefault(_kernel_plan(qtype), []).append(qtype)
    if len(plans) == 1:
        return f"{isa}: {next(iter(plans))}"
    return f"{isa}: " + "; ".join(f"{', '.join(qtypes)}: {plan}" for plan, qtypes in plans.items())


def set_gemv(enabled: bool) -> bool:
    """Whether AVX2's matrix-vector kernel takes the products below the tiles' threshold over the formats
    it has (the default) or the row kernels do. Returns the previous setting. For tests and benchmarks: the
    row kernels read an interleaved ("x8") weight through a copy of each row, many times slower."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return bool(lib.ts_qgemm_set_gemv(int(enabled)))


def cpu_isa() -> str | None:
    """The best path this CPU (and this build of the kernels) offers, whatever the cap."""
    lib = _lib()
    return None if lib is None else ISA_NAMES[lib.ts_qgemm_isa()]


@contextlib.contextmanager
def forced_isa(name: str) -> Iterator[str]:
    """Run the quantized kernels on at most path ``name`` inside the block; yields the path in effect
    (lower than ``name`` when the CPU lacks it). Process-wide: for tests and benchmarks."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    previous = lib.ts_qgemm_set_isa(ISA_NAMES.index(name))
    try:
        yield ISA_NAMES[lib.ts_qgemm_active_isa()]
    finally:
        lib.ts_qgemm_set_isa(previous)


def set_tile_min_rows(rows: int) -> int:
    """From how many input rows the tiles (AMX, or AVX2's where there is no AMX) replace the row kernels,
    on every path; 0 restores each path's own threshold. Returns the previous override (0: none). For
    tests and benchmarks."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return lib.ts_qgemm_set_tile_min_rows(rows)


@contextlib.contextmanager
def amx_tasks_in_one_list() -> Iterator[None]:
    """Within: every AMX product's tasks start in its first thread's list, so that the other threads can
    only take theirs from it (tests of that taking)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    previous = lib.ts_qgemm_set_amx_one_list(1)
    try:
        yield
    finally:
        lib.ts_qgemm_set_amx_one_list(previous)


def amx_tasks_taken() -> int:
    """AMX tasks threads took from another thread's list since the library loaded."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return lib.ts_qgemm_amx_tasks_taken()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] (float32, k a multiple of 32) as the kernels quantize a matmul's input on the path in
    force: int8 codes [m, k], each block's scale [m, k / 32] and each 16-value half's code sum times that
    scale [m, k / 16]. For tests: every ISA path must give the same bits."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    x = x.contiguous().float()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, k // 32)
    sums = torch.empty(m, k // 16)
    if lib.ts_qgemm_quantize_rows_f32(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), sums.data_ptr()) != 0:
        raise ValueError(f"k must be a multiple of 32, got {k}")
    return q, scale, sums


def tile_chunk_bytes() -> int:
    """Activation bytes per chunk of rows the integer tiles sweep, each panel decoded once per chunk: half
    the core's L2 unless ``set_tile_chunk_bytes`` overrides it."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return int(lib.ts_qgemm_tile_chunk_bytes())


def set_tile_chunk_bytes(num_bytes: int) -> int:
    """Override the integer tiles' chunk of rows (in activation bytes); 0 restores the L2-sized default.
    Returns the previous override (0: none). The product is the same for every chunk: for tests and
    benchmarks."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return int(lib.ts_qgemm_set_tile_chunk_bytes(num_bytes))


def preferred_layout(qtype: str) -> str:
    """The layout the kernels read fastest on the path taken now: "x8" for the formats the matrix-vector
    kernel and the integer tiles read interleaved (the AVX2 and AVX-512 VNNI paths; AMX's tiles read rows as
    stored), else "rows"."""
    lib = _lib()
    return "x8" if lib is not None and lib.ts_qgemm_x8_preferred(QTYPES[qtype]) else "rows"


def relayout(qtype: str, data: torch.Tensor, in_features: int, to: str,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of the uint8 [rows, row_bytes] blocks ``data`` in layout ``to`` ("x8" from the file's rows,
    "rows" back from "x8"), written into ``out`` (contiguous, same shape) when given. Rows past the last
    whole group of 8 are the same in both."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    if to not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {to!r}")
    data = data.contiguous()
    if out is None:
        out = torch.empty_like(data)
    elif out.shape != data.shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {tuple(data.shape)}")
    if lib.ts_qgemm_relayout(QTYPES[qtype], data.data_ptr(), out.data_ptr(), data.shape[0], in_features,
                             int(to == "x8")):
        raise ValueError(f"{qtype} has no interleaved layout")
    return out


def make_qmat(segments: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
              layouts: list[str] | None = None) -> QMat:
    """The kernel's description of a weight whose rows are ``segments`` ((qtype, uint8 [rows, row_bytes])
    in output order), each in its layout (default: the file's rows). The struct holds the tensors' memory
    by address, so it keeps references to them: a caller that drops its own cannot leave it dangling."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"a quantized weight has 1 to {MAX_SEGMENTS} segments, got {len(segments)}")
    layouts = layouts or ["rows"] * len(segments)
    mat = QMat()
    for i, ((qtype, data), layout) in enumerate(zip(segments, layouts, strict=True)):
        mat.seg[i] = QSeg(QTYPES[qtype], data.data_ptr(), data.shape[0], LAYOUTS[layout])
    mat.num_segs = len(segments)
    mat.bias = None if bias is None else bias.data_ptr()
    mat.n = sum(d.shape[0] for _, d in segments)
    mat.k = in_features
    mat._keep = (tuple(data for _, data in segments), bias)  # the memory the pointers above point into
    return mat


def qmatmul(x: torch.Tensor, mat: QMat, swiglu: bool = False) -> torch.Tensor | None:
    """x [M, K] float32 (rows may be strided) times the weight ``mat`` describes: [M, N] float32. With
    ``swiglu`` x is [M, 2K] (gate | up) and the product is taken with silu(gate) * up. None, computing
    nothing, when the inputs do not fit the kernel."""
    lib = _lib()
    if (lib is None or x.dim() != 2 or x.shape[0] == 0 or x.stride(1) != 1 or x.dtype != torch.float32
            or x.device.type != "cpu" or x.shape[1] != mat.k * (2 if swiglu else 1)):
        return None
    out = torch.empty(x.shape[0], mat.n)
    failed = lib.ts_qmatmul_f32(ctypes.byref(mat), x.data_ptr(), x.stride(0), x.shape[0], int(swiglu),
                                out.data_ptr(), mat.n, intra_op_threads())
    return None if failed else out


def dequant_rows(qtype: str, data: torch.Tensor, in_features: int, ids: torch.Tensor,
                 layout: str = "rows") -> torch.Tensor | None:
    """Rows ``ids`` of a [rows, K] weight in ``qtype`` and ``layout``, as float32 [len(ids), K] (embedding
    lookups); None when the native library is not there."""
    lib = _lib()
    if lib is None:
        return None
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= data.shape[0]):
        raise IndexError(f"token id out of range for an embedding table of {data.shape[0]} rows")
    out = torch.empty(ids.numel(), in_features)
    if ids.numel() == 0:
        return out
    failed = lib.ts_qdequant_rows_f32(QTYPES[qtype], data.data_ptr(), data.shape[0], LAYOUTS[layout], in_features,
                                      ids.data_ptr(), ids.numel(), out.data_ptr(), intra_op_threads())
    return None if failed else out
