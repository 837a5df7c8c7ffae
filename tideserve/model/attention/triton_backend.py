"""The GPU backend: Triton kernels for paged decode and paged prefill (tideserve/model/attention/triton/).

Both kernels read the block tables in place, so nothing is gathered or padded; this step's K/V are stored
through ``slot_mapping`` first, then decodes and prefill chunks (with or without a cached prefix) attend
over the cache, within a sliding window and with soft-capped scores where the layer asks for them. The
kernels are imported once, at construction, so a missing ``triton`` is a start-up error, not a failure in
the middle of a step. On the CPU the kernels run only under Triton's interpreter
(``TRITON_INTERPRET=1``): slow, and meant for tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from tideserve.model.attention.backend import AttentionBackend, AttentionMetadata
from tideserve.model.attention.batch_layout import BatchLayout
from tideserve.platform import platform_for


@dataclass
class TritonMetadata(AttentionMetadata):
    """The kernels' contract, all int32: decodes' block tables [N, W] and context lengths [N]; prefills'
    block tables [S, W], query start offsets [S + 1] (from 0, over the prefill tokens only) and context
    lengths [S] (every key, cached prefix and this chunk; a chunk's queries are its last positions)."""

    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_max_context_len: int | None = None  # known on the host: the kernel need not read it back
    prefill_block_tables: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_max_query_len: int | None = None


def _load_kernels():
    """(paged_decode_attention, paged_prefill_attention), imported here so that the rest of tideserve never
    needs triton."""
    from tideserve.model.attention.triton.paged_decode import paged_decode_attention
    from tideserve.model.attention.triton.paged_prefill import paged_prefill_attention

    return paged_decode_attention, paged_prefill_attention


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_fields = ("slot_mapping", "decode_block_tables", "decode_context_lens")

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        platform = platform_for(self.device)
        if "triton" not in platform.attention_backends and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' runs on CUDA devices, not {platform.device_name} (on the CPU "
                             "only under Triton's interpreter, TRITON_INTERPRET=1, for tests); use "
                             "attention_backend='auto', 'cpu-native' or 'torch'.")
        try:
            self._decode, self._prefill = _load_kernels()
        except ImportError as exc:
            raise ValueError(f"attention_backend='triton' needs the triton package and tideserve's Triton "
                             f"kernels ({exc}); pip install triton, or use attention_backend='auto' or "
                             "'torch'.") from exc

    @staticmethod
    def available() -> bool:
        try:
            _load_kernels()
        except ImportError:
            return False
        return True

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        to_dev = self._to_device
        n = layout.num_decodes
        meta = TritonMetadata(self, to_dev(layout.slot_mapping), n)
        int32 = lambda a: to_dev(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        if n:
            meta.decode_block_tables = int32(layout.block_tables[:n])
            meta.decode_context_lens = int32(layout.context_lens[:n])
            meta.decode_max_context_len = int(layout.context_lens[:n].max())
        if n < len(layout.query_lens):
            meta.prefill_block_tables = int32(layout.block_tables[n:])
            meta.prefill_query_start_loc = int32(layout.query_start_loc[n:] - layout.query_start_loc[n])
            meta.prefill_context_lens = int32(layout.context_lens[n:])
            meta.prefill_max_query_len = int(layout.query_lens[n:].max())
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale, out, *, window=0, softcap=0.0):
        n = meta.num_decode_tokens
        if n:
            self._decode(q[:n].contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                         scale, out[:n], max_context_len=meta.decode_max_context_len, window=window,
                         softcap=softcap)
        if meta.prefill_block_tables is not None:
            self._prefill(q[n:].contiguous(), k_cache, v_cache, meta.prefill_block_tables,
                          meta.prefill_query_start_loc, meta.prefill_context_lens, scale, out[n:],
                          max_query_len=meta.prefill_max_query_len, window=window, softcap=softcap)
