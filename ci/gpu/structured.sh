#!/usr/bin/env bash
# Constrained against unconstrained decode on the H200 machine: the device masks' tests (the kernel's,
# and the whole model's against the CPU backend), then each server at 1 and 64 streams over HTTP
# with and without a JSON schema (bench/load/load.py --schema bench/structured/long-array.json:
# answers of ~200 tokens, so the decode rates compare), and the host time the masks took (the
# server's metrale:grammar_mask* counters, before and after each run); llama.cpp's llama-server on
# the same files, the same way. Two calls made back to back (the machine keeps ~/ while warm).
# ST_STREAMS and ST_TOKENS (default "1 64" and 256) shorten a trial run elsewhere;
# ST_SKIP="NAME:STREAMS:MODE ..." leaves runs out (e.g. llamacpp-l8b-q4_1:64:schema); ST_PEER=0
# leaves llama.cpp out (no build, no wait).
#
#   bash ci/gpu/structured.sh prepare MODEL.gguf   CPU machine: .st1/ and .st2/ (the default
#                                                  model, xz-compressed, split between them;
#                                                  llama.cpp's source from .peer/ in .st1)
#   bash ci/gpu/structured.sh call1   carry .st1   llama.cpp's build (background); kernel tests
#        (h200/smollm2-135m/q4_1 and h200/llama-3.1-8b/q4_1, the mask test among them); the 8B
#        q4_1 GGUF made there; once the build is done, its server, then llama-server on it
#   bash ci/gpu/structured.sh call2   carry .st2   the default model assembled and checked; SmolLM2's
#        cuda_model and contract tests; its server, then llama-server on it
#   bash ci/gpu/structured.sh runs NAME SERVER MODEL   the runs alone, against any metrale-server
#   bash ci/gpu/structured.sh peer NAME LLAMA_SERVER MODEL   the same against llama-server
# Each call leaves $OUT/<call>.tgz (its results folder). ci/gpu/README.md says what they predict.
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
SCHEMA=bench/structured/long-array.json

# the grammar counters of the server on PORT: "masks seconds"
mask_counters() {
  curl -s "localhost:$1/metrics" | awk '/^metrale:grammar_masks_total/ {n=$2} /^metrale:grammar_mask_seconds_total/ {s=$2} END {print n+0, s+0}'
}

# NAME SERVER MODEL: metrale-server at 1 stream (3 runs each way) and 64 streams (1 run each way),
# unconstrained then constrained; one JSON line per run in $R/structured-NAME.jsonl
runs() {
  step "$1: server up"
  "$2" --model "$3" --port 8093 --parallel 64 --ctx-size 1024 > "$R/serve-$1.log" 2>&1 &
  measure "$1" $!
}

# NAME LLAMA_SERVER MODEL: llama.cpp's server on the same file (64 slots of 1024 positions, every
# layer on the GPU, flash attention by its default), the same runs
peer() {
  step "$1: llama-server up"
  "$2" -m "$3" --port 8093 -ngl 99 -np 64 -c 65536 > "$R/serve-$1.log" 2>&1 &
  measure "$1" $!
}

# NAME PID: the runs against the server PID listening on port 8093, then stop it
measure() {
  local name=$1 sp=$2 port=8093
  for _ in $(seq 600); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.2; done
  for streams in ${ST_STREAMS:-1 64}; do
    local reps=5; [ $streams -gt 1 ] && reps=1
    for rep in $(seq $reps); do
      for mode in free schema; do
        case " ${ST_SKIP:-} " in *" $name:$streams:$mode "*) step "$name: $streams streams $mode: skipped (ST_SKIP)"; continue;; esac
        local extra="" f=$R/load-$name-$streams-$mode-$rep.json
        [ $mode = schema ] && extra="--schema $SCHEMA"
        # each run stops at 120 s, or earlier when the call's time runs out
        local to=$(($(left) - 30)); [ $to -gt 120 ] && to=120
        [ $to -lt 10 ] && { step "$name: $streams streams $mode: no time left"; continue; }
        local c0; c0=$(mask_counters $port)
        timeout $to python3 bench/load/load.py --base http://127.0.0.1:$port --streams $streams \
          --prompt-words 40 --max-tokens ${ST_TOKENS:-256} $extra --out "$f" > /dev/null
        local rc=$? c1; c1=$(mask_counters $port)
        python3 - "$f" "$name" "$streams" "$mode" "$rc" "$c0" "$c1" <<'EOF' | tee -a "$R/structured-$name.jsonl"
import json, sys
f, name, streams, mode, rc, c0, c1 = sys.argv[1:]
try:
    d = json.load(open(f))
except OSError:
    d = {}
n0, s0 = map(float, c0.split()); n1, s1 = map(float, c1.split())
masks = n1 - n0
print(json.dumps({"model": name, "streams": int(streams), "mode": mode, "rc": int(rc),
                  "stream_decode_tok_s_p50": d.get("stream_decode_tok_s_p50"),
                  "output_tok_s": d.get("output_tok_s"), "invalid_json": d.get("invalid_json"),
                  "masks": masks, "mask_us_per_token": (s1 - s0) / masks * 1e6 if masks else None}))
EOF
      done
    done
  done
  kill $sp; wait $sp
  # per stream count: medians each way, constrained / unconstrained, host time per mask
  python3 - "$R/structured-$name.jsonl" <<'EOF' | tee -a "$R/structured-summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda v: statistics.median(v) if v else None
for n in sorted({r["streams"] for r in rows}):
    got = {}
    for mode in ("free", "schema"):
        rs = [r for r in rows if r["streams"] == n and r["mode"] == mode and r["rc"] == 0]
        got[mode] = (med([r["stream_decode_tok_s_p50"] for r in rs]), med([r["output_tok_s"] for r in rs]),
                     med([r["mask_us_per_token"] for r in rs if r["mask_us_per_token"] is not None]), len(rs))
    (fs, fo, _, fn), (ss, so, mu, sn) = got["free"], got["schema"]
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"
    fmt = lambda v: f"{v:,.1f}" if v is not None else "-"
    print(f"{rows[0]['model']} {n} streams: per-stream decode {fmt(fs)} -> {fmt(ss)} tok/s "
          f"(x{ratio(ss, fs)}), output {fmt(fo)} -> {fmt(so)} tok/s (x{ratio(so, fo)}), "
          f"mask {fmt(mu)} us/token, runs {fn}/{sn}")
EOF
}

# NAME MODEL: llama-server's runs if it was built and there is time (and ST_PEER is not 0)
with_peer() {
  local L=$H/llamacpp/build/bin/llama-server
  [ "${ST_PEER:-1}" = 1 ] || return 0
  if [ -x "$L" ] && [ "$(left)" -gt 100 ]; then
    peer "$1" "$L" "$2"
  else
    step "$1: not run ($(left) s left, $(cat "$H/llamacpp/build.done" 2>/dev/null || echo 'build not done'))"
  fi
}

case "${1:-}" in
runs|peer)  # the runs alone, against any server binary (a trial on the CPU machine)
  mkdir -p "$R"; "$@"
  ;;
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/structured.sh prepare MODEL.gguf" >&2; exit 2; }
  rm -rf .st1 .st2 && mkdir -p .st1/b/bin .st1/b/k .st1/b/srv .st2
  for t in smollm2-135m llama-3.1-8b; do
    cargo xtask build-target --hw h200 --model $t --quant q4_1 --kernels-only --out .st1/b/k/h200-$t-q4_1 2>&1 | tail -1
    cargo xtask build-target --hw h200 --model $t --quant q4_1 --out .st1/b/srv/h200-$t-q4_1 2>&1 | tail -1
    rm -rf .st1/b/srv/h200-$t-q4_1/kernels
  done
  for t in cuda_kernels cuda_model contract; do
    cp "$(exe test --release -p metrale-backend --features cuda --no-run --test $t)" .st1/b/bin/$t
  done
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  cp .peer/llamacpp-src.tgz .st1/
  cp "$(exe build --release -p xtask)" .st1/b/bin/xtask
  strip .st1/b/bin/* .st1/b/srv/*/metrale-server
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .st1/b/vocab-8b.gguf >/dev/null
  tar cJf .st1/b.tar.xz -C .st1 b && rm -rf .st1/b
  # the default model, xz-compressed, as much in .st1 as fits (1.5 MB kept in hand)
  xz -T0 -6 -c "$model" > .st2/model.xz
  n=$((67108864 - 1500000 - $(du -cb .st1 | tail -1 | cut -f1) - $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)))
  head -c $n .st2/model.xz > .st1/part.aa
  tail -c +$((n + 1)) .st2/model.xz > .st2/part.ab && rm .st2/model.xz
  sha256sum "$model" | cut -d' ' -f1 > .st2/model.sha256
  for c in .st1 .st2; do echo "carry $c: $(du -cb $c | tail -1 | cut -f1) bytes + the tree (at most 67108864)"; done
  ;;
call1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .st1/b.tar.xz -C "$H" && cp .st1/part.aa "$H/b/"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$R/gpu.txt"
  if [ "${ST_PEER:-1}" = 1 ]; then
    step "llama.cpp build (background)"
    bash ci/gpu/llamacpp.sh bench .st1/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  fi
  kernel_tests smollm2-135m/q4_1 llama-3.1-8b/q4_1
  step "synth-model: 8B q4_1 GGUF"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model | tee "$R/synth.txt"
  # the servers measured once the build no longer takes the CPU
  if [ "${ST_PEER:-1}" = 1 ]; then
    step "llama.cpp build: waiting"
    peer_wait 350 | tee -a "$R/steps.txt"
  fi
  runs l8b-q4_1 "$H/b/srv/h200-llama-3.1-8b-q4_1/metrale-server" "$H/s/l8b-q4_1.gguf"
  with_peer llamacpp-l8b-q4_1 "$H/s/l8b-q4_1.gguf"
  finish call1
  ;;
call2)
  mkdir -p "$R"
  step "assemble the default model"
  cat "$H/b/part.aa" .st2/part.ab | xz -dc > "$H/s/smollm2.gguf"
  echo "$(cat .st2/model.sha256)  $H/s/smollm2.gguf" | sha256sum -c - || exit 1
  smollm2_regression
  runs smollm2-q4_1 "$H/b/srv/h200-smollm2-135m-q4_1/metrale-server" "$H/s/smollm2.gguf"
  with_peer llamacpp-smollm2-q4_1 "$H/s/smollm2.gguf"
  finish call2
  ;;
prepare-quick)  # CPU machine: .st3/ (SmolLM2's target, cuda_bench, cuda_kernels, xtask, SmolLM2's vocabulary)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/structured.sh prepare-quick MODEL.gguf" >&2; exit 2; }
  rm -rf .st3 && mkdir -p .st3/b/bin .st3/b/k .st3/b/srv
  t=smollm2-135m
  cargo xtask build-target --hw h200 --model $t --quant q4_1 --kernels-only --out .st3/b/k/h200-$t-q4_1 2>&1 | tail -1
  cargo xtask build-target --hw h200 --model $t --quant q4_1 --out .st3/b/srv/h200-$t-q4_1 2>&1 | tail -1
  rm -rf .st3/b/srv/h200-$t-q4_1/kernels
  cp "$(exe build --release -p metrale-backend --features cuda --example cuda_bench)" .st3/b/bin/cuda_bench
  cp "$(exe test --release -p metrale-backend --features cuda --no-run --test cuda_kernels)" .st3/b/bin/cuda_kernels
  cp "$(exe build --release -p xtask)" .st3/b/bin/xtask
  strip .st3/b/bin/* .st3/b/srv/*/metrale-server
  cargo xtask synth-model $t --tokenizer "$model" --format vocab --out .st3/b/vocab.gguf >/dev/null
  tar cJf .st3/b.tar.xz -C .st3 b && rm -rf .st3/b
  echo "carry .st3: $(du -cb .st3 | tail -1 | cut -f1) bytes + the tree"
  ;;
quick)  # carry .st3: SmolLM2's kernel tests; its shape on a synthetic file (one call, no model to assemble): batch-1
  # decode in process with and without a mask on every step (cuda_bench's tg128, tg128_masked and
  # the masked pick's pieces) under each runtime choice in ST_TUNINGS, then the server at one
  # stream under each of ST_SERVER_TUNINGS ("default": none)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .st3/b.tar.xz -C "$H"
  "$H/b/bin/xtask" synth-model smollm2-135m --tokenizer "$H/b/vocab.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/smollm2-synth.gguf" 2>&1 | grep synth-model | tee "$R/synth.txt"
  kernel_tests smollm2-135m/q4_1
  for t in ${ST_TUNINGS:-default mask_zero_copy=on pdl=off mask_zero_copy=on,pdl=off}; do
    step "cuda_bench, $t"
    tv=$t; [ "$t" = default ] && tv=""
    METRALE_CUDA_TUNING=$tv METRALE_TARGETS=$PWD/targets timeout 120 "$H/b/bin/cuda_bench" \
      "$H/s/smollm2-synth.gguf" "$H/b/k/h200-smollm2-135m-q4_1/kernels" h200/smollm2-135m/q4_1 \
      --batch 1 --pp 64 --steps 64 --out "$R/bench-$t.json" > /dev/null 2> "$R/bench-$t.txt"
    grep -E "tg128|relaunched|panicked" "$R/bench-$t.txt"
  done
  for t in ${ST_SERVER_TUNINGS:-default mask_zero_copy=on}; do
    tv=$t; [ "$t" = default ] && tv=""
    (export METRALE_CUDA_TUNING=$tv ST_STREAMS=1
     runs "smollm2-synth-$t" "$H/b/srv/h200-smollm2-135m-q4_1/metrale-server" "$H/s/smollm2-synth.gguf")
  done
  finish quick
  ;;
*)
  sed -n 2,21p "$0"; exit 2
  ;;
esac
