"""Attention backends, each with its metadata builder and its kernels (see backend.py):

- ``torch``: SDPA over gathered blocks, decodes in groups of similar length; runs everywhere, the reference.
- ``cpu-native``: the CPU's C kernels (decode reads the paged cache in place; rotary fused with the store).
- ``triton``: Triton kernels for paged decode and prefill on CUDA (CPU only under TRITON_INTERPRET=1).

The runner describes each step once (``BatchLayout``) and asks its backend for the metadata; the model
attends through ``meta.backend``.
"""

from tideserve.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    GroupedMetadata,
    metadata_per_layer,
    store_kv,
)
from tideserve.model.attention.batch_layout import BatchLayout, PrefillSpan
from tideserve.model.attention.cpu_native import CpuNativeBackend, CpuNativeMetadata
from tideserve.model.attention.selector import ATTENTION_BACKENDS, backend_for_model, select_attention_backend
from tideserve.model.attention.torch_sdpa import DecodeGroup, TorchMetadata, TorchSDPABackend, group_by_blocks
from tideserve.model.attention.triton_backend import TritonBackend, TritonMetadata

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "BatchLayout", "CpuNativeBackend",
    "CpuNativeMetadata", "DecodeGroup", "GroupedMetadata", "PrefillSpan", "TorchMetadata", "TorchSDPABackend",
    "TritonBackend", "TritonMetadata", "backend_for_model", "group_by_blocks", "metadata_per_layer",
    "select_attention_backend", "store_kv",
]
