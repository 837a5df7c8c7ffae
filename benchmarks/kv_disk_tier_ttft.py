"""Time to first token of a long prompt: cold, warm (its prefix in the pool), after a restart on the same
``--kv-cache-dir`` (its prefix on disk only) and, with ``--kv-offloading-size``, after the pool gave its
cached prefixes up in a shrink (its prefix in the host tier only), with the embedded model, in-process.

Each "cold" and "restart" figure is the first request of a freshly built engine (the pool starts empty and
grows for it, as a server's first request does); "warm" is the same prompt again in the engine that just
ran it. Also reported: the cold TTFT with the tier off (the cost of writing the blocks down) and the
restart TTFT relative to warm and cold. ``--samples`` takes that many warm and restart figures per cold run
(each restart a fresh engine on the same directory): they are short, so on a shared machine several of them
give a steadier median than more cold runs would.

    .venv/bin/python benchmarks/kv_disk_tier_ttft.py --prompt-tokens 3000 --repeats 3
    .venv/bin/python benchmarks/kv_disk_tier_ttft.py --prompt-tokens 3000 --repeats 2 --samples 5
    .venv/bin/python benchmarks/kv_disk_tier_ttft.py --prompt-tokens 3000 --repeats 2 --samples 5 --host-only

The host figure runs on an elastic pool (a fixed one never shrinks): it shrinks the pool to one block as an
idle server's pool does (the same call), then sends the prompt again; the pool grows back (committing its
pages again) and the prompt's blocks come back from the host tier. Its "warm" is the same engine's.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from tideserve import LLM, SamplingParams
from tideserve.model.loader import LoadedModel

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def long_prompt(llm: LLM, num_tokens: int) -> list[int]:
    """Token ids of a varied English text about ``num_tokens`` long."""
    sentence = ("Entry {i}: the shipment from warehouse {w} left on day {d} with {n} parcels, of which {k} need "
                "a signature and {j} travel by air. ")
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids += llm.tokenizer.encode(sentence.format(i=i, w=i % 7, d=i % 31, n=10 + i, k=i % 5, j=i % 3),
                                    add_special_tokens=False)
        i += 1
    return ids[:num_tokens]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request, alone in the engine."""
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, FIRST_TOKEN)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1, help="warm and restart figures per cold run")
    parser.add_argument("--kv-offloading-size", default="2GiB", help="the host tier's size ('0': no host figure)")
    parser.add_argument("--host-only", action="store_true", help="only the host tier's figures (no disk runs)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="a fixed pool, so that 'warm' is the prefix in the pool (an elastic pool may shrink "
                             "between two requests; 'none' measures it anyway)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # A fixed block size: "auto" may switch sizes between the runs, which starts the prefix cache over.
    settings = {"max_model_len": args.prompt_tokens + 64, "dtype": args.dtype, "block_size": 16,
                "kv_cache_memory": None if args.kv_cache_memory == "none" else args.kv_cache_memory}
    base = LLM(**settings)
    prompt = long_prompt(base, args.prompt_tokens)
    old = base.engine
    shared = LoadedModel(old.model, old.arch, old.dtype, old.model_path, old.model_name, old.quantization)

    def engine(**kwargs) -> LLM:
        """A fresh engine over the same weights (loading once keeps the run short)."""
        return LLM.from_loaded(shared, old.tokenizer, **{**settings, **kwargs})

    ttft(base, prompt[:64])  # warm the kernels once
    off, cold, warm, restart, cached, host_warm, host, host_cached = [], [], [], [], [], [], [], []
    for _ in range(args.repeats):
        if args.kv_offloading_size != "0":
            # An elastic pool, as a server's: a fixed one does not shrink when idle (nor grow back).
            llm = engine(kv_offloading_size=args.kv_offloading_size, kv_cache_memory=None)
            ttft(llm, prompt)
            host_warm += [ttft(llm, prompt)[0] for _ in range(args.samples)]
            for _ in range(args.samples):
                llm.engine.pool.shrink(1, "benchmark: an idle pool")
                seconds, hit = ttft(llm, prompt)
                host.append(seconds)
                host_cached.append(hit)
            llm.engine.shutdown()
        if args.host_only:
            continue
        llm = engine()
        off.append(ttft(llm, prompt)[0])
        llm.engine.shutdown()
        with tempfile.TemporaryDirectory() as directory:
            llm = engine(kv_cache_dir=directory)
            cold.append(ttft(llm, prompt)[0])
            warm += [ttft(llm, prompt)[0] for _ in range(args.samples)]
            llm.engine.shutdown()
            for _ in range(args.samples):
                llm = engine(kv_cache_dir=directory)
                seconds, hit = ttft(llm, prompt)
                restart.append(seconds)
                cached.append(hit)
                llm.engine.shutdown()
    med = statistics.median
    for name, values in (("tier off", off), ("cold", cold), ("warm", warm), ("restart", restart),
                         ("host warm", host_warm), ("host", host)):
        print(f"  {name:9s} " + " ".join(f"{v:.3f}" for v in values))
    print(f"prompt {len(prompt)} tokens, {args.repeats} repeats x {args.samples} samples (medians), KV dtype "
          f"{str(base.engine.kv_dtype).removeprefix('torch.')}")
    if host:
        print(f"warm, host tier on    {med(host_warm):7.3f} s")
        print(f"host (after a shrink) {med(host):7.3f} s  ({med(host) / med(host_warm):.2f}x warm; "
              f"{min(host_cached)} tokens cached)")
    if args.host_only:
        return
    print(f"cold, tier off        {med(off):7.3f} s")
    print(f"cold, tier on         {med(cold):7.3f} s  ({med(cold) / med(off):.2f}x tier off)")
    print(f"warm (in the pool)    {med(warm):7.3f} s")
    print(f"restart (from disk)   {med(restart):7.3f} s  ({med(restart) / med(warm):.2f}x warm, "
          f"{med(restart) / med(cold):.2f}x cold; {min(cached)} tokens cached)")


if __name__ == "__main__":
    main()
