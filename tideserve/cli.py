"""Command line: ``tideserve serve``, ``tideserve generate`` and ``tideserve chat``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tideserve.config import KV_CACHE_DTYPES
from tideserve.sampling_params import SamplingParams


def _size(text: str) -> int:
    """'4GiB', '512MiB', '2GB' or a plain byte count."""
    from tideserve.config import parse_size

    try:
        return int(parse_size(text, "size"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_size(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory or hub id (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "gguf", "int8", "int4"],
                   help="auto (default): a quantized GGUF runs on its own blocks (gguf), anything else in float; "
                        "gguf: keep a GGUF file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K) for the native "
                        "kernels; none: dequantize to --dtype (the float reference); int8: int8 GEMMs for every "
                        "linear layer (CPU, fbgemm); int4: 4-bit blocks for every linear layer, quantized at load")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--allow-long-max-model-len", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default 2048; without chunked prefill at least max_model_len)")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-adaptive-threads", dest="adaptive_threads", action="store_false",
                   help="keep the intra-op thread count fixed even when other processes take cores")
    kv = p.add_argument_group("KV cache (elastic by default: sized from measurement, grows and shrinks)")
    kv.add_argument("--block-size", type=_block_size, default="auto",
                    help="8, 16, 32, 64, 128 or auto (chosen from the workload)")
    kv.add_argument("--kv-cache-memory", default=None,
                    help="fix the pool at this size, e.g. 4GiB (static mode)")
    kv.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="fix the pool at this share of device (or host) memory (static mode)")
    kv.add_argument("--num-blocks", type=int, default=None, help="fix the pool at this many blocks")
    kv.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="auto: the model's dtype; bfloat16 holds twice the tokens of float32 per byte and "
                         "halves the bytes decode attention reads")
    kv.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                    default=True)
    kv.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    kv.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    kv.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swap preemption")
    kv.add_argument("--kv-cache-shrink-delay", type=float, default=None, metavar="SECONDS",
                    help="elastic pool: how long usage stays low before the pool gives memory back (default 5)")


def engine_kwargs(ns: argparse.Namespace) -> dict:
    keys = ["model", "dtype", "device", "max_model_len", "allow_long_max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "enable_chunked_prefill", "block_size", "num_blocks",
            "kv_cache_memory", "gpu_memory_utilization", "kv_cache_dtype", "enable_prefix_caching", "preemption_mode",
            "swap_space", "seed", "quantization", "adaptive_threads", "kv_cache_shrink_delay"]
    return {k: getattr(ns, k) for k in keys}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--sample-seed", type=int, default=None)


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          max_tokens=ns.max_tokens, seed=ns.sample_seed)


def cmd_generate(ns: argparse.Namespace) -> int:
    from tideserve.engine.llm import LLM

    llm = LLM(**engine_kwargs(ns))
    prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for out in llm.generate(prompts, sampling_params(ns)):
        print(out.outputs[0].text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from tideserve.engine.llm import LLM

    llm = LLM(**engine_kwargs(ns))
    params = sampling_params(ns)
    history: list[dict] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("tideserve chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        try:
            reply = llm.chat(history, params)[0].outputs[0].text
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """``tideserve bench serve | offline | plot``; the commands live in tideserve/bench/cli.py."""
    from tideserve.bench.cli import add_bench_subcommands

    add_bench_subcommands(sub, add_engine_args)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="name(s) clients use, comma-separated (default: derived from the model file)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable; default: $TIDESERVE_API_KEY)")
    g.add_argument("--rate-limit", type=int, default=None, help="requests per minute per API key")
    g.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests beyond which new ones get 429")
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--max-body-size", type=_size, default=16 * 2**20, help="largest request body, e.g. 16MiB")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests")
    g.add_argument("--log-prompts", action="store_true", help="log prompt text (off: only token counts)")


def cmd_serve(ns: argparse.Namespace) -> int:
    from tideserve.engine.async_engine import AsyncEngine
    from tideserve.engine.llm_engine import EngineArgs
    from tideserve.serve.config import ServerConfig, api_keys_from
    from tideserve.serve.openai.server import run_server

    config = ServerConfig(
        host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
        api_keys=api_keys_from(ns.api_key), rate_limit=ns.rate_limit, max_queue=ns.max_queue,
        max_logprobs=ns.max_logprobs, log_prompts=ns.log_prompts, max_body_bytes=ns.max_body_size,
        shutdown_timeout=ns.shutdown_timeout)
    args = EngineArgs(**engine_kwargs(ns))
    args.configs()  # validate engine flags before the server starts listening
    return run_server(config, lambda: AsyncEngine.from_engine_args(args, max_queue=config.max_queue))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate completions for prompts (args or stdin lines)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
