"""The elastic KV pool's decisions: budget, when to grow or shrink, and which block size to use.

Plain Python over numbers (no torch), so every decision can be tested with a fake clock and a fake
memory probe. The pool controller (engine/pool_controller.py) carries the decisions out: the cache
manager moves block ids, the workers move the KV data.

The account, from measurement:
    budget = available - activation_peak - margin
    margin = max(MARGIN_FLOOR, 5% of the weights + 50% of the activation peak)
``available`` is read after the weights are loaded, so it already excludes them. The margin scales with
what can fluctuate: the activation peak varies with the batch, allocator slack scales with the weights.
The budget is not frozen: ``available`` is read again while the engine runs (the process's own cgroup,
or the device), so an engine that shares a memory limit grows into what a neighbour gave back and stops
short of what a neighbour took.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tideserve.config import VALID_BLOCK_SIZES as BLOCK_SIZES
from tideserve.core.kv_cache.geometry import KVGeometry
from tideserve.settings import KV_GROUP, setting

MARGIN_FLOOR = 256 * 2**20
# Cost of one more block per request, in token slots: one more block-table entry to carry and one more
# gather to issue. Weighs table/gather overhead against the unused slots of last blocks.
BLOCK_OVERHEAD_SLOTS = 2.0


def safety_margin(weights_bytes: int, activation_bytes: int, floor: int = MARGIN_FLOOR) -> int:
    return max(floor, int(0.05 * weights_bytes + 0.5 * activation_bytes))


@dataclass
class MemoryAccount:
    """What the pool may take: free memory, less the part of the activation peak that is not resident
    yet, less the safety margin.

    Activation memory that is already resident (an allocator keeps freed buffers: glibc's heap on CPU,
    torch's caching allocator on CUDA) is already missing from the free memory, so it is not reserved a
    second time; ``baseline_bytes`` (the process with its weights, before any forward pass) tells how much
    of the peak is resident: the process's memory beyond the baseline and the KV cache.
    """

    available_bytes: int
    weights_bytes: int
    activation_bytes: int
    margin_bytes: int
    baseline_bytes: int = 0  # the process's memory before the profiling pass (0: unknown)
    resident_bytes: int = 0  # the process's memory (no KV cache yet) when available_bytes was read

    def activation_to_reserve(self, non_kv_bytes: int) -> int:
        """The part of the activation peak not yet resident in a process holding ``non_kv_bytes``
        beside its KV cache."""
        if not self.baseline_bytes:
            return self.activation_bytes
        resident = non_kv_bytes - self.baseline_bytes
        return max(0, self.activation_bytes - max(0, resident))

    def headroom_bytes(self, available_bytes: int, non_kv_bytes: int) -> int:
        """Bytes the KV cache may still take now (negative: it should give some back)."""
        return available_bytes - self.activation_to_reserve(non_kv_bytes) - self.margin_bytes

    @property
    def budget_bytes(self) -> int:
        return max(0, self.headroom_bytes(self.available_bytes, self.resident_bytes or self.baseline_bytes))

    def describe(self) -> str:
        gib = 2**30
        reserve = self.activation_to_reserve(self.resident_bytes or self.baseline_bytes)
        return (f"memory account: available {self.available_bytes / gib:.2f} GiB (after weights), "
                f"weights {self.weights_bytes / gib:.2f} GiB, activation peak "
                f"{self.activation_bytes / gib:.2f} GiB ({reserve / gib:.2f} GiB not resident yet), safety "
                f"margin {self.margin_bytes / gib:.2f} GiB, KV budget {self.budget_bytes / gib:.2f} GiB")


@dataclass
class ElasticConfig:
    high_watermark: float = 0.85  # grow when usage crosses this
    low_watermark: float = 0.30  # shrink when usage stays under this ...
    shrink_delay_s: float = setting(  # ... for this long (EngineArgs' kv_cache_shrink_delay)
        5.0, name="kv_cache_shrink_delay", group=KV_GROUP, unset=True, metavar="SECONDS",
        help="elastic pool: how long usage stays low before the pool gives memory back (default {default:g})")
    # Each growth step multiplies the pool by this (at least). Growth copies nothing, so small steps are
    # cheap, and they keep a bursting pool close to what it needs (what a neighbour cannot take).
    grow_factor: float = 1.25
    shrink_target_usage: float = 0.5  # after a shrink the live blocks fill about this share
    fragmentation_threshold: float = 0.05  # compaction runs when fragmentation stays above this ...
    compaction_delay_s: float = 2.0  # ... for this long
    pressure_check_interval_s: float = 1.0  # how often the machine's free memory is read
    margin_floor_bytes: int = MARGIN_FLOOR  # the safety margin is never smaller than this
    idle_reserve_bytes: int = 16 * 2**20  # the pool's floor: what an idle engine keeps beyond its cache
    # An idle pool keeps every cached prefix that was hit. Its reserve's free blocks hold the most recent
    # ones not hit yet (the last turns of conversations that may continue), and this many bytes more may
    # be kept for them; the rest is given back.
    idle_unhit_cache_bytes: int = 0
    grow_backoff_s: float = 5.0  # after a failed growth (out of memory), wait this long before retrying

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low_watermark < high_watermark <= 1, got "
                f"{self.low_watermark} and {self.high_watermark}.")
        if self.grow_factor <= 1:
            raise ValueError(f"grow_factor must be > 1, got {self.grow_factor}.")
        if self.shrink_delay_s < 0:
            raise ValueError(f"shrink_delay_s must be >= 0 seconds, got {self.shrink_delay_s}.")


@dataclass
class ElasticPolicy:
    """When to grow, shrink and compact, with the pool's floor and ceiling kept in bytes.

    Bytes, not blocks: a block-size change leaves both bounds as they are, and each decision converts them
    with the geometry it is asked about, so no count is ever rescaled by hand.
    """

    config: ElasticConfig
    floor_bytes: int  # the idle reserve: kept even when idle
    ceiling_bytes: int  # the budget: re-read from the machine while the engine runs
    _low_since: float | None = None
    _low_idle: bool = False  # whether _low_since counts an idle period
    _fragmented_since: float | None = None

    def min_blocks(self, geometry: KVGeometry) -> int:
        """The floor in blocks of ``geometry`` (at least one)."""
        return max(1, -(-self.floor_bytes // geometry.bytes_per_block))

    def max_blocks(self, geometry: KVGeometry) -> int:
        """The ceiling in blocks of ``geometry`` (never under the floor)."""
        return max(self.min_blocks(geometry), geometry.blocks_for_bytes(self.ceiling_bytes))

    def follow_machine(self, reachable_bytes: int) -> None:
        """The machine now allows a pool of ``reachable_bytes``: the ceiling follows, up or down."""
        self.ceiling_bytes = max(0, reachable_bytes)

    def cap(self, pool_bytes: int) -> None:
        """Memory pressure: the ceiling drops to what the pool holds now, until the machine is read again."""
        self.ceiling_bytes = min(self.ceiling_bytes, pool_bytes)

    def grow_target(self, geometry: KVGeometry, num_used: int, extra_needed: int,
                    reachable: int | Callable[[], int],
                    demand: int | Callable[[], int] | None = None) -> int | None:
        """New pool size when usage crosses the high watermark, or when an allocation needs
        ``extra_needed`` more blocks; bounded by the budget and by ``reachable``, the largest pool the
        machine allows now (a pool size, not an increment). ``reachable`` may be a function, called only
        when growing is on the table: asking the machine reads files, which costs more than a whole
        decode step's bookkeeping.

        ``demand`` (a number or a function, called like ``reachable``) is the most blocks the requests
        in the engine could ever hold, each at its prompt plus its ``max_tokens``. Growth stops there:
        headroom beyond it can never be used until more requests come, and committing it is not free
        (on VMs whose host reclaims freed guest pages, first touches cost milliseconds per MiB, on
        the cores the steps need). A new request raises the demand, and the pool grows again."""
        num_blocks = geometry.num_blocks
        want = num_used + extra_needed
        if extra_needed == 0 and want <= num_blocks * self.config.high_watermark:
            return None
        target = min(max(math.ceil(num_blocks * self.config.grow_factor),
                         math.ceil(want / self.config.high_watermark)), self.max_blocks(geometry))
        # Cheapest bound first: a pool at its budget (usage high, a queue waiting) asks nothing more.
        if target > num_blocks and demand is not None:
            target = min(target, max(want, demand() if callable(demand) else demand))
        if target > num_blocks and callable(reachable):
            reachable = reachable()
        if target > num_blocks:
            target = min(target, reachable)
        return target if target > num_blocks else None

    def shrink_target(self, geometry: KVGeometry, num_used: int, now: float, idle: bool = False,
                      num_cache_kept: int = 0) -> int | None:
        """New (smaller) pool size once usage has stayed under the low watermark for shrink_delay_s.

        Busy: the live blocks end up filling ``shrink_target_usage`` of the pool. Idle (nothing running
        or waiting): the floor's reserve, which free blocks holding cached prefixes may fill, or the
        ``num_cache_kept`` cached-prefix blocks worth keeping when they are more.
        The clock restarts when the engine turns from idle to busy or back, and whenever the pool is
        already as small as it should be, so a burst that follows an idle period is not shrunk at once
        for the idle period's low usage.
        """
        num_blocks = geometry.num_blocks
        if num_used >= num_blocks * self.config.low_watermark or idle != self._low_idle:
            self._low_since = None
            self._low_idle = idle
            if num_used >= num_blocks * self.config.low_watermark:
                return None
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since < self.config.shrink_delay_s:
            return None
        floor = self.min_blocks(geometry)
        if idle:
            target = num_used + max(floor, num_cache_kept)
        else:
            target = max(floor, math.ceil(num_used / self.config.shrink_target_usage))
        self._low_since = now if target >= num_blocks else None
        return target if target < num_blocks else None

    def commit_ahead_target(self, geometry: KVGeometry, target: int, known_blocks: int,
                            demand: Callable[[], int], reachable: Callable[[], int]) -> int:
        """How far a background commit goes for a growth to ``target``: at least there, and on to what the
        requests already in the engine will hold (``known_blocks``) below the high watermark (a burst's
        prompts are known when it arrives, and each of its prefill steps would otherwise cross the
        watermark again, a step at a time), within the budget, the machine and the requests' demand."""
        known = math.ceil(known_blocks / self.config.high_watermark)
        if known <= target:
            return target
        return max(target, min(known, self.max_blocks(geometry), demand(), reachable()))

    def cache_to_keep(self, geometry: KVGeometry, num_hit: int, num_unhit: int) -> int:
        """Cached-prefix blocks an idle pool keeps: every one that was hit, and the newest unhit ones up to
        ``idle_unhit_cache_bytes`` (the reserve's free blocks hold more of them)."""
        return num_hit + min(num_unhit, geometry.blocks_for_bytes(self.config.idle_unhit_cache_bytes))

    def pressure_target(self, geometry: KVGeometry, available_bytes: int, margin_bytes: int) -> int | None:
        """The pool size that gives back what the machine lacks when free memory fell under the safety
        margin (something else took it), or None when it did not."""
        deficit = margin_bytes - available_bytes
        if deficit <= 0:
            return None
        return max(1, geometry.num_blocks - math.ceil(deficit / geometry.bytes_per_block))

    def should_compact(self, fragmentation: float, now: float) -> bool:
        if fragmentation <= self.config.fragmentation_threshold:
            self._fragmented_since = None
            return False
        if self._fragmented_since is None:
            self._fragmented_since = now
            return False
        if now - self._fragmented_since < self.config.compaction_delay_s:
            return False
        self._fragmented_since = None
        return True


def predicted_waste(lengths: Iterable[int], block_size: int,
                    overhead_slots: float = BLOCK_OVERHEAD_SLOTS) -> float:
    """Mean cost per request, in token slots: unused slots of the last block + per-block overhead."""
    total = count = 0.0
    for n in lengths:
        blocks = -(-n // block_size)
        total += blocks * block_size - n + overhead_slots * blocks
        count += 1
    return total / count if count else 0.0


@dataclass
class BlockSizeAdvisor:
    """Keeps the recent sequence lengths and names the block size that wastes least on them."""

    window: int = 256
    min_samples: int = 32
    min_gain: float = 0.15  # switch only when the predicted waste drops by this share
    lengths: deque[int] = field(default_factory=deque)

    def observe(self, length: int) -> None:
        self.lengths.append(length)
        while len(self.lengths) > self.window:
            self.lengths.popleft()

    def best(self, current: int) -> tuple[int, str] | None:
        """(block size, reason) when another size is clearly better for the recent workload."""
        if len(self.lengths) < self.min_samples:
            return None
        costs = {b: predicted_waste(self.lengths, b) for b in BLOCK_SIZES}
        best = min(costs, key=lambda b: (costs[b], b))
        if best == current or costs[best] > costs[current] * (1 - self.min_gain):
            return None
        lens = sorted(self.lengths)
        reason = (f"median sequence length {lens[len(lens) // 2]} over the last {len(lens)} requests: "
                  f"predicted waste {costs[current]:.1f} slots/request at block size {current}, "
                  f"{costs[best]:.1f} at {best}")
        return best, reason
