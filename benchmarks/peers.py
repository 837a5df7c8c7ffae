"""Peers measured in-process by benchmarks/compare.py: Hugging Face transformers, two ways.

Both produce tideserve's per-request records (tideserve/bench/report.py), timed from when a request is
submitted, with at most ``concurrency`` requests in flight, so their numbers sit in the same table as
tideserve's offline and served runs:

- static batching: ``generate()`` on padded batches of ``concurrency`` prompts, each batch running until
  its longest request is done (shorter requests' extra tokens are wasted work, not counted output);
- continuous batching: transformers' ``ContinuousBatchingManager`` (``generate_batch``'s engine), fed one
  new request whenever one finishes.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from tideserve.bench.datasets import SampleRequest
from tideserve.bench.report import RequestRecord

logger = logging.getLogger(__name__)


def load_hf_model(model_path: str, dtype: torch.dtype) -> Any:
    """transformers' own load of the same GGUF file (dequantized to ``dtype``, as tideserve does)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def has_continuous_batching(model: Any) -> bool:
    """transformers >= 4.56 has ``generate_batch`` / ``init_continuous_batching`` on generative models."""
    return hasattr(model, "init_continuous_batching") and hasattr(model, "generate_batch")


class _StepClock:
    """A stopping criterion that never stops: it notes when each decoding step produced its token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf_static(model: Any, pad_id: int, requests: list[SampleRequest],
                  concurrency: int) -> tuple[list[RequestRecord], float]:
    """Padded batches of ``concurrency`` requests, in order; EOS is ignored (min_new_tokens)."""
    from transformers import StoppingCriteriaList

    records = [RequestRecord(index=i, prompt_tokens=r.prompt_len, expected_output_tokens=r.output_len)
               for i, r in enumerate(requests)]
    t_origin = time.perf_counter()
    for b in range(0, len(requests), concurrency):
        chunk = requests[b:b + concurrency]
        width = max(r.prompt_len for r in chunk)
        steps = max(r.output_len for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):  # left padding, as generate() expects for decoder-only models
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        clock = _StepClock()
        submitted = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=pad_id,
                           stopping_criteria=StoppingCriteriaList([clock]))
        for i, r in enumerate(chunk):
            rec = records[b + i]
            stamps = clock.times[:r.output_len]
            rec.start_s = submitted - t_origin
            rec.ttft_s = stamps[0] - submitted
            rec.itl_s = [t1 - t0 for t0, t1 in itertools.pairwise(stamps)]
            rec.e2el_s = stamps[-1] - submitted
            rec.output_tokens = len(stamps)
            rec.success = rec.usage_from_server = True
    return records, time.perf_counter() - t_origin


def run_hf_continuous(model: Any, requests: list[SampleRequest], concurrency: int,
                      max_batch_tokens: int) -> tuple[list[RequestRecord], float]:
    """transformers' continuous batching, at most ``concurrency`` requests submitted at a time."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    page = 64
    longest = max(r.prompt_len + r.output_len for r in requests)
    num_blocks = concurrency * math.ceil(longest / page) + 8
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens,
                                         max_requests_per_batch=concurrency)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,  # -1: never stop on EOS
                                  max_new_tokens=max(r.output_len for r in requests))
    records = [RequestRecord(index=i, prompt_tokens=r.prompt_len, expected_output_tokens=r.output_len)
               for i, r in enumerate(requests)]
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    manager.start()
    try:
        t_origin = time.perf_counter()
        pending = list(range(len(requests)))[::-1]
        inflight: dict[str, tuple[int, float]] = {}
        while pending or inflight:
            while pending and len(inflight) < concurrency:
                i = pending.pop()
                now = time.perf_counter()
                rid = manager.add_request(requests[i].prompt_token_ids, request_id=f"bench-{i}",
                                          max_new_tokens=requests[i].output_len, record_timestamps=True)
                records[i].start_s = now - t_origin
                if rid is None:
                    records[i].error = "transformers' manager refused the request"
                    continue
                inflight[rid] = (i, now)
            if not inflight:
                continue
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped unexpectedly")
                continue
            if not result.is_finished() or result.request_id not in inflight:
                continue
            i, submitted = inflight.pop(result.request_id)
            rec = records[i]
            if result.error:
                rec.error = str(result.error)
                continue
            stamps = result.timestamps or []
            rec.output_tokens = len(result.generated_tokens)
            if stamps:
                rec.ttft_s = stamps[0] - submitted
                rec.itl_s = [t1 - t0 for t0, t1 in itertools.pairwise(stamps)]
                rec.e2el_s = stamps[-1] - submitted
            else:
                rec.e2el_s = time.perf_counter() - submitted
            rec.success = rec.usage_from_server = True
        duration = time.perf_counter() - t_origin
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    return records, duration


def llama_server_command(binary: str, gguf: str, port: int, concurrency: int, ctx_per_slot: int,
                         threads: int, no_repack: bool = False) -> list[str]:
    """llama.cpp's OpenAI server with one slot per concurrent request (it splits -c among the slots).
    ``no_repack``: on AMX CPUs the repacked AMX path of the llama.cpp version we build crashes on Q4_1
    models, so it runs on its unrepacked CPU kernels."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(concurrency),
            "-c", str(concurrency * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            *(["--no-repack"] if no_repack else [])]
