"""The offline API: ``LLM(...).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tideserve.engine.input_processor import EngineRequest
from tideserve.engine.llm_engine import EngineArgs, LLMEngine
from tideserve.model.loader import LoadedModel
from tideserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tideserve.pooling_params import PoolingParams
from tideserve.sampling_params import SamplingParams
from tideserve.settings import check_names
from tideserve.tokenizer.chat_template import load_chat_template
from tideserve.tokenizer.tokenizer import Tokenizer

Prompt = str | Sequence[int] | dict[str, Any]
Message = dict[str, Any]
# vLLM's prompt dicts: TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _plain_prompt(prompt: Prompt) -> str | Sequence[int]:
    """Text or token ids from any accepted prompt form; a dict must carry exactly one of PROMPT_KEYS, so a
    field we would ignore (multi-modal data, say) is refused instead of silently dropped."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (token ids); "
                         f"got unsupported key(s) {', '.join(map(repr, unknown))}.")
    if len(prompt) != 1:
        raise ValueError("a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids' (token ids), "
                         f"got {sorted(prompt) or 'neither'}.")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}.")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}.")
    return ids


def _engine_args(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    check_names(kwargs, EngineArgs.field_names())  # a typo names the closest real argument
    return EngineArgs(model=model, **kwargs)


class LLM:
    """Runs a model over a batch of prompts with continuous batching; outputs come back in input order."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """Load ``model`` (None: the embedded default) with engine settings ``kwargs`` (EngineArgs' fields)."""
        self.engine = LLMEngine.from_engine_args(_engine_args(model, kwargs))

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, tokenizer: Tokenizer | None = None, **kwargs: Any) -> LLM:
        """An LLM over an already loaded model (``tideserve.model.loader.load_model``), sharing its weights
        with any other engine built on it; ``kwargs`` as for ``LLM(...)``, and settings left at "auto"
        take the loaded model's (an explicit dtype, quantization or device must match it)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_loaded(_engine_args(kwargs.pop("model", None), kwargs), loaded, tokenizer)
        return llm

    def __del__(self) -> None:
        # ``del llm`` stops a tensor-parallel engine's ranks at once (no orphan processes)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def sleep(self, level: int = 1) -> None:
        """Release the weights and the KV cache while idle (vLLM's ``LLM.sleep``; needs
        ``enable_sleep_mode=True``): level 1 keeps a host copy of GPU weights, level 2 reloads them from the
        model file on ``wake_up``. On the CPU both levels give the memory back to the system."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` released (``tags``: "weights", "kv_cache"; default both)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``): the next request prefills
        its whole prompt. True when nothing stays cached."""
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on the worker of every rank (vLLM's ``LLM.collective_rpc``): a ``Worker``
        function, or the name of a method of ``worker_extension_cls``, called as ``method(worker, *args,
        **kwargs)``; returns every rank's answer in rank order."""
        if timeout is not None:
            raise ValueError(f"timeout={timeout!r} is not supported: a collective call runs between steps until "
                             "every rank has answered; leave timeout at None.")
        return self.engine.collective_rpc(method, *args, kwargs=kwargs)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Each prompt is text, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``; ``priority``: one per prompt, lower first (needs
        ``scheduling_policy="priority"``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = [_plain_prompt(p) for p in prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = self._priorities(priority, len(prompts))
        # Check every prompt before adding any, so a bad one loses nothing.
        checked = [self.engine.input_processor.process(prompt, p, priority=rank)
                   for prompt, p, rank in zip(prompts, params, priorities)]
        return self._run(checked, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False,
             priority: Sequence[int] | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations through the chat template: the model's, or ``chat_template``
        (a Jinja string or a file path, as ``--chat-template``), with ``chat_template_kwargs`` as
        template variables; ``continue_final_message`` continues the last assistant message
        (``add_generation_prompt`` must then be False). ``tools`` (OpenAI's format) reach the template as
        vLLM's ``LLM.chat(tools=...)`` does; calls are not parsed here: constrain them with a JSON schema."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params_per_prompt(sampling_params, len(conversations))
        priorities = self._priorities(priority, len(conversations))
        template = load_chat_template(chat_template)
        checked = []
        for conv, p, rank in zip(conversations, params, priorities):
            token_ids = self.engine.tokenizer.encode_chat(
                conv, add_generation_prompt=add_generation_prompt, chat_template=template,
                chat_template_kwargs=chat_template_kwargs, continue_final_message=continue_final_message,
                tools=tools)
            text = self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)
            checked.append(self.engine.input_processor.process(text, p, prompt_token_ids=token_ids, priority=rank))
        return self._run(checked, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): the prompt's final hidden states pooled as
        ``pooling_params`` or the engine's ``pooler_config`` say (LAST, normalized, by default).
        ``truncate_prompt_tokens`` keeps each prompt's last N tokens; without it a prompt longer than the
        context is a ValueError."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_plain_prompt(p) for p in prompts]
        pooling = pooling_params or PoolingParams()
        processor = self.engine.input_processor
        checked = []
        for prompt in prompts:
            text, token_ids = processor.tokenize_prompt(prompt)
            if truncate_prompt_tokens is not None:
                token_ids = token_ids[-truncate_prompt_tokens:]
            checked.append(processor.process(text, pooling, prompt_token_ids=token_ids))
        results = self._run(checked, use_tqdm)
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.embedding))
                for r in results]

    @staticmethod
    def _priorities(priority: Sequence[int] | None, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        priority = list(priority)
        if len(priority) != n:
            raise ValueError(f"priority has {len(priority)} entries but there are {n} prompts.")
        return priority

    def _run(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Add the checked requests and step until every one is done; outputs in their order."""
        order = {self.engine.add(request): i for i, request in enumerate(requests)}
        return self._drain(order, use_tqdm, len(requests))

    def _drain(self, order: dict[str, int], use_tqdm: bool, total: int) -> list[RequestOutput]:
        """Step until every request is done; their final outputs in ``order``'s positions."""
        results: list[RequestOutput | None] = [None] * total
        bar = _progress(total) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries but there are {n} prompts.")
        return params


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Generating", unit="req")
