"""One rank's worker: its model (or tensor-parallel shard), KV storage, runner and memory probe.

Why one type on every rank, the driver included: every operation on the weights or the KV storage (a
step, a resize, a compaction's copies, a block-size change, a background commit, giving memory back) is
one method here, and the engine calls it through ``Executor.collective_rpc`` (worker/executor.py), which
runs it on every rank. So an operation exists once, and it cannot run on one rank only by mistake: there
are no per-rank proxies or command tables to keep in step with it.

Every method must leave every rank in the same state given the same arguments (block ids mean the same
bytes everywhere, and the forward pass's collectives line up); what differs by rank (the KV heads of a
shard, who samples) is fixed when the worker is built. Methods run on the engine's thread only, between
steps, never concurrently with one another.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tideserve import native
from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits
from tideserve.core.kv_cache.memory import MemoryProbe
from tideserve.core.scheduler import SchedulerOutput
from tideserve.native.cores import intra_op_threads, lend_core
from tideserve.platform import platform_for
from tideserve.worker.kv_disk_tier import DiskTier, TierFile, TierLoadResult
from tideserve.worker.kv_host_tier import HostTier
from tideserve.worker.kv_staging import StagingBuffers
from tideserve.worker.kv_store import KVCacheStorage, KVLayout
from tideserve.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReport:
    """One rank's answer to "how much memory may the KV cache take": its probe's figures, the host it
    runs on (ranks on one host share its memory) and its KV bytes per token (ranks of an uneven split
    hold different shares of a block)."""

    host: str
    available_bytes: int
    total_bytes: int
    used_by_process_bytes: int
    kv_token_bytes: int
    description: str = ""
    scope: str | None = None  # what the probe's memory is shared with (Platform.memory_scope); None: nothing


@dataclass(frozen=True)
class TierLoad:
    """One rank's part of a load from a KV tier: how many leading blocks its read found whole, the keys
    whose files were bad (removed; the disk tier's) and the bytes it read."""

    num_loaded: int
    bad_keys: list[bytes]
    bytes_read: int


@dataclass(frozen=True)
class KVCommitState:
    """A background commit's progress (``Worker.commit_kv_ahead``), in blocks of the pool."""

    in_flight: bool
    committed_ahead_blocks: int  # the largest pool whose pages are resident already
    goal_blocks: int  # the largest pool the commit under way will have made resident

    @staticmethod
    def slowest(states: list[KVCommitState]) -> KVCommitState:
        """Every rank's commit counted as one: in flight while any is, resident as far as all are."""
        return KVCommitState(any(s.in_flight for s in states), min(s.committed_ahead_blocks for s in states),
                             min(s.goal_blocks for s in states))


def host_core_free() -> bool:
    """Whether a background commit would find a core of its own: the kernels compute with fewer intra-op
    threads (the thread governor's count in force, less the cores lent out) than the CPUs this process
    may run on. With every core in the step's OpenMP team, a commit thread takes one of them and every
    barrier then waits for the thread it displaced (on a 2-vCPU VM whose host takes freed memory back,
    64-stream output fell by a sixth that way: docs/benchmarks.md); the commit is lent a core instead
    (``native.cores.lend_core``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return intra_op_threads() < cpus


def worker_class(extension: str | None) -> type[Worker]:
    """``Worker``, or with ``extension`` ("package.module.Class", vLLM's ``worker_extension_cls``) a
    worker whose class also has that class's methods: operations a user adds, called through
    ``LLM.collective_rpc`` on every rank like the engine's own."""
    if not extension:
        return Worker
    module_name, _, class_name = extension.rpartition(".")
    try:
        mixin = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker_extension_cls={extension!r} cannot be imported: {exc}") from exc
    if not isinstance(mixin, type):
        raise ValueError(f"worker_extension_cls={extension!r} must name a class as 'package.module.Class'.")
    return type(f"{class_name}Worker", (Worker, mixin), {"__module__": __name__})


class Worker:
    """A rank's model, KV storage, runner and memory probe; each public method is one operation."""

    def __init__(self, model: torch.nn.Module, device: torch.device, kv_dtype: torch.dtype,
                 attention_backend: str = "auto", *, rank: int = 0, block_size: int = 16,
                 memory_probe: MemoryProbe | None = None, structured_output: Any = None,
                 reload: Callable[[], torch.nn.Module] | None = None, batch_invariant: bool = True,
                 draft_model: torch.nn.Module | None = None) -> None:
        """``model``: this rank's model (its shard under tensor parallelism: its KV heads are the ones
        cached here). Rank 0 samples; the others compute the logits' collectives only and learn each
        sampled token with the next step. ``memory_probe`` replaces the device's answers (a test double);
        ``structured_output`` computes the grammar masks of the rows rank 0 samples; ``reload`` builds this
        rank's model again from its file (sleep mode: weights released are brought back with it);
        ``batch_invariant`` keeps the CPU kernels on the paths whose rows do not depend on their batch
        (native.apply_batch_invariance), in this rank's process. ``draft_model``: the draft-model method's
        proposer (spec_decode/draft.py checked that its KV has the target's shape): its layers are extra layer
        slots of the same store, after the target's, so every move of the pool carries its KV too. A separate
        draft stays loaded through sleep (it is small beside the target); the target's own weights as the
        draft sleep and wake with the target."""
        if device.type == "cpu":
            native.apply_batch_invariance(batch_invariant)
        self.rank = rank
        self.model: torch.nn.Module | None = model
        self.device = device
        self.platform = platform_for(device)
        self.memory_probe: MemoryProbe = memory_probe if memory_probe is not None else self.platform
        arch = model.arch
        self.draft_model = draft_model
        self._draft_is_target = draft_model is model
        # One K and one V region per layer slot: every layer, or with local and global layers mixed one per
        # layer of a KV cache group (a block then holds one group's layers; core/kv_cache/groups.py); then
        # the draft model's layers.
        num_slots = arch.kv_cache_groups().group_size
        if draft_model is not None:
            num_slots += draft_model.arch.num_hidden_layers
        self.kv_storage = KVCacheStorage(
            KVLayout(num_slots, arch.num_key_value_heads, arch.head_dim, kv_dtype), device, block_size)
        self._attention_backend = attention_backend
        self._structured_output = structured_output
        self._reload = reload
        self._graphs: tuple[int, int] | None = None  # (max_num_seqs, max_model_len) of enable_cuda_graphs
        self._host_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # sleep level 1 on a GPU
        self.runner: ModelRunner | None = None
        self.disk_tier: DiskTier | None = None  # this rank's files of the KV disk tier (open_kv_disk_tier)
        self.host_tier: HostTier | None = None  # this rank's blocks in the KV host tier (open_kv_host_tier)
        # the loads under way (start_kv_load): load id -> (medium, buffer, read)
        self._kv_loads: dict[int, tuple[str, np.ndarray, Future[TierLoadResult]]] = {}
        self._staging = StagingBuffers()  # the loads' buffers, kept between loads (worker/kv_staging.py)
        self._build_runner()

    def _build_runner(self) -> None:
        self.runner = ModelRunner(self.model, self.kv_storage, self.device, self._attention_backend,
                                  draft_model=self.draft_model)
        self.runner.samples = self.rank == 0
        self.runner.structured_output = self._structured_output
        if self._graphs is not None:
            self.runner.enable_graphs(*self._graphs)

    # ----------------------------------------------------------------- what the builder asks
    def kv_token_bytes(self) -> int:
        """Bytes of one token of one layer's K (or V) on this rank."""
        return self.kv_storage.layout.token_bytes

    def kv_num_layer_slots(self) -> int:
        """Layer slots a block holds: the target's (one group's, for a model with several KV cache groups)
        and a draft model's."""
        return self.kv_storage.layout.num_layers

    def describe_attention(self) -> str:
        return self.runner.attn_backend.describe()

    def memory_report(self) -> MemoryReport:
        """The probe's figures; what the process holds counts the KV pool also where the probe cannot see it
        (device memory the driver maps beside torch's allocator, worker/cuda_kv_store.py)."""
        probe = self.memory_probe
        describe = getattr(probe, "describe", None)
        scope = getattr(probe, "memory_scope", None)
        used = probe.used_by_process_bytes() + self.kv_storage.bytes_outside_allocator
        return MemoryReport(os.uname().nodename, probe.available_bytes(), probe.total_bytes(), used,
                            self.kv_token_bytes(), describe() if describe is not None else type(probe).__name__,
                            scope() if scope is not None else None)

    def profile_activation_bytes(self, num_tokens: int, max_num_seqs: int, block_size: int) -> int:
        """The activation peak of a forward pass over ``num_tokens`` prompt tokens (ModelRunner's)."""
        return self.runner.profile_activation_bytes(num_tokens, max_num_seqs, block_size)

    # ----------------------------------------------------------------- the KV cache
    def initialize_kv_cache(self, geometry: KVGeometry, reserve_bytes: int, static: bool) -> KVStoreLimits:
        """Create the device pool (``reserve_bytes``: the largest it may ever grow to; ``static``: commit
        it all now) and the swap tier as ``geometry`` says; returns what bounds the pool's growth here."""
        self.kv_storage.create_store(geometry.num_blocks, reserve_bytes, static, block_size=geometry.block_size)
        self.kv_storage.allocate_swap(geometry.num_swap_blocks)
        return self.kv_storage.limits()

    def describe_kv_store(self) -> str:
        """What holds the KV pool and what a resize costs (``KVStore.describe``), for the start-up log."""
        return self.kv_storage.describe()

    def apply_kv_geometry(self, geometry: KVGeometry) -> KVStoreLimits:
        """Make the pool match ``geometry``: resize it (blocks below min(old, new) keep their KV; raises
        ``KVStoreGrowError``, changing nothing, when a growth cannot get the memory) or, with no request
        holding KV, read it at another block size; the swap tier follows. Returns the store's limits,
        which a block-size change moves."""
        self.kv_storage.apply_geometry(geometry)
        return self.kv_storage.limits()

    def set_commit_floor(self, floor_bytes: int) -> None:
        """Commit the pool's pages in steps, each only while the machine keeps ``floor_bytes`` free beyond
        it (the probe is read again before each step): something outside the engines' accounting that
        takes memory during a long commit stops it instead of pushing the host past its limit."""
        probe = self.memory_probe
        self.kv_storage.set_commit_guard(lambda num_bytes: probe.available_bytes() - num_bytes >= floor_bytes)

    def commit_kv_ahead(self, num_blocks: int) -> bool:
        """Commit the pages of a pool of ``num_blocks`` off the engine's thread (the store's
        ``commit_ahead``); True when a resize to it may follow at once. On the host with every core in
        the kernels' threads, the commit is lent one of them while it runs; a single core commits on
        the engine's thread (True: the resize does it)."""
        on_done = None
        if self.platform.computes_on_host and not host_core_free():
            if intra_op_threads() < 2:
                return True
            on_done = lend_core()
        return self.kv_storage.commit_ahead(num_blocks, on_done)

    def kv_commit_state(self) -> KVCommitState:
        storage = self.kv_storage
        return KVCommitState(storage.commit_in_flight, storage.committed_ahead_blocks, storage.commit_goal_blocks)

    def move_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy the KV of each (old id, new id) and rewrite the runner's block tables: compaction."""
        self.runner.apply_moves(moves)

    def release_idle_swap(self) -> None:
        """No request is swapped out: hand the swap tier's pages back."""
        self.kv_storage.release_idle_swap()

    def release_freed_memory(self) -> None:
        """Hand memory the process freed back to the system or the device (the platform's way)."""
        self.platform.release_freed_memory()

    # ----------------------------------------------------------------- the KV tiers (host, disk)
    def open_kv_disk_tier(self, root: str, fingerprint: dict[str, str]
                          ) -> tuple[list[TierFile], list[str], str | None]:
        """Open this rank's files of the disk tier of ``fingerprint`` under ``root`` (each rank keeps its own
        shard); returns the block files it holds, least recently used first, the other fingerprints'
        directories there, and why the directory cannot be used (None when it can)."""
        tier = DiskTier(root, fingerprint, self.rank)
        try:
            tier.open()
            files = tier.scan()
        except OSError as exc:
            tier.close()
            return [], [], str(exc)
        self.disk_tier = tier
        return files, tier.other_fingerprints(), None

    def open_kv_host_tier(self) -> None:
        """Start this rank's host tier (empty: host memory does not outlive the process)."""
        self.host_tier = HostTier()

    def _kv_tier(self, medium: str) -> DiskTier | HostTier | None:
        return self.disk_tier if medium == "DISK" else self.host_tier

    def save_kv_blocks(self, items: dict[str, list[tuple[int, bytes]]]) -> dict[str, tuple[int, str | None]]:
        """Keep these (block id, tier key) blocks in each medium's tier: their bytes are copied out of the
        pool now, once for every tier (the blocks may be reused after this call); a disk tier writes its
        files on its own thread. Returns, per medium, the bytes one block takes there and why the tier
        stopped keeping blocks (None while it works)."""
        block_ids = sorted({block_id for pairs in items.values() for block_id, _ in pairs})
        rows = self.kv_storage.read_blocks(block_ids) if block_ids else None
        row_of = {block_id: i for i, block_id in enumerate(block_ids)}
        answers = {}
        for medium, pairs in items.items():
            tier = self._kv_tier(medium)
            if tier is None:
                answers[medium] = 0, f"the {medium} tier is closed"
                continue
            if tier.error is None:
                for block_id, key in pairs:
                    tier.save(key, rows[row_of[block_id]])
            answers[medium] = tier.file_bytes(self.kv_storage.bytes_per_block()), tier.error
        return answers

    def start_kv_load(self, medium: str, load_id: int, keys: list[bytes]) -> None:
        """Start reading these blocks from the medium's tier, in order, into a buffer of this rank's, on the
        tier's own thread (``kv_loads_done`` says when it is over, ``finish_kv_load`` puts the blocks in the
        pool). Nothing here touches the pool: it may resize or compact while the blocks are read."""
        tier = self._kv_tier(medium)
        rows = self._staging.take(len(keys) if tier is not None else 0, self.kv_storage.bytes_per_block())
        if tier is None:  # closed meanwhile: a load that found nothing
            future: Future[TierLoadResult] = Future()
            future.set_result(TierLoadResult(0, [], 0))
        else:
            future = tier.start_load(keys, rows.shape[1], memoryview(rows).cast("B"))
        self._kv_loads[load_id] = medium, rows, future

    def kv_loads_done(self, wait_s: float = 0.0) -> dict[int, int]:
        """The loads whose reads are over, with how many leading blocks each read whole; waits up to
        ``wait_s`` for the oldest one when none is over yet (the engine has nothing else to do)."""
        if wait_s > 0 and self._kv_loads and not any(f.done() for _, _, f in self._kv_loads.values()):
            wait([next(iter(self._kv_loads.values()))[2]], timeout=wait_s)
        return {load_id: future.result().num_loaded
                for load_id, (_, _, future) in self._kv_loads.items() if future.done()}

    def finish_kv_load(self, load_id: int, first: int, block_ids: list[int]) -> TierLoad:
        """Fill ``block_ids`` with the load's blocks from its ``first`` on (none: the load is dropped) and
        free its buffer; waits for the read if it is not over. Returns what the read found."""
        if load_id not in self._kv_loads:  # the tier was closed meanwhile
            return TierLoad(0, [], 0)
        _, rows, future = self._kv_loads.pop(load_id)
        result = future.result()
        self.kv_storage.write_blocks(block_ids, rows[first:first + len(block_ids)])
        self._staging.give_back(rows)
        return TierLoad(result.num_loaded, result.bad_keys, result.bytes_read)

    def remove_kv_blocks(self, medium: str, keys: list[bytes]) -> None:
        """Drop these blocks from the medium's tier (evicted from it, or found on some ranks only)."""
        tier = self._kv_tier(medium)
        if tier is not None:
            tier.remove(keys)

    def close_kv_tier(self, medium: str) -> None:
        """Finish the tier's writes under way (shutdown: every published block is on disk) and loads, and
        stop its threads; the loads of that medium not yet finished are dropped."""
        tier = self._kv_tier(medium)
        if tier is not None:
            tier.close()
            if medium == "DISK":
                self.disk_tier = None
            else:
                self.host_tier = None
            for load_id in [i for i, (m, _, _) in self._kv_loads.items() if m == medium]:
                del self._kv_loads[load_id]

    # ----------------------------------------------------------------- requests
    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled_last_step: dict[str, list[int]]) -> ModelRunnerOutput:
        """Run one step. ``sampled_last_step``: the tokens rank 0 sampled in the previous step, which a
        rank that does not sample appends to its requests before this one (rank 0 has them already)."""
        if not self.runner.samples:
            for request_id, tokens in sampled_last_step.items():
                state = self.runner.requests.get(request_id)
                if state is not None:
                    state.token_ids.extend(tokens)
        return self.runner.execute(scheduler_output)

    def forget_finished_requests(self) -> None:
        """Drop the state of requests that finished after the last step (a pool read at another block
        size leaves none of them with block ids of the old layout)."""
        self.runner.forget_finished()

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> int | None:
        """Replay decode-only steps as graphs captured per batch size; the largest size, or None when the
        attention backend cannot (every step then runs eagerly)."""
        if not self.runner.enable_graphs(max_num_seqs, max_model_len):
            return None
        self._graphs = (max_num_seqs, max_model_len)
        return self.runner.graphs.sizes[-1]

    # ----------------------------------------------------------------- sleep mode
    def sleep(self, level: int) -> None:
        """Release the KV pool's memory and the weights' (no request holds KV: the engine checked). On a
        GPU, level 1 keeps a host copy of the weights to copy back on wake; elsewhere (the host's own
        memory: a copy there would hold what is to be released), and at level 2, the weights are dropped
        and rebuilt from the model file on wake."""
        self.kv_storage.release_pages()
        if level == 1 and not self.platform.host_memory:
            self._host_weights = _offload_to_host(self.model, self.platform.async_host_copies)
        else:
            if self._reload is None:
                raise ValueError("this engine's weights cannot be released: it was built without the model file "
                                 "to reload them from.")
            self.model = self.runner = None
            if self._draft_is_target:
                self.draft_model = None
        gc.collect()
        self.platform.release_freed_memory()

    def wake_up(self, tags: list[str]) -> None:
        """Bring back what ``sleep`` released: ``tags`` "weights" (the host copy, or a fresh load from the
        model file) and "kv_cache" (the pool's memory, zeroed); each only if it is asleep."""
        if "weights" in tags:
            if self._host_weights is not None:
                _restore_from_host(self._host_weights, self.device)
                self._host_weights = None
                self._build_runner()  # graphs and kernels bound to the old addresses go with the old runner
            elif self.model is None:
                self.model = self._reload()
                if self._draft_is_target:
                    self.draft_model = self.model
                self._build_runner()
        if "kv_cache" in tags:
            self.kv_storage.restore_pages()


def _offload_to_host(model: torch.nn.Module, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter and buffer moved to (pinned) host memory in place (``.data`` swapped, so every
    module keeps its tensors); returns (tensor, host copy) pairs for ``_restore_from_host``."""
    moved = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor.data)
        moved.append((tensor, host))
        tensor.data = host
    return moved


def _restore_from_host(moved: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
    for tensor, host in moved:
        tensor.data = host.to(device, non_blocking=True)
