"""The engine's side of the KV tiers below the pool: what to keep in them, what to load back, and from where.

Two tiers stack under the pool, nearest first: the host tier (``--kv-offloading-size``: host memory outside
the pool, worker/kv_host_tier.py) and the disk tier (``--kv-cache-dir``: checksummed files, one directory
per fingerprint and rank, worker/kv_disk_tier.py). The cache manager names blocks (core/kv_cache/tiers.py:
stable keys; one LRU index per tier, within the tier's size), the workers move their bytes; this module runs
them around each step:

- **Keep at publish time.** A full block is copied down once, right after the step that computed it
  (``store_published``), into every tier that lacks it, not when it leaves the pool. Why: a block kept
  only on eviction is lost when the server stops or crashes (the disk tier is for restarts), and an
  eviction happens inside the scheduler's allocation and an idle shrink hands pages back in the same call:
  a copy there would sit on the step's path. Since the tiers already hold a block, its eviction, an idle
  shrink or a shutdown cost nothing more. The price is one gather of the step's new blocks out of the pool
  (a memcpy on CPU; files are written on the disk tier's thread) and room for prefixes that are never
  reused, which each tier's LRU bound ages out.
- **Load beside the steps.** Before each step, for the waiting requests that could be admitted soon, the
  blocks right after a request's pool hit start loading from the tier that holds the longest run of them
  (the nearer one on a tie, ``start_loads``): each rank reads them into a buffer of its own on the tier's
  thread, and the request is ``WAITING_FOR_REMOTE_KVS`` meanwhile, so the scheduler passes over it while
  every other request keeps its steps. Once every rank's read is over (``finish_loads``, before a later
  step) the blocks are copied into free blocks of the pool and published as cached prefixes, and the
  request, back in its previous state and place, is admitted with them as an ordinary prefix hit (or
  loads again, from the disk, what the host tier lacked). The pool is only touched on the engine thread,
  at that moment, so it may grow, shrink or compact while blocks are read. When nothing else can run the
  engine waits for the oldest read instead of spinning. A file that fails its checks ends the load there:
  the rest of the prompt is computed, so the output is the same.

Everything a tier does is optional to a request: a disk tier that cannot write turns itself off with one
warning, and nothing a tier does fails a request.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tideserve.config import CacheConfig
from tideserve.core.kv_cache.events import BlockRemoved, BlockStored, KVCacheEvent
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.tiers import TierIndex, TierStats
from tideserve.core.scheduler import Scheduler
from tideserve.model.loader import LoadedModel
from tideserve.request import Request, RequestStatus
from tideserve.tokenizer.tokenizer import Tokenizer
from tideserve.worker.executor import Executor
from tideserve.worker.worker import Worker

logger = logging.getLogger(__name__)
GiB = 2**30
DISK_MEDIUM = "DISK"  # the tiers' names in metrics and KV events (vLLM's KV events call a tier a medium)
HOST_MEDIUM = "CPU"
LOAD_WAIT_S = 0.05  # how long an engine with nothing else to run waits for a read at a time
LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass
class PendingLoad:
    """A load whose blocks are being read: its request, the state it returns to, the pool hit (in blocks)
    it continues, the tier keys it reads, when it began and from which tier."""

    request: Request
    status: RequestStatus
    start: int
    keys: list[bytes]
    began: float
    tier: KVTier


def _model_files(path: Path) -> str:
    """Name, size and modification time of the model file, or of every file of a model directory."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def tier_fingerprint(loaded: LoadedModel, kv_dtype: torch.dtype, device: torch.device, tokenizer: Tokenizer,
                     tensor_parallel_size: int) -> dict[str, str]:
    """Everything besides a block's tokens that changes its bytes (the block size is in the keys): blocks
    written under another fingerprint are never read."""
    path = Path(loaded.path).resolve()
    return {
        "format": "1",
        "model": str(path),
        "model_files": _model_files(path),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "quantization": loaded.quantization,
        "device": device.type,
        "arch": json.dumps(dataclasses.asdict(loaded.arch), sort_keys=True, default=str),
        "tokenizer": f"{tokenizer.name}:{tokenizer.vocab_size}",
        "tensor_parallel_size": str(tensor_parallel_size),
    }


class KVTier:
    """One tier as the engine sees it: its medium, the keys it holds (``TierIndex``) and its counters."""

    def __init__(self, medium: str, executor: Executor, index: TierIndex, where: str) -> None:
        self.medium = medium
        self.executor = executor
        self.index = index
        self.where = where  # for the log: the directory, or "host memory"
        self.stats = TierStats(medium, capacity_bytes=index.capacity_bytes)
        self.enabled = True
        # tier key -> the hash the KV events name its block by, for the blocks stored while events are on
        # (a restart's blocks have none: their events were a previous process's)
        self.event_hashes: dict[bytes, int] = {}

    def store(self, file_bytes: int, keys: list[bytes],
              event_blocks: dict[bytes, tuple[int, int | None, list[int]]]) -> list[KVCacheEvent]:
        """Record blocks the workers just kept (``file_bytes`` each, all ranks together); drop from the
        workers what the index evicts to stay within its size. Returns the KV events of both, with this
        tier's medium (``event_blocks``: what names each block in the events; empty with events off)."""
        evicted = []
        events: list[KVCacheEvent] = []
        for key in keys:
            evicted += self.index.add(key, file_bytes)
            block = event_blocks.get(key)
            if block is None:
                continue
            block_hash, parent, token_ids = block
            self.event_hashes[key] = block_hash
            last = events[-1] if events else None
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:  # one event per run
                last.block_hashes.append(block_hash)
                last.token_ids.extend(token_ids)
            else:
                events.append(BlockStored([block_hash], parent, list(token_ids), len(token_ids), self.medium))
        if evicted:
            self.executor.collective_rpc(Worker.remove_kv_blocks, self.medium, evicted)
            self.stats.evictions += len(evicted)
            events += self.forget(evicted)
        self.stats.blocks_written += len(keys)
        self.stats.bytes_written += file_bytes * len(keys)
        return events

    def forget(self, keys: list[bytes]) -> list[KVCacheEvent]:
        """The BlockRemoved event (this medium) of the blocks among ``keys`` that events named."""
        hashes = [h for h in (self.event_hashes.pop(k, None) for k in keys) if h is not None]
        return [BlockRemoved(hashes, self.medium)] if hashes else []

    def snapshot(self) -> TierStats:
        """The tier's counters with its occupancy now."""
        return dataclasses.replace(self.stats, used_bytes=self.index.used_bytes, enabled=self.enabled,
                                   load_buckets=list(self.stats.load_buckets))

    def close(self) -> None:
        """Finish the workers' writes under way (every published block is on disk afterwards); idempotent."""
        if self.enabled:
            self.enabled = False
            self.executor.collective_rpc(Worker.close_kv_tier, self.medium)


def open_host_tier(cache: CacheConfig, executor: Executor, kv: KVCacheManager) -> KVTier | None:
    """The host tier of ``cache.kv_offloading_size`` (empty at start), or None (logged) without prefix caching."""
    if not kv.enable_prefix_caching:
        logger.warning("kv_offloading_size=%s GiB is ignored: the host tier keeps prefix blocks, and prefix "
                       "caching is off", cache.kv_offloading_size)
        return None
    executor.collective_rpc(Worker.open_kv_host_tier)
    logger.info("KV host tier: %.2f GiB of host memory", cache.kv_offloading_bytes / GiB)
    return KVTier(HOST_MEDIUM, executor, TierIndex(cache.kv_offloading_bytes), "host memory")


def open_disk_tier(cache: CacheConfig, fingerprint: dict[str, str], executor: Executor,
                   kv: KVCacheManager) -> KVTier | None:
    """The tier under ``cache.kv_cache_dir`` with what it already holds for ``fingerprint`` (a restart serves
    those blocks at once), or None (logged) when the directory cannot be used."""
    path = cache.kv_cache_dir
    if not kv.enable_prefix_caching:
        logger.warning("kv_cache_dir=%s is ignored: the disk tier keeps prefix blocks, and prefix caching "
                       "is off", path)
        return None
    answers = executor.collective_rpc(Worker.open_kv_disk_tier, path, fingerprint)
    error = next((err for _, _, err in answers if err), None)
    if error is not None:
        executor.collective_rpc(Worker.close_kv_tier, DISK_MEDIUM)
        logger.warning("KV disk tier off: %s cannot be used (%s); requests are served without it", path, error)
        return None
    # A block is in the tier when every rank has its shard; one some ranks lack is removed.
    per_rank = [{f.key: f for f in files} for files, _, _ in answers]
    common = set(per_rank[0]).intersection(*per_rank[1:])
    partial = sorted(set().union(*per_rank) - common)
    files = sorted((f for f in answers[0][0] if f.key in common), key=lambda f: f.mtime)
    index = TierIndex(cache.kv_cache_dir_bytes)
    evicted = index.load((f.key, sum(rank[f.key].num_bytes for rank in per_rank)) for f in files)
    if partial or evicted:
        executor.collective_rpc(Worker.remove_kv_blocks, DISK_MEDIUM, partial + evicted)
    others = answers[0][1]
    if others:
        logger.info("KV disk tier: %d other configuration(s) under %s (another model file, dtype, KV dtype or "
                    "tensor-parallel size) are ignored", len(others), path)
    logger.info("KV disk tier: %s, %d blocks found (%.2f of %.2f GiB)", path, len(index),
                index.used_bytes / GiB, index.capacity_bytes / GiB)
    return KVTier(DISK_MEDIUM, executor, index, path)


class KVTiers:
    """Keeps published blocks in the tiers and loads tier hits back, around the engine's steps (module doc).
    ``tiers`` are nearest first; a tier that turned itself off leaves the list."""

    def __init__(self, executor: Executor, kv: KVCacheManager, scheduler: Scheduler, tiers: list[KVTier],
                 prepare_growth: Callable[[int], None] | None = None) -> None:
        self.executor = executor
        # Told how many more blocks a load just started will need (the elastic pool commits their pages in
        # the background meanwhile: PoolController.prepare_growth); None: a fixed pool.
        self.prepare_growth = prepare_growth
        self.kv = kv
        self.scheduler = scheduler
        self.tiers = tiers
        self.all_tiers = list(tiers)  # for the metrics: a tier that turned off still reports
        self._loads: dict[int, PendingLoad] = {}  # by load id, oldest first
        self._load_ids = itertools.count()
        # Waiting requests whose last load found no free block for what it read: not loaded again while
        # they wait (a pool that cannot grow would otherwise read the same blocks before every step).
        self._no_room: set[str] = set()
        kv.enable_tiers([t.index for t in tiers])

    def medium(self, medium: str) -> KVTier | None:
        return next((t for t in self.all_tiers if t.medium == medium), None)

    @property
    def loading(self) -> bool:
        """Whether some request waits for its blocks to be read."""
        return bool(self._loads)

    # ----------------------------------------------------------------- around each step
    def before_step(self) -> None:
        """Finish the loads whose reads are over, start the waiting requests' loads, and, when nothing else
        can run, wait a little for the oldest read (module doc)."""
        if not self.tiers and not self._loads:
            return
        self.finish_loads()
        if self.scheduler.waiting and self.tiers:
            self.start_loads()
        scheduler = self.scheduler
        if self._loads and not scheduler.running and all(r.status == LOADING for r in scheduler.waiting):
            self.finish_loads(LOAD_WAIT_S)

    def start_loads(self) -> None:
        """Start loading the tier hits of the waiting requests that could be admitted soon (the first free
        seats' worth, within one step's token budget), each from the tier with the longest run."""
        scheduler, kv = self.scheduler, self.kv
        seats = scheduler.config.max_num_seqs - len(scheduler.running)
        budget = scheduler.config.max_num_batched_tokens  # the requests past it cannot start in the next step
        if self._no_room:
            self._no_room.intersection_update(r.request_id for r in scheduler.waiting)
        for request in list(scheduler.waiting)[:max(0, seats)]:
            if budget <= 0:
                return
            if request.status == LOADING:
                budget -= request.num_tokens % kv.block_size or kv.block_size
                continue
            if (request.request_id in kv.swapped or request.request_id in self._no_room
                    or request.sampling_params.needs_every_prompt_position):
                continue
            token_ids = request.all_token_ids
            start, keys, tier = 0, [], None
            for candidate in self.tiers:  # nearest first: a tie goes to the nearer tier
                found_start, found = kv.plan_tier_load(request.request_id, token_ids, candidate.index)
                start = found_start
                if len(found) > len(keys):
                    keys, tier = found, candidate
            budget -= len(token_ids) - (start + len(keys)) * kv.block_size
            if tier is None:
                continue
            load_id = next(self._load_ids)
            self.executor.collective_rpc(Worker.start_kv_load, tier.medium, load_id, keys)
            self._loads[load_id] = PendingLoad(request, request.status, start, keys, time.perf_counter(), tier)
            request.status = LOADING
            if self.prepare_growth is not None:
                self.prepare_growth(kv.tier_load_shortfall(request.request_id, start, len(keys)))

    def _grow_for(self, request_id: str, start: int, num_blocks: int) -> None:
        """Grow the elastic pool (as for an allocation) until ``num_blocks`` after the request's pool hit of
        ``start`` blocks have free blocks (pages ``prepare_growth`` committed meanwhile are taken first)."""
        grow, kv = self.scheduler.on_out_of_blocks, self.kv
        while grow is not None and (short := kv.tier_load_shortfall(request_id, start, num_blocks)):
            free = kv.num_free_blocks
            if not grow(short) or kv.num_free_blocks <= free:
                break

    def finish_loads(self, wait_s: float = 0.0) -> None:
        """Put the blocks of every load whose reads are over on every rank into the pool (waiting up to
        ``wait_s`` for the oldest when none is over)."""
        if not self._loads:
            return
        answers = self.executor.collective_rpc(Worker.kv_loads_done, wait_s)
        done = set(answers[0]).intersection(*answers[1:])
        for load_id in [i for i in self._loads if i in done]:
            self._finish(load_id, min(a[load_id] for a in answers))

    def _finish(self, load_id: int, num_read: int) -> None:
        """Copy what load ``load_id`` read (its first ``num_read`` blocks, whole on every rank) into free
        blocks after its request's pool hit and publish them; the request returns to its queue state. A
        request that went away meanwhile, or whose pool hit shrank below where the load starts, gets
        nothing (it is planned again, or computes its prefix: the same output)."""
        load = self._loads.pop(load_id)
        request, kv, scheduler, tier = load.request, self.kv, self.scheduler, load.tier
        hit, blocks, first, token_ids = [], [], 0, []
        if scheduler.requests.get(request.request_id) is request and request.status == LOADING:
            request.status = load.status
            token_ids = request.all_token_ids
            start = kv.num_pool_hit_blocks(request.request_id, token_ids)
            first = start - load.start  # of the loaded blocks, those the pool holds again already
            if 0 <= first < num_read and tier.enabled:
                self._grow_for(request.request_id, start, num_read - first)
                hit, blocks = kv.begin_tier_load(request.request_id, start, num_read - first)
                if not blocks:
                    self._no_room.add(request.request_id)
        answers = self.executor.collective_rpc(Worker.finish_kv_load, load_id, max(first, 0),
                                               [b.block_id for b in blocks])
        if blocks:
            kv.finish_tier_load(request.request_id, token_ids, hit, blocks, len(blocks))
        for key in load.keys[:num_read]:
            tier.index.touch(key)
        bad = sorted({key for a in answers for key in a.bad_keys})
        if bad:  # the other ranks' shards of a bad block are no use either
            for key in bad:
                tier.index.remove(key)
            self.executor.collective_rpc(Worker.remove_kv_blocks, tier.medium, bad)
            tier.stats.bad_files += len(bad)
            kv.record_events(tier.forget(bad))
        stats = tier.stats
        stats.hits += len(blocks)
        stats.bytes_read += sum(a.bytes_read for a in answers)
        if blocks:
            seconds = time.perf_counter() - load.began
            stats.observe_load(seconds)
            logger.debug("KV %s tier: request %s loaded %d blocks (%d..%d) in %.1f ms", tier.medium,
                         request.request_id, len(blocks), load.start + first, load.start + first + len(blocks) - 1,
                         1e3 * seconds)

    def store_published(self) -> None:
        """Keep the full blocks the step that just ran computed and published in every tier that lacks
        them (module doc)."""
        items = self.kv.take_tier_writes()
        event_blocks = self.kv.take_tier_event_blocks()
        if not items or not self.tiers:
            return
        wanted = {t.medium: [(block_id, key) for block_id, key in items if key not in t.index] for t in self.tiers}
        if not any(wanted.values()):
            return
        answers = self.executor.collective_rpc(Worker.save_kv_blocks, {m: v for m, v in wanted.items() if v})
        for tier in list(self.tiers):
            if not wanted[tier.medium]:
                continue
            error = next((a[tier.medium][1] for a in answers if a[tier.medium][1]), None)
            if error is not None:
                self._turn_off(tier, error)
                continue
            self.kv.record_events(tier.store(sum(a[tier.medium][0] for a in answers),
                                             [key for _, key in wanted[tier.medium]], event_blocks))

    def _turn_off(self, tier: KVTier, reason: str) -> None:
        logger.warning("KV %s tier off: %s; requests are served without it (prefixes that leave the pool "
                       "are recomputed)", tier.medium.lower(), reason)
        self.tiers.remove(tier)
        self.kv.enable_tiers([t.index for t in self.tiers])
        self.kv.record_events(tier.forget(list(tier.event_hashes)))
        tier.index.clear()
        tier.close()

    def snapshots(self) -> list[TierStats]:
        """Every tier's counters with its occupancy now, nearest first."""
        return [t.snapshot() for t in self.all_tiers]

    def close(self) -> None:
        """Finish the writes under way (every published block is on disk afterwards) and drop the loads
        under way (their requests compute their prefixes); idempotent."""
        for load in self._loads.values():
            if load.request.status == LOADING:
                load.request.status = load.status
        self._loads.clear()
        if self.tiers:
            self.tiers = []
            self.kv.enable_tiers([])
        for tier in self.all_tiers:
            tier.close()
