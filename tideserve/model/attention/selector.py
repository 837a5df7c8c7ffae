"""``--attention-backend``: which backend an engine runs, decided once at load from the device, the
model's dtype, the KV cache's dtype and the heads.

auto: cpu-native on the CPU when the native kernels load and the dtypes fit; triton on CUDA when triton
and the kernels import; else torch (which runs everywhere). An explicit choice that cannot run here is a
ValueError saying why, never a silent substitute.
"""

from __future__ import annotations

import torch

from tideserve.config import ATTENTION_BACKENDS
from tideserve.model.attention.backend import AttentionBackend
from tideserve.model.attention.cpu_native import CpuNativeBackend
from tideserve.model.attention.torch_sdpa import TorchSDPABackend
from tideserve.model.attention.triton_backend import TritonBackend
from tideserve.platform import platform_for

__all__ = ["ATTENTION_BACKENDS", "backend_for_model", "select_attention_backend"]


def select_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype,
                             num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    """The backend ``name`` (one of ATTENTION_BACKENDS), constructed with its kernels bound."""
    device = torch.device(device)
    fp8_cache = kv_dtype.is_floating_point and kv_dtype.itemsize == 1  # the Triton kernels read 16/32-bit caches
    if name == "auto":  # the platform's backends, best first; torch runs everywhere
        fits = {"cpu-native": lambda: CpuNativeBackend.supported(device, dtype, kv_dtype, num_heads, num_kv_heads,
                                                                 head_dim),
                "triton": lambda: TritonBackend.available() and not fp8_cache, "torch": lambda: True}
        name = next((b for b in platform_for(device).attention_backends if fits[b]()), "torch")
    if name == "torch":
        return TorchSDPABackend(device)
    if name == "cpu-native":
        return CpuNativeBackend(device, dtype, kv_dtype, num_heads, num_kv_heads, head_dim)
    if name == "triton":
        if fp8_cache:
            raise ValueError("attention_backend='triton' has no kernels for an fp8 KV cache; use "
                             "attention_backend='auto' or 'torch', or another kv_cache_dtype.")
        return TritonBackend(device)
    raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}.")


def backend_for_model(name: str, model: torch.nn.Module, kv_dtype: torch.dtype,
                      device: torch.device | str) -> AttentionBackend:
    """``select_attention_backend`` for a model (its dtype and ``arch``'s heads). Every backend runs
    sliding-window and soft-capped layers (Gemma, Phi-3), so the model's attention options narrow nothing."""
    arch = model.arch
    return select_attention_backend(name, device, model.dtype, kv_dtype, arch.num_attention_heads,
                                    arch.num_key_value_heads, arch.head_dim)
