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
- **Load before scheduling.** Before each step, for the waiting requests that could be admitted, the
  blocks right after a request's pool hit that the tier holds are loaded into free blocks and published
  as cached prefixes (``load_for_waiting``); the scheduler then admits the request with them as an
  ordinary prefix hit. A file that fails its checks ends the load there: the rest of the prompt is
  computed, so the output is the same. The load runs on the engine thread, between steps (reads and
  checksums release the GIL, but the step waits for them).

Everything the tier does is optional to a request: a tier that cannot write turns itself off with one
warning, and nothing it does fails a request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from tideserve.config import CacheConfig
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.tiers import TierIndex, TierStats
from tideserve.core.scheduler import Scheduler
from tideserve.model.loader import LoadedModel
from tideserve.tokenizer.tokenizer import Tokenizer
from tideserve.worker.executor import Executor
from tideserve.worker.worker import Worker

logger = logging.getLogger(__name__)
GiB = 2**30
DISK_MEDIUM = "DISK"  # the tier's name in metrics (vLLM's KV events call a tier a medium)


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
    def load_for_waiting(self) -> None:
        """Load the tier's blocks of the waiting requests that could be admitted now into free blocks, as
        cached prefixes the scheduler then hits."""
        if not self._open:
            return
        scheduler, kv = self.scheduler, self.kv
        seats = scheduler.config.max_num_seqs - len(scheduler.running)
        budget = scheduler.config.max_num_batched_tokens  # the requests past it cannot start in this step
        for request in list(scheduler.waiting)[:max(0, seats)]:
            if budget <= 0:
                return
            if request.request_id in kv.swapped or request.sampling_params.needs_every_prompt_position:
                continue
            token_ids = request.all_token_ids
            start, keys = kv.plan_tier_load(request.request_id, token_ids)
            budget -= len(token_ids) - (start + len(keys)) * kv.block_size
            if not keys:
                continue
            grow = scheduler.on_out_of_blocks  # the elastic pool grows for a load as for an allocation
            while grow is not None and (short := kv.tier_load_shortfall(request.request_id, start, len(keys))):
                free = kv.num_free_blocks
                if not grow(short) or kv.num_free_blocks <= free:
                    break
            if not self._load(request.request_id, token_ids, start, keys):
                return

    def _load(self, request_id: str, token_ids: list[int], start: int, keys: list[bytes]) -> int:
        """Load the tier's ``keys`` after the request's pool hit of ``start`` blocks (as many as there are
        free blocks for); returns how many blocks were loaded."""
        began = time.perf_counter()
        hit, blocks = self.kv.begin_tier_load(request_id, start, len(keys))
        answers = (self.executor.collective_rpc(Worker.load_kv_blocks_from_disk,
                                                [(key, b.block_id) for key, b in zip(keys, blocks)])
                   if blocks else [])
        num = min((a.num_loaded for a in answers), default=0)
        self.kv.finish_tier_load(request_id, token_ids, hit, blocks, num)
        for key in keys[:num]:
            self.index.touch(key)
        bad = sorted({key for a in answers for key in a.bad_keys})
        if bad:  # the other ranks' shards of a bad block are no use either
            for key in bad:
                self.index.remove(key)
            self.executor.collective_rpc(Worker.remove_kv_blocks_from_disk, bad)
            self.stats.bad_files += len(bad)
        stats = self.stats
        stats.hits += num
        stats.bytes_read += sum(a.bytes_read for a in answers)
        if num:
            stats.loads += 1
            stats.load_seconds += time.perf_counter() - began
            logger.debug("KV disk tier: request %s loaded %d blocks (%d..%d) in %.1f ms", request_id, num, start,
                         start + num - 1, 1e3 * (time.perf_counter() - began))
        return num

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
        """Finish the writes under way (every published block is on disk afterwards); idempotent."""
        if self._open:
            self._open = False
            self.kv.enable_tier(None)
            self.executor.collective_rpc(Worker.close_kv_disk_tier)
