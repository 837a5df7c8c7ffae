"""Small C kernels for the CPU, compiled on first use with the system's C compiler and called via ctypes.

Why C at all: decode attention is bound by memory traffic, and in torch it must first gather each
request's KV blocks into a contiguous copy. A kernel that reads the paged cache in place halves that
traffic. Linear layers over 4- and 8-bit block-quantized weights (qgemm.c) read a sixth or a quarter of
float32's bytes, and weight bytes are what a single decode stream is bound by. And a few row-wise steps
(RMSNorm with its residual add, the int8 GEMM's per-token scaling) are four to seven torch operators
each, whose dispatch costs more than their arithmetic at small batches; here each is one pass.

Why not a torch C++ extension: compiling against torch's headers takes minutes on a small CPU, while
these files build in about a second and need no torch ABI. They are linked against the OpenMP runtime
torch has already loaded (same soname), so both share one thread pool.

Everything here is optional: with no compiler, a failed build, another device or dtype, or
``TIDESERVE_NATIVE=0``, callers get ``None``/``False`` and use the torch path. The one exception is
``--quantization int4``, which has no torch kernel worth running and says so at startup.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode.c", "rows.c", "qgemm.c", "rope_store.c",
                                                          "decode_forward.c"))
HEADERS = (Path(__file__).with_name("paged_decode_kv.h"),)
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # cache element types with a kernel
CFLAGS = ("-O3", "-march=native", "-std=c11", "-fopenmp", "-fPIC", "-shared")
# qgemm.c's block formats and SIMD row kernels (its ctypes front is tideserve/native/quant.py)
HEADERS += tuple(Path(__file__).with_name(name) for name in ("qgemm_formats.h", "qgemm_simd.h"))


def cache_dir() -> Path:
    """Where built libraries are kept: $TIDESERVE_CACHE_DIR, else $XDG_CACHE_HOME/tideserve, else
    ~/.cache/tideserve."""
    if os.environ.get("TIDESERVE_CACHE_DIR"):
        return Path(os.environ["TIDESERVE_CACHE_DIR"]) / "native"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tideserve" / "native"


def _cpu_signature() -> str:
    """-march=native code must not be reused on another CPU: key the build on the CPU's flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                              capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be had here."""
    if os.environ.get("TIDESERVE_NATIVE", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.info("No C compiler found: decode attention uses the torch path.")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout
        key = hashlib.sha256(b"\0".join(s.encode() for s in (
            *(f.read_text() for f in (*SOURCES, *HEADERS)), " ".join(CFLAGS), version,
            _cpu_signature()))).hexdigest()[:16]
        path = cache_dir() / f"tideserve_kernels-{key}.so"
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("Native kernels unavailable, using the torch path: %s", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suffix in KV_DTYPES.values():
        fn = getattr(lib, f"ts_paged_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                       ctypes.c_int]
    f32, cint = ctypes.c_float, ctypes.c_int
    signatures = {
        "ts_rms_norm_f32": [ptr, ptr, ptr, i64, i64, f32, cint],
        "ts_add_rms_norm_f32": [ptr, ptr, ptr, ptr, i64, i64, f32, cint],
        "ts_int8_rows_f32": [ptr, ptr, ptr, ptr, i64, i64, cint],
        "ts_scale_rows_f32": [ptr, ptr, ptr, ptr, i64, i64, cint],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = argtypes
    lib.ts_rope_store_f32.restype = None
    lib.ts_rope_store_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint, cint]
    lib.ts_decode_forward_f32.restype = cint
    lib.ts_decode_forward_f32.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr,
                                          ptr, ptr, i64, ptr, i64, cint, f32, cint]
    return lib


def decode_attention_supported(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether ``paged_decode_attention`` can serve a model on this device with these dtypes."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and kv_dtype in KV_DTYPES
            and load_library() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor) -> bool:
    """out[i] = attention of q[i] ([H, D]) over request i's first context_lens[i] cached keys.

    q, out: float32 [N, H, D] with unit stride in D and D in H (rows may be strided); k_cache, v_cache:
    contiguous [num_blocks, block_size, KVH, D], float32 or bfloat16; block_tables [N, W] and
    context_lens [N] int64, with every block id below num_blocks. Returns False, computing nothing,
    when the inputs do not fit.
    """
    lib = load_library()
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    ok = (lib is not None and n > 0 and q.dtype == out.dtype == torch.float32 and k_cache.dtype in KV_DTYPES
          and v_cache.dtype == k_cache.dtype and q.device.type == k_cache.device.type == "cpu"
          and k_cache.is_contiguous() and v_cache.is_contiguous()
          and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
          and block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.is_contiguous()
          and context_lens.is_contiguous() and num_heads % num_kv_heads == 0
          and block_tables.shape[0] == context_lens.shape[0] == n)
    if not ok:
        return False
    kernel = getattr(lib, f"ts_paged_decode_{KV_DTYPES[k_cache.dtype]}")
    failed = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), out.stride(0), n, num_heads,
        num_kv_heads, head_dim, k_cache.shape[1], scale, torch.get_num_threads())
    return failed == 0


def _plain_f32(*tensors: torch.Tensor | None) -> bool:
    """float32, on the CPU, contiguous (None entries are optional arguments left out). A plain loop: this
    runs several hundred times per decode step."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """x / rms(x) * weight over the last dimension; with ``residual``, first ``residual += x`` (in place)
    and normalise the sum. None, touching nothing, when the inputs do not fit the kernel."""
    lib = load_library()
    if lib is None or x.numel() == 0 or not _plain_f32(x, weight, residual):
        return None
    cols = x.shape[-1]
    rows = x.numel() // cols
    if weight.numel() != cols or (residual is not None and residual.shape != x.shape):
        return None
    out = torch.empty_like(x)
    if residual is None:
        lib.ts_rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
                            torch.get_num_threads())
    else:
        lib.ts_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols,
                                eps, torch.get_num_threads())
    return out


def int8_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int8 GEMM's input for x [M, K]: (rows [M + 1, K], row_max [M, 1]); see rows.c. None when the
    inputs do not fit the kernel."""
    lib = load_library()
    if lib is None or x.dim() != 2 or x.shape[0] == 0 or not _plain_f32(x, inv_smooth):
        return None
    m, k = x.shape
    rows = torch.empty(m + 1, k)
    row_max = torch.empty(m, 1)
    lib.ts_int8_rows_f32(x.data_ptr(), None if inv_smooth is None else inv_smooth.data_ptr(), rows.data_ptr(),
                         row_max.data_ptr(), m, k, torch.get_num_threads())
    return rows, row_max


def scale_rows_(y: torch.Tensor, row_max: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """y[r] = y[r] * row_max[r] (+ bias), in place; False, touching nothing, when the inputs do not fit."""
    lib = load_library()
    if lib is None or y.dim() != 2 or not _plain_f32(y, row_max, bias):
        return False
    lib.ts_scale_rows_f32(y.data_ptr(), row_max.data_ptr(), None if bias is None else bias.data_ptr(),
                          y.data_ptr(), y.shape[0], y.shape[1], torch.get_num_threads())
    return True


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Rotate the q and k heads of qkv [T, (H + 2 KVH) * D] in place and store k and v at ``slots`` in the
    caches ([num_blocks, block_size, KVH, D], float32 or bfloat16); see rope_store.c. False, touching
    nothing, when the inputs do not fit the kernel."""
    lib = load_library()
    if lib is None or qkv.dim() != 2 or qkv.shape[0] == 0:
        return False
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    ok = (qkv.dtype == cos.dtype == sin.dtype == torch.float32 and qkv.device.type == "cpu" and qkv.stride(1) == 1
          and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
          and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == tokens * head_dim // 2
          and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
          and k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES and k_cache.device.type == "cpu"
          and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2] == num_kv_heads)
    if not ok:
        return False
    lib.ts_rope_store_f32(qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                          sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
    return True
