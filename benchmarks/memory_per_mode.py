"""Resident memory of one served engine per weight mode, on the same file, at one stream.

Each mode runs in its own process (so nothing is shared or cached between them): load the model, answer
one chat request of 128 greedy tokens, then read the process's resident set (VmRSS) and peak (VmHWM)
from /proc. The baseline row is the same process with torch and tideserve imported but no model, which
is what any Python engine pays before its first weight.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/memory_per_mode.py --modes gguf,none,int8,int4 \
        [--model X.gguf] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
def rss():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out
mode, model = sys.argv[1], sys.argv[2] or None
import torch  # noqa: F401
from tideserve import LLM, SamplingParams
if mode == "baseline":
    print(json.dumps({"mode": mode, **rss()})); sys.exit()
dtype = "auto" if mode in ("gguf", "auto") else "float32" if mode in ("int8", "int4") else mode.split(":")[1]
quant = mode if mode in ("gguf", "int8", "int4", "auto") else "none"
llm = LLM(model, dtype=dtype, quantization=quant, max_model_len=1024)
out = llm.chat([{"role": "user", "content": "Write a story about the sea."}],
               SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
print(json.dumps({"mode": mode, "dtype": str(llm.engine.dtype), "quantization": llm.engine.quantization,
                  "tokens": len(out[0].outputs[0].token_ids), **rss()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--modes", default="baseline,gguf,none:float32,none:bfloat16,int8,int4",
                    help="baseline, gguf, auto, int8, int4, none:DTYPE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for mode in args.modes.split(","):
        proc = subprocess.run([sys.executable, "-c", CHILD, mode, args.model], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{mode}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{mode:>14}: RSS {row['VmRSS']:7.1f} MiB, peak {row['VmHWM']:7.1f} MiB "
              f"({row.get('quantization', '-')}, {row.get('dtype', '-')})", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
