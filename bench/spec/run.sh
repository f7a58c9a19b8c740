#!/usr/bin/env bash
# Speculative decoding side by side: metrale-server plain and with prompt lookup, llama-server plain
# and with its n-gram speculation, one after another on the same GGUF and the same copy-heavy
# prompts (spec.py), greedy, batch 1. Each server's texts are compared with its own plain run.
# Usage: bench/spec/run.sh OUT_DIR MODEL.gguf OUR_SERVER LLAMA_SERVER [MORE_ARGS_FOR_OUR_SERVER...]
# Env: NUM_PROMPTS (12), MAX_TOKENS (256), K (4: metrale's --num-speculative-tokens),
#      LLAMA_SPEC ("--spec-type ngram-simple": llama-server's own defaults, n-grams of 12 tokens).
set -euo pipefail
out=$1 model=$2 ours=$3 peer=$4
shift 4
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
n=${NUM_PROMPTS:-12} max=${MAX_TOKENS:-256} k=${K:-4}
port=$((18300 + RANDOM % 500))
wait_ready() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited: see $2" >&2; exit 1; }
    sleep 0.5
  done
  echo "server not ready after 300 s: see $2" >&2
  exit 1
}
run() { # label compare-with command...
  local label=$1 cmp=$2
  shift 2
  "$@" --port "$port" >"$out/$label.log" 2>&1 &
  local pid=$!
  wait_ready $pid "$out/$label.log"
  python3 "$here/spec.py" --base "http://127.0.0.1:$port" --label "$label" --num-prompts "$n" \
    --max-tokens "$max" --out "$out/$label.json" ${cmp:+--compare "$out/$cmp.json"} | tee -a "$out/summary.txt"
  kill $pid
  wait $pid 2>/dev/null || true
}
: >"$out/summary.txt"
run metrale-plain "" "$ours" -m "$model" --ctx-size 4096 --parallel 1 "$@"
run metrale-ngram metrale-plain "$ours" -m "$model" --ctx-size 4096 --parallel 1 --speculative ngram \
  --num-speculative-tokens "$k" "$@"
run llama-plain "" "$peer" -m "$model" -c 4096 -np 1
# shellcheck disable=SC2086
run llama-ngram llama-plain "$peer" -m "$model" -c 4096 -np 1 ${LLAMA_SPEC:---spec-type ngram-simple}
