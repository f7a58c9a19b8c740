#!/usr/bin/env bash
# The serving benchmark (serve.py) against metrale-server and llama.cpp's llama-server on the same
# GGUF, one after the other on one machine: the same seeded workload at swept Poisson rates and at a
# fixed concurrency, then one long prompt among decoding streams; a JSON file per server and run, the
# latency plot of both, and a summary table (summary.md).
#
#   bash bench/serve/run.sh SERVER LLAMA_SERVER MODEL.gguf OUT_DIR
#
# Each server gets SV_PARALLEL slots of SV_CTX positions (llama-server: --parallel and a context of
# their product, which it splits among the slots). Settings (environment; defaults for a CPU
# machine, the README gives the H200's):
#   SV_PARALLEL (8) SV_CTX (4096) SV_RATES (0.5,1,2,inf) SV_CONC (8) SV_PROMPTS (32)
#   SV_PROMPT_MEDIAN (100) SV_OUTPUT_MEDIAN (64) SV_MAX_PROMPT (512) SV_MAX_OUTPUT (256)
#   SV_LONG (1500 words) SV_AMONG (6 streams) SV_AMONG_OUT (160 tokens)
#   SV_NGL: llama-server's --n-gpu-layers (unset on a CPU machine; 99 on a GPU)
#   SV_OUR_ARGS / SV_LLAMA_ARGS: more flags for either server; SV_PORT (18095)
# A server that does not come up within 600 s, or a run with a failed request, fails the script
# (its log is in OUT_DIR).
set -euo pipefail
[ $# -eq 4 ] || { sed -n 2,18p "$0"; exit 2; }
ours=$1 theirs=$2 model=$3 out=$4
for f in "$ours" "$theirs" "$model"; do [ -f "$f" ] || { echo "run.sh: $f: no such file" >&2; exit 2; }; done
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
par=${SV_PARALLEL:-8} ctx=${SV_CTX:-4096} port=${SV_PORT:-18095}
base=http://127.0.0.1:$port
common=(--base "$base" --num-prompts "${SV_PROMPTS:-32}" --prompt-median "${SV_PROMPT_MEDIAN:-100}"
  --output-median "${SV_OUTPUT_MEDIAN:-64}" --max-prompt "${SV_MAX_PROMPT:-512}"
  --max-output "${SV_MAX_OUTPUT:-256}")

# NAME COMMAND...: start a server, wait for /health, run the sweep and the long prompt, stop it
bench() {
  local name=$1 pid t rc=0
  shift
  echo "== $name: $*" | sed "s|$HOME|~|g"
  "$@" > "$out/$name-server.log" 2>&1 &
  pid=$!
  for t in $(seq 600); do
    curl -sf "$base/health" > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || { echo "run.sh: $name exited (log: $out/$name-server.log)" >&2; exit 1; }
    sleep 1
  done
  curl -sf "$base/health" > /dev/null || { echo "run.sh: $name not healthy after 600 s" >&2; kill "$pid"; exit 1; }
  python3 "$here/serve.py" "${common[@]}" --rates "${SV_RATES:-0.5,1,2,inf}" --concurrency "${SV_CONC:-8}" \
    --label "$name" --out "$out/$name-sweep.json" || rc=1
  python3 "$here/serve.py" --base "$base" --long-prompt "${SV_LONG:-1500}" --among "${SV_AMONG:-6}" \
    --among-output "${SV_AMONG_OUT:-160}" --warmup 1 --label "$name" --out "$out/$name-long.json" || rc=1
  kill "$pid"
  wait "$pid" 2> /dev/null || true
  [ $rc -eq 0 ] || { echo "run.sh: a $name run failed (see above)" >&2; exit 1; }
}

# shellcheck disable=SC2086
bench metrale "$ours" --model "$model" --port "$port" --parallel "$par" --ctx-size "$ctx" ${SV_OUR_ARGS:-}
# shellcheck disable=SC2086
bench llama-server "$theirs" --model "$model" --port "$port" --parallel "$par" --ctx-size $((par * ctx)) \
  ${SV_NGL:+--n-gpu-layers $SV_NGL} ${SV_LLAMA_ARGS:-}

python3 "$here/serve.py" --plot "$out/latency.png" --plot-from "$out/metrale-sweep.json" "$out/llama-server-sweep.json" || true
python3 - "$out" << 'EOF' | tee "$out/summary.md"
import json, sys
out = sys.argv[1]
f = lambda v, n=1: "-" if v is None else f"{v:,.{n}f}"
names = ("metrale", "llama-server")
sweep = {n: json.load(open(f"{out}/{n}-sweep.json")) for n in names}
long = {n: json.load(open(f"{out}/{n}-long.json")) for n in names}
print("| server | arrivals | completed req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | goodput (req/s) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for name in names:
    for r in sweep[name]["runs"]:
        how = f"{r['concurrency']} in flight" if r["concurrency"] else (
            "all at once" if r["rate"] == "inf" else f"Poisson {r['rate']:g}/s")
        print(f"| {name} | {how} | {f(r['request_rate'], 2)} | {f(r['output_tok_s'])} | "
              f"{f(r['ttft_ms_p50'], 0)} / {f(r['ttft_ms_p99'], 0)} | {f(r['itl_ms_p50'])} / {f(r['itl_ms_p99'])} | "
              f"{f(r['goodput_req_s'], 2)} |")
print()
for name in names:
    print(f"{name}: highest swept rate meeting the SLO: {sweep[name]['max_rate_meeting_slo']}")
print()
print("| server | long prompt (tokens) | its TTFT (ms) | streams' ITL p50 / p99 before (ms) | during its prefill (ms) | p99 ratio |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for name in names:
    d = long[name]
    print(f"| {name} | {d['long_prompt_tokens']} | {f(d['long_ttft_ms'], 0)} | {f(d['itl_ms_p50_baseline'])} / "
          f"{f(d['itl_ms_p99_baseline'])} | {f(d['itl_ms_p50_during'])} / {f(d['itl_ms_p99_during'])} | "
          f"{f(d['itl_p99_ratio'], 2)}x |")
EOF
