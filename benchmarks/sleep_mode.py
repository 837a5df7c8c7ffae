"""Sleep mode's figures on a real server: what an idle `tideserve serve --enable-sleep-mode` gives back.

For each level (1, then 2): a burst of concurrent requests (the pool grows, the allocator keeps the
activations), the server's resident set then ("awake"), ``POST /sleep?level=N`` and its wall time, the
resident set asleep, ``POST /wake_up`` and its wall time, and whether greedy answers after the wake equal
those before the first sleep (each prompt alone, so the batch cannot change them by rounding).

    .venv/bin/python benchmarks/sleep_mode.py --out out/sleep.json                     # the embedded model
    .venv/bin/python benchmarks/sleep_mode.py --model out/checking-models/qwen2-0.5b-q4_k_m.gguf

``--make-qwen2-0.5b DIR`` writes a random-weight float16 GGUF of Qwen2-0.5B's shape first
(benchmarks/checking_models.py) and serves it with ``--quantization int4`` (4-bit blocks made at load,
so the weights are repacked anonymous memory, not the file's pages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import httpx

from tideserve.bench.launch import ServerProcess, free_port

PROMPTS = [f"Question {i}: what does the ferry to island {i} cost, and when does it leave? " * 4 for i in range(32)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def complete(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    reply = client.post("/v1/completions", json=body)
    reply.raise_for_status()
    return reply.json()["choices"][0]["token_ids"]


def burst(base_url: str, model: str, n: int, max_tokens: int) -> None:
    import concurrent.futures

    with httpx.Client(base_url=base_url, timeout=600) as client, \
            concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda p: complete(client, model, p, max_tokens), PROMPTS[:n]))


def make_qwen2(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("checking_models", Path(__file__).with_name("checking_models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "qwen2-0.5b-f16.gguf"
    if not path.exists():
        module.write_f16_model(module.SHAPES["qwen2-0.5b"], path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model the server loads (default: the embedded one)")
    ap.add_argument("--make-qwen2-0.5b", dest="make_qwen2", default=None, metavar="DIR")
    # A fixed block size and thread count: both change how sums round, which the comparison must not see.
    ap.add_argument("--server-args", default="--max-model-len 1024 --block-size 16 --no-adaptive-threads",
                    help="more `tideserve serve` flags")
    ap.add_argument("--burst", type=int, default=32, help="concurrent requests before each sleep")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = shlex.split(args.server_args)
    model_path = args.model
    if args.make_qwen2:
        model_path = str(make_qwen2(Path(args.make_qwen2)))
        flags += ["--quantization", "int4"]
    port = free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), "--enable-sleep-mode", *flags]
    if model_path:
        cmd += ["--model", model_path]
    result = {"command": shlex.join([sys.executable, *sys.argv]), "server": shlex.join(cmd),
              "machine": platform.processor() or platform.machine(), "levels": []}
    with ServerProcess(cmd, port, ready_timeout_s=600, name="sleep-mode") as server, \
            httpx.Client(base_url=server.base_url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        want = [complete(client, model, p, args.max_tokens) for p in PROMPTS[:3]]
        for level in (1, 2):
            burst(server.base_url, model, args.burst, args.max_tokens)
            awake = rss_bytes(server.proc.pid)
            start = time.perf_counter()
            client.post("/sleep", params={"level": level}).raise_for_status()
            slept = time.perf_counter() - start
            time.sleep(1.0)
            asleep = rss_bytes(server.proc.pid)
            start = time.perf_counter()
            client.post("/wake_up").raise_for_status()
            woke = time.perf_counter() - start
            same = [complete(client, model, p, args.max_tokens) for p in PROMPTS[:3]] == want
            row = {"level": level, "rss_awake_mib": awake / 2**20, "rss_asleep_mib": asleep / 2**20,
                   "asleep_over_awake": asleep / awake, "sleep_s": slept, "wake_s": woke, "same_answers": same}
            result["levels"].append(row)
            print(f"level {level}: RSS awake {row['rss_awake_mib']:.0f} MiB, asleep {row['rss_asleep_mib']:.0f} MiB "
                  f"({row['asleep_over_awake']:.2f}); sleep {slept:.2f} s, wake {woke:.2f} s; same answers: {same}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
