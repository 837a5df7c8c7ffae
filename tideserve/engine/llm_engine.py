"""The engine: ``add`` queues a checked request, ``abort_request`` ends one, ``step`` runs one step
(schedule, run the model on the workers, sample, emit outputs).

An engine is built by ``engine/builder.py`` (``from_engine_args`` / ``from_loaded``); requests are
checked once, by the input processor (engine/input_processor.py), before they reach it. A request with
n > 1 (or best_of) is split into one child per sample, and every request's outputs stream back as
cumulative RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from tideserve.core.scheduler import SchedulerOutput
from tideserve.engine.arg_utils import EngineArgs
from tideserve.engine.builder import EngineParts, build_engine, check_cpu_offload
from tideserve.engine.input_processor import EngineRequest
from tideserve.engine.kv_tiers import DISK_MEDIUM, HOST_MEDIUM, KVTier
from tideserve.engine.stats import EngineStats
from tideserve.errors import EngineBusyError, EngineSleepingError, InvalidParameterError
from tideserve.model.loader import LoadedModel, load_model
from tideserve.outputs import RequestOutput
from tideserve.platform import platform_for, resolve_device
from tideserve.pooling_params import PoolingParams
from tideserve.request import Request, RequestStatus
from tideserve.sampling_params import SamplingParams
from tideserve.spec_decode.proposals import Speculator
from tideserve.spec_decode.stats import SpecDecodeStats
from tideserve.structured_output.reasoning_gate import gated
from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer
from tideserve.worker.executor import Method
from tideserve.worker.model_runner import ModelRunnerOutput
from tideserve.worker.worker import Worker

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds, aborts and steps requests over the workers an ``engine/builder.py`` build started.

    Two ways in: ``from_engine_args(args)`` loads the model and tokenizer named by ``args``;
    ``from_loaded(args, loaded, tokenizer)`` builds over a model already loaded, which several engines may
    share (its weights are read-only; each engine owns its KV cache, scheduler and workers). Either way
    the settings in ``args`` must describe the model (engine/loaded_model.py).
    """

    def __init__(self, parts: EngineParts) -> None:
        """The parts ``build_engine`` assembled (use ``from_engine_args`` or ``from_loaded``)."""
        self.args = parts.args
        self.model_config = parts.model_config
        self.cache_config = parts.cache_config
        self.scheduler_config = parts.scheduler_config
        self.arch = parts.loaded.arch
        self.dtype = parts.loaded.dtype
        self.quantization = parts.loaded.quantization
        self.model_path = parts.loaded.path
        self.model_name = parts.loaded.name
        self.device = parts.device
        self.platform = parts.platform
        self.kv_dtype = parts.kv_dtype
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.executor = parts.executor
        self.memory = parts.memory
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.pool = parts.pool
        self.input_processor = parts.input_processor
        self.output_processor = parts.output_processor
        self.structured_output = parts.structured_output
        self.thread_governor = parts.thread_governor
        self.kv_events = parts.kv_events
        # --kv-offloading-size, --kv-cache-dir: full prefix blocks kept in host memory and on disk too
        self.kv_tiers = parts.kv_tiers
        self._ids = itertools.count()
        self._sampled_last_step: dict[str, list[int]] = {}
        self.sleep_level = 0  # sleep mode: 0 awake, else the level the engine was put to sleep at
        self._asleep: set[str] = set()  # what is released and not woken yet: "weights", "kv_cache"
        self._num_prompt_tokens = 0
        spec = parts.scheduler_config.speculative_config
        # Speculative decoding: proposals set on the running requests before each schedule (None: off).
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        if spec is not None:
            self.scheduler.spec_stats = SpecDecodeStats.for_proposals(spec.num_speculative_tokens)
            if spec.method == "draft_model":  # the worker drafts after each step into lookahead slots
                self.scheduler.lookahead = self.speculator.lookahead
                source = f"greedy tokens of the draft model {spec.model}"
            else:
                source = f"lookup of the last {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens"
            logger.info("Speculative decoding: %s, %d proposed tokens per step (%s), off while %d or more requests "
                        "run", spec.method, spec.num_speculative_tokens, source, spec.disable_by_batch_size)
        self._num_generation_tokens = 0

    @property
    def model(self) -> torch.nn.Module | None:
        """The weights as this process serves them (rank 0's shard under tensor parallelism; None while
        asleep at a level that dropped them)."""
        return self.executor.driver_worker.model

    @classmethod
    def from_engine_args(cls, args: EngineArgs | Mapping[str, Any]) -> LLMEngine:
        """vLLM's constructor: ``args`` is an EngineArgs or a dict of its fields. Loads the model and its
        tokenizer (seconds), then builds the engine over them."""
        args = EngineArgs.coerce(args)
        model_config = args.configs()[0]  # every setting checked before anything loads
        device = resolve_device(model_config.device)
        check_cpu_offload(model_config, platform_for(device), warn=False)  # refused before the weights load
        torch.manual_seed(model_config.seed)
        quantization = model_config.quantization
        if quantization == "auto" and args.parallel_config().tensor_parallel_size > 1:
            quantization = "none"  # tensor parallelism splits float weights: a GGUF file is dequantized
        loaded = load_model(model_config.model, model_config.dtype, device, quantization)
        return cls.from_loaded(args, loaded, load_tokenizer(loaded.path))

    @classmethod
    def from_loaded(cls, args: EngineArgs | Mapping[str, Any], loaded: LoadedModel,
                    tokenizer: Tokenizer | None = None) -> LLMEngine:
        """An engine over an already loaded model (``load_model``) and its tokenizer (loaded from the
        model's path when None); settings left at "auto" take the loaded model's."""
        return cls(build_engine(args, loaded, tokenizer))

    # ----------------------------------------------------------------- requests
    def make_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Check and queue a request (``InputProcessor.process``; with PoolingParams an embedding request,
        whose output carries ``embedding`` and no tokens); returns its id.

        ``priority`` orders it under the priority policy (lower first); ``cache_salt`` keeps its
        prefix-cache entries apart from requests without the same salt.
        """
        return self.add(self.input_processor.process(prompt, params, request_id, prompt_token_ids, priority,
                                                     cache_salt))

    def add(self, request: EngineRequest) -> str:
        """Queue a request the input processor checked: one child per sample (best_of of them when set,
        else n); returns its id."""
        self._check_awake()
        request_id = request.request_id or self.make_request_id()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        params, max_tokens, grammar = request.params, request.max_tokens, request.grammar
        num_samples = params.num_samples
        # best_of ranks samples by cumulative logprob, so every sample computes its logprobs; they are
        # dropped from the output when the user did not ask for them.
        hide_logprobs = num_samples > params.n and params.logprobs is None
        eos = self.tokenizer.eos_token_id
        children = []
        for index in range(num_samples):
            child_params = replace(params, n=1, best_of=None, extra_stop_token_ids=request.extra_stop_token_ids,
                                   bad_words_token_ids=request.bad_words_token_ids,
                                   logprobs=0 if hide_logprobs else params.logprobs)
            if params.seed is not None:
                child_params.seed = params.seed + index
            child_id = request_id if num_samples == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, list(request.prompt_token_ids), child_params, eos, max_tokens,
                                    prompt=request.prompt, priority=request.priority,
                                    cache_salt=request.cache_salt,
                                    structured_output=(gated(grammar.matcher(), params.reasoning_markers)
                                                       if grammar is not None else None)))
        self.output_processor.add(request_id, request.prompt, request.prompt_token_ids, children,
                                  num_returned=params.n, hide_logprobs=hide_logprobs)
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

    # ----------------------------------------------------------------- sleep mode
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def _check_awake(self) -> None:
        if self._asleep:
            raise EngineSleepingError(
                f"The engine is asleep (sleep level {self.sleep_level}; {' and '.join(sorted(self._asleep))} "
                "released): it serves no requests until it is woken (LLM.wake_up(), POST /wake_up).")

    def sleep(self, level: int = 1) -> None:
        """Release the KV pool and the weights of an idle engine (vLLM's sleep mode, ``enable_sleep_mode``):
        level 1 keeps a host copy of the weights where they live on a GPU, level 2 (and level 1 on the CPU,
        whose weights are host memory already) drops them and reloads them from the model file on
        ``wake_up``. The prefix cache is emptied (its blocks' memory goes). Refused, changing nothing, while
        a request is in flight (``EngineBusyError``); sleeping deeper than now drops what level 1 kept."""
        if not self.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled: build the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode) to let it release its weights and KV cache.")
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidParameterError(f"level must be 1 or 2, got {level!r}.", "level")
        if self.has_unfinished_requests():
            raise EngineBusyError(
                f"Cannot sleep while requests are in flight ({len(self.scheduler.running)} running, "
                f"{len(self.scheduler.waiting)} waiting): let them finish, or abort them, then sleep.")
        if self._asleep and level <= self.sleep_level:
            return
        if self._asleep:  # deeper: bring the weights back only to drop them the other way
            self.wake_up(["weights"])
        if "kv_cache" not in self._asleep:
            self.pool.prepare_sleep()
        self.executor.collective_rpc(Worker.sleep, level)
        self.sleep_level = level
        self._asleep = {"weights", "kv_cache"}
        self._publish_kv_events()
        logger.info("Engine asleep (level %d): KV pool and weights released", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``sleep`` released: ``tags`` "weights" and/or "kv_cache" (default both); the
        engine serves again once both are back. Outputs are those of an engine that never slept."""
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        unknown = sorted(set(tags) - {"weights", "kv_cache"})
        if unknown or not tags:
            raise InvalidParameterError(f"tags must be weights and/or kv_cache, got {unknown or tags!r}.", "tags")
        wanted = sorted(set(tags) & self._asleep)
        if not wanted:
            return
        start = time.perf_counter()
        self.executor.collective_rpc(Worker.wake_up, wanted)
        self._asleep -= set(wanted)
        if not self._asleep:
            self.sleep_level = 0
        logger.info("Woke %s in %.2f s%s", " and ".join(wanted), time.perf_counter() - start,
                    "" if self._asleep else ": the engine serves again")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix no request holds (vLLM's ``reset_prefix_cache``); True when nothing
        stays cached."""
        self.kv_manager.reset_prefix_cache()
        self._publish_kv_events()
        return self.kv_manager.num_cached_blocks() == 0

    def collective_rpc(self, method: Method, *args: Any, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` (a Worker method, or the name of one a ``worker_extension_cls`` adds) on every
        worker between steps; every rank's answer, in rank order."""
        return self.executor.collective_rpc(method, *args, kwargs=kwargs)

    # ----------------------------------------------------------------- the loop
    def maintain(self) -> None:
        """The KV pool's upkeep (grow, shrink, give memory back, block size); the server's engine thread
        calls it on a timer while idle, so an idle server returns memory without a step."""
        self.executor.check_health()  # a rank that died while idle ends the loop (/health: 503)
        if not self._asleep:  # nothing of the pool is there to keep up
            self.pool.maintain()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache gained and lost since the last call to the publisher's thread."""
        if self.kv_events is not None:
            events = self.kv_manager.take_events()
            if events:
                self.kv_events.publish(events)

    @property
    def kv_disk_tier(self) -> KVTier | None:
        """The disk tier (``--kv-cache-dir``), None without one."""
        return self.kv_tiers.medium(DISK_MEDIUM) if self.kv_tiers is not None else None

    @property
    def kv_host_tier(self) -> KVTier | None:
        """The host tier (``--kv-offloading-size``), None without one."""
        return self.kv_tiers.medium(HOST_MEDIUM) if self.kv_tiers is not None else None

    def close(self) -> None:
        """Stop what runs beside the engine (the KV events publisher) and withdraw its claim on the memory
        it shares with other engines; idempotent."""
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.pool.ledger is not None:
            self.pool.ledger.close()

    def shutdown(self) -> None:
        """Stop the workers' processes (tensor-parallel ranks; bounded) and withdraw the engine's memory
        claim; the disk tier's writes under way finish first. The engine is unusable afterwards. Garbage
        collection and interpreter exit do the same."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.pool.ledger is not None:
            self.pool.ledger.close()
        self.executor.shutdown()

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
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, len(self.scheduler.running))
        if self.kv_tiers is not None:  # loads beside the steps (engine/kv_tiers.py)
            self.kv_tiers.before_step()
        sched_out = self.scheduler.schedule()
        if not sched_out.is_empty:
            runner_out = self._execute(sched_out)
            if self.kv_tiers is not None:
                self.kv_tiers.store_published()
            now = time.monotonic()  # when this step's tokens exist
            sampled = runner_out.sampled
            for rid, (first, entries) in runner_out.prompt_logprobs.items():
                self.output_processor.on_prompt_logprobs(rid, first, entries)
            for rid, part in runner_out.pooled.items():
                self.output_processor.on_pooled(rid, part)
            updated = self.scheduler.update_from_output(
                {rid: [s.token_id for s in tokens] for rid, tokens in sampled.items()})
            if self.speculator is not None and runner_out.draft_token_ids:
                self.speculator.receive(runner_out.draft_token_ids, self.scheduler.requests)
            self._num_generation_tokens += sum(r.num_new_tokens for r in updated if r.max_tokens > 0)
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
                    new = request.num_new_tokens
                    tokens = sampled[request.request_id]
                    for index in range(new):  # stops at a stop string, dropping the tokens after it
                        stop = self.output_processor.on_token(
                            request, request.output_token_ids[index - new], tokens[index].logprobs)
                        if stop is not None:
                            break
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
            self._execute(sched_out)  # nothing runs: the workers only drop those requests' state
        outputs = []
        for parent_id in touched:
            if parent_id is None or parent_id not in self.output_processor.parents:
                continue
            outputs.append(self.output_processor.parents[parent_id].output())
            self.output_processor.pop_if_finished(parent_id)
        self._publish_kv_events()
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step on every worker; rank 0's output (it samples). The other ranks learn the tokens it
        sampled with the next step."""
        out = self.executor.collective_rpc(Worker.execute_model, scheduler_output, self._sampled_last_step,
                                           unique_reply_rank=0)
        self._sampled_last_step = {rid: [s.token_id for s in tokens] for rid, tokens in out.sampled.items()}
        return out

    def _advance_grammars(self, updated: list[Request]) -> None:
        """Move each grammar past its request's new token: once per appended token, after sampling."""
        for request in updated:
            matcher = request.structured_output
            if matcher is None or request.max_tokens == 0 or request.is_finished:
                continue
            if not all(matcher.accept_token(t) for t in request.output_token_ids[-request.num_new_tokens:]):
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
        memory = self.memory.read()
        total = memory.total_bytes
        spec = self.scheduler.spec_stats
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits,
            fragmentation_ratio=internal + external,
            kv_cache_pool_bytes=self.pool.pool_bytes,
            kv_cache_resident_bytes=self.pool.resident_bytes(),
            memory_claimed_bytes=self.pool.ledger.claim if self.pool.ledger is not None else 0,
            memory_others_claimed_bytes=self.pool.others_claimed_bytes,
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
            memory_utilization=memory.used_by_process_bytes / total if total else 0.0,
            sleep_level=self.sleep_level,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            spec_decode_enabled=self.speculator is not None,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos),
            kv_tiers=self.kv_tiers.snapshots() if self.kv_tiers is not None else [],
        )
