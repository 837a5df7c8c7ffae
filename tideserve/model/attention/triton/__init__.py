"""Triton kernels for paged attention on GPUs: decode (one query token per sequence, split-K for long
contexts) and prefill (variable-length query chunks over a cached prefix).

Both read the paged KV cache in place through the block tables: no gather into a contiguous copy. On a
machine without a GPU they run (slowly) under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this package is imported), which is how the test suite checks them against a torch reference.
Importing this package needs ``triton``; the attention backend imports it only where it runs.
"""

from tideserve.model.attention.triton.paged_decode import (
    PARTITION_SIZE,
    num_partitions,
    paged_decode_attention,
)
from tideserve.model.attention.triton.paged_prefill import paged_prefill_attention

__all__ = ["PARTITION_SIZE", "num_partitions", "paged_decode_attention", "paged_prefill_attention"]
