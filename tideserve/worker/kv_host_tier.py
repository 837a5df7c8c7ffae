"""One rank's host tier (``--kv-offloading-size``): full prefix blocks in host memory, by tier key.

The rows live outside the KV pool (one array per block, allocated as blocks arrive and freed as the LRU
bound drops them), so the elastic pool can give its pages back on an idle shrink while the prefixes it
held stay here; on a GPU they are host memory below device memory, as in vLLM's CPU offloading. A row is
the payload a disk file carries (``KVCacheStorage.read_blocks``: every layer's K then V) with no header:
memory needs no checksum, and nothing outlives the process. Which keys it holds and their order of use is
the engine's ``TierIndex``; this class only keeps the bytes, so ``save``, ``load_into`` and ``remove`` are
its whole contract, the same as the disk tier's (``worker/kv_disk_tier.py``), including loads that run on
a thread of their own while the engine steps.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tideserve.worker.kv_disk_tier import TierLoadResult


class HostTier:
    """Block payloads in host memory, by tier key; thread-safe (loads copy out on their own thread)."""

    error: str | None = None  # memory does not fail as storage does: the tier never turns itself off

    def __init__(self) -> None:
        self._rows: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()
        self._loads: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="kv-host-load")

    def __len__(self) -> int:
        return len(self._rows)

    def file_bytes(self, payload_bytes: int) -> int:
        """What one block takes here: its payload."""
        return payload_bytes

    def save(self, key: bytes, payload: np.ndarray) -> None:
        """Keep a copy of a block's payload (a row of a batch: copied, so the batch is not kept alive)."""
        row = np.array(payload, dtype=np.uint8, copy=True)
        with self._lock:
            self._rows[key] = row

    def start_load(self, keys: list[bytes], payload_bytes: int, out: memoryview) -> Future[TierLoadResult]:
        """``load_into`` on the tier's own thread; ``out`` must stay alive and untouched until it is done."""
        if self._loads is None:
            raise RuntimeError("the host tier is closed")
        return self._loads.submit(self.load_into, keys, payload_bytes, out)

    def load_into(self, keys: list[bytes], payload_bytes: int, out: memoryview) -> TierLoadResult:
        """Copy the payloads of ``keys`` into consecutive rows of ``out``, in order, up to the first missing
        one (dropped meanwhile). A row is never written after ``save``, so it is copied outside the lock."""
        rows = np.frombuffer(out, dtype=np.uint8)
        result = TierLoadResult(0, [], 0)
        for i, key in enumerate(keys):
            with self._lock:
                row = self._rows.get(key)
            if row is None or row.size != payload_bytes:
                break
            rows[i * payload_bytes:(i + 1) * payload_bytes] = row
            result.num_loaded += 1
            result.bytes_read += payload_bytes
        return result

    def remove(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._rows.pop(key, None)

    def close(self) -> None:
        """Finish the loads under way and free every row."""
        if self._loads is not None:
            self._loads.shutdown(wait=True)
            self._loads = None
        with self._lock:
            self._rows.clear()
