"""KV cache events: what the prefix cache gained and lost, in the order it happened.

The manager appends these while it works (only when events are enabled: otherwise nothing is allocated
per block), and the engine drains them once per step for a publisher (tideserve/engine/kv_events.py),
which sends them in vLLM's KV-events format so a router can route on the real cache state.

Invariant (tests/core/kv_cache/test_events.py): applying every event in order to an empty set (stored:
add the hashes; removed: drop them; cleared: empty it) gives exactly the set of hashes the pool can hit.

Hashes are published as unsigned 64-bit integers: the prefix hash (Python's hash of the parent hash, the
block's token ids and the model name) modulo 2**64. They are stable for the life of the process, not
across processes (string hashing is salted per process), which is what consumers need: they key blocks
by (worker, hash) and chain them through ``parent_block_hash`` and the token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's name for the engine's own KV tier ("GPU"), whatever the device: consumers filter on it.
MEDIUM = "GPU"
_U64 = (1 << 64) - 1


def external_hash(block_hash: int) -> int:
    """The published form of a prefix hash: an unsigned 64-bit integer (routers reject negative ones)."""
    return block_hash & _U64


@dataclass(slots=True)
class BlockStored:
    """Full blocks that became findable by their prefix hash, parent first. ``parent_block_hash`` is the
    hash of the block before the first one, None for a prompt's first block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks whose prefix was forgotten (reused for other tokens, dropped by a shrink)."""

    block_hashes: list[int] = field(default_factory=list)
    medium: str = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    """Nothing is cached any more (a reset that emptied the cache, a block-size change)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_events(cached: set[int], events: list[KVCacheEvent]) -> set[int]:
    """Replay ``events`` onto a consumer's view of the cached hashes (what a router does)."""
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()
    return cached
