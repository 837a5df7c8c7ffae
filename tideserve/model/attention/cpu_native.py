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
    """Prefill chunks attended by one kernel call, their keys read from the paged cache, fresh prompts'
    too: every later step reads them there, in the cache's dtype, so a token's attention has the same bits
    whether its prompt was fresh, after a cached prefix, chunked or decoded (paged_prefill.c,
    attn_rows.h). All int64 [chunks] but ``tables``, [chunks, width]."""

    tables: torch.Tensor  # the chunks' block tables
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
        self._prefill = native.bind_paged_prefill(dtype, kv_dtype, num_heads, num_kv_heads)

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
            meta.prefills.append(PrefillCall(to_dev(np.ascontiguousarray(layout.block_tables[rows])),
                                             to_dev(layout.query_start_loc[rows]), to_dev(layout.query_lens[rows]),
                                             to_dev(layout.num_computed[rows])))
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: CpuNativeMetadata, scale, out, *, window=0, softcap=0.0):
        n = meta.num_decode_tokens
        if n:
            self._paged_decode(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                               out[:n], window, softcap)
        keys = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        values = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        for call in meta.prefills:
            if not self._prefill(q, keys, values, call.tables, k_cache.shape[1], call.query_start, call.query_lens,
                                 call.computed, scale, out, window, softcap):
                raise RuntimeError("native prefill attention failed: its scratch memory could not be allocated")
