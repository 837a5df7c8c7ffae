"""The CPU backend: decode attention reads the paged cache in place (tideserve/native/paged_decode.c),
prefill chunks attend causally with a flash-style kernel of their own (paged_prefill.c), and rotary is
fused with the KV store (rope_store.c).

Why in place: on the CPU decode attention is bound by memory traffic, and torch must first gather each
request's blocks into a contiguous copy; a chunk after a cached prefix needs the same gather for torch's
SDPA, whose CPU kernel is also a few times slower than ours at prompt sizes (docs/benchmarks.md). The
kernels are bound once, at construction, for the model's dtype, the cache's dtype and the heads;
``supported`` says whether they can be (the selector asks it), so a step makes no per-call checks and
never falls back half-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tideserve import native
from tideserve.model.attention.backend import AttentionBackend, AttentionMetadata
from tideserve.model.attention.batch_layout import BatchLayout
from tideserve.platform import platform_for


@dataclass
class PrefillCall:
    """Prefill chunks whose keys lie in one place, attended by one kernel call: the paged cache (chunks
    after a cached prefix, or every chunk when the cache holds the model's own dtype), or this step's own
    k/v rows (fresh prompts over a cache of another dtype, so their keys keep the model's precision, as
    torch's SDPA path gives them). All int64 [chunks] but ``tables``, [chunks, width]."""

    from_cache: bool
    tables: torch.Tensor  # cache: the chunks' block tables; own rows: row ids, read with block size 1
    query_start: torch.Tensor
    query_lens: torch.Tensor
    computed: torch.Tensor  # tokens cached before each chunk (its first query's position)


@dataclass
class CpuNativeMetadata(AttentionMetadata):
    """Decodes as the kernel reads them: raw block tables (padding never read) and context lengths, int64;
    prefill chunks as the calls of the prefill kernel. model/native_decode.py (a whole decode step in one
    call) reads the same."""

    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillCall] = field(default_factory=list)


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype,
                       num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the CPU kernels cannot serve this model here, or None when they can."""
    try:
        backends = platform_for(torch.device(device)).attention_backends
    except ValueError:  # a device tideserve has no platform for
        backends = ()
    if "cpu-native" not in backends:
        return f"it runs on the CPU, not {torch.device(device)}"
    if native.load_library() is None:
        return "the native kernels are not available (no C compiler, a failed build, or TIDESERVE_NATIVE=0)"
    kernel_dtypes = ", ".join(str(d).removeprefix("torch.") for d in native.KV_DTYPES)
    if dtype not in native.KV_DTYPES:
        return f"the model's dtype {str(dtype).removeprefix('torch.')} has no kernel (kernels: {kernel_dtypes})"
    if kv_dtype not in native.CACHE_DTYPE_CODES:
        cache_dtypes = ", ".join(str(d).removeprefix("torch.") for d in native.CACHE_DTYPE_CODES)
        return (f"the KV cache dtype {str(kv_dtype).removeprefix('torch.')} has no kernel "
                f"(kernels: {cache_dtypes})")
    if num_heads % num_kv_heads or head_dim % 2:
        return f"{num_heads} heads over {num_kv_heads} KV heads of size {head_dim} do not fit the kernels"
    return None


class CpuNativeBackend(AttentionBackend):
    name = "cpu-native"
    graph_fields = ("slot_mapping", "decode_block_tables", "decode_context_lens")

    def __init__(self, device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int) -> None:
        super().__init__(device)
        reason = unsupported_reason(device, dtype, kv_dtype, num_heads, num_kv_heads, head_dim)
        if reason is not None:
            raise ValueError(f"attention_backend='cpu-native' cannot run here: {reason}; use "
                             "attention_backend='auto' or 'torch'.")
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self._paged_decode = native.bind_paged_decode(dtype, kv_dtype, num_heads, num_kv_heads)
        self.rope_store = native.bind_rope_store(dtype, kv_dtype, num_heads, num_kv_heads, head_dim)
        # Prefill keys come from the cache (its dtype) or from the step's own rows (the model's dtype).
        self._prefill_from_cache = native.bind_paged_prefill(dtype, kv_dtype, num_heads, num_kv_heads)
        self._prefill_own_rows = native.bind_paged_prefill(dtype, dtype, num_heads, num_kv_heads)

    @staticmethod
    def supported(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> bool:
        return unsupported_reason(device, dtype, kv_dtype, num_heads, num_kv_heads, head_dim) is None

    def describe(self) -> str:
        level = native.isa() or "scalar"
        form = native.prefill_form(self.kv_dtype, self.head_dim)
        prefill = f"; prefill on {form}" if form else ""
        return f"{self.name} (native kernel, {native.kernel_isa(level)}{prefill})"

    def build_metadata(self, layout: BatchLayout) -> CpuNativeMetadata:
        to_dev = self._to_device
        n = layout.num_decodes
        meta = CpuNativeMetadata(self, to_dev(layout.slot_mapping), n)
        if n:
            meta.decode_block_tables = to_dev(layout.block_tables[:n])
            meta.decode_context_lens = to_dev(layout.context_lens[:n].copy())
        rows = np.arange(n, len(layout.query_lens))
        if len(rows):
            own_rows = layout.num_computed[rows] == 0
            # the cache holds exactly this step's k/v, or the bfloat16 forms (bfloat16 caches) round them so anyway:
            # read everything there
            if self.kv_dtype == self.dtype or native.prefill_uses_tiles(self.kv_dtype, self.head_dim):
                own_rows[:] = False
            for from_cache, chosen in ((True, rows[~own_rows]), (False, rows[own_rows])):
                if not len(chosen):
                    continue
                starts, lens = layout.query_start_loc[chosen], layout.query_lens[chosen]
                if from_cache:
                    tables = layout.block_tables[chosen]
                else:
                    tables = starts[:, None] + np.arange(int(lens.max()), dtype=np.int64)[None, :]
                meta.prefills.append(PrefillCall(from_cache, to_dev(np.ascontiguousarray(tables)), to_dev(starts),
                                                 to_dev(lens), to_dev(layout.num_computed[chosen])))
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: CpuNativeMetadata, scale, out):
        n = meta.num_decode_tokens
        if n:
            self._paged_decode(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                               out[:n])
        for call in meta.prefills:
            if call.from_cache:
                keys = k_cache.view(-1, self.num_kv_heads, self.head_dim)
                values, block_size = v_cache.view(-1, self.num_kv_heads, self.head_dim), k_cache.shape[1]
                prefill = self._prefill_from_cache
            else:
                keys, values, block_size, prefill = k, v, 1, self._prefill_own_rows
            if not prefill(q, keys, values, call.tables, block_size, call.query_start, call.query_lens,
                           call.computed, scale, out):
                raise RuntimeError("native prefill attention failed: its scratch memory could not be allocated")
