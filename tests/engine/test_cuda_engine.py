"""The whole engine on a GPU against transformers on the same GPU: the CUDA path (Triton paged attention,
CUDA-graph decode replay, the device KV pool) must give transformers' greedy tokens and their log
probabilities. Marked ``cuda``: skipped without a GPU (benchmarks/gpu_check.sh runs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tideserve import SamplingParams

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Water boils at"]
NEW_TOKENS = 16
# Where transformers' two best logits are closer than this, float32 sums taken in another order may pick
# either: the comparison of that prompt stops there.
TIE = 1e-3


def _transformers_model(path: Path, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager")
    return model.to(device).eval()


@pytest.mark.cuda
def test_cuda_engine_gives_transformers_greedy_tokens_and_logprobs(make_llm):
    from tideserve.model.loader import default_model_path

    # benchmarks/gpu_check.sh names a model of the default's shape where the embedded one is not installed
    model = os.environ.get("TIDESERVE_TEST_MODEL") or None
    llm = make_llm(model=model, dtype="float32", device="cuda", max_model_len=256)
    assert llm.engine.executor.driver_worker.runner.device.type == "cuda"
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                   logprobs=0))
    hf = _transformers_model(Path(model or default_model_path()), "cuda")

    compared = 0
    for out in outputs:
        ids = list(out.prompt_token_ids)
        ours = list(out.outputs[0].token_ids)
        assert len(ours) == NEW_TOKENS
        for step, token in enumerate(ours):
            with torch.no_grad():
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            best = int(torch.argmax(logits))
            if token != best:
                gap = float(logits[best] - logits[token])
                assert gap < TIE, f"step {step}: we chose {token}, transformers {best} ({gap:.4f} better)"
                break
            ours_logprob = out.outputs[0].logprobs[step][token].logprob
            assert abs(ours_logprob - float(logprobs[token])) < 1e-3, (step, ours_logprob, float(logprobs[token]))
            ids.append(token)
            compared += 1
    assert compared >= len(PROMPTS) * NEW_TOKENS // 2  # ties are rare: most tokens were compared
