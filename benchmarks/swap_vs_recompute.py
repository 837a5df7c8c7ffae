"""Swap against recompute preemption on long prompts: when does copying a preempted request's KV to the
host and back beat computing it again?

A fixed pool too small for the batch forces preemptions; the same requests run under
``preemption_mode="recompute"`` and ``"swap"`` (interleaved, repeated), with and without prefix caching
(a preempted request's full blocks stay cached until reused, which can make recompute cheap). Reported:
wall time, output tok/s, preemptions, swap-ins, tokens the forward passes computed, and the bytes the
swaps moved. Swap costs two copies of the request's KV (host memory bandwidth); recompute costs a
prefill of its context (compute), so swap wins as contexts grow and as compute gets scarcer.

    .venv/bin/python benchmarks/swap_vs_recompute.py --prompt-lens 512,2048 --output-len 256 \
        --num-requests 6 --repeats 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from tideserve import LLM, SamplingParams

WORDS = "tide harbour ferry island signal storm current anchor lantern chart compass rope sail".split()


def prompts_of(tokenizer, n: int, length: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(length * 2))
        out.append(tokenizer.encode(f"Request {i}: {text}")[:length])
    return out


def run_once(args, mode: str, prefix: bool, prompt_len: int) -> dict:
    # Room for --admit prompts and half their outputs: they are all admitted, and preemptions start once
    # their decodes pass half way.
    pool_tokens = args.admit * (prompt_len + args.output_len // 2)
    llm = LLM(dtype=args.dtype, max_model_len=prompt_len + args.output_len + 16, block_size=16,
              num_blocks=-(-pool_tokens // 16), preemption_mode=mode,
              swap_space=args.swap_gib, enable_prefix_caching=prefix, max_num_seqs=args.num_requests)
    engine = llm.engine
    computed, copied_blocks = [0], [0]
    execute = engine.executor.driver_worker.runner.execute

    def counting(out):
        computed[0] += out.total_num_scheduled_tokens
        copied_blocks[0] += len(out.swap_out) + len(out.swap_in)
        return execute(out)

    engine.executor.driver_worker.runner.execute = counting
    prompts = prompts_of(llm.tokenizer, args.num_requests, prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    return {"seconds": seconds, "tok_s": args.num_requests * args.output_len / seconds,
            "preemptions": engine.scheduler.num_preemptions, "swap_ins": engine.scheduler.num_swap_ins,
            "computed": computed[0], "tokens": [o.outputs[0].token_ids for o in outs],
            "copied_bytes": copied_blocks[0] * engine.executor.driver_worker.kv_storage.bytes_per_block()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="256,1024,2048")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--admit", type=int, default=3,
                    help="the fixed pool holds this many prompts and half their outputs")
    ap.add_argument("--swap-gib", type=float, default=4.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    logging.getLogger("tideserve").setLevel(logging.ERROR)  # one preemption warning per request otherwise
    print(f"{args.num_requests} requests x {args.output_len} output tokens, a pool for {args.admit} prompts and "
          f"half their outputs, {args.dtype}; medians of {args.repeats} interleaved runs")
    print("| prompt | prefix cache | mode | seconds | output tok/s | preemptions | swap-ins | tokens computed |"
          " KV moved by swaps |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for prompt_len in (int(x) for x in args.prompt_lens.split(",")):
        for prefix in (False, True):
            runs: dict[str, list[dict]] = {"recompute": [], "swap": []}
            for _ in range(args.repeats):
                for mode in runs:
                    runs[mode].append(run_once(args, mode, prefix, prompt_len))
            assert runs["swap"][0]["tokens"] == runs["recompute"][0]["tokens"], "modes disagree on greedy output"
            for mode, rs in runs.items():
                r = rs[0]
                secs = statistics.median(x["seconds"] for x in rs)
                tok_s = statistics.median(x["tok_s"] for x in rs)
                moved = f"{r['copied_bytes'] / 2**20:.0f} MiB" if mode == "swap" else "-"
                print(f"| {prompt_len} | {'on' if prefix else 'off'} | {mode} | {secs:.2f} | {tok_s:.1f} | "
                      f"{r['preemptions']} | {r['swap_ins']} | {r['computed']} | {moved} |")


if __name__ == "__main__":
    main()
