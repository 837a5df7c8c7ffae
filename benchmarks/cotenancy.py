"""Co-tenancy: two real ``tideserve serve`` processes in ONE memory cgroup, bursting in turn and at once.

A bursts while B idles, then B while A idles (A, B, A, B: the shape kvcached reports for two instances on
one GPU), in three modes with the same prompts and client: ``elastic`` (default pools, short shrink
delay: the bursting server grows into what the idle one gave back), ``static`` (a half split,
``--kv-cache-memory X`` each, X = 0.97 R / 2) and ``static-swap`` (KV 2/3 X plus swap 1/3 X each). A
fourth mode, ``joint``, has both elastic servers burst at the same moment, so together they want twice
the room the limit leaves: neither may be killed and no request may fail (the engines share the
headroom through their memory ledger and preempt or wait instead).
Memory, not compute, must bind, so the limit is measured: the working set of both servers started,
warmed and idle, less their KV pools (taken again in each mode once its servers are warm; the elastic
pair, calibrated first with no limit, gives the rest) + their idle floors + R + both activation peaks +
the safety margin (from the logs), where the KV room R holds one whole burst, N (P + O) tokens of KV plus
slack, while R / 2 cannot hold all N prompts. Reported per mode: burst TTFT mean / p99, output tok/s,
preemptions, swap-ins, OOM kills, failures, seconds until the bursting pool was back at its floor, peak
pools and cgroup usage.

Needs root and a writable memory cgroup (v1 or v2); a child of this process's own one is created and
removed at the end. Reproduce (10-20 minutes on 2 cores) with:

    .venv/bin/python benchmarks/cotenancy.py --out out/cotenancy.json

``--device cuda``: the two servers share one GPU instead (``CUDA_VISIBLE_DEVICES`` picks it), and there is
no cgroup. The limit is held by this process: a ballast tensor of the device's size less the limit, so the
servers' free memory ends where the limit says (usage = everything on the device but the ballast, read
with ``torch.cuda.mem_get_info``). As on the CPU, one elastic pair is calibrated, then bursts in turn
(``elastic``) and at once (``joint``); the static split is the one the articles recommend, two instances at
``--gpu-memory-utilization 0.45``: each server's KV gets what 0.45 of the limit leaves after its own
weights, runtime and activation peak (``--gpu-room whole``: no ballast, the whole GPU, the flag itself, and
a workload the user makes large enough to bind). An OOM is a server that died or a CUDA out-of-memory
error in a server's log (the pool's own growth failures, which back off, are counted apart).

    python3 benchmarks/cotenancy.py --device cuda --bursts 1 --out out/cotenancy-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tideserve.bench.datasets import SampleRequest, TokenizerLike
from tideserve.bench.launch import ServerProcess, free_port
from tideserve.bench.report import RequestRecord, latency_stats
from tideserve.bench.serve import ServeBenchConfig, discover_model, send_request
from tideserve.core.kv_cache.elastic import ElasticConfig
from tideserve.platform.host_memory import CgroupMemory

logger = logging.getLogger("cotenancy")
MiB, GiB = 2**20, 2**30
MODES = ("elastic", "static", "static-swap", "joint")
GPU_MODES = ("elastic", "joint", "static")
GPU_STATIC_SHARE = 0.45  # two instances at --gpu-memory-utilization 0.45 each: the split the articles recommend
POLL_S = 0.25
# An idle elastic pool keeps its reserve plus up to idle_unhit_cache_bytes of unhit prefix cache; the
# warmup leaves that much cache behind so every burst starts from the same after-serving floor.
RESERVE_BYTES = ElasticConfig().idle_reserve_bytes
IDLE_FLOOR_BYTES = RESERVE_BYTES + ElasticConfig().idle_unhit_cache_bytes
SYSTEM = ("You are the dispatcher of a regional ferry company. Answer briefly, quote departure times only "
          "from the timetable, never invent prices, and send every complaint to the customer desk. ")
WORDS = ("harbour island ferry ticket morning evening weather storm captain deck cabin cargo bicycle car "
         "passenger season winter summer route pier coast lighthouse delay refund timetable").split()
METRICS = {"pool_bytes": "vllm:kv_cache_pool_bytes", "pool_blocks": "vllm:kv_cache_pool_blocks",
           "used_blocks": "vllm:kv_cache_used_blocks", "running": "vllm:num_requests_running",
           "preemptions": "vllm:num_preemptions_total", "swap_ins": "vllm:num_swap_ins_total",
           "claimed": "vllm:memory_claimed_bytes", "others_claimed": "vllm:memory_others_claimed_bytes"}


class CgroupUnavailable(RuntimeError):
    """No memory cgroup this process may create and limit (not root, no controller, read-only)."""


@dataclass
class Cgroup:
    """A child of this process's own memory cgroup (v1 or v2), which the servers are launched into."""

    version: int
    path: Path

    @classmethod
    def create(cls, name: str) -> Cgroup:
        if os.geteuid() != 0:
            raise CgroupUnavailable("must run as root to create and limit a memory cgroup")
        own = CgroupMemory().cgroup
        if own is None:
            raise CgroupUnavailable("no memory cgroup controller is mounted for this process")
        cg = cls(own.version, own.directory / name)
        control = own.directory / "cgroup.subtree_control"
        try:
            if own.version == 2 and "memory" not in control.read_text().split():
                control.write_text("+memory")
            cg.path.mkdir()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create a child memory cgroup {cg.path}: {exc}") from None
        try:
            cg.set_limit(None)
        except OSError as exc:
            cg.remove()
            raise CgroupUnavailable(f"cannot write the memory limit of {cg.path}: {exc}") from None
        return cg

    def _read(self, v1: str, v2: str, key: str | None = None) -> int:
        """An integer file, or the ``key value`` line of a flat-keyed one (0 when absent)."""
        try:
            text = (self.path / (v1 if self.version == 1 else v2)).read_text()
            if key is None:
                return int(text)
            return next((int(v) for k, _, v in (ln.partition(" ") for ln in text.splitlines()) if k == key), 0)
        except (OSError, ValueError):
            return 0

    def set_limit(self, limit_bytes: int | None) -> None:
        value = str(limit_bytes) if limit_bytes is not None else ("-1" if self.version == 1 else "max")
        (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(value)

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes", "memory.current")

    def working_set(self) -> int:
        """Usage less the inactive page cache, as the engine's memory probe counts it."""
        return self.usage() - self._read("memory.stat", "memory.stat",
                                         "total_inactive_file" if self.version == 1 else "inactive_file")

    def counters(self) -> dict[str, int]:
        """OOM kills, times usage hit the limit (v1 failcnt, v2 ``max`` events), the kernel's peak usage
        (v1: since the last reset, which this does; v2: since creation, 0 on old kernels)."""
        out = {"oom_kills": self._read("memory.oom_control", "memory.events", "oom_kill"),
               "limit_hits": self._read("memory.failcnt", "memory.events", None if self.version == 1 else "max"),
               "kernel_peak": self._read("memory.max_usage_in_bytes", "memory.peak")}
        if self.version == 1:
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        return out

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run by a shell that first moves itself into the cgroup, then execs it (same pid)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def remove(self) -> None:
        """rmdir, after killing (by pid) anything our servers left behind inside."""
        for _ in range(100):
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        logger.warning("could not remove the cgroup %s", self.path)


class GpuMemory:
    """One GPU shared by the servers, read and limited from this process (see the module docstring): the
    same questions a ``Cgroup`` answers, so the drive, the sampling and the report are the same code."""

    version = 0

    def __init__(self, index: int = 0) -> None:
        import torch

        self._torch = torch
        if not torch.cuda.is_available():
            raise SystemExit("cotenancy --device cuda: torch sees no CUDA device")
        self.device = torch.device("cuda", index)
        self.name = torch.cuda.get_device_name(self.device)
        self.total_bytes = int(torch.cuda.mem_get_info(self.device)[1])
        self.path = Path(f"/dev/nvidia{index}")  # what the report names as the scope
        self._ballast = None
        self.ballast_bytes = 0
        self.servers: list[ServerProcess] = []

    def _free(self) -> int:
        return int(self._torch.cuda.mem_get_info(self.device)[0])

    def usage(self) -> int:
        """Device memory in use by everything but the ballast (the servers, this process's context)."""
        return self.total_bytes - self._free() - self.ballast_bytes

    def working_set(self) -> int:
        return self.usage()

    def set_limit(self, limit_bytes: int | None) -> None:
        """Hold ``total - limit`` bytes, so that usage + free = limit; None: hold nothing."""
        self._ballast, self.ballast_bytes = None, 0
        self._torch.cuda.empty_cache()
        if limit_bytes is None:
            return
        want = self.total_bytes - limit_bytes
        take = max(0, min(want, self._free() - 64 * MiB))
        if take < want:
            logger.warning("the ballast holds %.0f MiB, not %.0f: the servers already use more than the limit",
                           take / MiB, want / MiB)
        self._ballast = self._torch.empty(take, dtype=self._torch.uint8, device=self.device)
        self.ballast_bytes = take

    def counters(self) -> dict[str, int]:
        """OOMs so far: servers that died, and CUDA out-of-memory errors in their logs; the pool growths that
        failed and backed off (a mapped row or a copy the device could not back) are counted apart."""
        deaths = sum(s.proc is not None and s.proc.poll() is not None for s in self.servers)
        errors = growth = 0
        for s in self.servers:
            text = s.log_path.read_text(errors="replace") if s.log_path and s.log_path.exists() else ""
            for line in text.splitlines():
                if "KV pool growth" in line:
                    growth += 1
                elif "CUDA out of memory" in line or "OutOfMemoryError" in line:
                    errors += 1
        return {"oom_kills": deaths + errors, "limit_hits": growth, "kernel_peak": 0}

    def wrap(self, cmd: list[str]) -> list[str]:
        return cmd

    def remove(self) -> None:
        self.set_limit(None)


# ----------------------------------------------------------------------------------------- workload
def make_prompt(tokenizer: TokenizerLike, target: int, rng: random.Random, qid: int, prefix: str,
                output_len: int) -> SampleRequest:
    """``prefix`` + distinct filler + a distinct question, grown word by word to about ``target`` tokens."""
    question = f"\nQuestion {qid}: when does the ferry to island {qid} leave, and what does it cost?\nAnswer:"
    words: list[str] = []
    while len(ids := tokenizer.encode(text := prefix + " ".join(words) + question)) < target:
        words += [rng.choice(WORDS) for _ in range(target - len(ids))]
    return SampleRequest(text, ids, output_len)


def build_bursts(tokenizer: TokenizerLike, n: int, prompt_len: int, output_len: int, num_bursts: int,
                 seed: int = 0) -> list[list[SampleRequest]]:
    """Distinct prompts per burst; the even-numbered requests share a system prompt of about P/4 tokens."""
    rng = random.Random(seed)
    prefix = SYSTEM * math.ceil(max(1, prompt_len // 4) / len(tokenizer.encode(SYSTEM)))
    return [[make_prompt(tokenizer, prompt_len, rng, seed * 10**4 + b * n + i, prefix if i % 2 == 0 else "",
                         output_len) for i in range(n)] for b in range(num_bursts)]


def kv_blocks(burst: list[SampleRequest], block_size: int, with_output: bool = True) -> int:
    """Distinct KV blocks a burst holds at its peak: the shared prefix's full blocks count once."""
    shared = [r.prompt_token_ids for r in burst[::2]]
    common = len(os.path.commonprefix(shared))
    total = sum(-(-(r.prompt_len + (r.output_len if with_output else 0)) // block_size) for r in burst)
    return total - (len(shared) - 1) * (common // block_size)


# ----------------------------------------------------------------------------------------- servers
@dataclass
class Calibration:
    kv_bytes_per_token: int
    block_size: int
    activation_bytes: int
    margin_bytes: int
    fresh_usage_bytes: int  # working set of both servers just started (no limit)
    idle_usage_bytes: int  # ... and after the warmup, idle again: the base of the limit
    idle_pool_bytes: list[float]


@dataclass
class Sizing:
    room_bytes: int  # R
    limit_bytes: int
    static_kv_bytes: int  # X
    burst_kv_bytes: int
    burst_prompt_kv_bytes: int
    limit_overridden: bool
    memory_binds: bool  # R/2 < the prompts' KV: under the static split some requests wait to be admitted


def parse_log(text: str) -> dict[str, float]:
    """KV bytes per token, block size, activation peak and safety margin from a server's start-up log."""
    patterns = {"kv_bytes_per_token": r"KV cache dtype \S+ \((\d+) bytes per token\)",
                "block_size": r"Available KV cache blocks: \d+ \([\d.]+ GiB, block size (\d+)",
                "activation_gib": r"memory account: .*activation peak ([\d.]+) GiB",
                "margin_gib": r"memory account: .*safety margin ([\d.]+) GiB"}
    out = {}
    for key, pattern in patterns.items():
        if (match := re.search(pattern, text)) is None:
            raise RuntimeError(f"the server log has no line matching {pattern!r}")
        out[key] = float(match.group(1))
    return out


def mode_flags(mode: str, args: argparse.Namespace, sizing: Sizing | None) -> list[str]:
    if mode in ("elastic", "joint"):
        return ["--kv-cache-shrink-delay", str(args.shrink_delay)]
    if mode == "static" and args.device == "cuda" and args.gpu_room == "whole":
        return ["--gpu-memory-utilization", str(GPU_STATIC_SHARE)]
    x = sizing.static_kv_bytes  # type: ignore[union-attr]
    if mode == "static":
        return ["--kv-cache-memory", str(x)]
    return ["--kv-cache-memory", str(2 * x // 3), "--preemption-mode", "swap", "--swap-space", f"{x / 3 / GiB:.6f}"]


@contextmanager
def start_servers(cg: Cgroup | GpuMemory, args: argparse.Namespace, flags: list[str],
                  name: str) -> Iterator[list[ServerProcess]]:
    """Servers A and B in the cgroup (or on the GPU), one after the other (a static pool is committed at
    start, so B's fit check sees A's pool); both stopped at the end."""
    with ExitStack() as stack:
        servers = []
        for tag in "AB":
            port = free_port()
            cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   *shlex.split(args.server_args), *flags]
            servers.append(stack.enter_context(ServerProcess(
                cg.wrap(cmd), port, env={"OMP_NUM_THREADS": str(args.threads)}, name=f"{name}-{tag}",
                ready_timeout_s=args.ready_timeout)))
            if isinstance(cg, GpuMemory):
                cg.servers = list(servers)
        yield servers


def parse_metrics(text: str) -> dict[str, float]:
    """The families we read from Prometheus text, summed over label sets (a server serves one model)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, number = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(number)
    return {key: values.get(family, math.nan) for key, family in METRICS.items()}


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        return parse_metrics((await client.get(url + "/metrics")).text)
    except (httpx.HTTPError, ValueError):
        return None


async def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.perf_counter() + timeout_s
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


# ----------------------------------------------------------------------------------------- driving
@dataclass
class Burst:
    server: int
    start_s: float
    floor_bytes: float  # the bursting server's pool just before the burst
    end_s: float = math.nan
    records: list[RequestRecord] = field(default_factory=list)


async def sample_loop(urls: list[str], cg: Cgroup | GpuMemory, t0: float, samples: list[dict[str, Any]],
                      stop: asyncio.Event) -> None:
    """Both servers' /metrics and the cgroup's usage every POLL_S seconds until ``stop``."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        while not stop.is_set():
            start = time.perf_counter()
            servers = await asyncio.gather(*(scrape(client, u) for u in urls))
            samples.append({"t": start - t0, "cgroup_bytes": cg.usage(), "servers": servers})
            await asyncio.sleep(max(0.0, POLL_S - (time.perf_counter() - start)))


def latest(samples: list[dict[str, Any]], server: int) -> dict[str, float]:
    return next(s["servers"][server] for s in reversed(samples) if s["servers"][server])


async def run_burst(url: str, model: str, requests: list[SampleRequest], timeout_s: float) -> list[RequestRecord]:
    """Every request of the burst at once, streamed (ignore_eos, temperature 0)."""
    cfg = ServeBenchConfig(base_url=url, model=model, request_timeout_s=timeout_s, progress=False)
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(send_request(client, cfg, r, i, None, t0)
                                           for i, r in enumerate(requests))))


async def warm(urls: list[str], model: str, warmup: list[SampleRequest], args: argparse.Namespace) -> None:
    """The same mini burst on each server, then ``settle``."""
    for url in urls:
        records = await run_burst(url, model, warmup, args.request_timeout)
        if not all(r.success for r in records):
            raise RuntimeError(f"warmup failed on {url}: {next(r.error for r in records if not r.success)}")
    await settle(urls, args)


async def settle(urls: list[str], args: argparse.Namespace) -> None:
    """Wait until both servers run nothing and neither pool has changed for shrink delay + 2.5 s: the idle
    pools are at their after-serving floor."""
    last: list[Any] = [None, time.perf_counter()]  # pools seen, since when
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        deadline = time.perf_counter() + args.shrink_delay + 30
        while time.perf_counter() < deadline and time.perf_counter() - last[1] < args.shrink_delay + 2.5:
            now = [await scrape(client, u) for u in urls]
            if [(m or {}).get("pool_bytes") for m in now] != last[0] or any(not m or m["running"] for m in now):
                last[:] = [[(m or {}).get("pool_bytes") for m in now], time.perf_counter()]
            await asyncio.sleep(POLL_S)


def recovery_s(samples: list[dict[str, Any]], burst: Burst, window_s: float) -> float | None:
    """Seconds after the burst until the bursting server's pool was within 10% (or one reserve) of its
    pre-burst floor, or of the idle floor the engine keeps by design (reserve + unhit prefix cache) where
    that is larger (a block-size change while idle drops the cache); None when not within ``window_s``."""
    floor = max(burst.floor_bytes, IDLE_FLOOR_BYTES)
    threshold = floor + max(0.1 * floor, RESERVE_BYTES)
    for s in samples:
        m = s["servers"][burst.server]
        if burst.end_s <= s["t"] <= burst.end_s + window_s and m and m["pool_bytes"] <= threshold:
            return s["t"] - burst.end_s
    return None


async def drive(servers: list[ServerProcess], bursts: list[list[SampleRequest]], warmup: list[SampleRequest],
                cg: Cgroup | GpuMemory, args: argparse.Namespace, elastic: bool,
                limit_above_idle: int | None, joint: bool = False, warmed: bool = False) -> dict[str, Any]:
    """Warm both servers (``warmed``: they served the warmup already, so only let them settle), then the
    staggered bursts A, B, A, B, ``gap`` seconds apart (elastic: and each once the previous burster's pool
    is back near its floor, so a burst never starts inside the last one's give-back, whose timing varies
    with the machine); with ``joint``, A and B burst together, round after round, each round once both
    pools are back near their floors; counters, timeline.

    With ``limit_above_idle`` the cgroup's limit is set once both servers are warm and idle: their working
    set then less their KV pools, plus that many bytes: what the servers driven hold at idle (page cache
    turned active, allocator state) differs from pair to pair by tens of MB out of a room of about 100, and
    from mode to mode on one pair."""
    urls = [s.base_url for s in servers]
    model = discover_model(urls[0])
    await (settle(urls, args) if warmed else warm(urls, model, warmup, args))
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        idle_pools = sum((m or {}).get("pool_bytes", 0.0) for m in [await scrape(client, u) for u in urls])
    idle_working_set = cg.working_set()
    limit = None if limit_above_idle is None else int(idle_working_set - idle_pools) + limit_above_idle
    if limit is not None:
        cg.set_limit(limit)
    t0, samples, stop = time.perf_counter(), [], asyncio.Event()
    task = asyncio.create_task(sample_loop(urls, cg, t0, samples, stop))
    if not await wait_for(lambda: bool(samples) and all(samples[-1]["servers"]), 30):
        raise RuntimeError("the servers' /metrics did not answer")
    before = [latest(samples, i) for i in range(2)]
    counters0 = cg.counters()
    done: list[Burst] = []
    window = args.shrink_delay + 15
    if joint:
        for k in range(0, len(bursts), 2):
            logger.info("joint burst %d/%d: %d + %d requests on A and B at once", k // 2 + 1, len(bursts) // 2,
                        len(bursts[k]), len(bursts[k + 1]))
            pair = [Burst(i, time.perf_counter() - t0, latest(samples, i)["pool_bytes"]) for i in range(2)]
            results = await asyncio.gather(*(run_burst(urls[i], model, bursts[k + i], args.request_timeout)
                                             for i in range(2)))
            for burst, records in zip(pair, results):
                burst.records = records
                burst.end_s = time.perf_counter() - t0
            done += pair
            await asyncio.sleep(args.gap if k + 2 < len(bursts) else 0)
            await wait_for(lambda pair=pair: all(recovery_s(samples, b, window) is not None for b in pair), window)
    for k, requests in enumerate([] if joint else bursts):
        burst = Burst(k % 2, time.perf_counter() - t0, latest(samples, k % 2)["pool_bytes"])
        logger.info("burst %d/%d: %d requests on server %s", k + 1, len(bursts), len(requests), "AB"[k % 2])
        burst.records = await run_burst(urls[burst.server], model, requests, args.request_timeout)
        burst.end_s = time.perf_counter() - t0
        done.append(burst)
        await asyncio.sleep(args.gap if k + 1 < len(bursts) else 0)
        if elastic:  # the next burst starts once this burster has given its memory back: turns, not overlap
            await wait_for(lambda: recovery_s(samples, done[-1], window) is not None, window)
    stop.set()
    await task
    counters = cg.counters()
    return {"bursts": done, "samples": samples, "before": before, "after": [latest(samples, i) for i in range(2)],
            "idle_working_set_bytes": idle_working_set, "limit_bytes": limit,
            "oom_kills": counters["oom_kills"] - counters0["oom_kills"], "kernel_peak": counters["kernel_peak"],
            "limit_hits": counters["limit_hits"] - counters0["limit_hits"],
            "alive": [s.proc is not None and s.proc.poll() is None for s in servers],
            "logs": [str(s.log_path) for s in servers]}


# ----------------------------------------------------------------------------------------- report
def summarize(mode: str, run: dict[str, Any], window_s: float) -> dict[str, Any]:
    bursts, samples = run["bursts"], run["samples"]
    records = [r for b in bursts for r in b.records]
    ok = [r for r in records if r.success]
    ttft = latency_stats([r.ttft_s for r in ok if r.ttft_s is not None])

    def pool(s: dict[str, Any], i: int, used: bool = False) -> float:
        m = s["servers"][i]
        return (m["used_blocks"] * m["pool_bytes"] / m["pool_blocks"] if used else m["pool_bytes"]) if m else 0.0

    per_burst = []
    for b in bursts:
        tokens = sum(r.output_tokens for r in b.records if r.success)
        inside = [s for s in samples if b.start_s <= s["t"] <= b.end_s] or samples[-1:]
        per_burst.append({"server": "AB"[b.server], "start_s": b.start_s, "wall_s": b.end_s - b.start_s,
                          "output_tokens": tokens, "output_tok_s": tokens / (b.end_s - b.start_s),
                          "floor_bytes": b.floor_bytes, "peak_pool_bytes": max(pool(s, b.server) for s in inside),
                          "peak_used_bytes": max(pool(s, b.server, used=True) for s in inside),
                          "recovery_s": recovery_s(samples, b, window_s) if mode in ("elastic", "joint") else "n/a",
                          "failed": sum(not r.success for r in b.records)})
    delta = {k: sum(run["after"][i][k] - run["before"][i][k] for i in range(2)) for k in ("preemptions", "swap_ins")}
    return {
        "mode": mode, "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_mean_ms": ttft["mean"], "ttft_p99_ms": ttft["p99"],
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "output_tokens_mean": statistics.fmean(r.output_tokens for r in ok) if ok else None,
        "output_tok_s_median_burst": statistics.median(b["output_tok_s"] for b in per_burst),
        "output_tok_s_overall": sum(b["output_tokens"] for b in per_burst) / sum(b["wall_s"] for b in per_burst),
        **delta, "oom_kills": run["oom_kills"], "limit_hits": run["limit_hits"], "alive": run["alive"],
        "bursts": per_burst, "peak_pool_bytes": [max(pool(s, i) for s in samples) for i in range(2)],
        "peak_pool_sum_bytes": max(pool(s, 0) + pool(s, 1) for s in samples),
        # what each server saw the other claim on the limit (its memory ledger), at most
        "peak_others_claimed_bytes": [max((s["servers"][i] or {}).get("others_claimed", 0.0) or 0.0 for s in samples)
                                      for i in range(2)],
        "peak_cgroup_bytes": max([run["kernel_peak"]] + [s["cgroup_bytes"] for s in samples]), "logs": run["logs"],
        "idle_working_set_bytes": run["idle_working_set_bytes"], "limit_bytes": run["limit_bytes"],
        "timeline": [[round(s["t"], 3), s["cgroup_bytes"], pool(s, 0), pool(s, 1)] for s in samples],
        "records": [{k: v for k, v in r.to_dict().items() if k not in ("generated_text", "itl_s")} for r in records],
    }


def _num(v: Any, digits: int = 0) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else ("none" if v is None else str(v))


def format_report(result: dict[str, Any]) -> str:
    s, c, w = result["sizing"], result["calibration"], result["workload"]
    gpu = result.get("gpu")
    where = (f"gpu: {gpu['name']} ({gpu['total_bytes'] / GiB:.1f} GiB), limit held by a ballast"
             if gpu and gpu["room"] == "auto" else f"gpu: {gpu['name']}, the whole device" if gpu else "")
    lines = [
        f"command: `{result['command']}`", f"cpu: {result['cpu']}", *([where] if where else []), "",
        f"workload: {w['num_requests']} requests per burst, prompts {w['prompt_tokens_min']}-{w['prompt_tokens_max']} "
        f"tokens (mean {w['prompt_tokens_mean']:.1f}; half share a {w['shared_prefix_tokens']}-token prefix), "
        f"{w['output_tokens']} output tokens, {w['num_bursts']} bursts (A, B, ...), gap {result['config']['gap']:.1f} "
        f"s; warmup {w.get('warmup_requests')} requests per server",
        f"sizing: KV {c['kv_bytes_per_token']} B/token, block {c['block_size']}; burst KV "
        f"{s['burst_kv_bytes'] / MiB:.0f} MiB (prompts {s['burst_prompt_kv_bytes'] / MiB:.0f} MiB); R "
        f"{s['room_bytes'] / MiB:.0f} MiB, R/2 {s['room_bytes'] / 2 / MiB:.0f} MiB; idle usage "
        f"{c['idle_usage_bytes'] / MiB:.0f} MiB (fresh {c['fresh_usage_bytes'] / MiB:.0f}, idle pools "
        f"{' + '.join(f'{p / MiB:.0f}' for p in c['idle_pool_bytes'])})"
        f" + activation 2 x {c['activation_bytes'] / MiB:.0f} + margin {c['margin_bytes'] / MiB:.0f} -> limit "
        f"{s['limit_bytes'] / MiB:.0f} MiB{' (--limit)' if s['limit_overridden'] else ''}; static "
        + (f"--gpu-memory-utilization {GPU_STATIC_SHARE} each (of the limit: {s['static_kv_bytes'] / MiB:.0f} MiB of "
           "KV each)" if gpu else f"X {s['static_kv_bytes'] / MiB:.0f} MiB")
        + f"; R/2 < prompt KV: {'yes' if s['memory_binds'] else 'NO'}", "",
        "| mode | TTFT mean ms | TTFT p99 ms | tok/s per burst (median) | tok/s overall | preemptions | swap-ins "
        + ("| OOMs (deaths + CUDA OOM errors) | alive | failed | back at floor s (per burst) | peak pool A / B MiB "
           "| peak GPU use / limit MiB |" if gpu else "| OOM kills | alive | failed | back at floor s (per burst) "
           "| peak pool A / B MiB | peak cgroup / limit MiB |"),
        "|" + "---|" * 13]
    for m in result["modes"].values():
        if "error" in m:
            lines.append(f"| {m['mode']} | did not run: {m['error'][:300]} |" + " |" * 11)
            continue
        rec = ", ".join(_num(b["recovery_s"], 2) for b in m["bursts"])
        lines.append(
            f"| {m['mode']} | {_num(m['ttft_mean_ms'])} | {_num(m['ttft_p99_ms'])} | "
            f"{m['output_tok_s_median_burst']:.1f} | {m['output_tok_s_overall']:.1f} | {m['preemptions']:.0f} | "
            f"{m['swap_ins']:.0f} | {m['oom_kills']} | {'both' if all(m['alive']) else m['alive']} | {m['failed']} | "
            f"{rec} | {m['peak_pool_bytes'][0] / MiB:.0f} / {m['peak_pool_bytes'][1] / MiB:.0f} | "
            f"{m['peak_cgroup_bytes'] / MiB:.0f} / {(m.get('limit_bytes') or s['limit_bytes']) / MiB:.0f} |")
    if gpu:
        lines.append("\npool growths that failed and backed off (the device had no memory for them), per mode: "
                     + ", ".join(f"{m['mode']} {m.get('limit_hits', 'n/a')}" for m in result["modes"].values()))
    for name, r in result["ratios"].items():
        lines.append(f"\n{name}: p99 TTFT static/elastic {_num(r['ttft_p99'], 2)}x; output tok/s elastic/static "
                     f"{_num(r['throughput'], 2)}x overall, {_num(r['throughput_median_burst'], 2)}x median burst")
    return "\n".join(lines)


def cpu_summary() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = (m.group(1).split() if (m := re.search(r"^flags\s*:\s*(.*)$", text, re.M)) else [])
    avx512, amx = (sorted(f for f in flags if f.startswith(p)) for p in ("avx512", "amx"))
    return (f"{model.group(1) if model else 'unknown'}, {os.cpu_count()} cpus; avx512: {' '.join(avx512) or 'no'}; "
            f"amx: {' '.join(amx) or 'no'}")


# ----------------------------------------------------------------------------------------- main
def compute_sizing(burst: list[SampleRequest], cal: Calibration, args: argparse.Namespace,
                   total_bytes: int | None = None) -> Sizing:
    """R, the limit and the static split. On a GPU (``total_bytes``: the device's size) the static split is
    two instances at ``--gpu-memory-utilization 0.45`` of the limit: each server's KV is what 0.45 of it
    leaves after the server's own non-KV memory and activation peak; with ``--gpu-room whole`` the limit is
    the device itself, R what the idle servers leave of it."""
    per_block = cal.kv_bytes_per_token * cal.block_size
    burst_kv = kv_blocks(burst, cal.block_size) * per_block
    prompt_kv = kv_blocks(burst, cal.block_size, with_output=False) * per_block
    # Each server's activation peak: either may be handed a request at any moment, and each claims the part of
    # its peak not resident in the ledger the other reads (one shared safety margin: both keep the same free
    # memory in reserve).
    fixed = cal.idle_usage_bytes + 2 * cal.activation_bytes + cal.margin_bytes
    limit = args.limit
    if total_bytes is not None and args.gpu_room == "whole":
        limit = total_bytes
    room = math.ceil(burst_kv * (1 + args.slack)) if limit is None else limit - fixed
    if room <= 0:
        raise SystemExit(f"--limit {limit} leaves no KV room above the {fixed} bytes the idle servers need")
    limit = limit or fixed + room
    static = int(0.97 * room / 2)
    if total_bytes is not None:
        non_kv_one = (cal.idle_usage_bytes - sum(cal.idle_pool_bytes)) / 2
        static = int(GPU_STATIC_SHARE * limit - non_kv_one - cal.activation_bytes)
    return Sizing(room, limit, static, burst_kv, prompt_kv, limit == args.limit and args.limit is not None,
                  room / 2 < prompt_kv)


def warmed_calibration(cg: Cgroup | GpuMemory, servers: list[ServerProcess], args: argparse.Namespace,
                       make_warmup: Callable[[int], list[SampleRequest]]) -> tuple[Calibration, list[SampleRequest]]:
    """Both servers' log figures and working set, fresh and after a warmup (which must leave a full idle floor
    of cache), from a pair started with no limit; ``make_warmup(kv_bytes_per_token)`` builds the warmup."""
    info = parse_log(servers[0].log_path.read_text())  # type: ignore[union-attr]
    fresh = cg.working_set()
    warmup = make_warmup(int(info["kv_bytes_per_token"]))
    asyncio.run(warm([s.base_url for s in servers], discover_model(servers[0].base_url), warmup, args))
    pools = [parse_metrics(httpx.get(s.base_url + "/metrics", trust_env=False).text)["pool_bytes"] for s in servers]
    idle = cg.working_set()
    return Calibration(int(info["kv_bytes_per_token"]), int(info["block_size"]), int(info["activation_gib"] * GiB),
                       int(info["margin_gib"] * GiB), fresh, idle, pools), warmup


def run_modes(cg: Cgroup | GpuMemory, args: argparse.Namespace, bursts: list[list[SampleRequest]],
              make_warmup: Callable[[int], list[SampleRequest]], result: dict[str, Any]) -> None:
    """One elastic pair, calibrated with no limit, then driven staggered and jointly under the limit (each
    drive sets the limit from the pair's own idle working set, so one pair serves every elastic mode); then
    a pair at the static split for each static mode."""
    elastic_modes = [m for m in args.modes if m in ("elastic", "joint")]
    window = args.shrink_delay + 15
    total_bytes = cg.total_bytes if isinstance(cg, GpuMemory) else None
    cg.set_limit(None)
    with start_servers(cg, args, mode_flags("elastic", args, None), "elastic") as servers:
        cal, warmup = warmed_calibration(cg, servers, args, make_warmup)
        sizing = compute_sizing(bursts[0], cal, args, total_bytes)
        result["calibration"], result["sizing"] = asdict(cal), asdict(sizing)
        result["workload"]["warmup_requests"] = len(warmup)
        logger.info("sizing: %s", result["sizing"])
        if not sizing.memory_binds:
            logger.warning("R/2 holds every prompt of a burst: memory does not bind (raise N or P, lower O)")
        non_kv_idle = cal.idle_usage_bytes - int(sum(cal.idle_pool_bytes))
        # --limit (or the whole GPU) holds from the start; a computed one is set once the pair is warm and idle
        fixed_limit = sizing.limit_overridden or (total_bytes is not None and args.gpu_room == "whole")
        above_idle = None if fixed_limit else sizing.limit_bytes - non_kv_idle
        for mode in elastic_modes:
            try:
                if sizing.limit_overridden:
                    cg.set_limit(sizing.limit_bytes)
                run = asyncio.run(drive(servers, bursts, warmup, cg, args, elastic=True, limit_above_idle=above_idle,
                                        joint=mode == "joint", warmed=True))
                result["modes"][mode] = summarize(mode, run, window)
            except RuntimeError as exc:
                logger.error("mode %s failed: %s", mode, exc)
                result["modes"][mode] = {"mode": mode, "error": str(exc).splitlines()[-1]}
            finally:
                cg.set_limit(None)
    for mode in [m for m in args.modes if m not in ("elastic", "joint")]:
        try:
            cg.set_limit(sizing.limit_bytes if sizing.limit_overridden else None)
            with start_servers(cg, args, mode_flags(mode, args, sizing), mode) as servers:
                run = asyncio.run(drive(servers, bursts, warmup, cg, args, elastic=False, limit_above_idle=above_idle))
            result["modes"][mode] = summarize(mode, run, window)
        except RuntimeError as exc:
            logger.error("mode %s failed: %s", mode, exc)
            result["modes"][mode] = {"mode": mode, "error": str(exc).splitlines()[-1]}
        finally:
            cg.set_limit(None)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tideserve.model.loader import default_model_path
    from tideserve.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    bursts = build_bursts(tokenizer, args.num_requests, args.prompt_tokens, args.output_tokens, 2 * args.bursts)

    def make_warmup(kv_bytes_per_token: int) -> list[SampleRequest]:
        n = math.ceil(1.25 * IDLE_FLOOR_BYTES / (kv_bytes_per_token * (args.prompt_tokens + 16)))
        return build_bursts(tokenizer, max(2, n), args.prompt_tokens, 16, 1, seed=1)[0]

    lens = [r.prompt_len for b in bursts for r in b]
    cg = GpuMemory() if args.device == "cuda" else Cgroup.create(f"tideserve-cotenancy-{os.getpid()}")
    result: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_summary(), "config": vars(args),
        "cgroup": {"version": cg.version, "path": str(cg.path)}, "modes": {}, "ratios": {},
        "workload": {"num_requests": args.num_requests, "output_tokens": args.output_tokens, "num_bursts": len(bursts),
                     "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens),
                     "prompt_tokens_mean": statistics.fmean(lens),
                     "shared_prefix_tokens": len(os.path.commonprefix([r.prompt_token_ids for r in bursts[0][::2]]))}}
    if isinstance(cg, GpuMemory):
        result["gpu"] = {"name": cg.name, "total_bytes": cg.total_bytes, "room": args.gpu_room}
    try:
        run_modes(cg, args, bursts, make_warmup, result)
    finally:
        cg.remove()
    add_ratios(result)
    return result


def add_ratios(result: dict[str, Any]) -> None:
    """p99 TTFT static/elastic and output tok/s elastic/static, per static mode."""
    if (base := result["modes"].get("elastic")) is not None:
        for mode, m in result["modes"].items():
            if mode not in ("elastic", "joint") and "error" not in m and "error" not in base:
                result["ratios"][mode] = {
                    "ttft_p99": m["ttft_p99_ms"] / base["ttft_p99_ms"] if base["ttft_p99_ms"] else None,
                    "throughput": base["output_tok_s_overall"] / m["output_tok_s_overall"],
                    "throughput_median_burst": base["output_tok_s_median_burst"] / m["output_tok_s_median_burst"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: a memory cgroup; cuda: one GPU, limited by a ballast (see the module docstring)")
    p.add_argument("--gpu-room", choices=("auto", "whole"), default="auto",
                   help="cuda: auto sizes the limit from the workload (a ballast holds the rest); whole: the whole "
                        "GPU, static at --gpu-memory-utilization 0.45 as given")
    p.add_argument("--modes", type=lambda s: s.split(","), default=None,
                   help=f"comma list of {','.join(MODES)} (default: all; cuda: {','.join(GPU_MODES)})")
    p.add_argument("--num-requests", "-n", type=int, default=32, help="N: concurrent requests per burst")
    p.add_argument("--prompt-tokens", "-p", type=int, default=320, help="P: prompt tokens per request (about)")
    p.add_argument("--output-tokens", "-o", type=int, default=192, help="O: output tokens per request")
    p.add_argument("--bursts", type=int, default=2, help="bursts per server (2: A, B, A, B)")
    p.add_argument("--shrink-delay", type=float, default=2.0, help="--kv-cache-shrink-delay of the elastic mode")
    p.add_argument("--gap", type=float, default=None, help="seconds between bursts (default: shrink delay + 4)")
    p.add_argument("--slack", type=float, default=0.07, help="R = burst KV * (1 + slack), for block rounding")
    p.add_argument("--limit", type=int, default=None, help="the cgroup limit in bytes (default: computed)")
    p.add_argument("--server-args", default=None,
                   help="flags for every server (default: --dtype float32 --max-model-len 1024; cuda: --device cuda "
                        "--dtype bfloat16 --max-model-len 2048)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the embedded model)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for a server to load")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.modes is None:
        args.modes = list(GPU_MODES if cuda else MODES)
    if args.server_args is None:
        args.server_args = ("--device cuda --dtype bfloat16 --max-model-len 2048" if cuda
                            else "--dtype float32 --max-model-len 1024")
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    args.gap = args.shrink_delay + 4 if args.gap is None else args.gap
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    try:
        result = run_benchmark(args)
    except CgroupUnavailable as exc:
        raise SystemExit(f"cotenancy: {exc}; run as root on a machine with a writable memory cgroup") from None
    print(format_report(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
