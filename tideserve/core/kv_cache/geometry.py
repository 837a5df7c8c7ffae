"""The KV cache's geometry: one value object that every part of the engine reads the same way.

Why one object: the block size and the block count decide how the scheduler counts slots, how the
workers lay out their tensors, how the elastic policy turns bytes into blocks and how large the swap tier
is. Kept in several places, they drift (a block-size change rescaled by hand, a swap size computed
twice). Here they are fixed once by the engine builder, changed only by the pool controller (which
replaces the object: it is frozen) and handed to the workers and the cache manager after each change.

Plain Python over numbers (no torch): the dtype is named, the bytes per token are counted, so the core
stays testable without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVGeometry:
    """Block size, block count and the bytes behind them, as the driver rank holds them.

    Tensor-parallel ranks may hold fewer KV heads per block than the driver (uneven splits); every rank
    has the same block ids and block size, and the byte figures here are the driver's, in which the
    engine's memory accounting is kept.
    """

    num_layers: int  # layer slots a block holds: every layer, or one KV cache group's (core/kv_cache/groups.py)
    token_bytes: int  # one token of one layer's K (or V), on the driver rank
    kv_dtype: str  # torch's name without the prefix: "float32", "bfloat16", "float8_e4m3fn"
    block_size: int
    num_blocks: int
    swap_bytes: int = 0  # the host swap tier's size (preemption_mode="swap"); 0: no tier

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 0 or self.token_bytes < 1 or self.swap_bytes < 0:
            raise ValueError(f"invalid KV geometry: {self}")

    @property
    def bytes_per_block(self) -> int:
        """One block across the K and V of the layers it holds (one group's, with several groups: a block is
        owned by one group, so the bytes of a token across every layer are spread over a block per group)."""
        return 2 * self.num_layers * self.block_size * self.token_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def num_swap_blocks(self) -> int:
        """Blocks the swap tier holds at this block size (the tier keeps its bytes across block sizes)."""
        return self.swap_bytes // self.bytes_per_block

    def blocks_for_bytes(self, num_bytes: int) -> int:
        """Whole blocks that fit in ``num_bytes`` (0 for a negative figure)."""
        return max(0, num_bytes) // self.bytes_per_block

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def resized(self, num_blocks: int) -> KVGeometry:
        return replace(self, num_blocks=num_blocks)

    def with_block_size(self, block_size: int) -> KVGeometry:
        """The same pool read in blocks of ``block_size``: as many whole blocks as its token slots hold
        (at least one), the swap tier at the same bytes."""
        return replace(self, block_size=block_size, num_blocks=max(1, self.num_tokens // block_size))

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.num_blocks} blocks of {self.block_size} tokens, {self.bytes_per_block} bytes each "
                f"({self.pool_bytes / gib:.2f} GiB, KV dtype {self.kv_dtype})")


@dataclass(frozen=True)
class KVStoreLimits:
    """What bounds a growth of the pool, as the workers' stores report it.

    A store over one reserved address range grows in place up to the reservation (``capacity_tokens``);
    a copying store allocates the new pool beside the old one (``copies_on_resize``), so a growth must fit
    in the spare memory whole. Combined over ranks with ``tightest``.
    """

    copies_on_resize: bool
    capacity_tokens: int | None = None  # token slots of the reservation (None: no reservation)

    def max_blocks_within(self, geometry: KVGeometry, spare_bytes: int, resident_blocks: int = 0) -> int:
        """The largest pool a resize can reach when ``spare_bytes`` more memory may be taken and the store
        holds ``resident_blocks`` blocks' pages already (a pool, plus what a background commit made
        resident ahead of a growth: those pages are already missing from the free memory, so they count
        once, as the base the spare bytes add to)."""
        extra = geometry.blocks_for_bytes(spare_bytes)
        if self.copies_on_resize:
            return max(geometry.num_blocks, extra)
        top = max(geometry.num_blocks, resident_blocks) + extra
        return top if self.capacity_tokens is None else min(self.capacity_tokens // geometry.block_size, top)

    @staticmethod
    def tightest(limits: list[KVStoreLimits]) -> KVStoreLimits:
        """The bound every rank's store can meet."""
        capacities = [lim.capacity_tokens for lim in limits if lim.capacity_tokens is not None]
        return KVStoreLimits(any(lim.copies_on_resize for lim in limits), min(capacities) if capacities else None)
