"""Carries out the KV pool's decisions between engine steps: grow, shrink (evict, compact, release),
back off under memory pressure, and change the block size at a safe point.

The cache manager moves block ids, the runner moves the KV data; this class keeps the two in step and
logs every resize once, with numbers. It runs on the engine's step thread only, between steps, so no
forward pass ever sees a half-moved pool.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from tideserve.core.kv_cache.elastic import BlockSizeAdvisor, ElasticPolicy, MemoryAccount
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.memory import MemoryProbe
from tideserve.core.scheduler import Scheduler
from tideserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
GiB = 2**30
ALLOC_LOG_INTERVAL_S = 5.0


class PoolController:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner, scheduler: Scheduler, probe: MemoryProbe,
                 account: MemoryAccount, policy: ElasticPolicy | None, max_model_len: int,
                 swap_bytes: int = 0, auto_block_size: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.runner = runner
        self.scheduler = scheduler
        self.probe = probe
        self.account = account
        self.policy = policy  # None: a static pool
        self.max_model_len = max_model_len
        self.swap_bytes = swap_bytes
        self.advisor = BlockSizeAdvisor() if auto_block_size else None
        self.clock = clock
        self.num_resizes = 0
        self.num_compactions = 0
        self.block_size_changes: list[int] = [kv.block_size]
        self._last_pressure_check = -math.inf
        self._last_alloc_log = -math.inf
        self._last_advice = -math.inf
        if policy is not None:
            scheduler.on_out_of_blocks = self.grow_for_allocation

    # ----------------------------------------------------------------- numbers
    @property
    def bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block(self.kv.block_size)

    @property
    def pool_bytes(self) -> int:
        return self.kv.num_blocks * self.bytes_per_block

    @property
    def budget_bytes(self) -> int:
        return self.account.budget_bytes if self.policy is not None else self.pool_bytes

    def num_used_blocks(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks

    def fragmentation(self) -> tuple[float, float]:
        """(internal, external): empty slots in allocated blocks / allocated slots, and free blocks
        stranded below the highest live block / pool blocks."""
        bs = self.kv.block_size
        allocated = holding = 0
        for request in self.scheduler.running:
            blocks = len(self.kv.req_blocks.get(request.request_id, ()))
            allocated += blocks * bs
            holding += min(request.num_computed_tokens, blocks * bs)
        internal = (allocated - holding) / allocated if allocated else 0.0
        return internal, self.kv.external_fragmentation()

    def log_pool(self, reason: str) -> None:
        logger.info("Available KV cache blocks: %d (%.2f GiB, block size %d) [%s]", self.kv.num_blocks,
                    self.pool_bytes / GiB, self.kv.block_size, reason)

    # ----------------------------------------------------------------- growing
    def _affordable_blocks(self) -> int:
        """Blocks the machine can still give without eating into the safety margin."""
        spare = self.probe.available_bytes() - self.account.margin_bytes
        return max(0, spare // self.bytes_per_block)

    def _resize(self, target: int, reason: str) -> None:
        before = self.kv.num_blocks
        if target > before:
            self.kv.grow(target - before)
        else:
            self.kv.shrink_to(target)
        self.runner.resize(target)
        self.num_resizes += 1
        self.log_pool(f"{reason}: {before} -> {target} blocks")

    def grow_for_allocation(self) -> bool:
        """The scheduler found no free block: grow if the budget and the machine allow (else it preempts)."""
        if self.policy is None:
            return False
        target = self.policy.grow_target(self.kv.num_blocks, self.num_used_blocks(), 1,
                                         self._affordable_blocks())
        if target is None:
            return False
        self._resize(target, "grow on demand")
        return True

    # ----------------------------------------------------------------- between steps
    def maintain(self) -> None:
        now = self.clock()
        self._log_allocation(now)
        if self.policy is None:
            return
        if now - self._last_pressure_check >= self.policy.config.pressure_check_interval_s:
            self._last_pressure_check = now
            if self._relieve_pressure():
                return
        used = self.num_used_blocks()
        grow = self.policy.grow_target(self.kv.num_blocks, used, 0, self._affordable_blocks)
        if grow is not None:
            self._resize(grow, f"usage {used}/{self.kv.num_blocks} above the high watermark")
            return
        shrink = self.policy.shrink_target(self.kv.num_blocks, used, now)
        if shrink is not None:
            self.shrink(shrink, f"usage {used}/{self.kv.num_blocks} stayed under the low watermark")
            self._maybe_change_block_size(now, at_safe_point=True)
            return
        if self.policy.should_compact(sum(self.fragmentation()), now):
            self.compact()
            self._maybe_change_block_size(now, at_safe_point=True)
            return
        self._maybe_change_block_size(now, at_safe_point=not self.scheduler.running)

    def compact(self) -> int:
        moves = self.kv.compact(self.num_used_blocks())
        self.runner.apply_moves(moves)
        self.num_compactions += 1
        if moves:
            logger.info("KV cache compacted: moved %d blocks toward the start", len(moves))
        return len(moves)

    def shrink(self, target: int, reason: str) -> int:
        """Evict cached prefixes in the tail, compact live blocks below target, release the tail."""
        target = max(1, target)
        self.kv.pool.evict_cached(from_id=target)
        self.runner.apply_moves(self.kv.compact(target))
        top = self.kv.pool.highest_used_id()
        new_size = max(target, top + 1)
        if new_size < self.kv.num_blocks:
            self._resize(new_size, f"shrink: {reason}")
        return self.kv.num_blocks

    def _relieve_pressure(self) -> bool:
        """If something else took the machine's memory, give back enough of ours: cache, then requests."""
        available = self.probe.available_bytes()
        deficit = self.account.margin_bytes - available
        if deficit <= 0:
            return False
        release = math.ceil(deficit / self.bytes_per_block)
        target = max(1, self.kv.num_blocks - release)
        logger.warning("Free memory %.2f GiB is below the safety margin %.2f GiB: shrinking the KV pool "
                       "by %d blocks", available / GiB, self.account.margin_bytes / GiB, release)
        self.kv.reset_prefix_cache()
        while self.num_used_blocks() > target and len(self.scheduler.running) > 1:
            self.scheduler.preempt_newest()
        self.shrink(target, "memory pressure")
        return True

    # ----------------------------------------------------------------- block size
    def observe_finished(self, num_tokens: int) -> None:
        if self.advisor is not None:
            self.advisor.observe(num_tokens)

    def _maybe_change_block_size(self, now: float, at_safe_point: bool) -> None:
        if self.advisor is None or not at_safe_point or now - self._last_advice < 5.0:
            return
        self._last_advice = now
        advice = self.advisor.best(self.kv.block_size)
        if advice is not None:
            self.change_block_size(*advice)

    def change_block_size(self, new_block_size: int, reason: str) -> bool:
        """Re-lay every live request's KV out in blocks of another size; outputs stay identical."""
        if self.kv.swapped or new_block_size == self.kv.block_size:
            return False
        old = self.kv.block_size
        pool_bytes = self.pool_bytes
        live = {r.request_id: r.num_computed_tokens for r in self.scheduler.running}
        needed = sum(-(-n // new_block_size) for n in live.values())
        new_per_block = self.runner.kv_bytes_per_block(new_block_size)
        num_blocks = max(needed + 1, pool_bytes // new_per_block)
        tables = self.kv.relayout(new_block_size, num_blocks, live)
        self.runner.relayout(new_block_size, num_blocks, tables)
        if self.swap_bytes:
            self.kv.enable_swap(self.swap_bytes // new_per_block)
        if self.policy is not None:
            scale = old / new_block_size
            self.policy.min_blocks = max(1, math.ceil(self.policy.min_blocks * scale))
            self.policy.max_blocks = max(self.policy.min_blocks, self.account.budget_bytes // new_per_block)
        self.block_size_changes.append(new_block_size)
        logger.info("KV block size changed %d -> %d (%d live requests re-laid out): %s", old,
                    new_block_size, len(live), reason)
        self.log_pool("block size change")
        return True

    def _log_allocation(self, now: float) -> None:
        if now - self._last_alloc_log < ALLOC_LOG_INTERVAL_S or not self.scheduler.running:
            return
        self._last_alloc_log = now
        logger.info("Allocated %d blocks for %d sequences (pool %d blocks, %.1f%% used)",
                    self.num_used_blocks(), len(self.scheduler.running), self.kv.num_blocks,
                    100 * self.kv.usage())
