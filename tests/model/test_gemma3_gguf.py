"""A real Gemma 3 file: our float32 load of a llama.cpp GGUF (e.g. Gemma 3 270M Q4_K_M) against
transformers' load of the same file, greedy tokens through the engine, for prompts shorter and longer
than the model's sliding window (512). Runs only where ``TIDESERVE_GEMMA3_GGUF`` names such a file (the
suite needs no network); transformers' GGUF load of a 262k-token vocabulary takes minutes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

GGUF = os.environ.get("TIDESERVE_GEMMA3_GGUF", "")
pytestmark = [pytest.mark.slow,  # minutes: transformers' GGUF load
              pytest.mark.skipif(not Path(GGUF).is_file(), reason="TIDESERVE_GEMMA3_GGUF names no Gemma 3 GGUF file")]

TEXTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city of Rome and "
    "continuing through the rise and fall of its republic. Historians often divide this period into",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large values of n "
    "do not overflow the stack.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n",
    " ".join(f"Item {i}: the {['red', 'blue', 'green', 'small', 'large'][i % 5]} box holds {i * 7 % 13} coins."
             for i in range(60)) + " In total, the boxes hold",
]
NEW_TOKENS = 24


@pytest.mark.parametrize("backend", ["cpu-native", "torch"])
def test_float_load_gives_transformers_greedy_tokens(backend: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tideserve import LLM, SamplingParams

    path = Path(GGUF)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(map(len, prompts)) > 512  # past the window
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)
            want.append(out[0, len(p):].tolist())
    llm = LLM(model=str(path), quantization="none", dtype="float32", attention_backend=backend, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
