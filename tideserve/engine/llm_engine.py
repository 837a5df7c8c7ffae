"""The synchronous engine: one ``step()`` schedules, runs the model, samples and emits outputs.

Requests are validated on entry (every user mistake is a ValueError with the parameter, value and
limit), split into one child per sample when n > 1, and streamed back as cumulative RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from tideserve.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_max_model_len
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.memory import available_memory_bytes
from tideserve.core.scheduler import Scheduler
from tideserve.engine.output_processor import OutputProcessor
from tideserve.engine.stats import EngineStats
from tideserve.model.loader import load_model
from tideserve.outputs import RequestOutput
from tideserve.request import Request, RequestStatus
from tideserve.sampling_params import SamplingParams
from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer
from tideserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Share of the memory still available at start-up that a pool sized without guidance may take.
DEFAULT_KV_MEMORY_FRACTION = 0.3


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        return (
            ModelConfig(self.model, self.dtype, self.device, self.max_model_len,
                        self.allow_long_max_model_len, self.seed),
            CacheConfig(self.block_size, self.num_blocks, self.kv_cache_memory,
                        enable_prefix_caching=self.enable_prefix_caching),
            SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill),
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}.") from exc


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        model_config, cache_config, sched_config = args.configs()
        self.args = args
        self.device = resolve_device(model_config.device)
        torch.manual_seed(model_config.seed)
        loaded = load_model(model_config.model, model_config.dtype, self.device)
        self.model = loaded.model
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.model_path = loaded.path
        self.model_name = loaded.name
        self.tokenizer: Tokenizer = load_tokenizer(loaded.path)
        self.max_model_len = resolve_max_model_len(
            model_config.max_model_len, self.arch.max_position_embeddings,
            model_config.allow_long_max_model_len)
        sched_config.max_num_batched_tokens = max(sched_config.max_num_batched_tokens, 1)
        self.cache_config = cache_config
        self.scheduler_config = sched_config

        self.runner = ModelRunner(self.model, 0, cache_config.block_size, self.dtype, self.device)
        num_blocks = self._size_pool(cache_config)
        self.runner.kv_caches = self.runner.allocate_kv_caches(num_blocks)
        self.kv_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                         cache_config.enable_prefix_caching, extra_key=self.model_name)
        self.scheduler = Scheduler(sched_config, self.kv_manager, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        logger.info("Available KV cache blocks: %d (%.2f GiB, block size %d)", num_blocks,
                    num_blocks * self.runner.kv_bytes_per_block() / 2**30, cache_config.block_size)

    # ----------------------------------------------------------------- memory
    def _size_pool(self, cache: CacheConfig) -> int:
        per_block = self.runner.kv_bytes_per_block()
        bs = cache.block_size
        blocks_one_request = -(-self.max_model_len // bs)
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
            budget = num_blocks * per_block
        else:
            budget = cache.kv_cache_memory or int(
                available_memory_bytes(self.device) * DEFAULT_KV_MEMORY_FRACTION)
            cap = self.scheduler_config.max_num_seqs * blocks_one_request
            num_blocks = min(budget // per_block, cap)
        if num_blocks < blocks_one_request:
            largest = num_blocks * bs
            raise ValueError(
                f"One request of max_model_len={self.max_model_len} tokens needs "
                f"{blocks_one_request * per_block} bytes of KV cache, but only {budget} bytes "
                f"({num_blocks} blocks) are available; the largest max_model_len that fits is {largest}. "
                "Lower max_model_len or give the KV cache more memory.")
        return int(num_blocks)

    # ----------------------------------------------------------------- requests
    def make_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, self.tokenizer.encode(prompt)
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

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id or self.make_request_id()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if prompt_token_ids is not None:
            text, token_ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
            if not token_ids:
                raise ValueError("prompt must not be empty.")
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.check_lengths(len(token_ids), params)
        eos = self.tokenizer.eos_token_id
        extra_stop = [] if params.ignore_eos else [t for t in self.arch.eos_token_ids if t != eos]
        children = []
        for index in range(params.n):
            child_params = replace(params, n=1, extra_stop_token_ids=extra_stop)
            if params.seed is not None:
                child_params.seed = params.seed + index
            generator = None
            if child_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(child_params.seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, list(token_ids), child_params, eos, max_tokens,
                                    prompt=text, generator=generator))
        self.output_processor.add(request_id, text, token_ids, children)
        self._num_prompt_tokens += len(token_ids) * params.n
        for child in children:
            if max_tokens == 0:
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.output_processor.parents)

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of every parent request that changed."""
        touched: dict[str, None] = {}
        # Requests finished without running (max_tokens=0) are reported on the next step.
        for parent_id, parent in list(self.output_processor.parents.items()):
            if parent.finished:
                touched[parent_id] = None
        sched_out = self.scheduler.schedule()
        if not sched_out.is_empty:
            now = time.monotonic()
            runner_out = self.runner.execute(sched_out)
            sampled = runner_out.sampled
            for rid, (first, entries) in runner_out.prompt_logprobs.items():
                self.output_processor.on_prompt_logprobs(rid, first, entries)
            updated = self.scheduler.update_from_output({rid: s.token_id for rid, s in sampled.items()})
            self._num_generation_tokens += len(updated)
            for request in updated:
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
                touched[self.output_processor.parent_of(request.request_id)] = None
        outputs = []
        for parent_id in touched:
            if parent_id is None or parent_id not in self.output_processor.parents:
                continue
            outputs.append(self.output_processor.parents[parent_id].output())
            self.output_processor.pop_if_finished(parent_id)
        return outputs

    # ----------------------------------------------------------------- observability
    def stats(self) -> EngineStats:
        kv = self.kv_manager
        per_block = self.runner.kv_bytes_per_block()
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits,
            fragmentation_ratio=self._internal_fragmentation(),
            kv_cache_pool_bytes=kv.num_blocks * per_block,
            kv_cache_pool_blocks=kv.num_blocks,
            kv_cache_block_size=kv.block_size,
            kv_cache_budget_bytes=kv.num_blocks * per_block,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
        )

    def _internal_fragmentation(self) -> float:
        """Allocated token slots that hold no token, over allocated slots."""
        bs = self.kv_manager.block_size
        allocated = holding = 0
        for request in self.scheduler.running:
            blocks = len(self.kv_manager.req_blocks.get(request.request_id, ()))
            allocated += blocks * bs
            holding += min(request.num_computed_tokens, blocks * bs)
        return (allocated - holding) / allocated if allocated else 0.0
