#!/usr/bin/env bash
# Throughput of two checkouts of tideserve, interleaved on one machine: offline (`tideserve bench offline`,
# 32 random prompts of 256 tokens, 64 out; and one sequence at a time, 4 prompts of 256 tokens, 128 out:
# single-stream decode without a server) for ROUNDS rounds, then a served pair (`tideserve serve` and
# `tideserve bench serve` at 1 and 64 concurrent streams, 256 in, 48 out, EOS ignored) for SERVED_ROUNDS.
# The order alternates each round, so drift on a shared host falls on both sides. One line per run:
#   round <r> <A|B> <offline|offline-1|served-1|served-64> <output tok/s>
# Usage: benchmarks/ab_checkouts.sh A_CHECKOUT B_CHECKOUT [ROUNDS [SERVED_ROUNDS]]
# Both checkouts run under this repository's .venv (PYTHONPATH selects the package).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); ROUNDS=${3:-3}; SERVED_ROUNDS=${4:-2}
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
declare -A TREE=([A]=$A [B]=$B)
tmp=$(mktemp -d)
trap 'pkill -f "tideserve serve --port 81[0-9][0-9]" 2>/dev/null; rm -rf "$tmp"' EXIT
echo "# A=$A ($(git -C "$A" rev-parse --short HEAD)) B=$B ($(git -C "$B" rev-parse --short HEAD))"
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile)$' | xargs)"
tok_s() { grep "Output token throughput (tok/s)" | head -1 | awk '{print $NF}'; }
for r in $(seq 1 "$ROUNDS"); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for t in $order; do
    v=$(cd "$tmp" && PYTHONPATH=${TREE[$t]} $PY -m tideserve bench offline --dataset random --num-prompts 32 \
        --input-len 256 --output-len 64 --seed "$r" --disable-tqdm 2>/dev/null | tok_s)
    echo "round $r $t offline $v"
    v=$(cd "$tmp" && PYTHONPATH=${TREE[$t]} $PY -m tideserve bench offline --dataset random --num-prompts 4 \
        --input-len 256 --output-len 128 --max-num-seqs 1 --seed "$r" --disable-tqdm 2>/dev/null | tok_s)
    echo "round $r $t offline-1 $v"
  done
done
for r in $(seq 1 "$SERVED_ROUNDS"); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for t in $order; do
    port=$((8100 + r))
    (cd "$tmp" && PYTHONPATH=${TREE[$t]} $PY -m tideserve serve --port $port --max-model-len 2048 \
        > "$tmp/serve-$t.log" 2>&1 &)
    for _ in $(seq 1 180); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 1; done
    for c in 1 64; do
      n=$([ $c = 1 ] && echo 12 || echo 64)
      v=$(cd "$tmp" && PYTHONPATH=${TREE[$t]} $PY -m tideserve bench serve --base-url "http://127.0.0.1:$port" \
          --dataset random --num-prompts $n --input-len 256 --output-len 48 --max-concurrency $c --ignore-eos \
          --seed "$r" --disable-tqdm 2>/dev/null | tok_s)
      echo "round $r $t served-$c $v"
    done
    pkill -f "tideserve serve --port $port"; sleep 3
  done
done
