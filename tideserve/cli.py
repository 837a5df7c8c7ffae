"""Command line: ``tideserve generate`` and ``tideserve chat``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tideserve.sampling_params import SamplingParams


def _size(text: str) -> int:
    """'4GiB', '512MiB', '2GB' or a plain byte count."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory or hub id (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--allow-long-max-model-len", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=_size, default=None, help="fixed KV pool size, e.g. 4GiB")
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    keys = ["model", "dtype", "device", "max_model_len", "allow_long_max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "enable_chunked_prefill", "block_size", "num_blocks",
            "kv_cache_memory", "enable_prefix_caching", "seed"]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
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
