"""The engine's side of the KV disk tier (``--kv-cache-dir``): what to write down, what to load back.

The cache manager names blocks (core/kv_cache/tiers.py: stable keys, the LRU index), the workers move
their bytes (worker/kv_disk_tier.py: checksummed files, one directory per fingerprint and rank); this
module runs the two around each step:

- **Write at publish time.** A full block is written down once, right after the step that computed it
  (``store_published``), not when it leaves the pool. Why: a block that is only written on eviction is
  lost when the server stops or crashes, and a restart on the same directory is the case the tier is
  for; an idle shrink, a reuse of the block or a shutdown then costs nothing more, since the tier already
  has it. The price is one copy of each new block's bytes out of the pool per step (a memcpy; the file
  is written on the tier's own thread), and a file for prefixes that are never reused, which the LRU
  bound ages out.
- **Load beside the steps.** Before each step, for the waiting requests that could be admitted soon, the
  blocks right after a request's pool hit that the tier holds start loading (``start_loads``): each rank
  reads its files into a buffer of its own on the tier's threads, and the request is
  ``WAITING_FOR_REMOTE_KVS`` meanwhile, so the scheduler passes over it while every other request keeps
  its steps. Once every rank's read is over (``finish_loads``, before a later step) the blocks are copied
  into free blocks of the pool and published as cached prefixes, and the request, back in its previous
  state and place, is admitted with them as an ordinary prefix hit. The pool is only touched on the
  engine thread, at that moment, so it may grow, shrink or compact while files are read. When nothing
  else can run the engine waits for the oldest read instead of spinning. A file that fails its checks
  ends the load there: the rest of the prompt is computed, so the output is the same.

Everything the tier does is optional to a request: a tier that cannot write turns itself off with one
warning, and nothing it does fails a request.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tideserve.config import CacheConfig
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
DISK_MEDIUM = "DISK"  # the tier's name in metrics (vLLM's KV events call a tier a medium)
LOAD_WAIT_S = 0.05  # how long an engine with nothing else to run waits for a read at a time
LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass
class PendingLoad:
    """A load whose files are being read: its request, the state it returns to, the pool hit (in blocks)
    it continues, the tier keys it reads, and when it began."""

    request: Request
    status: RequestStatus
    start: int
    keys: list[bytes]
    began: float


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


class KVDiskTier:
    """Writes published blocks down and loads tier hits back, around the engine's steps (module doc)."""

    def __init__(self, executor: Executor, kv: KVCacheManager, scheduler: Scheduler, index: TierIndex,
                 path: str) -> None:
        self.executor = executor
        self.kv = kv
        self.scheduler = scheduler
        self.index = index
        self.path = path
        self.stats = TierStats(DISK_MEDIUM, capacity_bytes=index.capacity_bytes)
        self._open = True
        self._loads: dict[int, PendingLoad] = {}  # by load id, oldest first
        self._load_ids = itertools.count()
        kv.enable_tier(index)

    @classmethod
    def open(cls, cache: CacheConfig, fingerprint: dict[str, str], executor: Executor, kv: KVCacheManager,
             scheduler: Scheduler) -> KVDiskTier | None:
        """The tier under ``cache.kv_cache_dir`` with what it already holds for ``fingerprint`` (a restart
        serves those blocks at once), or None (logged) when the directory cannot be used."""
        path = cache.kv_cache_dir
        if not kv.enable_prefix_caching:
            logger.warning("kv_cache_dir=%s is ignored: the disk tier keeps prefix blocks, and prefix caching "
                           "is off", path)
            return None
        answers = executor.collective_rpc(Worker.open_kv_disk_tier, path, fingerprint)
        error = next((err for _, _, err in answers if err), None)
        if error is not None:
            executor.collective_rpc(Worker.close_kv_disk_tier)
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
            executor.collective_rpc(Worker.remove_kv_blocks_from_disk, partial + evicted)
        others = answers[0][1]
        if others:
            logger.info("KV disk tier: %d other configuration(s) under %s (another model file, dtype, KV dtype or "
                        "tensor-parallel size) are ignored", len(others), path)
        logger.info("KV disk tier: %s, %d blocks found (%.2f of %.2f GiB)", path, len(index),
                    index.used_bytes / GiB, index.capacity_bytes / GiB)
        return cls(executor, kv, scheduler, index, path)

    @property
    def enabled(self) -> bool:
        return self._open

    # ----------------------------------------------------------------- around each step
    @property
    def loading(self) -> bool:
        """Whether some request waits for its blocks to be read."""
        return bool(self._loads)

    def before_step(self) -> None:
        """Finish the loads whose reads are over, start the waiting requests' loads, and, when nothing else
        can run, wait a little for the oldest read (module doc)."""
        if not self._open:
            return
        self.finish_loads()
        if self.scheduler.waiting:
            self.start_loads()
        scheduler = self.scheduler
        if self._loads and not scheduler.running and all(r.status == LOADING for r in scheduler.waiting):
            self.finish_loads(LOAD_WAIT_S)

    def start_loads(self) -> None:
        """Start reading the tier's blocks of the waiting requests that could be admitted soon (the first
        ``max_num_seqs`` free seats' worth, within one step's token budget)."""
        scheduler, kv = self.scheduler, self.kv
        seats = scheduler.config.max_num_seqs - len(scheduler.running)
        budget = scheduler.config.max_num_batched_tokens  # the requests past it cannot start in the next step
        for request in list(scheduler.waiting)[:max(0, seats)]:
            if budget <= 0:
                return
            if request.status == LOADING:
                budget -= request.num_tokens - (len(request.all_token_ids) // kv.block_size) * kv.block_size
                continue
            if request.request_id in kv.swapped or request.sampling_params.needs_every_prompt_position:
                continue
            token_ids = request.all_token_ids
            start, keys = kv.plan_tier_load(request.request_id, token_ids)
            budget -= len(token_ids) - (start + len(keys)) * kv.block_size
            if not keys:
                continue
            load_id = next(self._load_ids)
            self.executor.collective_rpc(Worker.start_kv_disk_load, load_id, keys)
            self._loads[load_id] = PendingLoad(request, request.status, start, keys, time.perf_counter())
            request.status = LOADING

    def finish_loads(self, wait_s: float = 0.0) -> None:
        """Put the blocks of every load whose reads are over on every rank into the pool (waiting up to
        ``wait_s`` for the oldest when none is over)."""
        if not self._loads:
            return
        answers = self.executor.collective_rpc(Worker.kv_disk_loads_done, wait_s)
        done = set(answers[0]).intersection(*answers[1:])
        for load_id in [i for i in self._loads if i in done]:
            self._finish(load_id, min(a[load_id] for a in answers))

    def _finish(self, load_id: int, num_read: int) -> None:
        """Copy what load ``load_id`` read (its first ``num_read`` blocks, whole on every rank) into free
        blocks after its request's pool hit and publish them; the request returns to its queue state. A
        request that went away meanwhile, or whose pool hit shrank below where the load starts, gets
        nothing (it is planned again, or computes its prefix: the same output)."""
        load = self._loads.pop(load_id)
        request, kv, scheduler = load.request, self.kv, self.scheduler
        hit, blocks, first, token_ids = [], [], 0, []
        if scheduler.requests.get(request.request_id) is request and request.status == LOADING:
            request.status = load.status
            token_ids = request.all_token_ids
            start = kv.num_pool_hit_blocks(request.request_id, token_ids)
            first = start - load.start  # of the loaded blocks, those the pool holds again already
            if 0 <= first < num_read:
                grow = scheduler.on_out_of_blocks  # the elastic pool grows for a load as for an allocation
                while grow is not None and (short := kv.tier_load_shortfall(request.request_id, start,
                                                                            num_read - first)):
                    free = kv.num_free_blocks
                    if not grow(short) or kv.num_free_blocks <= free:
                        break
                hit, blocks = kv.begin_tier_load(request.request_id, start, num_read - first)
        answers = self.executor.collective_rpc(Worker.finish_kv_disk_load, load_id, max(first, 0),
                                               [b.block_id for b in blocks])
        if blocks:
            kv.finish_tier_load(request.request_id, token_ids, hit, blocks, len(blocks))
        for key in load.keys[:num_read]:
            self.index.touch(key)
        bad = sorted({key for a in answers for key in a.bad_keys})
        if bad:  # the other ranks' shards of a bad block are no use either
            for key in bad:
                self.index.remove(key)
            self.executor.collective_rpc(Worker.remove_kv_blocks_from_disk, bad)
            self.stats.bad_files += len(bad)
        stats = self.stats
        stats.hits += len(blocks)
        stats.bytes_read += sum(a.bytes_read for a in answers)
        if blocks:
            seconds = time.perf_counter() - load.began
            stats.loads += 1
            stats.load_seconds += seconds
            logger.debug("KV disk tier: request %s loaded %d blocks (%d..%d) in %.1f ms", request.request_id,
                         len(blocks), load.start + first, load.start + first + len(blocks) - 1, 1e3 * seconds)

    def store_published(self) -> None:
        """Write down the full blocks the step that just ran computed and published (module doc)."""
        items = self.kv.take_tier_writes()
        if not items or not self._open:
            return
        answers = self.executor.collective_rpc(Worker.save_kv_blocks_to_disk, items)
        error = next((err for _, err in answers if err), None)
        if error is not None:
            self._turn_off(error)
            return
        file_bytes = sum(size for size, _ in answers)
        evicted = []
        for _, key in items:
            evicted += self.index.add(key, file_bytes)
        if evicted:
            self.executor.collective_rpc(Worker.remove_kv_blocks_from_disk, evicted)
            self.stats.evictions += len(evicted)
        self.stats.blocks_written += len(items)
        self.stats.bytes_written += file_bytes * len(items)

    def _turn_off(self, reason: str) -> None:
        logger.warning("KV disk tier off: %s; requests are served without it (prefixes that leave the pool "
                       "are recomputed)", reason)
        self.kv.enable_tier(None)
        self.index.clear()
        self.stats.enabled = False
        self.close()

    def snapshot(self) -> TierStats:
        """The tier's counters with its occupancy now."""
        return dataclasses.replace(self.stats, used_bytes=self.index.used_bytes, enabled=self._open)

    def close(self) -> None:
        """Finish the writes under way (every published block is on disk afterwards) and drop the loads
        under way (their requests compute their prefixes); idempotent."""
        if self._open:
            self._open = False
            for load in self._loads.values():
                if load.request.status == LOADING:
                    load.request.status = load.status
            self._loads.clear()
            self.kv.enable_tier(None)
            self.executor.collective_rpc(Worker.close_kv_disk_tier)
