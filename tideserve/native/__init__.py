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

Instruction sets: each kernel has a scalar reference and AVX2 / AVX-512 (/ AVX-512 BF16) paths, compiled
when ``-march=native`` enables them and chosen at run time by what the CPU reports (isa.c). ``isa()`` says
which runs; ``TIDESERVE_ISA=scalar|avx2|avx512|avx512bf16|amx`` (or ``set_isa``) caps it, so a lower path
can be forced. tideserve_native.h declares every export; the argtypes below are its Python side.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from tideserve.native.cores import intra_op_threads

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode.c", "paged_prefill.c", "rows.c", "qgemm.c",
                                                          "rope_store.c", "decode_forward.c", "isa.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("attn_rows.h", "paged_decode_kv.h", "tideserve_native.h",
                                                          "ts_simd.h", "paged_decode_pairs.h"))
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the float types the kernels compute in, by suffix
# KV cache element types the kernels read and write, by their TS_DTYPE_* code (e4m3: --kv-cache-dtype fp8)
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
CFLAGS = ("-O3", "-march=native", "-std=c11", "-fopenmp", "-fPIC", "-shared")
# The ISA levels of isa.c (TS_ISA_*), lowest first; the index is the C level.
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
# isa.c's TS_CPU_* bits, by the names /proc/cpuinfo uses.
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                "amx_tile", "amx_bf16", "amx_int8", "amx_permitted", "vendor_intel")
_TS_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # TS_DTYPE_* codes
# qgemm.c's block formats and SIMD row kernels (its ctypes front is tideserve/native/quant.py)
HEADERS += tuple(Path(__file__).with_name(name) for name in ("qgemm_formats.h", "qgemm_simd.h", "qgemm_tiles.h",
                                                                "qgemm_gemv.h"))
# The float kernels' width-generic vector layer, the bodies written once against it, their loops' alignment
HEADERS += tuple(Path(__file__).with_name(name) for name in ("ts_vec.h", "ts_vec_each.h", "paged_decode_vec.h",
                                                                "rows_vec.h", "rope_store_vec.h",
                                                                "convert_vec.h", "ts_align_loops.h"))


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


def _build(compiler: str, target: Path, extra_flags: Sequence[str] = ()) -> None:
    """Compiles the kernels into ``target``; ``extra_flags`` follow CFLAGS (a later -O wins)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([compiler, *CFLAGS, *extra_flags, *map(str, SOURCES), "-o", str(built), "-lm"],
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
        "ts_rms_norm_heads_f32": [ptr, i64, i64, i64, i64, ptr, f32, cint],
        "ts_rms_norm_heads_bf16": [ptr, i64, i64, i64, i64, ptr, f32, cint],
        "ts_int8_rows_f32": [ptr, ptr, ptr, ptr, i64, i64, cint],
        "ts_scale_rows_f32": [ptr, ptr, ptr, ptr, i64, i64, cint],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = argtypes
    lib.ts_rope_store_f32.restype = None
    lib.ts_rope_store_f32.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint, cint]
    lib.ts_decode_forward_f32.restype = cint
    lib.ts_decode_forward_f32.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr,
                                          ptr, ptr, ptr, i64, ptr, i64, cint, f32, cint, ptr]
    _declare_isa_exports(lib)
    _declare_qgemm_exports(lib)
    _select_isa(lib)
    return lib


def _declare_qgemm_exports(lib: ctypes.CDLL) -> None:
    """argtypes of qgemm.c's exports (tideserve/native/quant.py, their caller, narrows the weight pointer to
    its QMat structure)."""
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures: dict[str, tuple[type | None, list[type]]] = {
        "ts_qmatmul_f32": (cint, [ptr, ptr, i64, i64, cint, ptr, i64, cint]),
        "ts_qdequant_rows_f32": (cint, [i64, ptr, i64, i64, i64, ptr, i64, ptr, cint]),
        "ts_qgemm_x8_preferred": (cint, [i64]),
        "ts_qgemm_relayout": (cint, [i64, ptr, ptr, i64, i64, cint]),
        "ts_qgemm_isa": (cint, []),
        "ts_qgemm_set_isa": (cint, [cint]),
        "ts_qgemm_set_tile_min_rows": (cint, [cint]),
        "ts_qgemm_set_gemv": (cint, [cint]),
        "ts_qgemm_set_amx_one_list": (cint, [cint]),
        "ts_qgemm_amx_tasks_taken": (i64, []),
        "ts_qgemm_tile_chunk_bytes": (i64, []),
        "ts_qgemm_quantize_rows_f32": (cint, [ptr, i64, i64, ptr, ptr, ptr]),
        "ts_qgemm_set_tile_chunk_bytes": (i64, [i64]),
        "ts_qgemm_active_isa": (cint, []),
        "ts_qgemm_kernel_for": (cint, [i64, i64]),
    }
    for name, (restype, argtypes) in signatures.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes


def _declare_isa_exports(lib: ctypes.CDLL) -> None:
    """argtypes of the exports added with the ISA dispatch (tideserve_native.h has their C side)."""
    i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures: dict[str, tuple[type | None, list[type]]] = {
        "ts_isa_best": (cint, []),
        "ts_isa_level": (cint, []),
        "ts_set_isa_level": (cint, [cint]),
        "ts_attn_isa_level": (cint, [cint, i64]),
        "ts_attn_invariant": (cint, []),
        "ts_set_attn_invariant": (cint, [cint]),
        "ts_cpu_features": (ctypes.c_uint32, []),
        "ts_amx_probe": (cint, []),
        "ts_paged_decode": (cint, [ptr, i64, cint, ptr, ptr, cint, ptr, i64, ptr, ptr, i64, cint, i64, i64, i64, i64,
                                   i64, f32, cint]),
        "ts_paged_prefill": (cint, [ptr, i64, cint, ptr, ptr, cint, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64,
                                    cint, i64, i64, i64, f32, cint]),
        "ts_paged_decode_window": (cint, [ptr, i64, cint, ptr, ptr, cint, ptr, i64, ptr, ptr, i64, cint, i64, i64, i64,
                                          i64, i64, f32, i64, f32, cint]),
        "ts_paged_prefill_window": (cint, [ptr, i64, cint, ptr, ptr, cint, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr,
                                           i64, cint, i64, i64, i64, f32, i64, f32, cint]),
        "ts_paged_prefill_tiles": (cint, [cint, i64]),
        "ts_paged_prefill_set_pack_limit": (i64, [i64]),
        "ts_paged_prefill_packed_calls": (i64, []),
        "ts_rms_norm_bf16": (None, [ptr, ptr, ptr, i64, i64, f32, cint]),
        "ts_add_rms_norm_bf16": (None, [ptr, ptr, ptr, ptr, i64, i64, f32, cint]),
        "ts_rope_store_bf16": (None, [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint, cint]),
        "ts_argmax_rows_f32": (cint, [ptr, i64, i64, i64, ptr, cint]),
    }
    for name, (restype, argtypes) in signatures.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes


def _select_isa(lib: ctypes.CDLL) -> None:
    """Apply TIDESERVE_ISA (a ceiling: scalar, avx2, avx512, avx512bf16, amx or auto) and log the choice once."""
    requested = os.environ.get("TIDESERVE_ISA", "auto").strip().lower() or "auto"
    if requested != "auto" and requested not in ISA_LEVELS:
        raise ValueError(f"TIDESERVE_ISA={requested!r} is not one of auto, {', '.join(ISA_LEVELS)}")
    best = ISA_LEVELS[lib.ts_isa_best()]
    level = ISA_LEVELS[lib.ts_set_isa_level(-1 if requested == "auto" else ISA_LEVELS.index(requested))]
    if requested not in ("auto", level):
        logger.warning("TIDESERVE_ISA=%s: this CPU (or this build) has no %s path; using %s", requested, requested,
                       level)
    features = lib.ts_cpu_features()
    logger.info("native kernels: ISA %s%s; decode attention, RMSNorm and rotary run their %s path (CPU features: %s)",
                level, f" (capped by TIDESERVE_ISA; best here: {best})" if level != best else "", kernel_isa(level),
                " ".join(name for bit, name in enumerate(CPU_FEATURES) if features >> bit & 1) or "none")


# The highest path whose products (qgemm's row, matrix-vector and tile kernels) and row kernels (norms,
# rotary) compute a row with the same operations whatever its batch, chunk or cached prefix: AMX's bfloat16
# tiles round differently from the paths below their thresholds.
BATCH_INVARIANT_CEILING = "avx512bf16"
_invariance_logged: bool | None = None


def apply_batch_invariance(enabled: bool) -> str | None:
    """Keep the kernels at or below BATCH_INVARIANT_CEILING and attention in its invariant mode
    (``enabled``: ``set_attention_invariant``), or let both take the CPU's best path; TIDESERVE_ISA, when
    set, stays the ceiling of the whole level. Returns the level in effect (None without the library).
    Process-wide, as the path is: engines in one process should agree."""
    global _invariance_logged
    lib = load_library()
    if lib is None:
        return None
    set_attention_invariant(enabled)
    if os.environ.get("TIDESERVE_ISA", "auto").strip().lower() not in ("", "auto"):
        return isa()
    best = ISA_LEVELS[lib.ts_isa_best()]
    capped = enabled and ISA_LEVELS.index(best) > ISA_LEVELS.index(BATCH_INVARIANT_CEILING)
    level = set_isa(BATCH_INVARIANT_CEILING if capped else "auto")
    if enabled and _invariance_logged is not True:
        logger.info("batch invariance: native kernels on %s, attention on %s for bfloat16 caches (best here: %s; "
                    "--no-batch-invariant takes it, and a request's tokens may then depend on its batch)", level,
                    attention_isa(torch.bfloat16, 64), best)
    _invariance_logged = enabled
    return level


def set_attention_invariant(on: bool) -> bool:
    """Attention's invariant mode: decode and prefill share one arithmetic per query (attn_rows.h's AVX2
    forms, or on AVX-512 BF16 CPUs with a bfloat16 cache the vdpbf16ps form), so a token's output does not
    depend on how its step was cut; off, each kernel takes its fastest form. Returns the previous mode."""
    lib = load_library()
    if lib is None:
        raise ValueError("set_attention_invariant: the native kernels are not available (no compiler, or "
                         "TIDESERVE_NATIVE=0)")
    return bool(lib.ts_set_attn_invariant(int(on)))


def attention_isa(kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """The path attention takes now for a cache of ``kv_dtype`` and heads of ``head_dim`` (ISA_LEVELS), or
    None without the library."""
    lib = load_library()
    return None if lib is None else ISA_LEVELS[lib.ts_attn_isa_level(CACHE_DTYPE_CODES[kv_dtype], head_dim)]


def kernel_isa(level: str) -> str:
    """The path decode attention, RMSNorm and rotary take at ``level``: they have none for AMX (its tiles
    serve GEMMs; decode attention is bound by reading the cache), so there they run AVX-512 BF16."""
    return "avx512bf16" if level == "amx" else level


def isa() -> str | None:
    """The instruction-set path the kernels run now (one of ISA_LEVELS), or None without the library."""
    lib = load_library()
    return None if lib is None else ISA_LEVELS[lib.ts_isa_level()]


def supported_isas() -> list[str]:
    """Every path this CPU and build can run, lowest first (what ``set_isa`` accepts)."""
    lib = load_library()
    return [] if lib is None else list(ISA_LEVELS[: lib.ts_isa_best() + 1])


def set_isa(name: str) -> str:
    """Run the kernels on path ``name`` (``"auto"``: the best one) from now on; returns the path in use.
    For tests and benchmarks: not while kernels run on other threads."""
    lib = load_library()
    if lib is None:
        raise ValueError("set_isa: the native kernels are not available (no compiler, or TIDESERVE_NATIVE=0)")
    if name != "auto" and name not in supported_isas():
        raise ValueError(f"isa {name!r} is not supported here; supported: auto, {', '.join(supported_isas())}")
    return ISA_LEVELS[lib.ts_set_isa_level(-1 if name == "auto" else ISA_LEVELS.index(name))]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, num_threads: int | None = None, *, window: int = 0,
                           softcap: float = 0.0) -> bool:
    """out[i] = attention of q[i] ([H, D]) over request i's first context_lens[i] cached keys (the last
    ``window`` of them when window > 0; scores capped to softcap * tanh(s / softcap) when softcap > 0).

    q, out: [N, H, D], both float32 or both bfloat16, with unit stride in D and D in H (rows may be
    strided); k_cache, v_cache: contiguous [num_blocks, block_size, KVH, D], float32, bfloat16 or float8_e4m3fn;
    block_tables [N, W] and context_lens [N] int64, with every block id below num_blocks. ``num_threads``
    defaults to torch's. Returns False, computing nothing, when the inputs do not fit.
    """
    lib = load_library()
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    ok = (lib is not None and n > 0 and q.dtype == out.dtype and q.dtype in _TS_DTYPES
          and k_cache.dtype in CACHE_DTYPE_CODES
          and v_cache.dtype == k_cache.dtype and q.device.type == k_cache.device.type == "cpu"
          and k_cache.is_contiguous() and v_cache.is_contiguous()
          and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
          and block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.is_contiguous()
          and context_lens.is_contiguous() and num_heads % num_kv_heads == 0
          and block_tables.shape[0] == context_lens.shape[0] == n)
    if not ok:
        return False
    failed = lib.ts_paged_decode_window(
        q.data_ptr(), q.stride(0), _TS_DTYPES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_DTYPE_CODES[k_cache.dtype], block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
        out.data_ptr(), out.stride(0), _TS_DTYPES[out.dtype], n, num_heads, num_kv_heads, head_dim,
        k_cache.shape[1], scale, window, softcap, num_threads or intra_op_threads())
    return failed == 0


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                            block_size: int, query_start: torch.Tensor, query_lens: torch.Tensor,
                            computed: torch.Tensor, scale: float, out: torch.Tensor,
                            num_threads: int | None = None, *, window: int = 0, softcap: float = 0.0) -> bool:
    """Causal attention of prefill spans: rows ``query_start[s] .. + query_lens[s]`` of q and out ([T, H, D])
    are span s's queries, query i attending its keys 0 .. ``computed[s] + i`` (only the last ``window`` of
    them when window > 0; scores capped to softcap * tanh(s / softcap) when softcap > 0); the key at position p is
    row ``tables[s, p // block_size] * block_size + p % block_size`` of k and v ([slots, KVH, D]: a cache
    viewed as ``cache.view(-1, KVH, D)``, or the step's own k/v rows with block_size 1).

    q, out: both float32 or both bfloat16 with unit stride in D and D in H (rows may be strided); k, v:
    float32, bfloat16 or float8_e4m3fn, rows of [KVH, D] (may be strided); tables [S, W], query_start,
    query_lens and computed [S], int64 and contiguous, every slot they name within k and v. Returns False,
    computing nothing, when the inputs do not fit.
    """
    lib = load_library()
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    ok = (lib is not None and q.dtype == out.dtype and q.dtype in _TS_DTYPES and k.dtype in CACHE_DTYPE_CODES
          and v.dtype == k.dtype and q.device.type == k.device.type == v.device.type == out.device.type == "cpu"
          and k.shape == v.shape and k.stride() == v.stride() and k.shape[2] == head_dim
          and k.stride(2) == 1 and k.stride(1) == head_dim
          and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
          and all(t.dtype == torch.int64 and t.is_contiguous() for t in (tables, query_start, query_lens, computed))
          and num_heads % num_kv_heads == 0 and query_start.shape == query_lens.shape == computed.shape
          and tables.shape[0] == query_start.shape[0])
    if not ok:
        return False
    failed = lib.ts_paged_prefill_window(
        q.data_ptr(), q.stride(0), _TS_DTYPES[q.dtype], k.data_ptr(), v.data_ptr(), CACHE_DTYPE_CODES[k.dtype],
        k.stride(0), tables.data_ptr(), tables.shape[1], block_size, query_start.data_ptr(), query_lens.data_ptr(),
        computed.data_ptr(), query_start.shape[0], out.data_ptr(), out.stride(0), _TS_DTYPES[out.dtype], num_heads,
        num_kv_heads, head_dim, scale, window, softcap, num_threads or intra_op_threads())
    return failed == 0


def prefill_uses_tiles(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill attention over keys and values of ``kv_dtype`` takes a bfloat16 form at the level in
    use: a bfloat16 cache with head_dim a multiple of 32, on AMX tiles where the CPU has them, else through
    vdpbf16ps where it has AVX-512 BF16. Those forms take bfloat16 queries and probabilities."""
    lib = load_library()
    return (lib is not None and kv_dtype in CACHE_DTYPE_CODES
            and bool(lib.ts_paged_prefill_tiles(CACHE_DTYPE_CODES[kv_dtype], head_dim)))


def prefill_form(kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """The bfloat16 form prefill attention takes at the level in use ("amx tiles" or "vdpbf16ps"), or None
    for the float32 form."""
    lib = load_library()
    if lib is None or kv_dtype not in CACHE_DTYPE_CODES:
        return None
    return {1: "vdpbf16ps", 2: "amx tiles"}.get(int(lib.ts_paged_prefill_tiles(CACHE_DTYPE_CODES[kv_dtype], head_dim)))


@contextmanager
def prefill_items_gather_their_keys() -> Iterator[None]:
    """Within: the bfloat16 forms of prefill attention do not pack a call's keys and values first, and each
    work item gathers the keys it reads, as calls past the packing's size limit do (tests of that path)."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    previous = lib.ts_paged_prefill_set_pack_limit(0)
    try:
        yield
    finally:
        lib.ts_paged_prefill_set_pack_limit(previous)


def prefill_packed_calls() -> int:
    """Prefill-attention calls that packed their keys and values once for all their work items, since the
    library loaded."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return int(lib.ts_paged_prefill_packed_calls())


def _plain_f32(*tensors: torch.Tensor | None) -> bool:
    """float32, on the CPU, contiguous (None entries are optional arguments left out). A plain loop: this
    runs several hundred times per decode step."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
            return False
    return True


def _plain(dtype: torch.dtype, *tensors: torch.Tensor | None) -> bool:
    """As _plain_f32, for ``dtype``."""
    for t in tensors:
        if t is not None and (t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """x / rms(x) * weight over the last dimension; with ``residual``, first ``residual += x`` (in place)
    and normalise the sum. float32, or bfloat16 rounded as torch's bfloat16 operators round (x, weight and
    residual all of one dtype). None, touching nothing, when the inputs do not fit the kernel."""
    lib = load_library()
    if lib is None or x.numel() == 0 or x.dtype not in _TS_DTYPES or not _plain(x.dtype, x, weight, residual):
        return None
    cols = x.shape[-1]
    rows = x.numel() // cols
    if weight.numel() != cols or (residual is not None and residual.shape != x.shape):
        return None
    out = torch.empty_like(x)
    suffix = KV_DTYPES[x.dtype]
    if residual is None:
        getattr(lib, f"ts_rms_norm_{suffix}")(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
                                              intra_op_threads())
    else:
        getattr(lib, f"ts_add_rms_norm_{suffix}")(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                                  out.data_ptr(), rows, cols, eps, intra_op_threads())
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
                         row_max.data_ptr(), m, k, intra_op_threads())
    return rows, row_max


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Row-wise index of the first maximum of x [M, N] float32 (rows may be strided), int64 [M]: what
    ``x.max(dim=-1).indices`` gives, in one pass. None when the input does not fit the kernel or a row
    holds a NaN (torch's max then decides how it propagates)."""
    lib = load_library()
    if (lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0
            or x.stride(1) != 1):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    failed = lib.ts_argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                                    intra_op_threads())
    return None if failed else out


def scale_rows_(y: torch.Tensor, row_max: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """y[r] = y[r] * row_max[r] (+ bias), in place; False, touching nothing, when the inputs do not fit."""
    lib = load_library()
    if lib is None or y.dim() != 2 or not _plain_f32(y, row_max, bias):
        return False
    lib.ts_scale_rows_f32(y.data_ptr(), row_max.data_ptr(), None if bias is None else bias.data_ptr(),
                          y.data_ptr(), y.shape[0], y.shape[1], intra_op_threads())
    return True


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Rotate the q and k heads of qkv [T, (H + 2 KVH) * D] in place and store k and v at ``slots`` in the
    caches ([num_blocks, block_size, KVH, D], float32, bfloat16 or float8_e4m3fn); see rope_store.c. qkv, cos
    and sin are all float32 or all bfloat16; cos and sin hold rotary_dim / 2 values per token (rotary_dim < D:
    partial rotary). False, touching nothing, when the inputs do not fit the kernel."""
    lib = load_library()
    if lib is None or qkv.dim() != 2 or qkv.shape[0] == 0:
        return False
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    rotary_dim = 2 * cos.shape[-1]
    ok = (qkv.dtype == cos.dtype == sin.dtype and qkv.dtype in _TS_DTYPES and qkv.device.type == "cpu"
          and qkv.stride(1) == 1
          and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
          and 0 < rotary_dim <= head_dim
          and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == tokens * rotary_dim // 2
          and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
          and k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPE_CODES and k_cache.device.type == "cpu"
          and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2] == num_kv_heads)
    if not ok:
        return False
    kernel = lib.ts_rope_store_f32 if qkv.dtype == torch.float32 else lib.ts_rope_store_bf16
    kernel(qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_dim, rotary_dim, cos.data_ptr(),
           sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype],
           intra_op_threads())
    return True


# ---------------------------------------------------------------------------------------------------------
# Bound kernels: the hot path's entry points. Each ``bind_*`` checks once (library, device, dtypes, layout)
# what the functions above check on every call, and returns the ctypes function(s) to call directly, or
# None when the kernel cannot serve that configuration (the caller then binds its torch fallback). The
# callers (model/attention/cpu_native.py, model/layers/norm.py, model/layers/quant/weights.py) own the
# per-call contract: tensors of the bound dtype, contiguous, on the CPU.


def bind_paged_decode(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                      num_kv_heads: int) -> Callable[..., None] | None:
    """``fn(q, k_cache, v_cache, block_tables, context_lens, scale, out, window=0, softcap=0.0)`` as
    ``paged_decode_attention`` for q/out of ``dtype`` and caches of ``kv_dtype``, or None."""
    lib = load_library()
    if lib is None or dtype not in _TS_DTYPES or kv_dtype not in CACHE_DTYPE_CODES or num_heads % num_kv_heads:
        return None
    kernel, q_code, kv_code = lib.ts_paged_decode_window, _TS_DTYPES[dtype], CACHE_DTYPE_CODES[kv_dtype]

    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, window=0, softcap=0.0) -> None:
        kernel(q.data_ptr(), q.stride(0), q_code, k_cache.data_ptr(), v_cache.data_ptr(), kv_code,
               block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
               out.stride(0), q_code, q.shape[0], num_heads, num_kv_heads, q.shape[2], k_cache.shape[1], scale,
               window, softcap, intra_op_threads())

    return paged_decode


def bind_paged_prefill(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                       num_kv_heads: int) -> Callable[..., bool] | None:
    """``fn(q, k, v, tables, block_size, query_start, query_lens, computed, scale, out, window=0, softcap=0.0)
    -> ok`` as
    ``paged_prefill_attention`` for q/out of ``dtype`` and k/v of ``kv_dtype`` (the cache's, or the model's
    own for a step's fresh rows), or None. False means the kernel found no scratch memory."""
    lib = load_library()
    if lib is None or dtype not in _TS_DTYPES or kv_dtype not in CACHE_DTYPE_CODES or num_heads % num_kv_heads:
        return None
    kernel, q_code, kv_code = lib.ts_paged_prefill_window, _TS_DTYPES[dtype], CACHE_DTYPE_CODES[kv_dtype]

    def paged_prefill(q, k, v, tables, block_size, query_start, query_lens, computed, scale, out, window=0,
                      softcap=0.0) -> bool:
        return kernel(q.data_ptr(), q.stride(0), q_code, k.data_ptr(), v.data_ptr(), kv_code, k.stride(0),
                      tables.data_ptr(), tables.shape[1], block_size, query_start.data_ptr(),
                      query_lens.data_ptr(), computed.data_ptr(), query_start.shape[0], out.data_ptr(),
                      out.stride(0), q_code, num_heads, num_kv_heads, q.shape[2], scale, window, softcap,
                      intra_op_threads()) == 0

    return paged_prefill


def bind_rope_store(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> Callable[..., None] | None:
    """``fn(qkv, cos, sin, slots, k_cache, v_cache)`` as ``rope_store`` for qkv/cos/sin of ``dtype`` and
    caches of ``kv_dtype``, or None. The rotated width is read from cos (2 * its last dimension), so the
    same bound kernel serves full and partial rotary."""
    lib = load_library()
    if lib is None or dtype not in _TS_DTYPES or kv_dtype not in CACHE_DTYPE_CODES or head_dim % 2:
        return None
    kernel = lib.ts_rope_store_f32 if dtype == torch.float32 else lib.ts_rope_store_bf16
    kv_code = CACHE_DTYPE_CODES[kv_dtype]

    def rope_store_bound(qkv, cos, sin, slots, k_cache, v_cache) -> None:
        kernel(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim, 2 * cos.shape[-1],
               cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_code,
               intra_op_threads())

    return rope_store_bound


def bind_rms_norm(dtype: torch.dtype, device: torch.device | str) -> tuple[Callable[..., None],
                                                                        Callable[..., None]] | None:
    """(``norm(x, weight, eps, out)``, ``add_norm(x, residual, weight, eps, out)``) as ``rms_norm`` for
    contiguous CPU tensors of ``dtype``, or None. (Python closures, so a deep-copied module shares them.)"""
    lib = load_library()
    if lib is None or torch.device(device).type != "cpu" or dtype not in _TS_DTYPES:
        return None
    suffix = KV_DTYPES[dtype]
    plain, fused = getattr(lib, f"ts_rms_norm_{suffix}"), getattr(lib, f"ts_add_rms_norm_{suffix}")

    def norm(x, weight, eps, out) -> None:
        cols = x.shape[-1]
        plain(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps, intra_op_threads())

    def add_norm(x, residual, weight, eps, out) -> None:
        cols = x.shape[-1]
        fused(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps,
              intra_op_threads())

    return norm, add_norm


def bind_rms_norm_heads(dtype: torch.dtype, device: torch.device | str) -> Callable[..., None] | None:
    """``norm_heads_(x, weight, eps)`` for CPU tensors of ``dtype``, or None: in place, every
    ``weight``-wide head of x [T, heads * head_dim] normalised on its own. x may be a view whose rows are
    strided (the q or k columns of a fused qkv output) but whose columns are contiguous."""
    lib = load_library()
    if lib is None or torch.device(device).type != "cpu" or dtype not in _TS_DTYPES:
        return None
    kernel = getattr(lib, f"ts_rms_norm_heads_{KV_DTYPES[dtype]}")

    def norm_heads_(x, weight, eps) -> None:
        head_dim = weight.shape[0]
        kernel(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1] // head_dim, head_dim, weight.data_ptr(), eps,
               intra_op_threads())

    return norm_heads_


def bind_int8_rows() -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], Callable[..., None]] | None:
    """(``rows(x, inv_smooth) -> (rows, row_max)``, ``scale(y, row_max, bias)``) as ``int8_rows`` and
    ``scale_rows_`` for contiguous float32 CPU tensors (the only place int8 runs), or None."""
    lib = load_library()
    if lib is None:
        return None
    rows_kernel, scale_kernel = lib.ts_int8_rows_f32, lib.ts_scale_rows_f32

    def rows(x, inv_smooth):
        m, k = x.shape
        out, row_max = torch.empty(m + 1, k), torch.empty(m, 1)
        rows_kernel(x.data_ptr(), None if inv_smooth is None else inv_smooth.data_ptr(), out.data_ptr(),
                    row_max.data_ptr(), m, k, intra_op_threads())
        return out, row_max

    def scale(y, row_max, bias) -> None:
        scale_kernel(y.data_ptr(), row_max.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     y.shape[0], y.shape[1], intra_op_threads())

    return rows, scale
