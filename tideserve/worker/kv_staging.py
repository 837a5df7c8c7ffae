"""Host buffers that the KV tiers' loads read blocks into before they are copied into the pool, kept
between loads.

Why keep them: a fresh buffer of a long prompt's blocks (tens to hundreds of MiB) is fresh pages, and on
virtual machines that hand freed memory back to the host a first touch costs 3-8 s per GiB, more than the
read itself; glibc returns such large blocks to the system as soon as they are freed. A buffer given back
after a load serves the next one whose blocks fit, so only a process's first loads (and ones larger than any
before) touch new pages. At most ``keep`` buffers stay, the largest ones.
"""

from __future__ import annotations

import numpy as np


class StagingBuffers:
    """Free buffers, largest first; ``take`` hands one out (or a new one), ``give_back`` keeps it."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []

    def take(self, num_rows: int, row_bytes: int) -> np.ndarray:
        """A ``(num_rows, row_bytes)`` uint8 array: the smallest free buffer that holds it, else a new one."""
        need = num_rows * row_bytes
        fits = [i for i, buf in enumerate(self._free) if buf.size >= need]
        flat = self._free.pop(fits[-1]) if fits else np.empty(need, dtype=np.uint8)
        return flat[:need].reshape(num_rows, row_bytes)

    def give_back(self, rows: np.ndarray) -> None:
        """Keep the buffer ``take`` handed out (``rows`` or a view of it) for the next load."""
        flat = rows.base if rows.base is not None else rows
        while flat.base is not None:
            flat = flat.base
        self._free.append(flat.reshape(-1))
        self._free.sort(key=lambda buf: buf.size, reverse=True)
        del self._free[self.keep:]

    def clear(self) -> None:
        self._free.clear()
