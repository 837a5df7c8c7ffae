"""GPU probes that benchmarks/gpu_check.sh runs on a machine with CUDA, each writing one JSON file.

    decode-micro  the Triton paged decode kernel against the torch path (blocks gathered, SDPA) at a few
                  batch sizes and context lengths, Llama-8B-like heads in bfloat16: median microseconds,
                  the KV bandwidth each reaches, and their largest difference
    elastic       the elastic KV pool on device memory: pool bytes, torch's allocated and reserved bytes
                  and the device's free memory at start, after a burst and while idle (grow, then shrink)
    make-model    a random-weight Hugging Face directory of SmolLM2-135M's shape (config and tokenizer
                  exported here by ``gpu_check.sh --fetch-wheels``) for a machine without the default model

    python3 benchmarks/gpu_probes.py decode-micro --json $OUT/decode-micro.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from pathlib import Path

import torch


def _torch_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The torch decode path (tideserve/model/layers/attention.py): whole blocks gathered, SDPA with a
    mask of real keys, grouped heads as query rows."""
    b, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    nb = block_tables.shape[1]
    idx = block_tables.reshape(-1).long()
    k = k_cache.index_select(0, idx).view(b, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, idx).view(b, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(nb * block_size, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, num_heads, head_dim)


def _bench_us(fn, device: torch.device) -> float:
    """Median microseconds per call: triton's do_bench on CUDA; one timed call elsewhere (the smoke run
    under the interpreter, whose time means nothing)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def decode_micro(args: argparse.Namespace) -> dict:
    from tideserve.model.attention.triton import num_partitions, paged_decode_attention

    device, dtype = torch.device(args.device), torch.bfloat16
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    rows = []
    for batch in [int(x) for x in args.batches.split(",")]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            nb = -(-ctx // block_size)
            num_blocks = batch * nb + 1
            k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            tables = (torch.randperm(num_blocks - 1, device=device)[: batch * nb] + 1).view(batch, nb).int()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
            out = torch.empty_like(q)
            scale = head_dim ** -0.5
            ours = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, scale, out,
                                     max_context_len=ctx)
            theirs = functools.partial(_torch_decode, q, k_cache, v_cache, tables, lens, scale)
            ours()
            diff = float((out.float() - theirs().float()).abs().max())
            t_ours, t_theirs = _bench_us(ours, device), _bench_us(theirs, device)
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
            row = {"batch": batch, "context": ctx, "partitions": num_partitions(ctx, batch * kv_heads),
                   "triton_us": round(t_ours, 1), "torch_us": round(t_theirs, 1),
                   "speedup": round(t_theirs / t_ours, 2), "triton_kv_GBps": round(kv_bytes / t_ours / 1e3, 1),
                   "max_abs_diff": diff}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del k_cache, v_cache, ours, theirs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"shape": f"H={heads} KVH={kv_heads} D={head_dim} block={block_size} {dtype}", "rows": rows,
            "gpu": _device_name(device)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def elastic(args: argparse.Namespace) -> dict:
    from tideserve import LLM, SamplingParams

    device = torch.device(args.device)
    llm = LLM(args.model, device=args.device, kv_cache_shrink_delay=args.shrink_delay, max_num_seqs=args.num_requests)
    engine = llm.engine
    t0 = time.monotonic()

    def snap(label: str) -> dict:
        s = engine.stats()
        free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
        row = {"t_s": round(time.monotonic() - t0, 2), "label": label, "pool_bytes": s.kv_cache_pool_bytes,
               "pool_blocks": s.kv_cache_pool_blocks, "used_blocks": s.kv_cache_used_blocks,
               "cached_blocks": s.kv_cache_cached_blocks, "resizes": s.kv_cache_resizes,
               "budget_bytes": s.kv_cache_budget_bytes, "device_free": free, "device_total": total}
        if device.type == "cuda":
            row.update(torch_allocated=torch.cuda.memory_allocated(device),
                       torch_reserved=torch.cuda.memory_reserved(device))
        print(json.dumps(row), flush=True)
        return row

    rows = [snap("start")]
    rng = random.Random(0)
    words = "the of and to in a is that for it as with was on be by this are from at or an tide ferry".split()
    text = " ".join(rng.choice(words) for _ in range(args.prompt_len * 2))
    base = llm.tokenizer.encode(text)[: args.prompt_len - 8]
    prompts = [llm.tokenizer.encode(f"Request {i}:", add_special_tokens=False) + base
               for i in range(args.num_requests)]  # distinct first block: no prefix sharing
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append(snap("after burst"))
    deadline = time.monotonic() + args.idle_seconds
    shrunk_at = None
    while time.monotonic() < deadline:  # what the server's engine thread does while idle
        engine.maintain()
        time.sleep(0.25)
        rows.append(snap("idle"))
        if shrunk_at is None and rows[-1]["pool_bytes"] < rows[1]["pool_bytes"]:
            shrunk_at = rows[-1]["t_s"] - rows[1]["t_s"]
    peak = max(r["pool_bytes"] for r in rows)
    return {"rows": rows, "burst_tok_s": round(tokens / elapsed, 1), "burst_s": round(elapsed, 2),
            "pool_start_bytes": rows[0]["pool_bytes"], "pool_peak_bytes": peak,
            "pool_end_bytes": rows[-1]["pool_bytes"],
            "device_free_gain_bytes": rows[-1]["device_free"] - rows[1]["device_free"],
            "first_shrink_after_s": shrunk_at, "gpu": _device_name(device)}


def make_model(args: argparse.Namespace) -> dict:
    """Random weights in the exported config's shape: throughput does not depend on the weights' values
    (greedy decoding, EOS ignored), so tok/s against transformers on the same files stays meaningful."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(args.config_dir), Path(args.out_dir)
    config = AutoConfig.from_pretrained(src)
    for item in args.set or ():  # a larger shape on the same tokenizer: the GPU loaded, not the launches
        key, _, value = item.partition("=")
        setattr(config, key, type(getattr(config, key))(value))
    torch.manual_seed(0)
    with torch.device(args.device):  # --device cuda: a 1B model initialises in seconds, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for f in src.iterdir():  # tokenizer files and chat template
        if not (dst / f.name).exists():
            (dst / f.name).write_bytes(f.read_bytes())
    return {"model_dir": str(dst), "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("decode-micro")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="512,4096,16384")
    p = sub.add_parser("elastic")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--shrink-delay", type=float, default=1.0)
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p = sub.add_parser("make-model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--config-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set hidden_size=2048 (repeatable)")
    for name, p in sub.choices.items():
        if name != "make-model":
            p.add_argument("--device", default="cuda", help="cpu: a smoke run (decode-micro: TRITON_INTERPRET=1)")
        p.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    result = {"decode-micro": decode_micro, "elastic": elastic, "make-model": make_model}[args.probe](args)
    result.update(torch=torch.__version__, probe=args.probe)
    if args.probe == "decode-micro":
        speedups = [r["speedup"] for r in result["rows"]]
        result["median_speedup"] = statistics.median(speedups) if speedups else None
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
