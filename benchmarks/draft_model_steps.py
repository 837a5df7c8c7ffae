"""What a draft-model round costs, pass by pass, against a step without a draft.

One stream rewrites a short file (the editing prompt of tests/spec_decode/test_engine.py's kind), greedy,
128 tokens, ``--runs`` times, on the embedded model as the target with each draft in turn: none, a 1-layer
192-wide random Llama with the target's vocabulary and KV shape (saved under ``--workdir``), and the
embedded model itself. It times, around the runner's methods, every target and draft forward pass (by
kind: one row, decode rows, mixed), the draft's logits and argmax, and the whole step of each, and prints
medians and totals with the output tok/s and the acceptance counters. In-process, so the figures are the
passes' own; a shared host's speed moves by the minute, so compare runs made together.

    .venv/bin/python benchmarks/draft_model_steps.py none tiny embedded
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tideserve import LLM, SamplingParams
from tideserve.model.loader import default_model_path
from tideserve.worker import draft_proposer, model_runner

SOURCE = '''def mean(values):
    """The arithmetic mean of a non-empty list."""
    total = 0.0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
EDIT = f"Rename the function `mean` to `average` in this code and print the whole file.\n\n{SOURCE}"
TIMES: dict[str, list[float]] = {}


def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        TIMES.setdefault(kind, []).append((time.perf_counter() - start) * 1e3)
        return result
    return run


def instrument() -> None:
    forward = model_runner.ModelRunner._forward

    def timed_forward(self, pieces, num_decodes, graphs=False, draft=False):
        start = time.perf_counter()
        hidden = forward(self, pieces, num_decodes, graphs, draft)
        rows = sum(count for _, _, count in pieces)
        shape = "1row" if rows == 1 else "decode" if num_decodes == len(pieces) else "mixed"
        TIMES.setdefault(f"{'draft' if draft else 'target'} pass, {shape}", []).append(
            (time.perf_counter() - start) * 1e3)
        return hidden

    model_runner.ModelRunner._forward = timed_forward
    model_runner.ModelRunner._execute_target = timed(model_runner.ModelRunner._execute_target, "target step")
    model_runner.propose_with_draft = timed(model_runner.propose_with_draft, "draft step (all passes)")
    draft_proposer._argmax = timed(draft_proposer._argmax, "draft logits + argmax")


def tiny_draft(directory: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (directory / "config.json").exists():
        config = LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=1, num_attention_heads=3,
                             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                             tie_word_embeddings=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return str(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", choices=["none", "tiny", "embedded"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--workdir", default="/tmp/draft_model_steps")
    args = parser.parse_args()
    instrument()
    paths = {"none": None, "tiny": tiny_draft(Path(args.workdir) / "tiny"), "embedded": default_model_path()}
    params = SamplingParams(temperature=0.0, max_tokens=128)
    for name in args.drafts:
        spec = {} if paths[name] is None else {
            "speculative_config": {"model": paths[name], "num_speculative_tokens": args.k}}
        llm = LLM(max_model_len=2048, max_num_seqs=1, **spec)
        chat = {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": EDIT}])}
        llm.generate(chat, params)  # warm-up
        TIMES.clear()
        start = time.perf_counter()
        tokens = sum(len(llm.generate(chat, params)[0].outputs[0].token_ids) for _ in range(args.runs))
        stats = llm.engine.scheduler.spec_stats
        print(f"== draft {name}: {tokens / (time.perf_counter() - start):.1f} tok/s; accepted "
              f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} proposals")
        for kind, values in sorted(TIMES.items()):
            print(f"   {kind:26s} n={len(values):4d}  median {statistics.median(values):7.2f} ms  "
                  f"total {sum(values):8.1f} ms")
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
