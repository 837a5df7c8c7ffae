"""The CPU backend: decode attention reads the paged cache in place (tideserve/native/paged_decode.c), and
rotary is fused with the KV store (rope_store.c); prefill chunks run torch's SDPA (torch_sdpa.py).

Why in place: on the CPU decode attention is bound by memory traffic, and torch must first gather each
request's blocks into a contiguous copy. Both kernels are bound once, at construction, for the model's
dtype, the cache's dtype and the heads; ``supported`` says whether they can be (the selector asks it),
so a step makes no per-call checks and never falls back half-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tideserve import native
from tideserve.model.attention.backend import AttentionBackend
from tideserve.model.attention.metadata import AttentionMetadata, BatchLayout, PrefillSpan
from tideserve.model.attention.torch_sdpa import attend_prefills, build_prefill_spans
from tideserve.platform import platform_for


@dataclass
class CpuNativeMetadata(AttentionMetadata):
    """Decodes as the kernel reads them: raw block tables (padding never read) and context lengths, int64;
    prefills as SDPA spans. model/native_decode.py (a whole decode step in one call) reads the same."""

    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillSpan] = field(default_factory=list)


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
        self._paged_decode = native.bind_paged_decode(dtype, kv_dtype, num_heads, num_kv_heads)
        self.rope_store = native.bind_rope_store(dtype, kv_dtype, num_heads, num_kv_heads, head_dim)

    @staticmethod
    def supported(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> bool:
        return unsupported_reason(device, dtype, kv_dtype, num_heads, num_kv_heads, head_dim) is None

    def describe(self) -> str:
        return f"{self.name} (native kernel, {native.kernel_isa(native.isa() or 'scalar')})"

    def build_metadata(self, layout: BatchLayout) -> CpuNativeMetadata:
        to_dev = self._to_device
        n = layout.num_decodes
        meta = CpuNativeMetadata(self, to_dev(layout.slot_mapping), n)
        if n:
            meta.decode_block_tables = to_dev(layout.block_tables[:n])
            meta.decode_context_lens = to_dev(layout.context_lens[:n].copy())
        meta.prefills = build_prefill_spans(layout, to_dev)
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: CpuNativeMetadata, scale, out):
        n = meta.num_decode_tokens
        if n:
            self._paged_decode(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                               out[:n])
        attend_prefills(q, k, v, k_cache, v_cache, meta.prefills, scale, out)
