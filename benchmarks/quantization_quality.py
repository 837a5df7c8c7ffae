"""What ``--quantization gguf``, ``int4`` or ``int8`` costs in accuracy, beside what it buys in speed.

Three measures against the float model on the same file:
- perplexity on a fixed text (prose, code, numbers; written for this benchmark, not a public corpus),
  from the engine's prompt logprobs;
- teacher-forced top-1 agreement: at each position of that text, do both models rank the same next
  token first;
- free-running greedy agreement: the number of tokens two greedy generations share before they first
  differ, over 8 chat prompts x 64 tokens (small models diverge early on near-ties, so this is the
  harshest of the three).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quantization_quality.py --quantization gguf,int4,int8 \
        --json out/quantization-quality.json

``--kv-cache-dtypes auto,fp8`` scores each mode over each cache dtype. A one-shot prefill attends to its
fresh keys and values, not to the cache, so for a cache dtype to show in the perplexity the text must be
scored in chunks that read the earlier ones back from the cache: ``--score-chunk 32`` (every model, the
float reference included, then scores that way).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

EVAL_TEXT = (
    "The harbour town woke slowly. Fishing boats returned with the tide, their decks crowded with crates "
    "of silver mackerel, and gulls circled above the market square where traders set out bread, cheese "
    "and rope. A schoolteacher walked her class along the sea wall and explained how the moon pulls the "
    "water twice a day, why the highest tides arrive near the new and full moon, and how sailors once "
    "kept tables of the hours so that no ship would run aground in the narrow channel. In the afternoon "
    "a storm gathered over the headland. The wind rose, shutters banged, and the harbour master raised a "
    "red flag to warn the small boats to stay inside the breakwater. By evening the rain had passed, the "
    "sky cleared to a pale green, and families came out to walk on the wet sand, collecting shells and "
    "pieces of driftwood polished smooth by the waves.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "The committee met on Tuesday to review the budget. Three proposals were discussed: repairing the "
    "old bridge, building a new library wing, and expanding the bus service to the villages in the "
    "hills. After a long debate the members voted to fund the bridge first, because the engineers' "
    "report showed cracks in two of its arches."
)
PROMPTS = ["Explain how vaccines train the immune system.", "Write a short poem about the sea.",
           "What is the capital of France and why is it famous?", "List three uses of a paperclip.",
           "Describe the water cycle in simple words.", "Why is the sky blue?",
           "Give me a recipe for pancakes.", "What does a compiler do?"]


def score_text(llm, ids: list[int]) -> tuple[float, list[int]]:
    """Perplexity of the text and the top-1 token the model predicts at each position."""
    from tideserve import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0))[0]
    logprobs, top1 = [], []
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        logprobs.append(entry[token].logprob)
        top1.append(max(entry.items(), key=lambda kv: kv[1].logprob)[0])
    return math.exp(-sum(logprobs) / len(logprobs)), top1


def greedy(llm, max_tokens: int) -> list[list[int]]:
    from tideserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="gguf",
                    help="comma-separated tideserve modes to score against the float model (gguf,int4,int8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated KV cache dtypes (auto,fp8)")
    ap.add_argument("--score-chunk", type=int, default=None,
                    help="prefill chunk (max_num_batched_tokens) for every model: later chunks read the cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tideserve import LLM

    chunk = {"max_num_batched_tokens": args.score_chunk} if args.score_chunk else {}
    ref_llm = LLM(args.model, dtype="float32", max_model_len=1024, quantization="none", **chunk)
    ids = ref_llm.tokenizer.encode(EVAL_TEXT)
    ref_ppl, ref_top1 = score_text(ref_llm, ids)
    ref_greedy = greedy(ref_llm, args.max_tokens)
    del ref_llm
    results = []
    combos = [(m, kv) for m in args.quantization.split(",") for kv in args.kv_cache_dtypes.split(",")]
    for method, kv in combos:
        q_llm = LLM(args.model, dtype="float32", max_model_len=1024, quantization=method, kv_cache_dtype=kv,
                    **chunk)
        ppl, top1 = score_text(q_llm, ids)
        runs = greedy(q_llm, args.max_tokens)
        del q_llm
        shared = [next((i for i, (a, b) in enumerate(zip(r, q)) if a != b), len(r)) for r, q in zip(ref_greedy, runs)]
        results.append({
            "quantization": method, "kv_cache_dtype": kv, "score_chunk": args.score_chunk, "model": args.model,
            "eval_tokens": len(ids),
            "perplexity_float32": ref_ppl, "perplexity_quantized": ppl,
            "perplexity_change_pct": (ppl / ref_ppl - 1) * 100,
            "teacher_forced_top1_agreement": sum(a == b for a, b in zip(top1, ref_top1)) / len(ref_top1),
            "greedy_shared_prefix_tokens": shared,
            "greedy_shared_prefix_median": statistics.median(shared),
            "greedy_identical_generations": sum(s == args.max_tokens for s in shared),
            "greedy_max_tokens": args.max_tokens,
        })
        print(json.dumps(results[-1], indent=2), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)


if __name__ == "__main__":
    main()
