"""Offline throughput: tideserve's LLM.generate against Hugging Face transformers' batched generate().

Same model file, same prompts (chat prompts of varied length), same greedy output length with EOS
ignored, measured in one run and interleaved. Every round draws a fresh set of prompts (seed + round),
which both engines get: a round that repeated an earlier one would find its prompts in tideserve's prefix
cache and skip their prefill, which no first sight of a workload does. tideserve runs once per
``--quantization`` value (times each ``--kv-cache-dtypes`` value), and transformers once per
``--hf-dtypes`` value (its bfloat16 is the reference config on CPUs with AMX;
float32 is its fastest where bf16 is emulated). Prints output tokens/s and the ratios, each the median of
the per-round ratios over the rounds both engines ran (``--hf-repeats`` may run fewer).

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --output-len 128 --repeats 3 \
        --quantization none,int8 --hf-dtypes float32,bfloat16 --hf-repeats 1
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
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=pad_id)
        total += (out.shape[1] - width) * len(chunk)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto", help="tideserve's device (auto: cuda when present, else cpu); "
                    "transformers runs on the same one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quantization", default="auto",
                    help="comma-separated tideserve variants: auto,none,gguf,int8,int4")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated KV cache dtypes: auto,bfloat16")
    ap.add_argument("--hf-dtypes", default=None, help="comma-separated transformers dtypes (default: --dtype's)")
    ap.add_argument("--hf-repeats", type=int, default=None, help="transformers runs (default: --repeats)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tideserve import LLM

    combos = [(q, kv) for q in args.quantization.split(",") for kv in args.kv_cache_dtypes.split(",")]
    variants = [q if kv == "auto" else f"{q}+kv-{kv}" for q, kv in combos]
    llms = {name: LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max(args.num_prompts, 1),
                      max_num_batched_tokens=4096, quantization=q, kv_cache_dtype=kv)
            for name, (q, kv) in zip(variants, combos)}
    llm = llms[variants[0]]
    dtype = llm.engine.dtype
    def encoded(seed: int) -> list[list[int]]:
        return [llm.tokenizer.encode_chat([{"role": "user", "content": p}])
                for p in make_prompts(args.num_prompts, seed)]

    rounds = [encoded(args.seed + r) for r in range(args.repeats)]
    lens = [len(p) for ids in rounds for p in ids]
    print(f"model={llm.engine.model_path} dtype={dtype} prompts={args.num_prompts} x {args.repeats} rounds "
          f"prompt tokens min/median/max={min(lens)}/{int(statistics.median(lens))}/{max(lens)} "
          f"output={args.output_len} threads={torch.get_num_threads()} device={llm.engine.device}")

    hfs = {}
    if not args.skip_transformers:
        path = Path(llm.engine.model_path)
        for name in (args.hf_dtypes.split(",") if args.hf_dtypes else [str(dtype).removeprefix("torch.")]):
            hf_dtype = getattr(torch, name)
            if path.is_file():
                hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=hf_dtype)
            else:
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype)
            hfs[name] = hf.to(llm.engine.device).eval()
        pad = llm.tokenizer.eos_token_id or 0

    # Warm up each once at the rounds' batch width (a few tokens, on prompts no round uses), then interleave
    # the timed runs: on a GPU the first batch of a width pays CUDA-graph captures and cuBLAS's choices.
    warm = encoded(args.seed - 1)
    for one in llms.values():
        run_tideserve(one, warm, 4)
    for hf in hfs.values():
        run_transformers(hf, pad, warm, 4, args.hf_batch_size or len(warm))
    ours: dict[str, list[float]] = {q: [] for q in variants}
    theirs: dict[str, list[float]] = {name: [] for name in hfs}
    hf_repeats = args.repeats if args.hf_repeats is None else args.hf_repeats
    for r, prompt_ids in enumerate(rounds):
        parts = []
        for q, one in llms.items():
            t, n = run_tideserve(one, prompt_ids, args.output_len)
            ours[q].append(n / t)
            parts.append(f"tideserve[{q}] {n / t:7.1f} tok/s ({t:.1f}s)")
        if r < hf_repeats:
            for name, hf in hfs.items():
                t2, n2 = run_transformers(hf, pad, prompt_ids, args.output_len,
                                          args.hf_batch_size or len(prompt_ids))
                theirs[name].append(n2 / t2)
                parts.append(f"transformers[{name}] {n2 / t2:7.1f} tok/s ({t2:.1f}s)")
        print(f"run {r}: " + " | ".join(parts), flush=True)

    med = statistics.median
    result = {
        "machine": f"{platform.machine()} {platform.processor()} threads={torch.get_num_threads()}",
        "torch": torch.__version__, "device": str(llm.engine.device), "dtype": str(dtype),
        "num_prompts": args.num_prompts, "prompt_seeds": [args.seed + r for r in range(args.repeats)],
        "output_len": args.output_len,
        "tideserve_tok_s": ours, "tideserve_median": {q: med(v) for q, v in ours.items()},
    }
    for q, v in ours.items():
        print(f"tideserve[{q}] median {med(v):.1f} tok/s (spread {min(v):.1f}-{max(v):.1f})")
    if theirs:
        import transformers

        result.update(transformers=transformers.__version__, transformers_tok_s=theirs,
                      transformers_median={n: med(v) for n, v in theirs.items()},
                      # rounds differ in their prompts: each ratio is the median of the rounds both ran
                      round_ratios={f"{q}/{n}": [a / b for a, b in zip(ours[q], theirs[n])]
                                    for q in ours for n in theirs})
        result["ratios"] = {key: med(v) for key, v in result["round_ratios"].items()}
        for n, v in theirs.items():
            print(f"transformers[{n}] median {med(v):.1f} tok/s (spread {min(v):.1f}-{max(v):.1f})")
        for key, ratio in result["ratios"].items():
            rounds_ = result["round_ratios"][key]
            print(f"ratio tideserve[{key.split('/')[0]}] / transformers[{key.split('/')[1]}]: {ratio:.2f}x "
                  f"(median of {len(rounds_)} rounds: {', '.join(f'{x:.2f}' for x in rounds_)})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
