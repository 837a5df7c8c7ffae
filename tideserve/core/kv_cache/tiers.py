"""The KV tiers below the pool, as the cache manager sees them: stable block keys and an LRU index.

A tier (the disk tier of ``--kv-cache-dir``) keeps full prefix blocks that were computed once, so a later
request, or a server restarted on the same directory, loads them instead of recomputing them. The pool's
own prefix hashes cannot name them: Python's ``hash`` of a tuple is salted per process, so a hash
written by one server means nothing to the next. Tier keys are therefore a second chain, computed only
when a tier is on: ``key(block i) = blake2b(key(block i-1) || token ids of block i)``, rooted in the
block size and the request's ``cache_salt``. The chain makes a key name the whole prefix up to its
block (as the pool's hashes do); the block size in the root keeps tiers of several block sizes apart
(a block-size change simply starts another chain); the salt keeps salted prefixes separate. Everything
else that changes a block's bytes (the model file, dtypes, the tensor-parallel rank) is the tier's
fingerprint, which names the directory the keys live in (engine/kv_tiers.py).

``TierIndex`` is which keys a tier holds and how many bytes each takes, least recently used first; the
engine decides with it what to load, write and evict, and the workers move the bytes. Plain Python.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TierKey = bytes
TIER_KEY_BYTES = 16
# Upper bounds (seconds) of the load-latency histogram's buckets, one histogram per tier: a host-tier load
# of a long prompt takes milliseconds, a disk one tens of them, a slow or busy disk seconds.
LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ROOT = b"tideserve-kv-tier-v1"


def tier_root_key(block_size: int, cache_salt: str | None = None) -> TierKey:
    """The parent key of a prompt's first block: the block size, and the salt that isolates a prefix."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return hashlib.blake2b(_ROOT + block_size.to_bytes(4, "little") + salt, digest_size=TIER_KEY_BYTES).digest()


def tier_block_key(parent: TierKey, token_ids: Sequence[int]) -> TierKey:
    """The key of a full block: its parent's key chained with its token ids (stable across processes)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=TIER_KEY_BYTES).digest()


@dataclass
class TierStats:
    """One tier's counters since start (``medium`` as in vLLM's KV events) and its occupancy."""

    medium: str
    hits: int = 0  # blocks loaded back into the pool
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    evictions: int = 0  # blocks dropped to stay within the tier's size
    bad_files: int = 0  # files skipped and removed: corrupted, truncated, foreign
    loads: int = 0  # load operations (one per request that hit)
    load_seconds: float = 0.0  # their total time
    used_bytes: int = 0  # gauge
    capacity_bytes: int = 0  # gauge
    enabled: bool = True  # False once the tier turned itself off (unwritable storage)
    # loads per LOAD_SECONDS_BUCKETS bucket (not cumulative), the last one past the largest bound
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_SECONDS_BUCKETS) + 1))

    def observe_load(self, seconds: float) -> None:
        """Count one load of ``seconds`` (the histogram, the counters of loads and their total time)."""
        self.loads += 1
        self.load_seconds += seconds
        self.load_buckets[bisect.bisect_left(LOAD_SECONDS_BUCKETS, seconds)] += 1


class TierIndex:
    """The keys a tier holds with their bytes, least recently used first, within ``capacity_bytes``.

    Invariants: ``used_bytes`` is the sum of the entries' bytes and never exceeds ``capacity_bytes``
    after ``add`` returns; ``add`` and ``touch`` make a key the most recently used.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[TierKey, int] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, key: TierKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[TierKey]:
        """Least recently used first."""
        return list(self._entries)

    def touch(self, key: TierKey) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def add(self, key: TierKey, num_bytes: int) -> list[TierKey]:
        """Record ``key`` as most recently used; returns the keys evicted to make room (least recently
        used first), which may be ``key`` itself when it is larger than the whole tier."""
        self.remove(key)
        if num_bytes > self.capacity_bytes:
            return [key]
        evicted = []
        while self.used_bytes + num_bytes > self.capacity_bytes:
            old, size = self._entries.popitem(last=False)
            self.used_bytes -= size
            evicted.append(old)
        self._entries[key] = num_bytes
        self.used_bytes += num_bytes
        return evicted

    def load(self, entries: Iterable[tuple[TierKey, int]]) -> list[TierKey]:
        """Add entries found on storage, oldest first (a restart's scan); returns those evicted."""
        evicted = []
        for key, num_bytes in entries:
            evicted += self.add(key, num_bytes)
        return evicted

    def remove(self, key: TierKey) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0
