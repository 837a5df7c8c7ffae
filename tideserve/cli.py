"""Command line: ``tideserve serve``, ``tideserve generate``, ``tideserve chat`` and ``tideserve bench``.

``vllm serve`` command lines work with ``vllm`` replaced: the model as a positional argument or
``--model``, vLLM's flag names and size units, global options before or after the subcommand, and
vLLM flags that mean nothing here explained (tideserve/cli_compat.py) instead of failing in argparse.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tideserve import __version__
from tideserve.cli_compat import (
    ENGINE_FLAGS,
    SERVER_FLAGS,
    add_foreign_flags,
    foreign_flag_messages,
    repair_dashes,
    unknown_flag_messages,
)
from tideserve.config import (
    ATTENTION_BACKENDS,
    DTYPE_ALIASES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
)
from tideserve.sampling_params import SamplingParams

logger = logging.getLogger("tideserve.cli")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _size(text: str) -> int:
    """'4GiB', '512MiB', '2GB' or a plain byte count."""
    from tideserve.config import parse_size

    try:
        return int(parse_size(text, "size"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_size(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def add_global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --version, on the top parser and on every subcommand (``serve ... --log-level info``
    works as well as ``--log-level info serve ...``). A subcommand's copy defaults to SUPPRESS, so it does
    not overwrite a value given before the subcommand."""
    default = "INFO" if top else argparse.SUPPRESS
    p.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"logging level: {', '.join(LOG_LEVELS)} (any case; default INFO)")
    p.add_argument("--version", action="version", version=__version__, help="print the version and exit")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory or hub id (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="auto", choices=[*DTYPES, *DTYPE_ALIASES],
                   help="auto: bfloat16 where the device computes it fast, else float32 (half = float16, "
                        "float = float32)")
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", "-q", default="auto", metavar="{" + ",".join(QUANTIZATIONS) + "}",
                   help="auto (default): a quantized GGUF runs on its own blocks (gguf), anything else in float; "
                        "gguf: keep a GGUF file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K) for the native "
                        "kernels; none: dequantize to --dtype (the float reference); int8: int8 GEMMs for every "
                        "linear layer (CPU, fbgemm); int4: 4-bit blocks for every linear layer, quantized at load. "
                        "awq/gptq/fp8 checkpoints cannot be read")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max_model_len: context length in tokens, prompt plus output (default: the model's "
                        "trained context)")
    g.add_argument("--allow-long-max-model-len", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=128, help="max_num_seqs: requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default 2048; without chunked prefill at least max_model_len)")
    g.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_true", default=True,
                   help="on by default, as in vLLM")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="fcfs: arrival order; priority: by each request's priority field (lower first, then "
                        "arrival), preempting lower-priority requests for higher ones")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-adaptive-threads", dest="adaptive_threads", action="store_false",
                   help="keep the intra-op thread count fixed even when other processes take cores")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="auto: cpu-native on the CPU when the native kernels build and the dtypes fit, triton on "
                        "CUDA when triton is installed, else torch (SDPA over gathered blocks, runs anywhere)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM's scripts: no CUDA graphs are captured yet, so steps already run "
                        "eagerly; once graph capture exists on CUDA this turns it off")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="only 1: tensor parallelism is not implemented yet (run one server per device)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="only 1 (not implemented yet)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="only 1: run one server per device behind a load balancer instead")
    kv = p.add_argument_group("KV cache (elastic by default: sized from measurement, grows and shrinks)")
    kv.add_argument("--block-size", type=_block_size, default="auto",
                    help="8, 16, 32, 64, 128 or auto (chosen from the workload)")
    kv.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory",
                    default=None, help="fix the pool at this size: 4GiB, 512M, 2e9 or bytes (static mode)")
    kv.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="fix the pool at this share of device (or host) memory (static mode)")
    kv.add_argument("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=int, default=None,
                    help="fix the pool at this many blocks")
    kv.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="auto: the model's dtype (bfloat16 for a GGUF's own blocks on CPUs with fast bf16); "
                         "bfloat16 holds twice the tokens of float32 per byte and halves the bytes decode "
                         "attention reads")
    kv.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                    default=True)
    kv.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    kv.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    kv.add_argument("--swap-space", default=4.0,
                    help="host memory for swap preemption: 16G, 4GiB, 512M, or a bare number of GiB (default 4)")
    kv.add_argument("--kv-cache-shrink-delay", type=float, default=None, metavar="SECONDS",
                    help="elastic pool: how long usage stays low before the pool gives memory back (default 5)")
    add_foreign_flags(p, ENGINE_FLAGS, "vLLM engine flags with no meaning here (a warning, or an error "
                                       "with the reason)")
    p.set_defaults(_has_engine_args=True)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    keys = ["model", "dtype", "device", "max_model_len", "allow_long_max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy", "block_size", "num_blocks",
            "kv_cache_memory", "gpu_memory_utilization", "kv_cache_dtype", "enable_prefix_caching", "preemption_mode",
            "swap_space", "seed", "quantization", "adaptive_threads", "kv_cache_shrink_delay", "enforce_eager",
            "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "attention_backend"]
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
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM takes it (`tideserve serve MODEL`); same as --model")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, as in a container)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    g.add_argument("--served-model-name", default=None,
                   help="name(s) clients use, comma-separated (default: derived from the model file)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable; default: $TIDESERVE_API_KEY)")
    g.add_argument("--rate-limit", type=int, default=None, help="requests per minute per API key")
    g.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests beyond which new ones get 429")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / top_logprobs / prompt_logprobs a request may ask for")
    g.add_argument("--max-body-size", type=_size, default=16 * 2**20, help="largest request body, e.g. 16MiB")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests")
    g.add_argument("--engine-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="an engine step running longer than this turns /health to 503 (0: never; default 60, "
                        "well above a full-budget CPU step of a 7-8B model)")
    g.add_argument("--log-prompts", action="store_true", help="log prompt text (off: only token counts)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, used instead of the model's "
                        "(a request's chat_template field still wins)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput/KV-usage log lines")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's own log level (access lines are tideserve's)")
    from tideserve.serve.openai.tool_parsers import TOOL_PARSERS

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (Hermes, Qwen2.5), llama3_json (Llama 3.x), "
                        "mistral")
    add_foreign_flags(p, SERVER_FLAGS, "vLLM server flags with no meaning here (a warning, or an error "
                                       "with the reason)")


def server_config(ns: argparse.Namespace):
    from tideserve.serve.config import ServerConfig, api_keys_from

    return ServerConfig(
        host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
        api_keys=api_keys_from(ns.api_key), rate_limit=ns.rate_limit, max_queue=ns.max_queue,
        max_logprobs=ns.max_logprobs, log_prompts=ns.log_prompts, max_body_bytes=ns.max_body_size,
        shutdown_timeout=ns.shutdown_timeout, engine_stall_timeout=ns.engine_stall_timeout,
        uvicorn_log_level=ns.uvicorn_log_level, chat_template=ns.chat_template,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser)


def cmd_serve(ns: argparse.Namespace) -> int:
    from tideserve.engine.async_engine import AsyncEngine
    from tideserve.engine.llm_engine import EngineArgs
    from tideserve.serve.openai.server import run_server

    config = server_config(ns)
    args = EngineArgs(**engine_kwargs(ns))
    args.configs()  # validate engine flags before the server starts listening
    stats_interval = None if ns.disable_log_stats else 5.0
    return run_server(config, lambda: AsyncEngine.from_engine_args(
        args, max_queue=config.max_queue, log_stats_interval=stats_interval))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,chat,bench}")
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
    for p, depth in _all_parsers(parser):
        add_global_options(p, top=depth == 0)
        p.set_defaults(_parser=p)  # the deepest parser a command line reaches: its flags name the typos
    return parser


def _all_parsers(parser: argparse.ArgumentParser, depth: int = 0):
    yield parser, depth
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _all_parsers(child, depth + 1)


@dataclass
class CommandLine:
    """A parsed command line: the namespace, warnings to log once logging is set up, and the errors that
    stop it (all of them at once, so one run shows everything to fix)."""

    ns: argparse.Namespace
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_command_line(argv: Sequence[str] | None = None,
                       parser: argparse.ArgumentParser | None = None) -> CommandLine:
    """Parse and check ``argv`` without running anything: unknown flags, vLLM flags with no meaning here,
    the model given twice, and the engine settings (their ValueError), all collected."""
    parser = parser or build_parser()
    argv, warnings = repair_dashes(sys.argv[1:] if argv is None else argv)
    missing = _missing_subcommand(parser, argv)
    if missing:
        return CommandLine(argparse.Namespace(command=argv[0] if argv else None), warnings, [missing])
    ns, extras = parser.parse_known_args(argv)
    command = " ".join(c for c in (getattr(ns, "command", None), getattr(ns, "bench_command", None)) if c)
    extras = _reclaim_flag_values(ns, argv, extras)
    cl = CommandLine(ns, warnings, unknown_flag_messages(extras, ns._parser, command))
    if not extras:
        _merge_model(cl)
    foreign_warnings, foreign_errors = foreign_flag_messages(ns)
    cl.warnings += foreign_warnings
    cl.errors += foreign_errors
    if getattr(ns, "_has_engine_args", False):
        from tideserve.engine.llm_engine import EngineArgs

        try:
            EngineArgs(**engine_kwargs(ns)).configs()
        except ValueError as exc:
            cl.errors.append(str(exc))
    return cl


def _reclaim_flag_values(ns: argparse.Namespace, argv: Sequence[str], extras: list[str]) -> list[str]:
    """The value of an unknown flag (``--max-num-sqs 256``) is left over too, or even taken as MODEL: drop
    it, so the error is about the flag alone."""
    unknown = {e for e in extras if e.startswith("-") and "=" not in e}
    values = {argv[i] for i in range(1, len(argv)) if argv[i - 1] in unknown and not argv[i].startswith("-")}
    tag = getattr(ns, "model_tag", None)
    if tag is not None and tag in values:
        ns.model_tag = None
    return [e for e in extras if e not in values]


def _missing_subcommand(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """``tideserve bench --model M`` (vLLM's seeds write it so): say which subcommands exist, instead of
    argparse's "invalid choice: 'M'"."""
    choices = _subcommands(parser)
    words = [t for t in argv if not t.startswith("-")]
    if not words or words[0] not in choices:
        return None
    child = choices[words[0]]
    nested = _subcommands(child)
    rest = list(argv[list(argv).index(words[0]) + 1:])
    if not nested or not rest or rest[0] in nested or rest[0] in ("-h", "--help", "--version"):
        return None
    names = ", ".join(nested)
    return (f"tideserve {words[0]} needs a subcommand before its flags: one of {names} "
            f"(e.g. tideserve {words[0]} {next(iter(nested))} {' '.join(rest[:2])} ...).")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _merge_model(cl: CommandLine) -> None:
    """``serve MODEL`` and ``serve --model MODEL`` mean the same; two different models are an error."""
    ns = cl.ns
    tag = getattr(ns, "model_tag", None)
    if tag is None:
        return
    if ns.model is not None and ns.model != tag:
        cl.errors.append(f"the model is given twice, as MODEL {tag!r} and as --model {ns.model!r}; "
                         "give it once.")
        return
    ns.model = tag


def main(argv: Sequence[str] | None = None) -> int:
    cl = parse_command_line(argv)
    if cl.errors:
        prog = " ".join(p for p in ("tideserve", getattr(cl.ns, "command", None),
                                    getattr(cl.ns, "bench_command", None)) if p)
        for message in cl.errors:
            print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cl.ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for message in cl.warnings:
        logger.warning(message)
    try:
        return cl.ns.func(cl.ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
