"""Embedding throughput: tideserve's LLM.embed against transformers' forward pass on the same model and texts.

Both embed the same batch of texts of varied length (LAST pooling, unit length: vLLM's embed task), in
interleaved rounds on fresh texts (a repeated text would hit tideserve's prefix cache); transformers runs
one padded forward per batch of ``--hf-batch-size`` texts of similar length (right padding, the last real
token's state), in its fastest dtype here unless told. Prints input tokens/s per engine, the ratio per round
and its median, and the largest difference between the two engines' vectors (cosine distance) as a check
that both computed the same thing.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/embedding_throughput.py --num-texts 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

WORDS = ("river market engine garden theory signal paper window orbit winter protein ledger harbor "
         "canvas volcano lattice compiler melody glacier archive").split()


def make_texts(n: int, seed: int) -> list[str]:
    """Sentences of 8 to 200 words, like passages a retrieval index holds."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200))) + "." for _ in range(n)]


def hf_embed(model, token_lists: list[list[int]], batch_size: int, pad_id: int) -> torch.Tensor:
    """Batches of texts of similar length (sorted, as sentence-transformers batches them), so padding
    wastes little; the vectors come back in the input order."""
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    vectors = []
    for b in range(0, len(order), batch_size):
        chunk = [token_lists[i] for i in order[b:b + batch_size]]
        width = max(len(t) for t in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, t in enumerate(chunk):
            ids[i, :len(t)] = torch.tensor(t)
            mask[i, :len(t)] = 1
        with torch.inference_mode():
            states = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                           output_hidden_states=True).hidden_states[-1]
        last = states[torch.arange(len(chunk)), mask.sum(dim=1) - 1].float()
        vectors.append(torch.nn.functional.normalize(last, dim=-1).cpu())
    return torch.cat(vectors)[torch.argsort(torch.tensor(order))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--num-texts", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="tideserve's (auto: a GGUF's own blocks)")
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tideserve import LLM

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=256)
    path = Path(llm.engine.model_path)
    hf_dtype = getattr(torch, args.hf_dtype)
    hf = (AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=hf_dtype) if path.is_file()
          else AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype)).eval()
    pad = llm.tokenizer.eos_token_id or 0
    rounds = [make_texts(args.num_texts, args.seed + r) for r in range(args.repeats)]
    warm = make_texts(8, args.seed - 1)
    llm.embed(warm)
    hf_embed(hf, [llm.tokenizer.encode(t) for t in warm], args.hf_batch_size, pad)

    ours, theirs, ratios, distances = [], [], [], []
    for r, texts in enumerate(rounds):
        token_lists = [llm.tokenizer.encode(t) for t in texts]
        n_tokens = sum(len(t) for t in token_lists)
        t0 = time.perf_counter()
        got = torch.tensor([o.outputs.embedding for o in llm.embed(token_lists)])
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = hf_embed(hf, token_lists, args.hf_batch_size, pad)
        t_theirs = time.perf_counter() - t0
        ours.append(n_tokens / t_ours)
        theirs.append(n_tokens / t_theirs)
        ratios.append(t_theirs / t_ours)
        distances.append(float((1 - (got * want).sum(dim=-1)).max()))
        print(f"round {r}: {len(texts)} texts, {n_tokens} tokens | tideserve {ours[-1]:8.0f} tok/s ({t_ours:.2f} s) | "
              f"transformers[{args.hf_dtype}] {theirs[-1]:8.0f} tok/s ({t_theirs:.2f} s) | {ratios[-1]:.2f}x | "
              f"max cosine distance {distances[-1]:.2e}", flush=True)
    med = statistics.median
    result = {"model": str(path), "tideserve_dtype": str(llm.engine.dtype), "quantization": llm.engine.quantization,
              "hf_dtype": args.hf_dtype, "threads": torch.get_num_threads(), "num_texts": args.num_texts,
              "tideserve_tok_s": ours, "transformers_tok_s": theirs, "round_ratios": ratios,
              "ratio": med(ratios), "max_cosine_distance": max(distances), "torch": torch.__version__}
    print(f"median: tideserve {med(ours):.0f} tok/s, transformers {med(theirs):.0f} tok/s, {med(ratios):.2f}x "
          f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
