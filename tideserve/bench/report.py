"""Per-request records -> summary metrics, the printed table, the saved JSON and the PNG chart.

One record shape serves the HTTP client and the offline engine, so every benchmark (ours against any
server, or offline) is summarised by the same code and lands in the same JSON schema::

    {"tideserve_bench": 1, "kind": "serve" | "offline", "label": ..., "environment": {...},
     "config": {...}, "runs": [{"max_concurrency": ..., "request_rate": ..., "metrics": {...},
                                "records": [...]}, ...]}

A single run has one entry in ``runs``; ``--sweep-concurrency`` adds one per level, and ``bench plot``
draws any number of these files together, one line per label.
"""

from __future__ import annotations

import json
import logging
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start_s`` is relative to the benchmark's start.

    ``itl_s`` holds the gaps between successive streamed chunks (a chunk usually carries one token);
    ``usage_from_server`` says whether the token counts came from the server's usage block or were
    counted with the tokenizer.
    """

    index: int
    success: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    start_s: float = 0.0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    usage_from_server: bool = False
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Decode time per token after the first: (E2E - TTFT) / (tokens - 1), as vLLM defines it."""
        if not self.success or self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tpot_s": self.tpot_s}


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 in milliseconds; ``None`` for an empty list (e.g. no ITL offline)."""
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES if p != 50]
    if not values_s:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.percentile(arr, 50))}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES if p != 50})
    return out


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once, from their start and end times."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.e2el_s is None:
            continue
        events += [(r.start_s, 1), (r.start_s + r.e2el_s, -1)]
    best = cur = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at equal times
        cur += delta
        best = max(best, cur)
    return best


def peak_output_throughput(records: list[RequestRecord]) -> float:
    """Most output tokens streamed in any one-second bucket (a chunk counts as one token)."""
    buckets: dict[int, int] = {}
    for r in records:
        if not r.success or r.ttft_s is None:
            continue
        t = r.start_s + r.ttft_s
        buckets[int(t)] = buckets.get(int(t), 0) + 1
        for gap in r.itl_s:
            t += gap
            buckets[int(t)] = buckets.get(int(t), 0) + 1
    return float(max(buckets.values(), default=0))


def compute_metrics(records: list[RequestRecord], duration_s: float, *,
                    max_concurrency: int | None = None, request_rate: float = math.inf) -> dict[str, Any]:
    """The summary block of a run. Throughputs count successful requests only, over the whole duration."""
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "max_concurrency": max_concurrency,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "peak_output_throughput": peak_output_throughput(ok),
        "peak_concurrent_requests": peak_concurrency(records),
        "usage_from_server": bool(ok) and all(r.usage_from_server for r in ok),
    }
    metrics["ttft_ms"] = latency_stats([r.ttft_s for r in ok if r.ttft_s is not None])
    metrics["tpot_ms"] = latency_stats([t for r in ok if (t := r.tpot_s) is not None])
    metrics["itl_ms"] = latency_stats([g for r in ok for g in r.itl_s])
    metrics["e2el_ms"] = latency_stats([r.e2el_s for r in ok if r.e2el_s is not None])
    errors = sorted({r.error for r in records if r.error})
    if errors:
        metrics["errors"] = errors[:10]
    return metrics


def make_run(records: list[RequestRecord], duration_s: float, *, max_concurrency: int | None,
             request_rate: float = math.inf) -> dict[str, Any]:
    """One entry of a result file's ``runs``."""
    return {
        "max_concurrency": max_concurrency,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "metrics": compute_metrics(records, duration_s, max_concurrency=max_concurrency,
                                   request_rate=request_rate),
        "records": [r.to_dict() for r in records],
    }


def environment() -> dict[str, str]:
    """Machine and versions, so a saved result says where it was measured."""
    import os

    env = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
           "cpus": str(os.cpu_count()), "python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = str(torch.get_num_threads())
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        env["tideserve"] = version("tideserve")
    except PackageNotFoundError:
        pass
    return env


def make_result(kind: str, label: str, config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tideserve_bench": SCHEMA_VERSION, "kind": kind, "label": label,
            "environment": environment(), "config": config, "runs": runs}


def save_result(result: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    logger.info("saved benchmark result to %s", path)


def load_result(path: str | Path) -> dict[str, Any]:
    """A saved result file; a clear error for anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read benchmark result {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        # A user's wrong file: a ValueError, reported like every other CLI error.
        raise ValueError(  # noqa: TRY004
            f"{str(path)!r} is not a tideserve bench result (no 'runs' list); save one with --save-result.")
    return data


# ---------------------------------------------------------------------------------------- text
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_metrics(metrics: dict[str, Any], title: str = "Benchmark Result") -> str:
    """A readable block in the layout of ``vllm bench serve``, with p90 and E2E added."""
    width = 52
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<40}{_fmt(value, digits):>12}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Maximum request concurrency:", metrics["max_concurrency"])
    row("Request rate configured (RPS):", metrics["request_rate"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Peak output token throughput (tok/s):", metrics["peak_output_throughput"])
    row("Peak concurrent requests:", metrics["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    row("Token counts exact (usage or engine):", "yes" if metrics["usage_from_server"] else "no")
    for key in LATENCY_METRICS:
        stats = metrics[f"{key}_ms"]
        lines.append(f"{' ' + LATENCY_TITLES[key] + ' ':-^{width}}")
        upper = key.upper()
        row(f"Mean {upper} (ms):", stats["mean"])
        row(f"Median {upper} (ms):", stats["median"])
        for p in PERCENTILES:
            if p != 50:
                row(f"P{p} {upper} (ms):", stats[f"p{p}"])
    for err in metrics.get("errors", []):
        lines.append(f"error: {err}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(result: dict[str, Any]) -> str:
    """One line per concurrency level: the numbers a sweep is run for."""
    head = (f"{'concurrency':>11} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
            f"{'p50 TTFT':>9} {'p99 TTFT':>9} {'p99 TPOT':>9} {'p99 E2E':>9}")
    lines = [f"{result.get('label', '')} (latencies in ms)", head]
    for run in result["runs"]:
        m = run["metrics"]
        lines.append(f"{_fmt(run['max_concurrency']):>11} {m['completed']:>5} {m['failed']:>5} "
                     f"{m['request_throughput']:>8.2f} {m['output_throughput']:>10.1f} "
                     f"{_fmt(m['ttft_ms']['median'], 1):>9} {_fmt(m['ttft_ms']['p99'], 1):>9} "
                     f"{_fmt(m['tpot_ms']['p99'], 1):>9} {_fmt(m['e2el_ms']['p99'], 1):>9}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plot
def set_concurrency_axis(ax: Any, ticks: list[int]) -> None:
    """Log-2 x axis labelled with the concurrency levels themselves (1, 8, 32), not powers of two."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())


def plot_results(results: list[dict[str, Any]], output: str | Path, title: str | None = None) -> Path:
    """Output tok/s and p99 TTFT / TPOT against concurrency, one line per labelled result."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or in CI
    import matplotlib.pyplot as plt

    panels = [("output_throughput", None, "output tok/s"), ("ttft_ms", "p99", "p99 TTFT (ms)"),
              ("tpot_ms", "p99", "p99 TPOT (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for i, result in enumerate(results):
        runs = [r for r in result["runs"] if r["metrics"]["completed"] > 0]
        # Unbounded concurrency plots at the number of requests, which is what it means in practice.
        xs = [r["max_concurrency"] or r["metrics"]["completed"] + r["metrics"]["failed"] for r in runs]
        label = result.get("label") or f"result {i + 1}"
        for ax, (key, sub, ylabel) in zip(axes, panels):
            ys = [r["metrics"][key][sub] if sub else r["metrics"][key] for r in runs]
            pts = [(x, y) for x, y in sorted(zip(xs, ys)) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_ylabel(ylabel)
    ticks = sorted({r["max_concurrency"] or r["metrics"]["completed"] + r["metrics"]["failed"]
                    for result in results for r in result["runs"]})
    for ax, (_, _, ylabel) in zip(axes, panels):
        ax.set_xlabel("max concurrency")
        set_concurrency_axis(ax, ticks)
        ax.set_title(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    logger.info("wrote chart %s", output)
    return output
