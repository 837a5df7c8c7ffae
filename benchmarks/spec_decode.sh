#!/usr/bin/env bash
# Speculative decoding against none, served, interleaved on one machine: for ROUNDS rounds, in alternating
# order, a server without proposals and one with n-gram proposals (SPEC below) each run
#   editing-1    one stream, chat requests to rewrite a short file with one change (the output copies the prompt)
#   questions-1  one stream, open-ended chat questions, 128 tokens
#   random-64    64 concurrent requests, 256 random tokens in, 64 out (the batch where proposals are off)
# greedy (temperature 0). One line per run:  round <r> <off|ngram> <workload> <output tok/s>
# Usage: benchmarks/spec_decode.sh [MODEL [ROUNDS [ENDPOINT]]]  (MODEL: a GGUF file or HF directory, default the
# embedded SmolLM2; ENDPOINT: chat, or completions for a model without a chat template)
set -u
MODEL=${1:-}; ROUNDS=${2:-2}; ENDPOINT=${3:-chat}
SPEC='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
PORT=8177
trap 'pkill -f "tideserve serve --port $PORT" 2>/dev/null' EXIT
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile)$' | xargs)"
echo "# model: ${MODEL:-embedded SmolLM2-135M-Instruct Q4_1}; proposals: $SPEC"
tok_s() { grep "Output token throughput (tok/s)" | head -1 | awk '{print $NF}'; }
bench() {  # dataset concurrency prompts [extra args]
  $PY -m tideserve bench serve --base-url "http://127.0.0.1:$PORT" --endpoint "$ENDPOINT" --dataset "$1" \
      --max-concurrency "$2" --num-prompts "$3" "${@:4}" --disable-tqdm ${MODEL:+--tokenizer "$MODEL"} 2>/dev/null | tok_s
}
for r in $(seq 1 "$ROUNDS"); do
  order="off ngram"; [ $((r % 2)) = 0 ] && order="ngram off"
  for mode in $order; do
    args=(--port $PORT --max-model-len 2048 ${MODEL:+--model "$MODEL"})
    [ "$mode" = ngram ] && args+=(--speculative-config "$SPEC")
    $PY -m tideserve serve "${args[@]}" > "/tmp/spec_decode_$mode.log" 2>&1 &
    for _ in $(seq 1 180); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
    echo "round $r $mode editing-1 $(bench editing 1 6)"
    echo "round $r $mode questions-1 $(bench questions 1 6 --output-len 128)"
    echo "round $r $mode random-64 $(bench random 64 64 --input-len 256 --output-len 64 --ignore-eos)"
    pkill -f "tideserve serve --port $PORT"; sleep 3
  done
done
