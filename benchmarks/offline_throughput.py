"""Offline throughput: tideserve's LLM.generate against Hugging Face transformers' batched generate().

Same model file, same prompts (chat prompts of varied length), same greedy output length with EOS
ignored, same dtype, measured in one run and interleaved. Prints output tokens/s for both and the ratio.

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --output-len 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

TOPICS = [
    "the history of the printing press", "how vaccines train the immune system", "the rules of chess",
    "why the sky is blue", "the water cycle", "how a compiler works", "the causes of the first world war",
    "photosynthesis", "the stock market", "black holes", "the French revolution", "machine learning",
    "how bread rises", "plate tectonics", "the internet's packet switching", "jazz improvisation",
]


def make_prompts(n: int, seed: int) -> list[str]:
    """Chat-style requests whose lengths vary from a sentence to a few paragraphs."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        filler = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 40)))
        context = f" Some context you may use: {filler}." if filler else ""
        prompts.append(f"Explain {topic} to a curious student.{context} Be clear and detailed.")
    return prompts


def run_tideserve(llm, prompt_ids: list[list[int]], output_len: int) -> tuple[float, int]:
    from tideserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model, pad_id: int, prompt_ids: list[list[int]], output_len: int,
                     batch_size: int) -> tuple[float, int]:
    total = 0
    t0 = time.perf_counter()
    for b in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[b:b + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding, as generate() expects for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
        total += (out.shape[1] - width) * len(chunk)
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tideserve import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1),
              max_num_batched_tokens=4096)
    dtype = llm.engine.dtype
    prompts = make_prompts(args.num_prompts, args.seed)
    prompt_ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    lens = [len(p) for p in prompt_ids]
    print(f"model={llm.engine.model_path} dtype={dtype} prompts={len(prompts)} "
          f"prompt tokens min/median/max={min(lens)}/{int(statistics.median(lens))}/{max(lens)} "
          f"output={args.output_len} threads={torch.get_num_threads()}")

    hf = None
    if not args.skip_transformers:
        path = Path(llm.engine.model_path)
        if path.is_file():
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf.eval()
        pad = llm.tokenizer.eos_token_id or 0

    # Warm up both once (small), then interleave the timed runs.
    run_tideserve(llm, prompt_ids[:2], 4)
    if hf is not None:
        run_transformers(hf, pad, prompt_ids[:2], 4, 2)
    ours, theirs = [], []
    for r in range(args.repeats):
        t, n = run_tideserve(llm, prompt_ids, args.output_len)
        ours.append(n / t)
        line = f"run {r}: tideserve {n / t:8.1f} tok/s ({n} tokens in {t:.1f}s)"
        if hf is not None:
            t2, n2 = run_transformers(hf, pad, prompt_ids, args.output_len,
                                      args.hf_batch_size or len(prompt_ids))
            theirs.append(n2 / t2)
            line += f" | transformers {n2 / t2:8.1f} tok/s ({n2} tokens in {t2:.1f}s)"
        print(line, flush=True)

    result = {
        "machine": f"{platform.machine()} {platform.processor()} threads={torch.get_num_threads()}",
        "torch": torch.__version__, "dtype": str(dtype), "num_prompts": args.num_prompts,
        "output_len": args.output_len, "tideserve_tok_s": ours,
        "tideserve_median": statistics.median(ours),
    }
    print(f"tideserve median {statistics.median(ours):.1f} tok/s (spread {min(ours):.1f}-{max(ours):.1f})")
    if theirs:
        import transformers

        result.update(transformers=transformers.__version__, transformers_tok_s=theirs,
                      transformers_median=statistics.median(theirs),
                      ratio=statistics.median(ours) / statistics.median(theirs))
        print(f"transformers median {statistics.median(theirs):.1f} tok/s "
              f"(spread {min(theirs):.1f}-{max(theirs):.1f})")
        print(f"ratio tideserve / transformers: {result['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
