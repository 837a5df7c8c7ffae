"""tideserve against its peers, in one run, on the same model file, prompts, output lengths and dtype.

Engines (each skipped with a note when it cannot run here):
  tideserve-offline  the engine in-process (tideserve bench offline's loop), prefix caching on
  tideserve-serve    `tideserve serve` as a subprocess, measured over HTTP by `tideserve bench serve`'s client
  hf-static          transformers generate() on padded batches of `concurrency` prompts
  hf-cb              transformers' continuous batching (ContinuousBatchingManager), if installed
  llama-server       llama.cpp's OpenAI server (--llama-server PATH or on PATH), one slot per request

Workloads:
  fixed          random prompts (input-len +-50%), exactly 128 output tokens
  mixed          prompt 20-1000 and output 16-512 tokens, log-uniform, seeded: static batching pays for
                 its stragglers
  shared-prefix  64 requests sharing one 500-token system prompt (prefix caching), 128 output tokens

Every engine sees the same token ids (servers get the text that encodes to them), ignores EOS and is
greedy. "Concurrency C" means at most C requests in flight; latencies run from a request's submission.
The ratio column is the engine's output tok/s over tideserve's in the same mode (in-process peers against
tideserve-offline, HTTP peers against tideserve-serve).

    .venv/bin/python benchmarks/compare.py --quick --out out/compare-quick.md       # smoke run, minutes
    .venv/bin/python benchmarks/compare.py                                          # full run, hours on CPU

Writes a markdown table (also printed), a JSON file with every number and a PNG chart next to it
(default out/compare-<date>.{md,json,png}; out/ is ignored by git).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, machine.py, when run from anywhere
import machine
import peers

from tideserve.bench.datasets import SampleRequest, mixed_requests, random_requests
from tideserve.bench.launch import ServerProcess, free_port
from tideserve.bench.report import compute_metrics, environment, set_concurrency_axis

logger = logging.getLogger("compare")

ENGINES = ("tideserve-offline", "hf-static", "hf-cb", "tideserve-serve", "llama-server")
HTTP_ENGINES = {"tideserve-serve", "llama-server"}
WORKLOADS = ("fixed", "mixed", "shared-prefix")
DEFAULT_LEVELS = "1,8,32,64"


@dataclasses.dataclass
class Sizes:
    """Workload shapes; --quick shrinks them to a smoke run."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    mixed_input: tuple[int, int] = (20, 1000)
    mixed_output: tuple[int, int] = (16, 512)
    prefix_len: int = 500
    prefix_suffix_len: int = 64


QUICK = Sizes(num_prompts=4, input_len=32, output_len=16, mixed_input=(20, 200), mixed_output=(8, 32),
              prefix_len=500, prefix_suffix_len=16)


def build_workloads(tokenizer: Any, names: list[str], sizes: Sizes,
                    seed: int) -> dict[str, list[SampleRequest]]:
    out: dict[str, list[SampleRequest]] = {}
    for name in names:
        if name == "fixed":
            reqs = random_requests(tokenizer, sizes.num_prompts, sizes.input_len, sizes.output_len, 0.5, seed)
            out[name] = [dataclasses.replace(r, output_len=sizes.output_len) for r in reqs]
        elif name == "mixed":
            out[name] = mixed_requests(tokenizer, sizes.num_prompts, seed, sizes.mixed_input,
                                       sizes.mixed_output)
        elif name == "shared-prefix":
            reqs = random_requests(tokenizer, sizes.num_prompts, sizes.prefix_suffix_len, sizes.output_len,
                                   0.5, seed, prefix_len=sizes.prefix_len)
            out[name] = [dataclasses.replace(r, output_len=sizes.output_len) for r in reqs]
        else:
            raise ValueError(f"workload {name!r} is not one of {', '.join(WORKLOADS)}")
    return out


# --------------------------------------------------------------------------------------------- engines
Runner = Callable[[list[SampleRequest], int], dict[str, Any]]


def _summary(records: list, duration: float, concurrency: int) -> dict[str, Any]:
    return compute_metrics(records, duration, max_concurrency=concurrency)


def prompts_at(args: argparse.Namespace, total: int, concurrency: int) -> int:
    """How many of a workload's requests run at one concurrency level.

    All of them unless --prompts-per-slot is set; then K requests per slot (at least --min-prompts), so a
    sweep's low-concurrency cells do not take hours on a small CPU. The first N requests are used, so
    every engine sees the same ones.
    """
    if not getattr(args, "prompts_per_slot", 0):
        return total
    return min(total, max(args.min_prompts, args.prompts_per_slot * concurrency))


def measure(engine: str, runner: Runner, workloads: dict[str, list[SampleRequest]], levels: list[int],
            rows: list[dict[str, Any]], args: argparse.Namespace | None = None) -> None:
    """Warm the engine up once, then run every workload at every concurrency level."""
    first = next(iter(workloads.values()))
    runner([dataclasses.replace(r, output_len=min(r.output_len, 4)) for r in first[:2]], 2)  # warmup
    for name, reqs in workloads.items():
        for c in levels:
            t0 = time.perf_counter()
            metrics = runner(reqs[:prompts_at(args, len(reqs), c)] if args else reqs, c)
            logger.info("%s %s c=%d: %.1f output tok/s, %d ok, %d failed (%.0fs)", engine, name, c,
                        metrics["output_throughput"], metrics["completed"], metrics["failed"],
                        time.perf_counter() - t0)
            rows.append({"engine": engine, "workload": name, "concurrency": c, "metrics": metrics})


def run_tideserve_offline(args: argparse.Namespace, workloads: dict, levels: list[int], rows: list) -> None:
    from tideserve import LLM
    from tideserve.bench.offline import run_offline_benchmark

    llm = LLM(args.model, dtype=args.tideserve_dtype, max_num_seqs=max(levels), enable_prefix_caching=True,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)

    def runner(reqs: list[SampleRequest], c: int) -> dict[str, Any]:
        return run_offline_benchmark(llm, reqs, max_concurrency=c, ignore_eos=True, progress=False)["metrics"]

    measure("tideserve-offline", runner, workloads, levels, rows, args)


def run_hf(args: argparse.Namespace, workloads: dict, levels: list[int], rows: list, engines: list[str],
           notes: list[str]) -> None:
    model = peers.load_hf_model(args.model, args.hf_torch_dtype)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)

    def static(reqs: list[SampleRequest], c: int) -> dict[str, Any]:
        return _summary(*peers.run_hf_static(model, pad, reqs, c), c)

    def continuous(reqs: list[SampleRequest], c: int) -> dict[str, Any]:
        return _summary(*peers.run_hf_continuous(model, reqs, c, args.max_num_batched_tokens), c)

    if "hf-static" in engines:
        measure("hf-static", static, workloads, levels, rows, args)
    if "hf-cb" in engines:
        if peers.has_continuous_batching(model):
            measure("hf-cb", continuous, workloads, levels, rows, args)
        else:
            notes.append("hf-cb skipped: this transformers has no continuous batching (generate_batch).")


def _http_runner(base_url: str, model: str) -> Runner:
    from tideserve.bench.serve import ServeBenchConfig, run_serve_benchmark

    def runner(reqs: list[SampleRequest], c: int) -> dict[str, Any]:
        cfg = ServeBenchConfig(base_url=base_url, model=model, endpoint="completions", max_concurrency=c,
                               ignore_eos=True, progress=False, ready_timeout_s=300)
        return run_serve_benchmark(reqs, cfg)["metrics"]  # usage from the server; no tokenizer fallback

    return runner


def run_tideserve_serve(args: argparse.Namespace, workloads: dict, levels: list[int], rows: list,
                        notes: list[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("tideserve.serve.openai.server") is None:
        notes.append("tideserve-serve skipped: tideserve.serve.openai.server is not installed yet.")
        return
    from tideserve.bench.serve import discover_model

    port = free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", args.model, "--dtype", args.tideserve_dtype, "--max-num-seqs", str(max(levels)),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enable-prefix-caching",
           "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype, *args.tideserve_arg]
    args.commands.append(" ".join(cmd))
    with ServerProcess(cmd, port, env=_thread_env(args.threads), name="tideserve-serve") as srv:
        runner = _http_runner(srv.base_url, discover_model(srv.base_url))
        for c in levels:  # one server for all levels: its peak RSS is noted after each (cumulative)
            start = len(rows)
            measure("tideserve-serve", runner, workloads, [c], rows, args)
            note_rss(rows, start, srv)


def run_llama_server(args: argparse.Namespace, workloads: dict, levels: list[int], rows: list,
                     notes: list[str]) -> None:
    binary = args.llama_server or shutil.which("llama-server")
    if not binary:
        notes.append("llama-server skipped: no binary (pass --llama-server PATH; "
                     "docs/benchmarks.md says how to build one).")
        return
    if not Path(args.model).is_file():
        notes.append(f"llama-server skipped: it needs a GGUF file, and {args.model} is not one.")
        return
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False)
        args.versions["llama-server"] = (version.stdout + version.stderr).strip().splitlines()[-1:]
    except (OSError, subprocess.SubprocessError) as exc:
        notes.append(f"llama-server skipped: {binary} --version failed ({exc}).")
        return
    ctx = max(r.prompt_len + r.output_len for reqs in workloads.values() for r in reqs) + 16
    for c in levels:  # slots are fixed at start, so one server per concurrency level
        port = free_port()
        cmd = peers.llama_server_command(binary, args.model, port, c, ctx, args.threads,
                                         no_repack="amx_tile" in args.machine["flags"])
        args.commands.append(" ".join(cmd))
        with ServerProcess(cmd, port, ready_path="/health", name="llama-server") as srv:
            start = len(rows)
            measure("llama-server", _http_runner(srv.base_url, "llama"), workloads, [c], rows, args)
            note_rss(rows, start, srv)


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident memory so far (VmHWM), in MiB; None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def note_rss(rows: list[dict[str, Any]], start: int, srv: Any) -> None:
    """Record the server's peak RSS so far on the rows measured since ``start`` (the server is still up)."""
    rss = peak_rss_mib(srv.proc.pid) if srv.proc is not None else None
    for r in rows[start:]:
        r["server_peak_rss_mib"] = rss


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# --------------------------------------------------------------------------------------------- report
def _ms(stats: dict[str, Any], key: str) -> str:
    v = stats.get(key)
    return "-" if v is None else f"{v:.0f}"


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, engine): over several rounds, the round with the median output
    tok/s (the lower middle one of an even count), so every column of a cell comes from one real run."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["concurrency"], r["engine"]), []).append(r)
    picked = []
    for runs in cells.values():
        runs = sorted(runs, key=lambda r: r["metrics"]["output_throughput"])
        picked.append(runs[(len(runs) - 1) // 2])
    return picked


def build_rounds_table(rows: list[dict[str, Any]]) -> str:
    """Every round's output tok/s per cell, and each round's ratio of an HTTP peer to tideserve-serve (and
    an in-process one to tideserve-offline), with their median and spread; empty for a single round."""
    rounds = sorted({r.get("round", 1) for r in rows})
    if len(rounds) < 2:
        return ""
    tps = {(r["workload"], r["concurrency"], r["engine"], r.get("round", 1)): r["metrics"]["output_throughput"]
           for r in rows}
    lines = ["Every round (output tok/s; the ratio is the peer's over tideserve's in the same round):", "",
             "| workload | conc. | engine | " + " | ".join(f"round {n}" for n in rounds)
             + " | ratio per round | median ratio |",
             "|---|---:|---|" + "---:|" * len(rounds) + "---|---:|"]
    order = {e: i for i, e in enumerate(ENGINES)}
    cells = sorted({(w, c, e) for w, c, e, _ in tps},
                   key=lambda k: (WORKLOADS.index(k[0]), k[1], order[k[2]]))
    for w, c, e in cells:
        base = "tideserve-serve" if e in HTTP_ENGINES else "tideserve-offline"
        values = [tps.get((w, c, e, n)) for n in rounds]
        ratios = [v / tps[(w, c, base, n)] for v, n in zip(values, rounds)
                  if v is not None and tps.get((w, c, base, n))]
        ratio_text = ", ".join(f"{x:.2f}x" for x in ratios) if e != base else "-"
        median = f"{statistics.median(ratios):.2f}x" if ratios and e != base else "-"
        lines.append(f"| {w} | {c} | {e} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in values)
                     + f" | {ratio_text} | {median} |")
    return "\n".join(lines)


def build_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table: every engine at every workload and concurrency, with the ratio to tideserve
    (over several rounds, each cell's median round: median_rows)."""
    rows = median_rows(rows)
    ref = {(r["workload"], r["concurrency"], r["engine"]): r["metrics"]["output_throughput"] for r in rows}
    header = ("| workload | conc. | engine | output tok/s | vs tideserve | TTFT p50 (ms) | TTFT p99 (ms) "
              "| E2E p50 (ms) | E2E p99 (ms) | TPOT p50 (ms) | server peak RSS (MiB) | ok / failed |\n"
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [header]
    order = {e: i for i, e in enumerate(ENGINES)}
    rows = sorted(rows, key=lambda r: (WORKLOADS.index(r["workload"]), r["concurrency"], order[r["engine"]]))
    for r in rows:
        m = r["metrics"]
        base = "tideserve-serve" if r["engine"] in HTTP_ENGINES else "tideserve-offline"
        base_tps = ref.get((r["workload"], r["concurrency"], base))
        ratio = f"{m['output_throughput'] / base_tps:.2f}x" if base_tps else "n/a"
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['engine']} | {m['output_throughput']:.1f} "
                     f"| {ratio} | {_ms(m['ttft_ms'], 'median')} | {_ms(m['ttft_ms'], 'p99')} "
                     f"| {_ms(m['e2el_ms'], 'median')} | {_ms(m['e2el_ms'], 'p99')} "
                     f"| {_ms(m.get('tpot_ms', {}), 'median')} | {_ms(r, 'server_peak_rss_mib')} "
                     f"| {m['completed']} / {m['failed']} |")
    return "\n".join(lines)


def draw_chart(rows: list[dict[str, Any]], workloads: list[str], path: Path) -> None:
    """Output tok/s (top) and p99 TTFT (bottom) against concurrency, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 8), squeeze=False)
    for col, wl in enumerate(workloads):
        for engine in ENGINES:
            pts = sorted((r["concurrency"], r["metrics"]) for r in rows
                         if r["workload"] == wl and r["engine"] == engine and r["metrics"]["completed"])
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0][col].plot(xs, [p[1]["output_throughput"] for p in pts], marker="o", label=engine)
            axes[1][col].plot(xs, [p[1]["ttft_ms"]["p99"] for p in pts], marker="o", label=engine)
        axes[0][col].set_title(f"{wl}: output tok/s")
        axes[1][col].set_title(f"{wl}: p99 TTFT (ms)")
        for ax in (axes[0][col], axes[1][col]):
            set_concurrency_axis(ax, sorted({r["concurrency"] for r in rows}))
            ax.set_xlabel("concurrency")
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DEFINITIONS = (
    "Concurrency C = at most C requests in flight (static batching: batches of C). Latencies are from a "
    "request's submission. *vs tideserve* = output tok/s over tideserve's in the same mode (in-process "
    "peers vs tideserve-offline, HTTP peers vs tideserve-serve). EOS is ignored everywhere; output tok/s "
    "counts requested tokens only (static batching's extra steps for shorter requests are not output). "
    "llama.cpp computes on the GGUF's quantized weights; the others dequantize them to the dtype above."
)


def write_report(args: argparse.Namespace, rows: list, notes: list[str], workloads: dict, out: Path) -> str:
    env = environment() | {k: str(v) for k, v in args.versions.items()}
    shapes = []
    for name, reqs in workloads.items():
        ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
        shapes.append(f"- {name}: {len(reqs)} requests, prompt {min(ins)}-{max(ins)} tokens "
                      f"(mean {sum(ins) / len(ins):.0f}), output {min(outs)}-{max(outs)} "
                      f"(mean {sum(outs) / len(outs):.0f})")
    title = f"# tideserve vs peers ({time.strftime('%Y-%m-%d %H:%M')})"
    hf_dtype = str(args.hf_torch_dtype).removeprefix("torch.")
    setup = (f"Model: `{args.model}`, dtype {args.dtype} (transformers: {hf_dtype}), tideserve quantization "
             f"{args.quantization} and KV cache dtype {args.kv_cache_dtype}, {args.threads} CPU thread(s) per engine, "
             f"max_num_batched_tokens {args.max_num_batched_tokens}, seed {args.seed}.")
    if getattr(args, "prompts_per_slot", 0):
        shapes.append(f"- at each concurrency level C only the first min(N, max({args.min_prompts}, "
                      f"{args.prompts_per_slot} x C)) requests of a workload run (--prompts-per-slot); the "
                      f"table's last column counts them")
    text = [title + (" — quick smoke run, numbers not meaningful" if args.quick else ""), "",
            f"Command: `{' '.join(sys.argv)}`", "", setup, "",
            "Machine and versions: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
            "Machine summary: " + machine.markdown(args.machine), "",
            "Workloads:", *shapes, "", DEFINITIONS, "", build_table(rows), ""]
    rounds_table = build_rounds_table(rows)
    if rounds_table:
        text += [f"{args.rounds} rounds, engines in alternating order; the table above shows each cell's median "
                 "round.", "", rounds_table, ""]
    if notes:
        text += ["Notes:", *[f"- {n}" for n in notes], ""]
    if args.commands:
        text += ["Servers were started with:", *[f"- `{c}`" for c in args.commands], ""]
    text.append(f"![chart]({out.with_suffix('.png').name})")
    return "\n".join(text) + "\n"


def merge_rows(paths: list[str], rows: list[dict[str, Any]], notes: list[str]) -> None:
    """Add earlier runs' cells that this run did not measure, each noted with the run it came from."""
    have = {(r["workload"], r["concurrency"], r["engine"]) for r in rows}
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        added = [r for r in earlier["rows"] if (r["workload"], r["concurrency"], r["engine"]) not in have]
        for r in added:
            have.add((r["workload"], r["concurrency"], r["engine"]))
            rows.append(r | {"source": Path(path).name})
        levels = sorted({r["concurrency"] for r in added})
        notes.append(f"{len(added)} cells (concurrency {', '.join(map(str, levels))}) come from an earlier run, "
                     f"{Path(path).name}: `{' '.join(earlier.get('command', []))}`")


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="one dtype for every engine (auto: what tideserve picks)")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"],
                    help="tideserve's --quantization (peers keep their own weights)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="tideserve's --kv-cache-dtype")
    ap.add_argument("--tideserve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for tideserve serve "
                         "(repeat it: --tideserve-arg=--num-blocks --tideserve-arg=4096)")
    ap.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: --dtype's)")
    ap.add_argument("--concurrency", default=DEFAULT_LEVELS, help="comma-separated levels")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per workload (64; quick: 4)")
    ap.add_argument("--prompts-per-slot", type=int, default=0,
                    help="run K requests per concurrency slot (at least --min-prompts, at most --num-prompts) "
                         "instead of all of them at every level")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--merge", nargs="*", default=[],
                    help="JSON files of earlier runs whose rows join the table and chart (this run's rows "
                         "win where both have a cell)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: torch's)")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary (default: PATH)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny workloads, concurrency 1,4: a smoke run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, in alternating order; the table shows each cell's "
                         "median round and a second table every round's throughput and ratio")
    ap.add_argument("--out", default=None, help="markdown output (default out/compare-<date>.md)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tideserve.model.loader import resolve_dtype, resolve_model_path
    from tideserve.tokenizer.tokenizer import load_tokenizer

    path, _ = resolve_model_path(args.model)
    args.model = str(path)
    # tideserve gets the dtype as given: "auto" also lets --quantization auto keep a quantized GGUF's
    # blocks, which an explicit float dtype would dequantize.
    args.tideserve_dtype = args.dtype
    args.torch_dtype = resolve_dtype(args.dtype, "cpu")
    args.dtype = str(args.torch_dtype).removeprefix("torch.")  # pin "auto" so every peer gets the same
    args.hf_torch_dtype = getattr(torch, args.hf_dtype) if args.hf_dtype else args.torch_dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    args.commands, args.versions = [], {}
    hidden, intermediate = machine.model_shape(args.model)
    args.machine = machine.describe(hidden, intermediate, args.threads)  # CPU flags, measured matmul ceiling
    logger.info("%s", machine.markdown(args.machine))
    import transformers

    args.versions["transformers"] = transformers.__version__
    sizes = dataclasses.replace(QUICK if args.quick else Sizes())
    if args.num_prompts:
        sizes.num_prompts = args.num_prompts
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.quick and args.concurrency == DEFAULT_LEVELS:
        levels = [1, 4]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    workloads = build_workloads(load_tokenizer(args.model), names, sizes, args.seed)

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    steps: list[tuple[str, Callable[[], None]]] = [
        ("tideserve-offline", lambda: run_tideserve_offline(args, workloads, levels, rows)),
        ("hf", lambda: run_hf(args, workloads, levels, rows, engines, notes)),
        ("tideserve-serve", lambda: run_tideserve_serve(args, workloads, levels, rows, notes)),
        ("llama-server", lambda: run_llama_server(args, workloads, levels, rows, notes)),
    ]
    for round_no in range(args.rounds):
        # Every other round runs the engines in the opposite order, so a drift of the host (memory
        # bandwidth on a shared VM moves by 2x over minutes) does not always favour the same engine.
        for name, step in steps if round_no % 2 == 0 else steps[::-1]:
            wanted = {"hf-static", "hf-cb"} & set(engines) if name == "hf" else name in engines
            if not wanted:
                continue
            start = len(rows)
            try:
                step()
                gc.collect()  # free one engine's weights before the next loads
            except Exception as exc:  # one broken peer must not lose the others' numbers
                logger.exception("%s failed", name)
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                notes.append(f"{name} failed (round {round_no + 1}): {type(exc).__name__}: {first_line}")
            for r in rows[start:]:
                r["round"] = round_no + 1

    merge_rows(args.merge, rows, notes)
    out = Path(args.out) if args.out else Path("out") / f"compare-{time.strftime('%Y%m%d-%H%M')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = write_report(args, rows, notes, workloads, out)
    out.write_text(report)
    out.with_suffix(".json").write_text(json.dumps({
        "command": sys.argv, "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "machine": args.machine,
        "environment": environment() | {k: str(v) for k, v in args.versions.items()},
        "levels": levels, "notes": notes, "rows": rows}, indent=2, default=str))
    if rows:
        draw_chart(median_rows(rows), names, out.with_suffix(".png"))
    print(report)
    print(f"wrote {out}, {out.with_suffix('.json')}" + (f", {out.with_suffix('.png')}" if rows else ""))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
