"""``tideserve bench serve | offline | plot``: argument parsing and the printed report.

Heavy imports (httpx, torch, matplotlib) happen inside the commands so ``tideserve --help`` stays fast.
The engine flags of ``bench offline`` are the ones ``tideserve generate`` takes (both add them with
tideserve/cli_engine_args.py, so the two never drift apart).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from tideserve.cli_engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


def _concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16,64; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1; got {text!r}")
    return levels


def _add_dataset_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    from tideserve.bench.datasets import DATASETS

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=DATASETS,
                   help="random: random token ids decoded to text (vLLM's random dataset); mixed: prompt "
                        "20-1000 / output 16-512 tokens, log-uniform; prompts-file: --dataset-path; editing: "
                        "chat requests to rewrite a short file with one change (output copies the prompt); "
                        "questions: open-ended chat questions (use --endpoint chat with these two)")
    g.add_argument("--dataset-path", default=None, help="prompts file: one prompt per line, or JSONL "
                                                        "with 'prompt' (and optional 'output_len')")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=256, help="random dataset: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from len*(1-r) .. len*(1+r)")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="random dataset: tokens of one shared prefix in front of every prompt")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="dataset and arrival-time seed")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly --output-len tokens (default: on for random/mixed, off for files)")
    g.add_argument("--temperature", type=float, default=0.0)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--warmup", type=int, default=0, help="untimed requests sent first")
    g.add_argument("--sweep-concurrency", type=_concurrency_list, default=None, metavar="1,4,16,64",
                   help="run once per max-concurrency level (overrides --max-concurrency)")
    g.add_argument("--save-result", default=None, metavar="OUT.json", help="JSON with per-request records")
    g.add_argument("--label", default=None, help="name of this run in plots and the JSON")
    g.add_argument("--plot", default=None, metavar="OUT.png", help="chart of the run(s)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_subcommands(sub: Any) -> None:
    """Register ``bench`` and its three subcommands on the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmark a server (any OpenAI-compatible) or the offline engine")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bsub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP (streaming)")
    t = serve.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    t.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory used to build prompts and to count tokens when the "
                        "server sends no usage (default: --model if it is a local path, else the embedded "
                        "SmolLM2)")
    t.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    t.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for the server to answer a test request")
    _add_dataset_args(serve, with_seed=True)
    _add_run_args(serve)
    serve.set_defaults(func=cmd_bench_serve)

    offline = bsub.add_parser("offline", help="throughput of the engine in-process (LLM.generate's loop)")
    add_engine_args(offline)  # its --seed seeds the dataset too
    _add_dataset_args(offline, with_seed=False)
    _add_run_args(offline)
    offline.set_defaults(func=cmd_bench_offline)

    plot = bsub.add_parser("plot", help="chart saved results: tok/s and p99 TTFT/TPOT vs concurrency")
    plot.add_argument("results", nargs="+", help="JSON files written by --save-result")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    plot.add_argument("--title", default=None)
    plot.set_defaults(func=cmd_bench_plot)


def _dataset_config(ns: argparse.Namespace) -> dict[str, Any]:
    from tideserve.bench.datasets import ignore_eos_default

    ignore_eos = ns.ignore_eos if ns.ignore_eos is not None else ignore_eos_default(ns.dataset)
    return {"dataset": ns.dataset, "dataset_path": ns.dataset_path, "num_prompts": ns.num_prompts,
            "input_len": ns.input_len, "output_len": ns.output_len, "range_ratio": ns.range_ratio,
            "prefix_len": ns.prefix_len, "seed": ns.seed, "ignore_eos": ignore_eos,
            "temperature": ns.temperature}


def _build_requests(tokenizer: Any, cfg: dict[str, Any]) -> list:
    from tideserve.bench.datasets import build_requests

    return build_requests(tokenizer, cfg["dataset"], cfg["num_prompts"], input_len=cfg["input_len"],
                          output_len=cfg["output_len"], range_ratio=cfg["range_ratio"], seed=cfg["seed"],
                          prefix_len=cfg["prefix_len"], dataset_path=cfg["dataset_path"])


def _levels(ns: argparse.Namespace) -> list[int | None]:
    return list(ns.sweep_concurrency) if ns.sweep_concurrency else [ns.max_concurrency]


def _finish(result: dict[str, Any], ns: argparse.Namespace) -> int:
    """Print the table(s), save the JSON, draw the chart."""
    from tideserve.bench.report import format_metrics, format_sweep, plot_results, save_result

    for run in result["runs"]:
        print(format_metrics(run["metrics"], title=f"bench {result['kind']}: {result['label']}"))
    if len(result["runs"]) > 1:
        print(format_sweep(result))
    if ns.save_result:
        save_result(result, ns.save_result)
        print(f"saved {ns.save_result}")
    if ns.plot:
        plot_results([result], ns.plot, title=result["label"])
        print(f"wrote {ns.plot}")
    failed = sum(run["metrics"]["failed"] for run in result["runs"])
    completed = sum(run["metrics"]["completed"] for run in result["runs"])
    return 1 if completed == 0 and failed else 0


def _tokenizer_path(ns: argparse.Namespace) -> str:
    if ns.tokenizer:
        return ns.tokenizer
    if ns.model and Path(ns.model).expanduser().exists():
        return str(Path(ns.model).expanduser())
    from tideserve.model.loader import default_model_path

    return default_model_path()


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from tideserve.bench.report import make_result
    from tideserve.bench.serve import ServeBenchConfig, discover_model, run_serve_benchmark
    from tideserve.tokenizer.tokenizer import load_tokenizer

    model = ns.model or discover_model(ns.base_url, ns.api_key)
    tok_path = _tokenizer_path(ns)
    logger.info("tokenizer for prompts and token counts: %s", tok_path)
    tokenizer = load_tokenizer(tok_path)
    data_cfg = _dataset_config(ns)
    requests = _build_requests(tokenizer, data_cfg)
    runs = []
    for level in _levels(ns):
        cfg = ServeBenchConfig(base_url=ns.base_url, model=model, endpoint=ns.endpoint, max_concurrency=level,
                               request_rate=ns.request_rate, seed=ns.seed, ignore_eos=data_cfg["ignore_eos"],
                               temperature=ns.temperature, warmup=ns.warmup, api_key=ns.api_key,
                               request_timeout_s=ns.request_timeout, ready_timeout_s=ns.ready_timeout,
                               progress=not ns.disable_tqdm)
        runs.append(run_serve_benchmark(requests, cfg, tokenizer))
    config = data_cfg | {"base_url": ns.base_url, "model": model, "endpoint": ns.endpoint,
                         "request_rate": "inf" if math.isinf(ns.request_rate) else ns.request_rate,
                         "warmup": ns.warmup, "tokenizer": tok_path, "command": " ".join(sys.argv)}
    return _finish(make_result("serve", ns.label or model, config, runs), ns)


def cmd_bench_offline(ns: argparse.Namespace) -> int:
    from tideserve.bench.offline import run_offline_benchmark
    from tideserve.bench.report import make_result
    from tideserve.engine.llm import LLM

    kwargs = engine_kwargs(ns)
    llm = LLM(**kwargs)
    data_cfg = _dataset_config(ns)
    requests = _build_requests(llm.tokenizer, data_cfg)
    runs = [run_offline_benchmark(llm, requests, max_concurrency=level, ignore_eos=data_cfg["ignore_eos"],
                                  temperature=ns.temperature, warmup=ns.warmup,
                                  progress=not ns.disable_tqdm)
            for level in _levels(ns)]
    engine = {k: str(v) for k, v in kwargs.items()} | {"model_path": str(llm.engine.model_path),
                                                       "resolved_dtype": str(llm.engine.dtype)}
    config = data_cfg | {"engine": engine, "warmup": ns.warmup, "command": " ".join(sys.argv)}
    label = ns.label or f"tideserve offline ({Path(str(llm.engine.model_path)).stem})"
    return _finish(make_result("offline", label, config, runs), ns)


def cmd_bench_plot(ns: argparse.Namespace) -> int:
    from tideserve.bench.report import load_result, plot_results

    results = [load_result(path) for path in ns.results]
    for path, result in zip(ns.results, results):
        result.setdefault("label", Path(path).stem)
    plot_results(results, ns.output, title=ns.title)
    print(f"wrote {ns.output}")
    return 0
