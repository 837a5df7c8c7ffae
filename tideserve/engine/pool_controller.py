"""Carries out the KV pool's decisions: grow, shrink (keep the valuable cached prefixes, compact, release
the tail), back off under memory pressure, and change the block size while nothing holds KV.

The controller owns the pool's ``KVGeometry`` (core/kv_cache/geometry.py): the one place the block size
and block count are decided. A change is made on the workers first (``Worker.apply_kv_geometry`` on every
rank through the executor; when a rank cannot get the memory, every rank goes back), then on the cache
manager through its public methods, and only then does the controller take the new geometry. Decisions
come from the pure policy (core/kv_cache/elastic.py); every resize is logged once, with numbers.

It runs on the engine's thread only: between steps, from the scheduler when it runs out of blocks, and
on a timer while the engine idles, so no forward pass ever sees a half-moved pool.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

from tideserve.core.kv_cache.elastic import BlockSizeAdvisor, ElasticPolicy, MemoryAccount
from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.scheduler import Scheduler
from tideserve.engine.memory_probe import MemoryReading, WorkersMemoryProbe
from tideserve.platform.memory_ledger import MemoryLedger
from tideserve.worker.executor import Executor
from tideserve.worker.kv_store import KVStoreGrowError
from tideserve.worker.worker import KVCommitState, Worker

logger = logging.getLogger(__name__)
GiB = 2**30
MiB = 2**20
ALLOC_LOG_INTERVAL_S = 5.0
# Watermark growths of at least this many bytes commit their pages in the background first (smaller ones
# take a few milliseconds on the engine's thread).
COMMIT_AHEAD_MIN_BYTES = 16 * MiB
BLOCK_SIZE_ADVICE_INTERVAL_S = 5.0
CLAIM_REFRESH_S = 1.0  # a fixed pool's claim is published this often (an elastic pool's at each pressure check)


class PoolController:
    def __init__(self, geometry: KVGeometry, limits: KVStoreLimits, kv: KVCacheManager, scheduler: Scheduler,
                 executor: Executor, memory: WorkersMemoryProbe, account: MemoryAccount,
                 policy: ElasticPolicy | None, max_model_len: int, auto_block_size: bool = False,
                 clock: Callable[[], float] = time.monotonic, ledger: MemoryLedger | None = None) -> None:
        """``geometry``: the pool as the workers and ``kv`` hold it now; ``limits``: what bounds its growth
        on the workers' stores; ``policy`` None: a static pool; ``ledger``: the claims of the engines that
        share this engine's memory limit (None: no neighbour to coordinate with)."""
        self.geometry = geometry
        self.limits = limits
        self.kv = kv
        self.scheduler = scheduler
        self.executor = executor
        self.memory = memory
        self.account = account
        self.policy = policy
        self.max_model_len = max_model_len
        self.advisor = BlockSizeAdvisor() if auto_block_size else None
        self.clock = clock
        self.ledger = ledger
        self._pending_claim = 0  # bytes of a growth decided and not yet committed
        self.others_claimed_bytes = 0  # what the neighbours claimed at the last reading
        self.num_resizes = 0
        self.num_compactions = 0
        self.num_grow_failures = 0
        self.num_background_commits = 0  # growths onto pages a background thread committed
        self.resize_seconds = 0.0  # time spent resizing (the stores' commits and releases)
        self.block_size_changes: list[int] = [geometry.block_size]
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
        return self.geometry.bytes_per_block

    @property
    def pool_bytes(self) -> int:
        return self.geometry.pool_bytes

    @property
    def min_blocks(self) -> int:
        """The idle pool's floor, in blocks of the current size (static: the pool itself)."""
        return self.policy.min_blocks(self.geometry) if self.policy is not None else self.geometry.num_blocks

    @property
    def max_blocks(self) -> int:
        """The largest the pool may grow to now, in blocks (static: the pool itself)."""
        return self.policy.max_blocks(self.geometry) if self.policy is not None else self.geometry.num_blocks

    @property
    def budget_bytes(self) -> int:
        """What the pool may grow to now (static: its size). Follows the machine's free memory."""
        return self.max_blocks * self.bytes_per_block

    def num_used_blocks(self) -> int:
        return self.geometry.num_blocks - self.kv.num_free_blocks

    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self.kv.num_cached_blocks()

    def fragmentation(self) -> tuple[float, float]:
        """(internal, external): empty slots in allocated blocks / allocated slots, and empty blocks
        stranded below the highest held block / pool blocks."""
        bs = self.geometry.block_size
        allocated = holding = 0
        for request in self.scheduler.running:
            blocks = self.kv.num_request_blocks(request.request_id)
            allocated += blocks * bs
            holding += min(request.num_computed_tokens, blocks * bs)
        internal = (allocated - holding) / allocated if allocated else 0.0
        return internal, self.kv.external_fragmentation()

    def log_pool(self, reason: str) -> None:
        logger.info("Available KV cache blocks: %d (%.2f GiB, block size %d; %d used, %d cached) [%s]",
                    self.geometry.num_blocks, self.pool_bytes / GiB, self.geometry.block_size,
                    self.num_used_blocks(), self.num_cached_blocks(), reason)

    # ----------------------------------------------------------------- the machine
    def _reachable_blocks(self) -> int:
        """The largest pool the machine allows now: what the pool holds plus the free memory, less what the
        engines sharing its limit have claimed, the part of the activation peak not resident yet and the
        safety margin (read afresh: a neighbour may have moved)."""
        reading = self.memory.read()
        others = self.others_claimed_bytes = self.ledger.others() if self.ledger is not None else 0
        headroom = self.account.headroom_bytes(reading.available_bytes - others, self._non_kv_bytes(reading))
        return self.limits.max_blocks_within(self.geometry, headroom, self.resident_bytes() // self.bytes_per_block)

    def _non_kv_bytes(self, reading: MemoryReading) -> int:
        """What the process holds beside its KV pages (pages committed ahead of a growth are KV pages)."""
        return reading.used_by_process_bytes - self.resident_bytes() - self.swap_resident_bytes()

    def resident_bytes(self) -> int:
        """Bytes of KV pages this engine holds resident: the pool, and what a background commit has made
        resident ahead of a growth (the host's pages: a GPU's pool is allocated as it grows)."""
        ahead = self._commit_state().committed_ahead_blocks if self.memory.host_memory else 0
        return max(self.geometry.num_blocks, ahead) * self.bytes_per_block

    @contextlib.contextmanager
    def _claiming(self) -> Iterator[None]:
        """Decide a growth and publish its claim as one step: no engine sharing the limit reads or claims
        memory in between (the ledger's lock), so two cannot take the same headroom."""
        with self.ledger.exclusive() if self.ledger is not None else contextlib.nullcontext():
            yield

    def _publish_claim(self, reading: MemoryReading | None = None) -> None:
        """Tell the engines sharing the limit what this one may still make resident that the limit's usage
        does not show: a growth decided and not committed yet, the pages a background commit has still to
        commit, and the part of the activation peak not resident now."""
        if self.ledger is None:
            return
        reading = reading or self.memory.read()
        state = self._commit_state()
        ahead = max(0, state.goal_blocks - state.committed_ahead_blocks) if state.in_flight else 0
        activation = self.account.activation_to_reserve(self._non_kv_bytes(reading))
        self.ledger.set_claim(self._pending_claim + ahead * self.bytes_per_block + activation)

    def swap_resident_bytes(self) -> int:
        """Host memory the swap tier may hold now (the most blocks swapped out at once since it was last
        handed back): it is the process's memory, not an activation's, when the pool is host memory too."""
        return self.kv.swap_high_water() * self.bytes_per_block if self.memory.host_memory else 0

    def demand_blocks(self) -> int:
        """The most blocks the requests in the engine could ever hold: each at its prompt plus its
        ``max_tokens`` (within the context), shared prefix blocks counted once per request."""
        total = 0
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for request in queue:
                total += self.kv.max_blocks_for_tokens(min(request.num_prompt_tokens + request.max_tokens,
                                                           self.max_model_len))
        return total

    def known_blocks(self) -> int:
        """The blocks the requests in the engine will surely hold: each at every token it has now (the
        prompt, and the output so far), shared prefix blocks counted once per request."""
        return sum(self.kv.max_blocks_for_tokens(min(request.num_tokens, self.max_model_len))
                   for queue in (self.scheduler.running, self.scheduler.waiting) for request in queue)

    def _refresh_ceiling(self) -> None:
        self.policy.follow_machine(max(1, self._reachable_blocks()) * self.bytes_per_block)

    # ----------------------------------------------------------------- carrying out a new geometry
    def _apply(self, geometry: KVGeometry) -> None:
        """Make every worker's pool match ``geometry``, all ranks or none: when one cannot get the memory
        (``KVStoreGrowError``), every rank goes back to the current geometry and the error is raised."""
        try:
            limits = self.executor.collective_rpc(Worker.apply_kv_geometry, geometry)
        except KVStoreGrowError:
            if self.executor.world_size > 1:  # the ranks that did grow give it back
                self.executor.collective_rpc(Worker.apply_kv_geometry, self.geometry)
            raise
        self.limits = KVStoreLimits.tightest(limits)

    def _commit_state(self) -> KVCommitState:
        return KVCommitState.slowest(self.executor.collective_rpc(Worker.kv_commit_state))

    # ----------------------------------------------------------------- resizing
    def _resize(self, target: int, reason: str) -> bool:
        """Resize the workers' pools and the cache manager together; False (nothing changed, growth
        backs off for a while) when the machine or a store cannot give the memory. A growth beyond the
        pages committed ahead is decided again under the ledger's lock, against what the machine has
        and the neighbours claim now, and claimed until its pages are resident."""
        before = self.geometry.num_blocks
        if target == before:
            return False
        start = time.perf_counter()
        resident = self._commit_state().committed_ahead_blocks
        committed_before = before < target <= resident
        if target > max(before, resident):
            with self._claiming():
                reachable = self._reachable_blocks()
                if reachable < target:
                    if reachable <= before:
                        return self._grow_failed(before, target, "the memory is no longer free: "
                                                 f"{self.others_claimed_bytes / MiB:.0f} MiB claimed by engines "
                                                 "sharing this memory limit")
                    target = reachable
                self._pending_claim = (target - max(before, resident)) * self.bytes_per_block
                self._publish_claim()
        try:  # the workers first: when they cannot get the memory, nothing has changed yet
            self._apply(self.geometry.resized(target))
        except KVStoreGrowError as exc:
            if target < before:  # the copying store needs a (smaller) new tensor to shrink
                logger.warning("KV pool shrink %d -> %d blocks failed (%s); staying at %d blocks", before,
                               target, exc, before)
                return False
            return self._grow_failed(before, target, str(exc))
        finally:
            if self._pending_claim:
                self._pending_claim = 0
                self._publish_claim()
        if target > before:
            self.kv.grow(target - before)
        else:
            self.kv.shrink_to(target)
        self.geometry = self.geometry.resized(target)
        elapsed = time.perf_counter() - start
        self.resize_seconds += elapsed
        self.num_resizes += 1
        self.num_background_commits += committed_before
        changed = abs(target - before) * self.bytes_per_block
        done = ("committed in the background" if committed_before else
                f"{'committed' if target > before else 'released'} in {elapsed * 1e3:.1f} ms")
        self.log_pool(f"{reason}: {before} -> {target} blocks, {changed / MiB:.1f} MiB {done}")
        return True

    def _grow_failed(self, before: int, target: int, why: str) -> bool:
        """A growth the machine could not give: growth backs off for a while (requests wait or are
        preempted instead); returns False."""
        self.num_grow_failures += 1
        backoff = self.policy.config.grow_backoff_s if self.policy else 0.0
        self._grow_blocked_until = self.clock() + backoff
        logger.warning("KV pool growth %d -> %d blocks failed (%s); staying at %d blocks, no growth for %.0f s "
                       "(requests wait or are preempted instead)", before, target, why, before, backoff)
        return False

    def _ahead_target(self, target: int) -> int:
        """How far a background commit goes for a growth to ``target`` (the policy's
        ``commit_ahead_target``, with what the requests in the engine hold and could hold)."""
        return self.policy.commit_ahead_target(self.geometry, target, self.known_blocks(), self.demand_blocks,
                                               self._reachable_blocks)

    def _commit_ahead(self, target: int, state: KVCommitState | None = None) -> bool:
        """Whether a growth the watermark asks for may run now: a large one first has its pages committed
        in the background (steps go on meanwhile; on the host the commit is lent a core of the kernels'
        threads, ``Worker.commit_kv_ahead``), and runs at a later step once they are. The commit's target
        is decided under the ledger's lock and claimed until its pages are resident. Growth that an
        allocation needs now takes what is committed so far (``grow_for_allocation``), and waits for the
        rest only when it must."""
        if (target - self.geometry.num_blocks) * self.bytes_per_block < COMMIT_AHEAD_MIN_BYTES:
            return True
        state = state or self._commit_state()
        if state.in_flight:
            return False
        if state.committed_ahead_blocks >= target:
            return True
        with self._claiming():
            ahead = self._ahead_target(target)
            self._pending_claim = max(0, ahead - state.committed_ahead_blocks) * self.bytes_per_block
            self._publish_claim()
            ready = all(self.executor.collective_rpc(Worker.commit_kv_ahead, ahead))
            self._pending_claim = 0  # from here on the commit's own progress is what stays claimed
            self._publish_claim()
        return ready

    def grow_for_allocation(self, num_short: int = 1) -> bool:
        """The scheduler lacks ``num_short`` free blocks: grow if the budget and the machine allow (else
        it preempts or waits). Blocks whose pages a background commit has made resident already are
        taken first, all of them (they cost nothing more). When the requests already in the engine will
        hold a large growth's worth more (a burst's first admissions), their pages are committed in the
        background from here on, and this growth waits only for the pages it needs: on a VM whose host
        takes freed memory back, a burst's first growths on the engine's thread were 0.3-0.5 s in which
        neither core computed (docs/benchmarks.md)."""
        if self.policy is None or self.clock() < self._grow_blocked_until:
            return False
        state = self._commit_state()
        if self._take_committed_ahead(num_short, state):
            return True
        target = self.policy.grow_target(self.geometry, self.num_used_blocks(), max(1, num_short),
                                         self._reachable_blocks, self.demand_blocks)
        if target is None:
            return False
        need = self.geometry.num_blocks + max(1, num_short)
        if not state.in_flight:  # _commit_ahead leaves a growth under 16 MiB to this thread
            self._commit_ahead(self._ahead_target(target), state)
            state = self._commit_state()
        if state.in_flight and state.goal_blocks >= need:
            target = min(target, max(need, state.committed_ahead_blocks))
        return self._resize(target, "grow on demand")

    def prepare_growth(self, num_short: int) -> None:
        """``num_short`` more blocks will be needed shortly (a KV tier's load under way): have a large
        growth's pages committed in the background now, beside the load, so that the growth the load then
        asks for (``grow_for_allocation``) takes resident pages instead of committing them on the engine's
        thread. After an idle shrink that commit is most of what a host-tier hit costs."""
        if self.policy is None or num_short <= 0 or self.clock() < self._grow_blocked_until:
            return
        target = self.policy.grow_target(self.geometry, self.num_used_blocks(), num_short, self._reachable_blocks,
                                         self.demand_blocks)
        state = self._commit_state()
        if target is not None and not state.in_flight:
            self._commit_ahead(self._ahead_target(target), state)

    def grow_to_admit(self, num_short: int = 1) -> bool:
        """A waiting request lacks ``num_short`` blocks while others run: grow as for any allocation, but
        not by waiting on a background commit (the running requests' step goes on without the newcomer,
        and the pages are in a step or two later)."""
        if self.policy is not None:
            state = self._commit_state()
            if state.in_flight and not self._covered_ahead(num_short, state):
                return False
        return self.grow_for_allocation(num_short)

    def _covered_ahead(self, num_short: int, state: KVCommitState) -> int:
        """The pool size a background commit has made resident (within the budget) when it covers
        ``num_short`` more blocks, else 0."""
        ahead = min(state.committed_ahead_blocks, max(self.max_blocks, self.geometry.num_blocks))
        return ahead if ahead >= self.geometry.num_blocks + num_short else 0

    def _take_committed_ahead(self, num_short: int, state: KVCommitState) -> bool:
        """Grow onto the blocks a background commit has made resident, if they cover ``num_short``."""
        ahead = self._covered_ahead(num_short, state)
        return bool(ahead) and self._resize(ahead, "grow on demand")

    def shrink(self, target: int, reason: str) -> int:
        """Keep the most valuable cached prefixes that fit below ``target`` beside the used blocks, move
        every kept block above it down (the only KV copy), and release the tail."""
        target = max(1, target)
        self.kv.retain_cached(target - self.num_used_blocks())
        moves = self.kv.compact(target)
        self._move_blocks(moves)
        if moves:
            logger.info("KV cache compacted: moved %d blocks below %d", len(moves), target)
        new_size = max(target, self.kv.highest_used_id() + 1)
        if new_size < self.geometry.num_blocks:
            self._resize(new_size, f"shrink: {reason}")
        return self.geometry.num_blocks

    def compact(self) -> int:
        """Fill the holes below the highest held block with the blocks above (cache kept)."""
        moves = self.kv.compact(self.kv.num_held_blocks())
        self._move_blocks(moves)
        self.num_compactions += 1
        if moves:
            logger.info("KV cache compacted: moved %d blocks toward the start", len(moves))
        return len(moves)

    def _move_blocks(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            self.executor.collective_rpc(Worker.move_kv_blocks, moves)

    def _release_freed_memory(self) -> None:
        self.executor.collective_rpc(Worker.release_freed_memory)

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
            self._release_freed_memory()
        self._was_idle = idle
        if self.policy is None:
            if now - self._last_pressure_check >= CLAIM_REFRESH_S:  # a fixed pool still claims its activations
                self._last_pressure_check = now
                self._publish_claim()
            return
        if now - self._last_pressure_check >= self.policy.config.pressure_check_interval_s:
            self._last_pressure_check = now
            if self._relieve_pressure():
                return
            self._refresh_ceiling()
            self._publish_claim()
        used = self.num_used_blocks()
        if not idle and now >= self._grow_blocked_until:
            grow = self.policy.grow_target(self.geometry, used, 0, self._reachable_blocks, self.demand_blocks)
            if grow is not None and self._commit_ahead(grow):
                grow = max(grow, min(self._commit_state().committed_ahead_blocks, self.max_blocks))
                if self._resize(grow, f"usage {used}/{self.geometry.num_blocks} above the high watermark"):
                    return
        shrink = self.policy.shrink_target(self.geometry, used, now, idle, self._cache_to_keep(idle))
        if shrink is not None:
            self.shrink(shrink, "idle" if idle else f"usage {used}/{self.geometry.num_blocks} stayed under "
                                                    "the low watermark")
        elif self.policy.should_compact(self.fragmentation()[1], now):
            self.compact()
        if idle:
            self._release_idle_swap()
        self._maybe_change_block_size(now)

    def _cache_to_keep(self, idle: bool) -> int:
        """Cached-prefix blocks an idle pool keeps (the policy's ``cache_to_keep``); none while busy."""
        if not idle:
            return 0
        hit = self._num_hit_cached_blocks()
        return self.policy.cache_to_keep(self.geometry, hit, self.kv.num_cached_blocks() - hit)

    def _num_hit_cached_blocks(self) -> int:
        return self.kv.num_hit_cached_blocks()

    def _relieve_pressure(self) -> bool:
        """If something else took the machine's memory, give back enough of ours: cache, then requests."""
        available = self.memory.read().available_bytes
        target = self.policy.pressure_target(self.geometry, available, self.account.margin_bytes)
        if target is None:
            return False
        logger.warning("Free memory %.2f GiB is below the safety margin %.2f GiB: shrinking the KV pool "
                       "by %d blocks", available / GiB, self.account.margin_bytes / GiB,
                       self.geometry.num_blocks - target)
        self.kv.retain_cached(target - self.num_used_blocks())
        while self.num_used_blocks() > target and len(self.scheduler.running) > 1:
            self.scheduler.preempt_newest()
        self.shrink(target, "memory pressure")
        self.policy.cap(self.pool_bytes)
        self._release_freed_memory()
        return True

    def _release_idle_swap(self) -> None:
        if self.kv.swap is None:
            return
        if self.kv.swap_in_use():
            self._swap_dirty = True
        elif self._swap_dirty and not self.kv.swapped:
            self.executor.collective_rpc(Worker.release_idle_swap)
            self.kv.swap_memory_released()
            self._swap_dirty = False

    # ----------------------------------------------------------------- sleep mode
    def prepare_sleep(self) -> None:
        """Before the workers release the pool's memory: forget every cached prefix (its bytes go), shrink
        an elastic pool to its floor (the pages a wake commits again), and claim nothing."""
        self.kv.reset_prefix_cache()
        if self.policy is not None:
            self.shrink(self.min_blocks, "sleep")
        self._pending_claim = 0
        if self.ledger is not None:
            self.ledger.set_claim(0)

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
        advice = self.advisor.best(self.geometry.block_size)
        if advice is not None:
            self.change_block_size(*advice)

    def change_block_size(self, new_block_size: int, reason: str) -> bool:
        """Read the pool in blocks of another size. Only while no request holds KV: then nothing is
        re-laid out or copied (the same pages are read in other chunks); the prefix cache starts over,
        since its hashes cover whole blocks. Returns False (and changes nothing) otherwise."""
        old = self.geometry
        if new_block_size == old.block_size or not self.is_idle() or self.kv.swapped:
            return False
        self.executor.collective_rpc(Worker.forget_finished_requests)
        new = old.with_block_size(new_block_size)
        try:
            self._apply(new)
        except KVStoreGrowError as exc:
            logger.warning("KV block size change %d -> %d failed (%s); staying at %d", old.block_size,
                           new_block_size, exc, old.block_size)
            return False
        self.kv.relayout(new.block_size, new.num_blocks, {})
        if new.swap_bytes:
            self.kv.enable_swap(new.num_swap_blocks)
        self.geometry = new
        self.block_size_changes.append(new_block_size)
        logger.info("KV block size changed %d -> %d (no request held KV: nothing copied): %s", old.block_size,
                    new_block_size, reason)
        if self.policy is not None and new.num_blocks < self.min_blocks:  # rounding down left it under the floor
            self._resize(self.min_blocks, "block size change")
        self.log_pool("block size change")
        return True

    def _log_allocation(self, now: float) -> None:
        if now - self._last_alloc_log < ALLOC_LOG_INTERVAL_S or not self.scheduler.running:
            return
        self._last_alloc_log = now
        logger.info("Allocated %d blocks for %d sequences (pool %d blocks, %.1f%% used)",
                    self.num_used_blocks(), len(self.scheduler.running), self.geometry.num_blocks,
                    100 * self.kv.usage())
