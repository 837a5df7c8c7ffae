"""The synchronous engine: one ``step()`` schedules, runs the model, samples and emits outputs.

Requests are validated on entry (every user mistake is a ValueError with the parameter, value and
limit), split into one child per sample when n > 1, and streamed back as cumulative RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from tideserve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_TORCH_DTYPES,
    CacheConfig,
    SchedulerConfig,
    resolve_max_model_len,
)
from tideserve.core.kv_cache.elastic import ElasticConfig, ElasticPolicy, MemoryAccount, safety_margin
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.memory import MemoryProbe
from tideserve.core.scheduler import Scheduler
from tideserve.engine.arg_utils import EngineArgs
from tideserve.engine.kv_events import create_publisher
from tideserve.engine.loaded_model import match_loaded
from tideserve.engine.output_processor import OutputProcessor
from tideserve.engine.pool_controller import PoolController
from tideserve.engine.stats import EngineStats
from tideserve.engine.threads import ThreadGovernor
from tideserve.errors import InvalidParameterError
from tideserve.model.layers.quant.calibration import CALIBRATION_TEXT, calibrate
from tideserve.model.layers.quant.transform import quantize_model
from tideserve.model.layers.quant.weight_bytes import model_weight_bytes
from tideserve.model.loader import LoadedModel, load_model
from tideserve.model.tensor_parallel import check_tensor_parallel, shard_model
from tideserve.outputs import RequestOutput
from tideserve.platform import platform_for, resolve_device
from tideserve.pooling_params import PoolingParams
from tideserve.request import Request, RequestStatus
from tideserve.sampling_params import SamplingParams
from tideserve.structured_output.manager import StructuredOutputManager
from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer
from tideserve.worker.kv_store import KVCacheStorage, KVLayout
from tideserve.worker.model_runner import ModelRunner
from tideserve.worker.tp_executor import (
    TensorParallelExecutor,
    TensorParallelMemoryProbe,
    TensorParallelRunner,
)
from tideserve.worker.tp_worker import WorkerSetup

logger = logging.getLogger(__name__)

GiB = 2**30
# The "average request" a static pool must hold max_num_seqs of: a quarter of max_model_len, capped.
AVERAGE_REQUEST_TOKENS = 512


class LLMEngine:
    """Two ways in: ``from_engine_args(args)`` loads the model and tokenizer named by ``args``;
    ``LLMEngine(args, loaded, tokenizer)`` (or ``from_loaded``) builds over a model already loaded, which
    several engines may share (its weights are read-only; each engine owns its KV cache, scheduler and
    runner). Either way the settings in ``args`` must describe the model (engine/loaded_model.py)."""

    def __init__(self, args: EngineArgs | Mapping[str, Any], loaded: LoadedModel,
                 tokenizer: Tokenizer | None = None) -> None:
        args = EngineArgs.coerce(args)
        model_config, cache_config, sched_config = args.configs()
        self.args = args
        self.model_config = model_config
        requested = None if model_config.device == "auto" else resolve_device(model_config.device)
        loaded, self.device = match_loaded(model_config, loaded, requested)
        self.platform = platform_for(self.device)
        self.platform.tune_allocator()
        torch.manual_seed(model_config.seed)
        self.model = loaded.model
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.model_path = loaded.path
        self.model_name = loaded.name
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else load_tokenizer(loaded.path)
        self.quantization = loaded.quantization  # "auto" resolved by the loader
        if not self.arch.generates:
            logger.info("%s is a %s checkpoint, without a language-model head: it serves embeddings only",
                        self.model_name, self.arch.architecture)
        tp = args.parallel_config().tensor_parallel_size
        check_tensor_parallel(self.arch, tp, self.quantization)  # before anything starts or quantizes
        if self.quantization == "int8":
            act_max = calibrate(self.model, self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False),
                                self.device)
            self.model, saved = quantize_model(self.model, self.quantization, self.device, act_max)
            logger.info("quantization int8 (per-token activations, SmoothQuant-calibrated): weights now %.2f GiB "
                        "(%.2f GiB saved)", model_weight_bytes(self.model) / GiB, saved / GiB)
        elif self.quantization != "none":
            from tideserve.native.quant import kernels_summary

            how = ("the GGUF file's own blocks" if self.quantization == "gguf"
                   else "4-bit blocks, tables 8-bit")
            logger.info("quantization %s (%s, kernels: %s): weights %.2f GiB", self.quantization, how,
                        kernels_summary(), model_weight_bytes(self.model) / GiB)
        self.max_model_len = resolve_max_model_len(
            model_config.max_model_len, self.arch.max_position_embeddings,
            model_config.allow_long_max_model_len)
        self.cache_config = cache_config
        self.scheduler_config = sched_config
        self._check_batched_tokens(sched_config, args.max_num_batched_tokens)
        self.probe: MemoryProbe = args.memory_probe or self.platform
        describe = getattr(self.probe, "describe", None)
        if describe is not None:
            logger.info("memory probe: %s", describe())

        block_size = cache_config.initial_block_size
        self.kv_dtype = (self.platform.auto_kv_dtype(self.dtype, self.quantization)
                         if cache_config.kv_cache_dtype == "auto"
                         else getattr(torch, KV_CACHE_TORCH_DTYPES[cache_config.kv_cache_dtype]))
        arch = self.arch
        self.tensor_parallel: TensorParallelExecutor | None = None
        if tp > 1:  # ranks 1..tp-1 start now and load their shards; this process is rank 0
            self.tensor_parallel = TensorParallelExecutor(tp, self.device, WorkerSetup(
                loaded.path, str(self.dtype).removeprefix("torch."), str(self.kv_dtype).removeprefix("torch."),
                block_size, model_config.seed, model_config.attention_backend,
                logging.getLogger("tideserve").getEffectiveLevel()))
            self.model = shard_model(self.model, self.tensor_parallel.group)
        self.kv_storage = KVCacheStorage(
            # the model's own KV heads (a tensor-parallel part's arch counts its shard's)
            KVLayout(arch.num_hidden_layers, self.model.arch.num_key_value_heads, arch.head_dim, self.kv_dtype),
            self.device, block_size)
        self.runner = ModelRunner(self.model, self.kv_storage, self.device, model_config.attention_backend)
        if self.tensor_parallel is not None:  # every step and every KV move mirrored on the other ranks
            self.runner = TensorParallelRunner(self.runner, self.tensor_parallel)
            self.kv_storage = self.runner.kv_storage
            self.probe = TensorParallelMemoryProbe(self.probe, self.tensor_parallel,
                                                   self.kv_storage.layout.token_bytes)
        logger.info("KV cache dtype %s (%d bytes per token); decode attention: %s",
                    str(self.kv_dtype).removeprefix("torch."), self.kv_storage.bytes_per_block(1),
                    self.runner.attn_backend.describe())
        elastic = args.elastic_config()
        num_blocks, account, policy = self._plan_pool(cache_config, sched_config, elastic)
        reserve = num_blocks * self.kv_storage.bytes_per_block()
        if policy is not None:  # the largest the pool could ever reach: the whole machine (virtual only)
            reserve = max(reserve, account.budget_bytes, self.probe.total_bytes())
        self.kv_storage.create_store(num_blocks, reserve, static=policy is None)
        # The storage's geometry is the one source; the manager starts from it (and the pool controller
        # keeps it following every resize and block-size change).
        self.kv_manager = KVCacheManager(self.kv_storage.num_blocks, self.kv_storage.block_size,
                                         cache_config.enable_prefix_caching, extra_key=self.model_name)
        swap_bytes = 0
        if sched_config.preemption_mode == "swap":
            swap_bytes = int(cache_config.swap_space * GiB)
            num_swap = swap_bytes // self.kv_storage.bytes_per_block()
            self.kv_manager.enable_swap(num_swap)
            self.kv_storage.allocate_swap(num_swap)
        self.scheduler = Scheduler(sched_config, self.kv_manager, self.max_model_len)
        self.pool = PoolController(self.kv_manager, self.runner, self.scheduler, self.probe, account, policy,
                                   self.max_model_len, swap_bytes, cache_config.auto_block_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Grammars end where the model may stop: EOS and every other end-of-generation id it has.
        self.structured_output = StructuredOutputManager(
            self.tokenizer.hf, self.arch.vocab_size, [*self.tokenizer.stop_token_ids, *self.arch.eos_token_ids])
        self.runner.structured_output = self.structured_output
        # Not under tensor parallelism: a captured step would have to capture the ranks' collectives too.
        if self.platform.graph_capture and not model_config.enforce_eager and self.tensor_parallel is None:
            if self.runner.enable_graphs(sched_config.max_num_seqs, self.max_model_len):
                logger.info("CUDA graphs: decode-only steps of up to %d requests replay graphs captured on first "
                            "use (--enforce-eager runs every step eagerly)", self.runner.graphs.sizes[-1])
        # Under tensor parallelism the ranks split the cores between them (worker/tp_executor.py).
        self.thread_governor = (ThreadGovernor() if args.adaptive_threads and self.platform.computes_on_host
                                and self.tensor_parallel is None else None)
        self._ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.pool.log_pool("elastic pool, start" if policy else "static pool")
        # What loading and the profiling pass freed goes back now: the allocator keeps freed activations for
        # the next step (tune_allocator), and a server sharing the machine must see them free at start-up.
        self.platform.release_freed_memory()
        # KV cache events for a router (--kv-events-config): the manager records, each step publishes.
        # Last, so a failed start-up leaves no socket bound.
        self.kv_events = create_publisher(cache_config.kv_events_config)
        if self.kv_events is not None:
            self.kv_manager.enable_events()

    # ----------------------------------------------------------------- memory
    @classmethod
    def from_engine_args(cls, args: EngineArgs | Mapping[str, Any]) -> LLMEngine:
        """vLLM's constructor: ``args`` is an EngineArgs or a dict of its fields. Loads the model and its
        tokenizer (seconds), then builds the engine over them."""
        args = EngineArgs.coerce(args)
        model_config = args.configs()[0]  # every setting checked before anything loads
        device = resolve_device(model_config.device)
        torch.manual_seed(model_config.seed)
        quantization = model_config.quantization
        if quantization == "auto" and args.parallel_config().tensor_parallel_size > 1:
            quantization = "none"  # tensor parallelism splits float weights: a GGUF file is dequantized
        loaded = load_model(model_config.model, model_config.dtype, device, quantization)
        return cls(args, loaded, load_tokenizer(loaded.path))

    @classmethod
    def from_loaded(cls, args: EngineArgs | Mapping[str, Any], loaded: LoadedModel,
                    tokenizer: Tokenizer | None = None) -> LLMEngine:
        """An engine over an already loaded model (``load_model``) and its tokenizer (loaded from the
        model's path when None); settings left at "auto" take the loaded model's."""
        return cls(args, loaded, tokenizer)

    def _check_batched_tokens(self, sched: SchedulerConfig, requested: int | None) -> None:
        """Without chunked prefill a prompt runs in one step, so one step must hold the longest prompt."""
        if sched.enable_chunked_prefill:
            return
        if requested is None:
            sched.max_num_batched_tokens = max(self.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        elif requested < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({requested}) is smaller than max_model_len ({self.max_model_len}). "
                "With chunked prefill disabled a prompt must fit in one step, so longer prompts could never "
                "run. Increase max_num_batched_tokens, decrease max_model_len, or enable chunked prefill.")

    def _plan_pool(self, cache: CacheConfig, sched: SchedulerConfig,
                   elastic: ElasticConfig) -> tuple[int, MemoryAccount, ElasticPolicy | None]:
        """Size the pool from measurement (elastic) or from the user's fixed size (static, checked
        against the memory that exists)."""
        per_block = self.kv_storage.bytes_per_block()
        bs = self.kv_storage.block_size
        blocks_one_request = -(-self.max_model_len // bs)
        weights = model_weight_bytes(self.model)
        activation = 0
        baseline = self.probe.used_by_process_bytes()
        if cache.num_blocks is None:
            activation = self.runner.profile_activation_bytes(
                min(sched.max_num_batched_tokens, self.max_model_len), sched.max_num_seqs)
        available = self.probe.available_bytes()
        account = MemoryAccount(available, weights, activation,
                                safety_margin(weights, activation, elastic.margin_floor_bytes),
                                baseline_bytes=baseline, resident_bytes=self.probe.used_by_process_bytes())
        logger.info("%s", account.describe())

        if cache.num_blocks is not None:
            budget = cache.num_blocks * per_block
            self._check_static_size("num_blocks", f"{cache.num_blocks} blocks", budget, account)
        elif cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
            self._check_static_size("kv_cache_memory", f"{budget / GiB:.2f} GiB", budget, account)
        elif cache.gpu_memory_utilization is not None:
            total = self.probe.total_bytes()
            budget = int(total * cache.gpu_memory_utilization - self.probe.used_by_process_bytes() - activation)
            self._check_static_size("gpu_memory_utilization",
                                    f"{cache.gpu_memory_utilization} of {total / GiB:.2f} GiB "
                                    f"({max(0, budget) / GiB:.2f} GiB for the KV cache)", budget, account)
        else:
            budget = account.budget_bytes
        max_blocks = max(0, budget // per_block)
        if max_blocks < blocks_one_request:
            raise ValueError(
                f"KV cache too small for one request of max_model_len={self.max_model_len} tokens: it needs "
                f"{blocks_one_request * per_block} bytes ({blocks_one_request} blocks of {bs} tokens), but "
                f"only {max(0, budget)} bytes are available for the KV cache; the largest max_model_len "
                f"that fits is {max_blocks * bs}. Lower max_model_len or give the KV cache more memory.")
        if not cache.is_static:
            floor = min(max_blocks, max(1, -(-elastic.idle_reserve_bytes // per_block)))
            return floor, account, ElasticPolicy(elastic, floor, max_blocks)
        if cache.num_blocks is None:
            self._fit_max_num_seqs(sched, max_blocks, bs)
        return max_blocks, account, None

    @staticmethod
    def _check_static_size(name: str, value: str, pool_bytes: int, account: MemoryAccount) -> None:
        """A fixed pool must fit the memory that exists now, beside the activation peak and the margin."""
        if pool_bytes > account.budget_bytes:
            gib = 2**30
            raise ValueError(
                f"{name}={value} asks for a {pool_bytes / gib:.2f} GiB KV cache, but only "
                f"{account.budget_bytes / gib:.2f} GiB can be given to it: {account.available_bytes / gib:.2f} "
                f"GiB available after the weights, minus the activation peak "
                f"{account.activation_bytes / gib:.2f} GiB and the safety margin "
                f"{account.margin_bytes / gib:.2f} GiB. Use a smaller {name}, or leave it unset for the "
                "elastic pool, which sizes itself.")

    def _fit_max_num_seqs(self, sched: SchedulerConfig, num_blocks: int, block_size: int) -> None:
        """Static pool: lower max_num_seqs when that many requests of average length cannot fit."""
        average = max(1, min(self.max_model_len // 4, AVERAGE_REQUEST_TOKENS))
        fit = num_blocks // -(-average // block_size)
        if fit < sched.max_num_seqs:
            logger.warning("Max num seqs reduced due to KV cache constraints: %d -> %d (%d blocks of %d "
                           "tokens hold %d requests of %d tokens)", sched.max_num_seqs, max(1, fit),
                           num_blocks, block_size, fit, average)
            sched.max_num_seqs = max(1, fit)

    # ----------------------------------------------------------------- requests
    def make_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty (got an empty list of token ids).")
        vocab = self.arch.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range: it must be in [0, {vocab}).")
        return None, token_ids

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Returns the resolved max_tokens; raises when the prompt or the output cannot fit."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens (it must be shorter than max_model_len={limit} so at least "
                "one token can be generated). Please shorten the prompt.")
        room = limit - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} is too large: this model's maximum context length is "
                f"{limit} tokens and the prompt has {num_prompt_tokens} tokens, so at most {room} tokens "
                f"can be generated ({params.max_tokens} > {limit} - {num_prompt_tokens}).")
        return params.max_tokens

    def check_priority(self, priority: int) -> None:
        """A request's priority: an integer; non-zero only under the priority policy (vLLM's wording)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError(f"priority must be an integer, got {priority!r}.", "priority")
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise InvalidParameterError(f"Got priority {priority} but Priority scheduling is not enabled.",
                                        "priority")

    def embedding_only_message(self, api: str = "generation") -> str:
        return (f"The model does not support {api}: {self.model_name} is an embedding model (a "
                f"{self.arch.architecture} checkpoint, without a language-model head). Use /v1/embeddings "
                "(LLM.embed).")

    def check_embedding_length(self, num_prompt_tokens: int) -> None:
        """An embedding's input may fill the context (no token follows it)."""
        if num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the input for embedding generation. Please reduce the length "
                "of the input.")

    def pooling_sampling_params(self, pooling: PoolingParams) -> SamplingParams:
        """The engine-side form of an embedding request: a prompt prefilled, pooled, and never decoded."""
        resolved = pooling.resolved(self.model_config.pooler_config, self.arch.hidden_size)
        return SamplingParams(max_tokens=0, temperature=0.0, pooling=resolved)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue a request: one child per sample (best_of of them when set, else n). With PoolingParams,
        an embedding request: its output carries ``embedding`` and no tokens.

        ``priority`` orders it under the priority policy (lower first); ``cache_salt`` keeps its
        prefix-cache entries apart from requests without the same salt.
        """
        embedding = isinstance(params, PoolingParams)
        if not embedding and not self.arch.generates:
            raise ValueError(self.embedding_only_message())
        params = self.pooling_sampling_params(params) if embedding else params or SamplingParams()
        request_id = request_id or self.make_request_id()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        self.check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError(f"cache_salt must be a non-empty string, got {cache_salt!r}.",
                                        "cache_salt")
        if prompt_token_ids is not None:
            text, token_ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
            if not token_ids:
                raise ValueError("prompt must not be empty.")
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        if embedding:
            self.check_embedding_length(len(token_ids))
            max_tokens = 0
        else:
            max_tokens = self.check_lengths(len(token_ids), params)
        params.check_token_ids(self.arch.vocab_size)
        bad_words_ids = self.tokenizer.bad_words_token_ids(params.bad_words) if params.bad_words else []
        grammar = None
        if params.structured_outputs is not None:  # compiled (and cached) before anything is added
            grammar = self.structured_output.compile(params.structured_outputs)
        eos = self.tokenizer.eos_token_id
        extra_stop = [] if params.ignore_eos else [t for t in self.arch.eos_token_ids if t != eos]
        num_samples = params.num_samples
        # best_of ranks samples by cumulative logprob, so every sample computes its logprobs; they are
        # dropped from the output when the user did not ask for them.
        hide_logprobs = num_samples > params.n and params.logprobs is None
        children = []
        for index in range(num_samples):
            child_params = replace(params, n=1, best_of=None, extra_stop_token_ids=extra_stop,
                                   bad_words_token_ids=bad_words_ids,
                                   logprobs=0 if hide_logprobs else params.logprobs)
            if params.seed is not None:
                child_params.seed = params.seed + index
            child_id = request_id if num_samples == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, list(token_ids), child_params, eos, max_tokens,
                                    prompt=text, priority=priority,
                                    cache_salt=cache_salt,
                                    structured_output=grammar.matcher() if grammar is not None else None))
        self.output_processor.add(request_id, text, token_ids, children, num_returned=params.n,
                                  hide_logprobs=hide_logprobs)
        for child in children:
            if max_tokens == 0 and params.prompt_logprobs is None and params.pooling is None:
                child.status = RequestStatus.FINISHED_LENGTH
                self.output_processor.on_finished(child)
            else:
                self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_id: str) -> None:
        for child_id in self.output_processor.child_ids(request_id):
            request = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                self.output_processor.on_finished(request)
        self.output_processor.pop_if_finished(request_id)

    def num_waiting_requests(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.output_processor.parents)

    # ----------------------------------------------------------------- the loop
    def maintain(self) -> None:
        """The KV pool's upkeep (grow, shrink, give memory back, block size); the server's engine thread
        calls it on a timer while idle, so an idle server returns memory without a step."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.check_alive()  # a rank that died while idle ends the loop (/health: 503)
        self.pool.maintain()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache gained and lost since the last call to the publisher's thread."""
        if self.kv_events is not None:
            events = self.kv_manager.take_events()
            if events:
                self.kv_events.publish(events)

    def close(self) -> None:
        """Stop what runs beside the engine (the KV events publisher); idempotent."""
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (bounded; nothing else needs stopping). The engine is unusable
        afterwards. Garbage collection and interpreter exit do the same."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of every parent request that changed."""
        self.maintain()
        if self.thread_governor is not None:
            self.thread_governor.observe()
        touched: dict[str, None] = {}
        # Requests finished without running (max_tokens=0) are reported on the next step.
        for parent_id, parent in list(self.output_processor.parents.items()):
            if parent.finished:
                touched[parent_id] = None
        sched_out = self.scheduler.schedule()
        if not sched_out.is_empty:
            runner_out = self.runner.execute(sched_out)
            now = time.monotonic()  # when this step's tokens exist
            sampled = runner_out.sampled
            for rid, (first, entries) in runner_out.prompt_logprobs.items():
                self.output_processor.on_prompt_logprobs(rid, first, entries)
            for rid, part in runner_out.pooled.items():
                self.output_processor.on_pooled(rid, part)
            updated = self.scheduler.update_from_output({rid: s.token_id for rid, s in sampled.items()})
            self._num_generation_tokens += sum(1 for r in updated if r.max_tokens > 0)
            for request in updated:  # prompt tokens count when their prefill is done, as vLLM counts them
                if not request.prefill_counted:
                    request.prefill_counted = True
                    self._num_prompt_tokens += request.num_prompt_tokens
            self._advance_grammars(updated)
            for request in updated:
                stop = None
                if request.max_tokens > 0:
                    if request.first_token_time is None:
                        request.first_token_time = now
                    stop = self.output_processor.on_token(
                        request, request.output_token_ids[-1], sampled[request.request_id].logprobs)
                if stop is not None and not request.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    request.stop_reason = stop
                elif stop is not None:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = stop
                if request.is_finished:
                    self.output_processor.on_finished(request)
                    self.pool.observe_finished(request.num_tokens)
                touched[self.output_processor.parent_of(request.request_id)] = None
        elif sched_out.finished_ids or sched_out.preempted_ids:
            self.runner.execute(sched_out)  # nothing runs: the runner only drops those requests' state
        outputs = []
        for parent_id in touched:
            if parent_id is None or parent_id not in self.output_processor.parents:
                continue
            outputs.append(self.output_processor.parents[parent_id].output())
            self.output_processor.pop_if_finished(parent_id)
        self._publish_kv_events()
        return outputs

    def _advance_grammars(self, updated: list[Request]) -> None:
        """Move each grammar past its request's new token: once per appended token, after sampling."""
        for request in updated:
            matcher = request.structured_output
            if matcher is None or request.max_tokens == 0 or request.is_finished:
                continue
            if not matcher.accept_token(request.output_token_ids[-1]):
                # The mask allowed this token, so the grammar engine and the mask disagree: end the request
                # rather than return output that does not match its constraint.
                logger.error("Request %s: its grammar refused the token it allowed (%s); aborting it",
                             request.request_id, matcher.error()[:200])
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)

    # ----------------------------------------------------------------- observability
    def stats(self) -> EngineStats:
        kv = self.kv_manager
        internal, external = self.pool.fragmentation()
        swap = kv.swap
        total = self.probe.total_bytes()
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits,
            fragmentation_ratio=internal + external,
            kv_cache_pool_bytes=self.pool.pool_bytes,
            kv_cache_pool_blocks=kv.num_blocks,
            kv_cache_block_size=kv.block_size,
            kv_cache_budget_bytes=self.pool.budget_bytes,
            kv_cache_used_blocks=self.pool.num_used_blocks(),
            kv_cache_cached_blocks=self.pool.num_cached_blocks(),
            kv_cache_resizes=self.pool.num_resizes,
            kv_cache_background_commits=self.pool.num_background_commits,
            kv_cache_grow_failures=self.pool.num_grow_failures,
            num_swap_ins=self.scheduler.num_swap_ins,
            swap_pool_usage=swap.usage() if swap else 0.0,
            memory_utilization=self.probe.used_by_process_bytes() / total if total else 0.0,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
        )
