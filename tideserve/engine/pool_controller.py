"""Carries out the KV pool's decisions: grow, shrink (keep the valuable cached prefixes, compact, release
the tail), back off under memory pressure, and change the block size while nothing holds KV.

The cache manager moves block ids, the worker's ``KVCacheStorage`` moves the data; this class keeps the
two in step (the storage changes first, and the manager takes its block size and count from it) and logs
every resize once, with numbers. It runs on the engine's thread only: between steps, from
the scheduler when it runs out of blocks, and on a timer while the engine idles, so no forward pass ever
sees a half-moved pool and no other thread touches the pool.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

from tideserve.core.kv_cache.elastic import BlockSizeAdvisor, ElasticPolicy, MemoryAccount
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.memory import MemoryProbe
from tideserve.core.scheduler import Scheduler
from tideserve.native.cores import intra_op_threads, lend_core
from tideserve.worker.kv_store import KVStoreGrowError, release_freed_memory
from tideserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
GiB = 2**30
MiB = 2**20
ALLOC_LOG_INTERVAL_S = 5.0
# Watermark growths of at least this many bytes commit their pages in the background first (smaller ones
# take a few milliseconds on the engine's thread).
COMMIT_AHEAD_MIN_BYTES = 16 * MiB
BLOCK_SIZE_ADVICE_INTERVAL_S = 5.0


def host_core_free() -> bool:
    """Whether a background commit would find a core of its own: the kernels compute with fewer intra-op
    threads (the thread governor's count in force, less the cores lent out) than the CPUs this process
    may run on. With every core in the step's OpenMP team, a commit thread takes one of them, and every
    barrier then waits for the thread it displaced: on a 2-vCPU VM whose host takes freed memory back
    (pages cost ~8 ms per MiB to commit there), 64-stream output fell from 529-571 to 434-480 tok/s with
    background commits that way (docs/benchmarks.md, eighteenth round); the pool lends the commit a
    core instead (``native.cores.lend_core``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return intra_op_threads() < cpus


class PoolController:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner, scheduler: Scheduler, probe: MemoryProbe,
                 account: MemoryAccount, policy: ElasticPolicy | None, max_model_len: int,
                 swap_bytes: int = 0, auto_block_size: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.runner = runner
        self.storage = runner.kv_storage
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
        self.num_grow_failures = 0
        self.num_background_commits = 0  # growths onto pages a background thread committed
        self.resize_seconds = 0.0  # time spent resizing (the store's commits and releases)
        self.block_size_changes: list[int] = [kv.block_size]
        self._last_pressure_check = -math.inf
        self._last_alloc_log = -math.inf
        self._last_advice = -math.inf
        self._grow_blocked_until = -math.inf
        self._was_idle = True  # a fresh engine has nothing to hand back
        self._swap_dirty = False
        if policy is not None:
            scheduler.on_out_of_blocks = self.grow_for_allocation
            scheduler.on_out_of_blocks_to_admit = self.grow_to_admit

    # ----------------------------------------------------------------- numbers
    @property
    def bytes_per_block(self) -> int:
        return self.storage.bytes_per_block()

    @property
    def pool_bytes(self) -> int:
        return self.kv.num_blocks * self.bytes_per_block

    @property
    def budget_bytes(self) -> int:
        """What the pool may grow to now (static: its size). Follows the machine's free memory."""
        return self.policy.max_blocks * self.bytes_per_block if self.policy is not None else self.pool_bytes

    def num_used_blocks(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks

    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self.kv.pool.num_cached_free()

    def fragmentation(self) -> tuple[float, float]:
        """(internal, external): empty slots in allocated blocks / allocated slots, and empty blocks
        stranded below the highest held block / pool blocks."""
        bs = self.kv.block_size
        allocated = holding = 0
        for request in self.scheduler.running:
            blocks = len(self.kv.req_blocks.get(request.request_id, ()))
            allocated += blocks * bs
            holding += min(request.num_computed_tokens, blocks * bs)
        internal = (allocated - holding) / allocated if allocated else 0.0
        return internal, self.kv.external_fragmentation()

    def log_pool(self, reason: str) -> None:
        logger.info("Available KV cache blocks: %d (%.2f GiB, block size %d; %d used, %d cached) [%s]",
                    self.kv.num_blocks, self.pool_bytes / GiB, self.kv.block_size, self.num_used_blocks(),
                    self.num_cached_blocks(), reason)

    # ----------------------------------------------------------------- the machine
    def _reachable_blocks(self) -> int:
        """The largest pool the machine allows now: what the pool holds plus the free memory, less the
        part of the activation peak not resident yet and the safety margin (read afresh: a neighbour may
        have moved)."""
        available = self.probe.available_bytes()
        non_kv = self.probe.used_by_process_bytes() - self.pool_bytes - self.swap_resident_bytes()
        headroom = self.account.headroom_bytes(available, non_kv)
        return self.storage.max_blocks_within(headroom)

    def swap_resident_bytes(self) -> int:
        """Host memory the swap tier may hold now (the most blocks swapped out at once since it was last
        handed back): it is the process's memory, not an activation's, when the pool is host memory too."""
        swap = self.kv.swap
        return swap.high_water * self.bytes_per_block if swap is not None and self.runner.platform.host_memory else 0

    def demand_blocks(self) -> int:
        """The most blocks the requests in the engine could ever hold: each at its prompt plus its
        ``max_tokens`` (within the context), shared prefix blocks counted once per request."""
        block_size = self.kv.block_size
        total = 0
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for request in queue:
                tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
                total += -(-tokens // block_size)
        return total

    def _refresh_ceiling(self) -> None:
        reachable = self._reachable_blocks()
        if self.policy.max_blocks != reachable:
            self.policy.max_blocks = max(1, reachable)

    # ----------------------------------------------------------------- resizing
    def _resize(self, target: int, reason: str) -> bool:
        """Resize the cache manager's pool and the KV store together; False (nothing changed, growth
        backs off for a while) when the store cannot get the memory."""
        before = self.kv.num_blocks
        if target == before:
            return False
        start = time.perf_counter()
        committed_before = self.storage.committed_ahead_blocks >= target > before
        try:  # the store first: when it cannot get the memory, nothing has changed yet
            self.storage.resize(target)
        except KVStoreGrowError as exc:
            if target < before:  # the copying store needs a (smaller) new tensor to shrink
                logger.warning("KV pool shrink %d -> %d blocks failed (%s); staying at %d blocks", before,
                               target, exc, before)
                return False
            self.num_grow_failures += 1
            backoff = self.policy.config.grow_backoff_s if self.policy else 0.0
            self._grow_blocked_until = self.clock() + backoff
            logger.warning("KV pool growth %d -> %d blocks failed (%s); staying at %d blocks, no growth "
                           "for %.0f s (requests wait or are preempted instead)", before, target, exc,
                           before, backoff)
            return False
        target = self.storage.num_blocks  # the manager follows the storage's count
        if target > before:
            self.kv.grow(target - before)
        else:
            self.kv.shrink_to(target)
        elapsed = time.perf_counter() - start
        self.resize_seconds += elapsed
        self.num_resizes += 1
        self.num_background_commits += committed_before
        changed = abs(target - before) * self.bytes_per_block
        done = ("committed in the background" if committed_before else
                f"{'committed' if target > before else 'released'} in {elapsed * 1e3:.1f} ms")
        self.log_pool(f"{reason}: {before} -> {target} blocks, {changed / MiB:.1f} MiB {done}")
        return True

    def known_blocks(self) -> int:
        """The blocks the requests in the engine will surely hold: each at every token it has now (the
        prompt, and the output so far), shared prefix blocks counted once per request."""
        block_size = self.kv.block_size
        return sum(-(-min(request.num_tokens, self.max_model_len) // block_size)
                   for queue in (self.scheduler.running, self.scheduler.waiting) for request in queue)

    def _ahead_target(self, target: int) -> int:
        """How far a background commit goes for a watermark growth to ``target``: at least there, and on
        to what the requests already in the engine will hold below the watermark (a burst's prompts are
        known when it arrives, and each of its prefill steps would otherwise cross the watermark again,
        a step at a time), within the budget, the machine and the requests' demand."""
        known = math.ceil(self.known_blocks() / self.policy.config.high_watermark)
        if known <= target:
            return target
        return max(target, min(known, self.policy.max_blocks, self.demand_blocks(), self._reachable_blocks()))

    def _commit_ahead(self, target: int) -> bool:
        """Whether a growth the watermark asks for may run now: a large one first has its pages committed
        in the background (steps go on meanwhile), and runs at a later step once they are. On the host
        with every core in the step's threads, the commit is lent one of them for as long as it runs
        (``native.cores``): the kernels run with one thread fewer, the commit on a core of its own. A
        single core commits on the engine's thread. Growth that an allocation needs now takes what is
        committed so far (``grow_for_allocation``), and waits for the rest only when it must."""
        if (target - self.kv.num_blocks) * self.bytes_per_block < COMMIT_AHEAD_MIN_BYTES:
            return True
        if self.storage.commit_in_flight:
            return False
        if self.storage.committed_ahead_blocks >= target:
            return True
        on_done = None
        if self.runner.platform.computes_on_host and not host_core_free():
            if intra_op_threads() < 2:
                return True
            on_done = lend_core()
        return self.storage.commit_ahead(self._ahead_target(target), on_done)

    def grow_for_allocation(self, num_short: int = 1) -> bool:
        """The scheduler lacks ``num_short`` free blocks: grow if the budget and the machine allow (else
        it preempts or waits). Blocks whose pages a background commit has made resident already are
        taken first, all of them (they cost nothing more). When the requests already in the engine will
        hold a large growth's worth more (a burst's first admissions), their pages are committed in the
        background from here on, and this growth waits only for the pages it needs: on a VM whose host
        takes freed memory back, a burst's first growths on the engine's thread were 0.3-0.5 s in which
        neither core computed (docs/benchmarks.md, twentieth round)."""
        if self.policy is None or self.clock() < self._grow_blocked_until:
            return False
        if self._take_committed_ahead(num_short):
            return True
        target = self.policy.grow_target(self.kv.num_blocks, self.num_used_blocks(), max(1, num_short),
                                         self._reachable_blocks, self.demand_blocks)
        if target is None:
            return False
        need = self.kv.num_blocks + max(1, num_short)
        if not self.storage.commit_in_flight:  # _commit_ahead leaves a growth under 16 MiB to this thread
            self._commit_ahead(self._ahead_target(target))
        if self.storage.commit_in_flight and self.storage.commit_goal_blocks >= need:
            target = min(target, max(need, self.storage.committed_ahead_blocks))
        return self._resize(target, "grow on demand")

    def grow_to_admit(self, num_short: int = 1) -> bool:
        """A waiting request lacks ``num_short`` blocks while others run: grow as for any allocation, but
        not by waiting on a background commit (the running requests' step goes on without the newcomer,
        and the pages are in a step or two later)."""
        if self.storage.commit_in_flight and self.policy is not None and not self._covered_ahead(num_short):
            return False
        return self.grow_for_allocation(num_short)

    def _covered_ahead(self, num_short: int) -> int:
        """The pool size a background commit has made resident (within the budget) when it covers
        ``num_short`` more blocks, else 0."""
        ahead = min(self.storage.committed_ahead_blocks, max(self.policy.max_blocks, self.kv.num_blocks))
        return ahead if ahead >= self.kv.num_blocks + num_short else 0

    def _take_committed_ahead(self, num_short: int) -> bool:
        """Grow onto the blocks a background commit has made resident, if they cover ``num_short``."""
        ahead = self._covered_ahead(num_short)
        return bool(ahead) and self._resize(ahead, "grow on demand")

    def shrink(self, target: int, reason: str) -> int:
        """Keep the most valuable cached prefixes that fit below ``target`` beside the used blocks, move
        every kept block above it down (the only KV copy), and release the tail."""
        target = max(1, target)
        self.kv.retain_cached(target - self.num_used_blocks())
        moves = self.kv.compact(target)
        self.runner.apply_moves(moves)
        if moves:
            logger.info("KV cache compacted: moved %d blocks below %d", len(moves), target)
        new_size = max(target, self.kv.pool.highest_used_id() + 1)
        if new_size < self.kv.num_blocks:
            self._resize(new_size, f"shrink: {reason}")
        return self.kv.num_blocks

    def compact(self) -> int:
        """Fill the holes below the highest held block with the blocks above (cache kept)."""
        moves = self.kv.compact(self.kv.num_held_blocks())
        self.runner.apply_moves(moves)
        self.num_compactions += 1
        if moves:
            logger.info("KV cache compacted: moved %d blocks toward the start", len(moves))
        return len(moves)

    # ----------------------------------------------------------------- between steps, and on a timer
    def is_idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting

    def maintain(self) -> None:
        """One round of the pool's upkeep; the engine calls it before every step and, while idle, on a
        timer (``LLMEngine.maintain``)."""
        now = self.clock()
        self._log_allocation(now)
        idle = self.is_idle()
        if idle and not self._was_idle:  # what the burst's steps freed goes back to the system now
            release_freed_memory(self.runner.device)
        self._was_idle = idle
        if self.policy is None:
            return
        if now - self._last_pressure_check >= self.policy.config.pressure_check_interval_s:
            self._last_pressure_check = now
            if self._relieve_pressure():
                return
            self._refresh_ceiling()
        used = self.num_used_blocks()
        if not idle and now >= self._grow_blocked_until:
            grow = self.policy.grow_target(self.kv.num_blocks, used, 0, self._reachable_blocks, self.demand_blocks)
            if grow is not None and self._commit_ahead(grow):
                grow = max(grow, min(self.storage.committed_ahead_blocks, self.policy.max_blocks))
                if self._resize(grow, f"usage {used}/{self.kv.num_blocks} above the high watermark"):
                    return
        shrink = self.policy.shrink_target(self.kv.num_blocks, used, now, idle, self._cache_to_keep(idle))
        if shrink is not None:
            self.shrink(shrink, "idle" if idle else f"usage {used}/{self.kv.num_blocks} stayed under the "
                                                    "low watermark")
        elif self.policy.should_compact(self.fragmentation()[1], now):
            self.compact()
        if idle:
            self._release_idle_swap()
        self._maybe_change_block_size(now)

    def _cache_to_keep(self, idle: bool) -> int:
        """Cached-prefix blocks an idle pool keeps: every one that was hit, and the newest unhit ones
        up to ``idle_unhit_cache_bytes`` (the reserve's free blocks hold more of them)."""
        if not idle:
            return 0
        hit = self._num_hit_cached_blocks()
        unhit = self.kv.pool.num_cached_free() - hit
        return hit + min(unhit, self.policy.config.idle_unhit_cache_bytes // self.bytes_per_block)

    def _num_hit_cached_blocks(self) -> int:
        pool = self.kv.pool
        return sum(1 for i in pool.cached_free_by_value() if pool.blocks[i].num_hits > 0)

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
        self.kv.retain_cached(target - self.num_used_blocks())
        while self.num_used_blocks() > target and len(self.scheduler.running) > 1:
            self.scheduler.preempt_newest()
        self.shrink(target, "memory pressure")
        self.policy.max_blocks = max(1, min(self.policy.max_blocks, self.kv.num_blocks))
        release_freed_memory(self.runner.device)
        return True

    def _release_idle_swap(self) -> None:
        swap = self.kv.swap
        if swap is None:
            return
        if swap.num_free < swap.num_blocks:
            self._swap_dirty = True
        elif self._swap_dirty and not self.kv.swapped:
            self.storage.release_idle_swap()
            swap.high_water = 0
            self._swap_dirty = False

    # ----------------------------------------------------------------- block size
    def observe_finished(self, num_tokens: int) -> None:
        if self.advisor is not None:
            self.advisor.observe(num_tokens)

    def _maybe_change_block_size(self, now: float) -> None:
        """Follow the advisor while idle, unless that would discard cached prefixes that were hit: a
        shared system prompt recomputed by every request costs more than a block size saves."""
        if (self.advisor is None or not self.is_idle() or self.kv.swapped
                or now - self._last_advice < BLOCK_SIZE_ADVICE_INTERVAL_S or self._num_hit_cached_blocks()):
            return
        self._last_advice = now
        advice = self.advisor.best(self.kv.block_size)
        if advice is not None:
            self.change_block_size(*advice)

    def change_block_size(self, new_block_size: int, reason: str) -> bool:
        """Read the pool in blocks of another size. Only while no request holds KV: then nothing is
        re-laid out or copied (the same pages are read in other chunks); the prefix cache starts over,
        since its hashes cover whole blocks. Returns False (and changes nothing) otherwise."""
        if new_block_size == self.kv.block_size or not self.is_idle() or self.kv.swapped:
            return False
        old = self.kv.block_size
        self.runner.forget_finished()
        self.storage.change_block_size(new_block_size)
        self.kv.relayout(self.storage.block_size, self.storage.num_blocks, {})  # the storage's geometry
        new_per_block = self.storage.bytes_per_block()
        if self.swap_bytes:
            self.kv.enable_swap(self.swap_bytes // new_per_block)
        if self.policy is not None:
            self.policy.min_blocks = max(1, math.ceil(self.policy.min_blocks * old / new_block_size))
            self.policy.max_blocks = max(self.policy.min_blocks, self.policy.max_blocks * old // new_block_size)
            if self.kv.num_blocks < self.policy.min_blocks:  # rounding down left it under the floor
                self._resize(self.policy.min_blocks, "block size change")
        self.block_size_changes.append(new_block_size)
        logger.info("KV block size changed %d -> %d (no request held KV: nothing copied): %s", old,
                    new_block_size, reason)
        self.log_pool("block size change")
        return True

    def _log_allocation(self, now: float) -> None:
        if now - self._last_alloc_log < ALLOC_LOG_INTERVAL_S or not self.scheduler.running:
            return
        self._last_alloc_log = now
        logger.info("Allocated %d blocks for %d sequences (pool %d blocks, %.1f%% used)",
                    self.num_used_blocks(), len(self.scheduler.running), self.kv.num_blocks,
                    100 * self.kv.usage())
