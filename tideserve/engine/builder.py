"""Builds an engine: settings checked, weights prepared, workers started and asked for their memory, the
KV geometry fixed and handed out, and every part the engine steps with assembled.

Why apart from the engine: assembling (quantization, tensor-parallel ranks, profiling, sizing the pool,
grammars, CUDA graphs, threads, KV events) happens once and in an order that matters; stepping happens
forever. ``build_engine`` does the first and returns an ``LLMEngine`` that only adds, aborts and steps.

The order: checks that cost nothing come first (a tensor-parallel split that cannot work is refused
before any process starts); the workers are asked for their memory after the weights are in place and
the profiling pass has run, so the budget is what is truly left; the KV events socket is bound last, so
a failed start-up leaves nothing behind.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tideserve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_TORCH_DTYPES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_max_model_len,
)
from tideserve.core.kv_cache.elastic import ElasticConfig
from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits
from tideserve.core.kv_cache.groups import KVCacheGroups
from tideserve.core.kv_cache.hybrid import HybridKVCacheManager
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.scheduler import Scheduler
from tideserve.engine.arg_utils import EngineArgs
from tideserve.engine.input_processor import InputProcessor
from tideserve.engine.kv_events import EventPublisher, create_publisher
from tideserve.engine.kv_sizing import KVPlan, memory_account, plan_kv_cache
from tideserve.engine.kv_tiers import KVTiers, open_disk_tier, open_host_tier, tier_fingerprint
from tideserve.engine.loaded_model import POST_LOAD_METHODS, match_loaded
from tideserve.engine.memory_probe import WorkersMemoryProbe
from tideserve.engine.output_processor import OutputProcessor
from tideserve.engine.pool_controller import PoolController
from tideserve.engine.threads import ThreadGovernor
from tideserve.model.layers.quant.calibration import CALIBRATION_TEXT, calibrate
from tideserve.model.layers.quant.transform import quantize_model
from tideserve.model.layers.quant.weight_bytes import model_weight_bytes
from tideserve.model.loader import LoadedModel, load_model
from tideserve.model.tensor_parallel import check_tensor_parallel, shard_model
from tideserve.platform import Platform, platform_for, resolve_device
from tideserve.platform.memory_ledger import MemoryLedger
from tideserve.spec_decode.draft import check_draft_model
from tideserve.structured_output.manager import StructuredOutputManager
from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer
from tideserve.worker.executor import Executor, UniprocExecutor
from tideserve.worker.parallel_state import TensorParallelGroup
from tideserve.worker.tp_executor import TensorParallelExecutor
from tideserve.worker.tp_rank import RankSetup
from tideserve.worker.worker import Worker, worker_class

logger = logging.getLogger(__name__)
GiB = 2**30


@dataclass
class EngineParts:
    """What an engine is made of, assembled once (``build_engine``) and stepped by ``LLMEngine``."""

    args: EngineArgs
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    loaded: LoadedModel
    model: torch.nn.Module  # the weights as this process serves them (rank 0's shard under tensor parallelism)
    device: torch.device
    platform: Platform
    kv_dtype: torch.dtype
    tokenizer: Tokenizer
    max_model_len: int
    executor: Executor
    memory: WorkersMemoryProbe
    kv_manager: KVCacheManager
    scheduler: Scheduler
    pool: PoolController
    input_processor: InputProcessor
    output_processor: OutputProcessor
    structured_output: StructuredOutputManager
    thread_governor: ThreadGovernor | None
    kv_events: EventPublisher | None
    kv_tiers: KVTiers | None = None


def build_engine(args: EngineArgs | Mapping[str, Any], loaded: LoadedModel,
                 tokenizer: Tokenizer | None = None) -> EngineParts:
    """The parts of an engine over ``loaded`` (see the module docstring); ``tokenizer`` None: read from
    the model's path."""
    args = EngineArgs.coerce(args)
    model_config, cache_config, sched_config = args.configs()
    requested = None if model_config.device == "auto" else resolve_device(model_config.device)
    loaded, device = match_loaded(model_config, loaded, requested)
    platform = platform_for(device)
    check_cpu_offload(model_config, platform)
    platform.tune_allocator()
    torch.manual_seed(model_config.seed)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(loaded.path)
    arch = loaded.arch
    if not arch.generates:
        logger.info("%s is a %s checkpoint, without a language-model head: it serves embeddings only",
                    loaded.name, arch.architecture)
    parallel = args.parallel_config()
    check_tensor_parallel(arch, parallel.tensor_parallel_size, loaded.quantization)  # before any rank starts
    model = _prepare_weights(loaded, tokenizer, device)
    max_model_len = resolve_max_model_len(model_config.max_model_len, arch.max_position_embeddings,
                                          model_config.allow_long_max_model_len)
    draft = _load_draft(sched_config, loaded, device, max_model_len, parallel.tensor_parallel_size)
    _check_batched_tokens(sched_config, args.max_num_batched_tokens, max_model_len)
    kv_dtype = (platform.auto_kv_dtype(loaded.dtype, loaded.quantization) if cache_config.kv_cache_dtype == "auto"
                else getattr(torch, KV_CACHE_TORCH_DTYPES[cache_config.kv_cache_dtype]))
    # Grammars end where the model may stop: EOS and every other end-of-generation id it has.
    structured_output = StructuredOutputManager(
        tokenizer.hf, arch.vocab_size, [*tokenizer.stop_token_ids, *arch.eos_token_ids])
    executor = _start_workers(args, model_config, loaded, model, device, kv_dtype,
                              cache_config.initial_block_size, structured_output, tokenizer, draft)
    try:
        memory = WorkersMemoryProbe(executor, platform.host_memory)
        logger.info("memory probe: %s", memory.describe())
        token_bytes = executor.collective_rpc(Worker.kv_token_bytes)[0]
        # Layer slots per block: the target's (one group's) and a draft model's, whose KV shares the pool.
        num_slots = executor.collective_rpc(Worker.kv_num_layer_slots)[0]
        kv_dtype_name = str(kv_dtype).removeprefix("torch.")
        groups = arch.kv_cache_groups()
        per_token = (f"{2 * num_slots * token_bytes} bytes per token" if not groups.is_hybrid else
                     f"{2 * groups.group_size * token_bytes} bytes per token in each of {groups.num_groups} layer "
                     f"groups")
        logger.info("KV cache dtype %s (%s); decode attention: %s", kv_dtype_name, per_token,
                    executor.collective_rpc(Worker.describe_attention, unique_reply_rank=0))
        if draft is not None:
            logger.info("KV cache: %d target layers and %d draft layers per block (the draft's KV shares the pool)",
                        groups.group_size, num_slots - groups.group_size)
        if groups.is_hybrid:
            logger.info("KV cache: %s; a block holds one group's layers, sliding groups keep only their window",
                        groups.describe())
            if cache_config.kv_cache_dir:
                raise ValueError(f"kv_cache_dir={cache_config.kv_cache_dir!r}: the disk tier does not support models "
                                 f"that mix sliding-window and global layers yet ({groups.describe()}); leave "
                                 "kv_cache_dir unset for this model.")
            if cache_config.kv_offloading_size:
                raise ValueError(f"kv_offloading_size={cache_config.kv_offloading_size!r}: the host tier does not "
                                 "support models that mix sliding-window and global layers yet "
                                 f"({groups.describe()}); leave kv_offloading_size unset for this model.")
        # A block holds one group's layers (all of them for a single-group model): its bytes count those.
        shape = KVGeometry(num_slots, token_bytes, kv_dtype_name, cache_config.initial_block_size, 0)
        plan = _plan(cache_config, sched_config, args.elastic_config(), executor, memory, model, shape,
                     max_model_len, groups.num_groups)
        limits = KVStoreLimits.tightest(executor.collective_rpc(
            Worker.initialize_kv_cache, plan.geometry, plan.reserve_bytes, plan.policy is None))
        _log_kv_store(executor, plan, limits)
        geometry = plan.geometry
        # Pages are committed in steps, each while the machine keeps half the safety margin free beyond it.
        executor.collective_rpc(Worker.set_commit_floor, plan.account.margin_bytes // 2)
        scope = memory.scope()
        ledger = MemoryLedger(scope) if scope is not None else None
        kv_manager = make_kv_manager(geometry, groups, cache_config.enable_prefix_caching, extra_key=loaded.name)
        kv_manager.enable_swap(geometry.num_swap_blocks)
        scheduler = Scheduler(sched_config, kv_manager, max_model_len)
        pool = PoolController(geometry, limits, kv_manager, scheduler, executor, memory, plan.account, plan.policy,
                              max_model_len, cache_config.auto_block_size, ledger=ledger)
        _enable_cuda_graphs(platform, model_config, executor, sched_config.max_num_seqs, max_model_len)
        # Under tensor parallelism the ranks split the cores between them (worker/tp_executor.py).
        thread_governor = (ThreadGovernor() if args.adaptive_threads and platform.computes_on_host
                           and executor.world_size == 1 else None)
        pool.log_pool("elastic pool, start" if plan.policy else "static pool")
        # What loading and the profiling pass freed goes back now: the allocator keeps freed activations for
        # the next step (tune_allocator), and a server sharing the machine must see them free at start-up.
        executor.collective_rpc(Worker.release_freed_memory)
        tiers = []  # nearest first
        if cache_config.kv_offloading_size:
            tiers.append(open_host_tier(cache_config, executor, kv_manager))
        if cache_config.kv_cache_dir:
            fingerprint = tier_fingerprint(loaded, kv_dtype, device, tokenizer, executor.world_size)
            if draft is not None:  # its layers are part of every block's bytes
                fingerprint["draft_model"] = str(sched_config.speculative_config.model)
            tiers.append(open_disk_tier(cache_config, fingerprint, executor, kv_manager))
        tiers = [t for t in tiers if t is not None]
        kv_tiers = KVTiers(executor, kv_manager, scheduler, tiers, pool.prepare_growth) if tiers else None
        processor = InputProcessor(tokenizer, arch, loaded.name, max_model_len, model_config, sched_config,
                                   structured_output)
        # Last, so a failed start-up leaves no socket bound.
        kv_events = create_publisher(cache_config.kv_events_config)
        if kv_events is not None:
            kv_manager.enable_events()
    except BaseException:
        executor.shutdown()
        raise
    return EngineParts(
        args=args, model_config=model_config, cache_config=cache_config, scheduler_config=sched_config,
        loaded=loaded, model=executor.driver_worker.model, device=device, platform=platform, kv_dtype=kv_dtype,
        tokenizer=tokenizer, max_model_len=max_model_len, executor=executor, memory=memory, kv_manager=kv_manager,
        scheduler=scheduler, pool=pool, input_processor=processor, output_processor=OutputProcessor(tokenizer),
        structured_output=structured_output, thread_governor=thread_governor, kv_events=kv_events,
        kv_tiers=kv_tiers)


def make_kv_manager(geometry: KVGeometry, groups: KVCacheGroups, enable_prefix_caching: bool,
                    extra_key: object = None) -> KVCacheManager:
    """The cache manager for ``groups``: per-group tables with window freeing when local and global layers
    mix, else the single-table manager."""
    if groups.is_hybrid:
        return HybridKVCacheManager(geometry.num_blocks, geometry.block_size, groups, enable_prefix_caching,
                                    extra_key=extra_key)
    return KVCacheManager(geometry.num_blocks, geometry.block_size, enable_prefix_caching, extra_key=extra_key)


def check_cpu_offload(config: ModelConfig, platform: Platform, warn: bool = True) -> None:
    """vLLM's ``cpu_offload_gb`` keeps that many GiB of the weights in host memory; tideserve keeps every
    weight where the model computes. On a device whose memory is the host's that changes nothing (a warning,
    unless ``warn`` is False); on a GPU it can decide whether a model fits, so the engine refuses to start,
    saying what to do instead, rather than start with another memory plan than the one asked for."""
    gib = config.cpu_offload_gb
    if not gib:
        return
    if platform.host_memory:
        if warn:
            logger.warning("cpu_offload_gb=%g has no effect on the %s: the weights are host memory already.", gib,
                           platform.device_name)
        return
    raise ValueError(
        f"cpu_offload_gb={gib:g} is not supported on {platform.device_name}: tideserve keeps every weight in device "
        "memory and offloads none of them to host memory, so a model that needs the offload would not fit as "
        "planned. Make the weights smaller (--quantization int4, or a quantized GGUF file), split them over "
        "several GPUs (--tensor-parallel-size N), or give the KV cache less (a smaller --max-model-len); then "
        "leave cpu_offload_gb at 0.")


def _prepare_weights(loaded: LoadedModel, tokenizer: Tokenizer, device: torch.device) -> torch.nn.Module:
    """The weights the engine runs: int8 quantized here (SmoothQuant-calibrated on a short text), or as
    loaded (the loader already applied GGUF blocks, int4 and float dtypes)."""
    if loaded.quantization == "int8":
        act_max = calibrate(loaded.model, tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False), device)
        model, saved = quantize_model(loaded.model, loaded.quantization, device, act_max)
        logger.info("quantization int8 (per-token activations, SmoothQuant-calibrated): weights now %.2f GiB "
                    "(%.2f GiB saved)", model_weight_bytes(model) / GiB, saved / GiB)
        return model
    if loaded.quantization != "none":
        from tideserve.native.quant import kernels_summary

        how = "the GGUF file's own blocks" if loaded.quantization == "gguf" else "4-bit blocks, tables 8-bit"
        logger.info("quantization %s (%s, kernels: %s): weights %.2f GiB", loaded.quantization, how,
                    kernels_summary(), model_weight_bytes(loaded.model) / GiB)
    return loaded.model


def _load_draft(sched: SchedulerConfig, loaded: LoadedModel, device: torch.device, max_model_len: int,
                tensor_parallel_size: int) -> torch.nn.Module | None:
    """The draft-model method's model, loaded in the target's dtype (the target's own weights when it names
    the same file: only its KV is separate), after the checks that it can share the target's pool
    (spec_decode/draft.py); None for any other method."""
    spec = sched.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    dtype = str(loaded.dtype).removeprefix("torch.")
    if _names_same_file(spec.model, loaded.path):
        draft = loaded
    else:
        try:
            draft = load_model(spec.model, dtype, device, "auto")
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ValueError(f"speculative_config.model={spec.model!r}: the draft model cannot be loaded "
                             f"({type(exc).__name__}: {exc}).") from exc
    check_draft_model(loaded.arch, draft.arch, loaded.name, draft.name, max_model_len, tensor_parallel_size)
    return draft.model


def _names_same_file(path: str, loaded_path: str) -> bool:
    try:
        return Path(path).resolve() == Path(loaded_path).resolve()
    except OSError:
        return False


def _check_batched_tokens(sched: SchedulerConfig, requested: int | None, max_model_len: int) -> None:
    """Without chunked prefill a prompt runs in one step, so one step must hold the longest prompt."""
    if sched.enable_chunked_prefill:
        return
    if requested is None:
        sched.max_num_batched_tokens = max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    elif requested < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({requested}) is smaller than max_model_len ({max_model_len}). "
            "With chunked prefill disabled a prompt must fit in one step, so longer prompts could never "
            "run. Increase max_num_batched_tokens, decrease max_model_len, or enable chunked prefill.")


def _start_workers(args: EngineArgs, model_config: ModelConfig, loaded: LoadedModel, model: torch.nn.Module,
                   device: torch.device, kv_dtype: torch.dtype, block_size: int,
                   structured_output: StructuredOutputManager, tokenizer: Tokenizer,
                   draft: torch.nn.Module | None = None) -> Executor:
    """One worker in this process, or under tensor parallelism this process's rank 0 and one process per
    other rank, each loading its shard of the same checkpoint."""
    parallel = args.parallel_config()
    cls = worker_class(parallel.worker_extension_cls)
    driver = {"rank": 0, "block_size": block_size, "memory_probe": args.memory_probe,
              "structured_output": structured_output, "batch_invariant": model_config.batch_invariant,
              "draft_model": draft}

    # What a wake needs to load the weights again: names only, never the loaded model (held here, it would
    # keep the weights alive through every sleep).
    path, dtype, method = loaded.path, str(loaded.dtype).removeprefix("torch."), loaded.quantization

    def reload(group: TensorParallelGroup | None = None) -> torch.nn.Module:
        """The weights again, from the model file, as this build prepared them (sleep mode's wake)."""
        again = load_model(path, dtype, device, "none" if method in POST_LOAD_METHODS else method)
        fresh = _prepare_weights(replace(again, quantization=method), tokenizer, device)
        return fresh if group is None else shard_model(fresh, group)

    if parallel.tensor_parallel_size == 1:
        return UniprocExecutor(cls(model, device, kv_dtype, model_config.attention_backend, reload=reload, **driver))
    setup = RankSetup(loaded.path, str(loaded.dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch."),
                      block_size, model_config.seed, model_config.attention_backend,
                      logging.getLogger("tideserve").getEffectiveLevel(), parallel.worker_extension_cls)
    return TensorParallelExecutor(
        parallel.tensor_parallel_size, device, setup,
        lambda group: cls(shard_model(model, group), device, kv_dtype, model_config.attention_backend,
                          reload=lambda: reload(group), **driver))


def _plan(cache: CacheConfig, sched: SchedulerConfig, elastic: ElasticConfig, executor: Executor,
          memory: WorkersMemoryProbe, model: torch.nn.Module, shape: KVGeometry, max_model_len: int,
          num_groups: int = 1) -> KVPlan:
    """Measure (the activation peak of a profiling pass on every rank, unless the pool's size is given in
    blocks) and size the pool from what the workers report."""
    baseline = memory.read().used_by_process_bytes
    activation = 0
    if cache.num_blocks is None:  # every rank measures its own peak; the budget takes the largest
        activation = max(executor.collective_rpc(
            Worker.profile_activation_bytes, min(sched.max_num_batched_tokens, max_model_len), sched.max_num_seqs,
            shape.block_size))
    reading = memory.read()
    account = memory_account(reading.available_bytes, model_weight_bytes(model), activation, elastic, baseline,
                             reading.used_by_process_bytes)
    return plan_kv_cache(shape, cache, sched, elastic, max_model_len, account, reading.total_bytes, num_groups)


def _log_kv_store(executor: Executor, plan: KVPlan, limits: KVStoreLimits) -> None:
    """Which store holds the pool, once; a warning when an elastic pool copies on every resize, since it can
    then grow only to about half the free memory."""
    text = executor.collective_rpc(Worker.describe_kv_store, unique_reply_rank=0)
    if plan.policy is not None and limits.copies_on_resize:
        logger.warning("KV store: %s. The elastic pool can grow to about %.2f GiB of the %.2f GiB budget at most "
                       "(the new tensor must fit beside the old one)", text,
                       plan.account.budget_bytes / 2 / GiB, plan.account.budget_bytes / GiB)
    else:
        logger.info("KV store: %s", text)


def _enable_cuda_graphs(platform: Platform, model_config: ModelConfig, executor: Executor, max_num_seqs: int,
                        max_model_len: int) -> None:
    """Decode-only steps replay CUDA graphs where the device captures them; not under tensor parallelism,
    where a captured step would have to capture the ranks' collectives too."""
    if not platform.graph_capture or model_config.enforce_eager or executor.world_size > 1:
        return
    largest = executor.collective_rpc(Worker.enable_cuda_graphs, max_num_seqs, max_model_len, unique_reply_rank=0)
    if largest is not None:
        logger.info("CUDA graphs: decode-only steps of up to %d requests replay graphs captured on first use "
                    "(--enforce-eager runs every step eagerly)", largest)
