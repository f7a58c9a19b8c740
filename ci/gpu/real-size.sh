#!/usr/bin/env bash
# The real-size checks on the H200 machine (the llama-3.1-8b targets on synthetic checkpoints made
# there), in four calls made back to back (the machine keeps ~/ while warm: ~30 s between calls).
# ci/gpu/README.md ("Real-size checks") says what each call carries, runs and predicts.
#
#   bash ci/gpu/real-size.sh prepare MODEL.gguf   CPU machine: build and pack .real1/, .real2/ (and
#                                                 .carry1/, .carry2/: the default model's halves, and
#                                                 .peer/: llama.cpp's source)
#   bash ci/gpu/real-size.sh call1   carry .real1 .peer    unpack; llama.cpp's build in the background;
#                                    load check and per-kernel tests of the three h200 targets; make the
#                                    8B checkpoints
#   bash ci/gpu/real-size.sh call2   carry .real2 .carry1  HF goldens (2 and 32 layers, f32 on the GPU);
#                                    CUDA against them (and against the CPU on 2 layers); the 8B bf16
#                                    server under 256 and 512 streams
#   bash ci/gpu/real-size.sh call3   carry .carry2         the SmolLM2 regression tests (cuda_model,
#                                    contract: paging); bench-record with llama.cpp for
#                                    h200/llama-3.1-8b/bf16
#   bash ci/gpu/real-size.sh call4   (carry nothing)       bench-record with llama.cpp for
#                                    h200/llama-3.1-8b/q4_1 and h200/smollm2-135m/q4_1
# Each call leaves $OUT/<call>.tgz (its results folder).
#
# After a change to the CUDA decode path, a second cycle re-runs what depends on it, in two calls
# (the 8B checkpoints are made again: a fresh machine has none):
#   bash ci/gpu/real-size.sh prepare-verify MODEL.gguf   CPU machine: .v1/, .v2/ (and .peer/)
#   bash ci/gpu/real-size.sh verify1  carry .v1 .peer    llama.cpp's build (background); the 8B files;
#                                     the 2-layer checks (kernels built for 2 layers); the 8B bf16
#                                     server under 256 then 512 streams; bench-record for 8B bf16
#   bash ci/gpu/real-size.sh verify2  carry .v2          SmolLM2's cuda_model and contract; the other
#                                     two records (and 8B bf16's if verify1 ran out of time)
# and the 2-layer comparison alone, position by position and repeated under each runtime choice
# that could race (one call, ~2 min):
#   bash ci/gpu/real-size.sh prepare-check2l MODEL.gguf   CPU machine: .v3/
#   bash ci/gpu/real-size.sh check2l  carry .v3     (ci/gpu/floor.sh call1 runs the same check
#                                     with a base revision's kernels beside this tree's)
set -uo pipefail
cd "$(dirname "$0")/../.."
H=$HOME
R=$H/results
SRC="llama.cpp vendored in llama-cpp-python 0.3.36 (ggml 0.25.3), CUDA sm_90 build (ci/gpu/llamacpp.sh)"
T8=h200/llama-3.1-8b
step() { echo "== $(date +%T) $*" | tee -a "$R/steps.txt"; }
finish() { tar czf "$OUT/$1.tgz" -C "$H" results; }
# the copy rate (GB/s) of the GPU this call got, for bench-record's floors: cuda_bench's
# device-to-device copy as measured there (H200 4,242-4,250; H100 80GB HBM3 3,013-3,018 on
# 2026-12-05); another GPU has none, and the record refuses to be made
copy_rate() {
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H200*) echo 4250 ;;
    *H100*) echo 3015 ;;
    *) echo "no measured copy rate for this GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))" >&2; echo 0 ;;
  esac
}
# bench-record with llama.cpp in the same run: record TARGET_DIR_NAME MODEL CTX
record() {
  step "bench-record $1 with llama.cpp"
  "$H/b/bin/xtask" bench-record "$H/b/srv/$1/metrale-server" --model "$2" \
    --gen-tokens 128 --concurrency "${RECORD_CONCURRENCY:-1,16,64,256}" --server-args "--parallel 256 --ctx-size $3" \
    --peer "$H/llamacpp/build/bin" --peer-source "$SRC" --memory-bandwidth-gbs "$(copy_rate)" --out "$R/records" \
    > "$R/record-$1.log" 2>&1; tail -3 "$R/record-$1.log"
}

T0=$(date +%s)
# seconds left before this call should stop (a call may run 600 s, CALL_LIMIT where the session's
# device time left is less; 40 s kept for packing)
left() { echo $((${CALL_LIMIT:-600} - 40 - $(date +%s) + T0)); }
# peer_wait [SECONDS]: until llama.cpp's build (started in the background by `llamacpp.sh bench`)
# is done, at most SECONDS (default 600), so that no timing shares the CPUs with it; prints its
# exit status, or that it is not done
peer_wait() {
  local _
  for _ in $(seq $((${1:-600} / 5))); do
    [ -f "$H/llamacpp/build.done" ] && { cat "$H/llamacpp/build.done"; return 0; }
    sleep 5
  done
  echo "llama.cpp's build not done after ${1:-600} s"
}
# the executable a cargo command builds (the last one it names)
exe() { cargo "$@" --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json; [print(j["executable"]) for j in map(json.loads, sys.stdin) if j.get("executable")]' | tail -1; }
# cb_run GGUF KERNEL_DIR TARGET NAME [cuda_bench args]: one cuda_bench run, its JSON to $R/NAME.json and
# its output to $R/NAME.txt, the summary lines printed (CB: the binary, TG: the targets folder,
# CB_TIMEOUT: seconds; default this tree's binary and targets/, 240 s)
cb_run() {
  local m=$1 k=$2 t=$3 n=$4; shift 4
  step "cuda_bench $n ${METRALE_CUDA_TUNING:-}"
  METRALE_TARGETS=${TG:-$PWD/targets} timeout "${CB_TIMEOUT:-240}" "${CB:-$H/b/bin/cuda_bench}" "$m" "$k" "$t" \
    --out "$R/$n.json" "$@" > "$R/$n.txt" 2>&1; echo "rc=$?" >> "$R/$n.txt"
  grep -E "copy:|decode b=1|attention alone|tg128|prefill 512:|prefill of one|decode batch|sum of kernels|${CB_GREP:-rc=}|rc=" "$R/$n.txt"
}
# kernel_tests MODEL/QUANT...: cuda_kernels (each kernel against the CPU reference ops) for each
# h200 target whose kernels are in $H/b/k/h200-MODEL-QUANT; its output in $R/kernel-tests-MODEL-QUANT.txt
# (KT_FILTER: only the tests whose names hold it)
kernel_tests() {
  local t n f
  for t in "$@"; do
    n=${t//\//-}; f=$R/kernel-tests-$n.txt
    [ -d "$H/b/k/h200-$n" ] || { echo "cuda_kernels h200/$t: no kernels in $H/b/k/h200-$n" | tee "$f"; continue; }
    step "cuda_kernels h200/$t"
    METRALE_CUDA_TARGET=h200/$t METRALE_CUDA_KERNELS=$H/b/k/h200-$n/kernels METRALE_TARGETS=$PWD/targets \
      timeout 240 "$H/b/bin/cuda_kernels" --nocapture --test-threads=1 ${KT_FILTER:-} > "$f" 2>&1
    echo "cuda_kernels h200/$t rc=$?" >> "$f"; grep -E "rel err|mask|test result|panicked|rc=" "$f" | tail -12
  done
}
# make the 8B checkpoints from the carried vocabulary GGUF: bf16 and q4_1 GGUFs, 2-layer HF folder and GGUF
synth8b() {
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs, 2-layer HF folder and bf16 GGUF"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf" \
           "--layers 2 --format hf --out $H/s/l8b2-hf" "--layers 2 --out $H/s/l8b2-bf16.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
}
# the 8B bf16 server: 256 streams that all fit (all must finish), then 512 that cannot
serve8b() {
  S="$H/b/srv/h200-llama-3.1-8b-bf16/metrale-server"
  step "8B bf16 server, 256 slots, pool 131072 tokens: 256 streams (~160 prompt + 256 generated), all must finish"
  "$S" --model "$H/s/l8b-bf16.gguf" --port 8091 --parallel 256 --ctx-size 4096 --kv-cache-tokens 131072 > "$R/serve.log" 2>&1 &
  SP=$!
  for _ in $(seq 600); do curl -sf localhost:8091/health >/dev/null && break; sleep 0.2; done
  grep -E "backend:|decode:|KV cache|ready in" "$R/serve.log"
  timeout 150 python3 bench/load/load.py --base http://127.0.0.1:8091 --streams 256 --prompt-words 140 \
    --max-tokens 256 --expect-all-ok --out "$R/load-256.json" | tail -13; echo "load-256 rc=$?"
  step "512 streams into the same server (256 slots; 512 x ~416 tokens > the pool): finish or 429/503"
  timeout 200 python3 bench/load/load.py --base http://127.0.0.1:8091 --streams 512 --prompt-words 140 \
    --max-tokens 256 --out "$R/load-512.json" | tail -13; echo "load-512 rc=$?"
  curl -s localhost:8091/metrics | grep -E "^vllm:(num_preemptions|request_success)|rejected" | tee "$R/metrics.txt"
  kill $SP; wait $SP
}

# in_rev REV CMD...: run CMD in a worktree of revision REV (its own xtask, built in target/base,
# with this checkout's pinned toolchain); CMD's paths must be absolute
in_rev() {
  local rev=$1 top=$PWD; shift
  rm -rf "$top/.rev" && git worktree prune && git worktree add --detach "$top/.rev" "$rev" >/dev/null
  (cd "$top/.rev" && export METRALE_TOOLCHAIN=$top/.toolchain/cuda-13.0 CARGO_TARGET_DIR=$top/target/base && "$@")
  local rc=$?
  git worktree remove --force "$top/.rev"
  return $rc
}

# the 2-layer variant's kernels (the KV layout and decode_1 depend on the layer count): the same
# target built from a copy of the targets with layers = 2, into $1/k/h200-MODEL-2l-bf16, and that
# copy's targets/ in $1/t2 (golden_check reads it through METRALE_TARGETS)
kernels2l() {  # DIR [NAME] [MODEL] [QUANT]: DIR/k/NAME (default h200-MODEL-2l-QUANT; MODEL llama-3.1-8b, QUANT bf16)
  local t2=$1/t2 m=${3:-llama-3.1-8b} q=${4:-bf16}
  mkdir -p "$t2" "$1/k" && [ -d "$t2/targets" ] || cp -r targets "$t2/"
  rm -rf "$t2/kernels" && cp -r kernels "$t2/"
  sed -i 's/^layers = [0-9]*$/layers = 2/' "$t2/targets/models/$m.toml"
  grep -q '^layers = 2$' "$t2/targets/models/$m.toml"
  cargo xtask build-target --hw h200 --model "$m" --quant "$q" --kernels-only --repo "$t2" \
    --out "$1/k/${2:-h200-$m-2l-$q}" 2>&1 | tail -1
  rm -rf "$t2/kernels"
}

# SmolLM2's whole-model checks on the paged cache ($H/s/smollm2.gguf, assembled and checked first)
smollm2_regression() {
  (
    export METRALE_MODEL=$H/s/smollm2.gguf METRALE_CUDA_KERNELS=$H/b/k/h200-smollm2-135m-q4_1/kernels
    export METRALE_CUDA_TARGET=h200/smollm2-135m/q4_1 METRALE_TARGETS=$PWD/targets
    step "SmolLM2 regression: cuda_model (64 sequences on the GEMM decode path too) and the contract"
    timeout 300 "$H/b/bin/cuda_model" --nocapture --test-threads=1 > "$R/model-test.txt" 2>&1; echo "cuda_model rc=$?" | tee -a "$R/model-test.txt"
    timeout 100 "$H/b/bin/contract" --nocapture --test-threads=1 > "$R/contract.txt" 2>&1; echo "contract rc=$?" | tee -a "$R/contract.txt"
    grep -E "test result|panicked|worst rel" "$R/model-test.txt" "$R/contract.txt"
  )
}

# Packing a call on the CPU machine (qwen3.sh, spec.sh); DIR is the carried folder, its files go in DIR/b.tar.xz
# pack_start DIR MODE MODEL.gguf: the model (the vocabulary's source) checked, DIR emptied
pack_start() {
  model=${3:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/$(basename "$0") $2 MODEL.gguf" >&2; exit 2; }
  rm -rf "$1" && mkdir -p "$1/b/bin" "$1/b/k" "$1/b/srv"
}
# kernels DIR MODEL/QUANT...: each h200 target's kernels in DIR/b/k/h200-MODEL-QUANT
kernels() {
  local d=$1 t; shift
  for t in "$@"; do
    cargo xtask build-target --hw h200 --model "${t%/*}" --quant "${t#*/}" --kernels-only \
      --out "$d/b/k/h200-${t%/*}-${t#*/}" 2>&1 | tail -1
  done
}
# servers DIR MODEL/QUANT...: each h200 target's server binary in DIR/b/srv/h200-MODEL-QUANT
servers() {
  local d=$1 t o; shift
  for t in "$@"; do
    o=$d/b/srv/h200-${t%/*}-${t#*/}
    cargo xtask build-target --hw h200 --model "${t%/*}" --quant "${t#*/}" --out "$o" 2>&1 | tail -1
    rm -rf "$o/kernels"
  done
}
# tools DIR EXAMPLE...: cuda_kernels, the examples named and xtask in DIR/b/bin
tools() {
  local d=$1 e C="--release -p metrale-backend --features cuda"; shift
  cp "$(exe test $C --no-run --test cuda_kernels)" "$d/b/bin/cuda_kernels"
  for e in "$@"; do cp "$(exe build $C --example "$e")" "$d/b/bin/$e"; done
  cp "$(exe build --release -p xtask)" "$d/b/bin/xtask"
}
# vocab DIR MODEL [FILE]: the model's vocabulary-only GGUF in DIR/b/FILE (default vocab.gguf)
vocab() {
  cargo xtask synth-model "$2" --tokenizer "$model" --format vocab --out "$1/b/${3:-vocab.gguf}" >/dev/null
}
# pack_end DIR [.peer]: binaries stripped, DIR/b packed; what the call carries (with .peer: the
# peer's source too, packed once)
pack_end() {
  local f
  for f in "$1"/b/bin/* "$1"/b/srv/*/metrale-server; do
    if [ -f "$f" ]; then strip "$f"; fi
  done
  tar cJf "$1/b.tar.xz" -C "$1" b && rm -rf "$1/b"
  [ -z "${2:-}" ] || [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  echo "carry $1${2:+ $2}: $(du -cb "$1" ${2:-} | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
}
# the GPU machine's side: unpack DIR: a fresh results folder and checkpoints folder (an earlier call's
# checkpoint in /dev/shm, which holds RAM, goes too), DIR's files in ~/b, the GPU's state recorded
unpack() {
  rm -rf "$R" "$H/b" "$H/s" /dev/shm/*.gguf && mkdir -p "$R" "$H/s" && tar xJf "$1/b.tar.xz" -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
}

# ci/gpu/floor.sh, qwen3.sh and spec.sh source this file for the helpers above and stops here
[ "${REAL_SIZE_LIB:-}" = 1 ] && return 0

case "${1:-}" in
prepare-verify)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/real-size.sh prepare-verify MODEL.gguf" >&2; exit 2; }
  rm -rf .v1 .v2 && mkdir -p .v1/b/bin .v1/b/k .v1/b/srv .v2/b/srv .v2/b/k
  kernels2l .v1/b
  cargo xtask build-target --hw h200 --model smollm2-135m --quant q4_1 --kernels-only \
    --out .v2/b/k/h200-smollm2-135m-q4_1 2>&1 | tail -1
  for t in llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1; do
    m=${t%/*} q=${t#*/} d=.v2; [ "$t" = llama-3.1-8b/bf16 ] && d=.v1
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --out "$d/b/srv/h200-$m-$q" 2>&1 | tail -1
    rm -rf "$d/b/srv/h200-$m-$q/kernels"
  done
  for t in cuda_model contract; do cp "$(exe test --release -p metrale-backend --features cuda --no-run --test $t)" .v1/b/bin/$t; done
  cp "$(exe build --release -p metrale-backend --features cuda --example golden_check)" .v1/b/bin/golden_check
  cp "$(exe build --release -p xtask)" .v1/b/bin/xtask
  strip .v1/b/bin/*
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .v1/b/vocab-8b.gguf >/dev/null
  tar cJf .v1/b.tar.xz -C .v1 b && rm -rf .v1/b
  tar cJf .v2/b.tar.xz -C .v2 b && rm -rf .v2/b
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  # the default model, xz-compressed (98.4 -> 90.5 MB), in two parts: as much in .v1 as fits
  # beside the peer's source (1.5 MB kept in hand)
  xz -T0 -6 -c "$model" > .v2/model.xz
  n=$((67108864 - 1500000 - $(du -cb .v1 .peer | tail -1 | cut -f1) - $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)))
  head -c $n .v2/model.xz > .v1/part.aa
  tail -c +$((n + 1)) .v2/model.xz > .v2/part.ab && rm .v2/model.xz
  sha256sum "$model" | cut -d' ' -f1 > .v2/model.sha256
  for c in ".v1 .peer" ".v2"; do
    echo "carry $c: $(du -cb $c | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  done
  ;;
verify1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s"
  tar xJf .v1/b.tar.xz -C "$H" && cp .v1/part.aa "$H/b/"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth8b
  step "HF golden (f32 on the GPU), 2 layers"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1
  tail -2 "$R/golden2.txt"
  step "CUDA vs HF and vs CPU: 2 layers (bf16 KV), HF folder and GGUF"
  K2=$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels
  for m in "$H/s/l8b2-hf" "$H/s/l8b2-bf16.gguf"; do
    METRALE_TARGETS=$H/b/t2/targets "$H/b/bin/golden_check" "$m" "$R/l8b2_golden.json" --cuda "$K2" $T8/bf16 \
      --vs-cpu --tol 0.05 | tee -a "$R/check-2l.json"
  done
  serve8b
  peer_wait 300
  if [ "$(left)" -gt 170 ]; then record h200-llama-3.1-8b-bf16 "$H/s/l8b-bf16.gguf" 4096; fi
  finish verify1
  ;;
prepare-check2l)
  # .v3: golden_check, xtask, the 2-layer variant's kernels and targets, the vocabulary GGUF
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/real-size.sh prepare-check2l MODEL.gguf" >&2; exit 2; }
  rm -rf .v3 && mkdir -p .v3/b/bin .v3/b/k
  kernels2l .v3/b
  cp "$(exe build --release -p metrale-backend --features cuda --example golden_check)" .v3/b/bin/golden_check
  cp "$(exe build --release -p xtask)" .v3/b/bin/xtask
  strip .v3/b/bin/*
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .v3/b/vocab-8b.gguf >/dev/null
  tar cJf .v3/b.tar.xz -C .v3 b && rm -rf .v3/b
  echo "carry .v3: $(du -cb .v3 | tail -1 | cut -f1) bytes"
  ;;
check2l)
  # the 2-layer comparison alone, per position: the prompt in one GEMM step and in 32-token
  # matrix-vector steps; then each run repeated 3 times on one backend (a deterministic backend
  # gives the same rows) under the runtime choices that could race (METRALE_CUDA_TUNING), to find
  # which one the run-to-run differences of one-sequence decode steps come from
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .v3/b.tar.xz -C "$H"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --layers 2 --format hf \
    --out "$H/s/l8b2-hf" 2>&1 | grep synth-model
  step "HF golden (f32 on the GPU), 2 layers"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1
  tail -1 "$R/golden2.txt"
  C="$H/b/bin/golden_check $H/s/l8b2-hf $R/l8b2_golden.json"
  export METRALE_TARGETS=$H/b/t2/targets
  K2=$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels
  step "CUDA, prompt in one step (GEMM path), vs HF and vs CPU"
  $C --cuda "$K2" $T8/bf16 --vs-cpu --tol 0.05 | tee "$R/check-2l-gemm.json"
  step "CUDA, prompt in 32-token steps (matrix-vector path), vs HF and vs CPU"
  $C --cuda "$K2" $T8/bf16 --vs-cpu --tol 0.05 --prefill-chunk 32 | tee "$R/check-2l-mv.json"
  step "CPU alone vs HF: bf16 KV, f32 activations"
  $C --kv bf16 --exact --tol 0.05 | tee "$R/check-2l-cpu.json"
  for t in "" graphs=off pdl=off attention_cluster=off lm_head_1=off pdl=off,graphs=off \
           pdl=off,attention_cluster=off,lm_head_1=off; do
    step "CUDA, 3 repeats, METRALE_CUDA_TUNING=$t"
    METRALE_CUDA_TUNING=$t $C --cuda "$K2" $T8/bf16 --tol 0.05 --repeat 3 \
      | tee -a "$R/repeat-2l.jsonl" | python3 -c 'import sys,json; d=json.load(sys.stdin); print(d["tuning"] or "default", "top20", round(d["max_abs_diff_top20"], 4), "rerun", d["repeat"]["max_abs_diff"], [round(x, 3) for x in d["max_abs_diff_top20_per_position"]])'
  done
  finish check2l
  ;;
verify2)
  mkdir -p "$R" && tar xJf .v2/b.tar.xz -C "$H"
  cat "$H/b/part.aa" .v2/part.ab | xz -d > "$H/s/smollm2.gguf"
  echo "$(cat .v2/model.sha256)  $H/s/smollm2.gguf" | sha256sum -c | tee "$R/model-sha256.txt" || exit 1
  smollm2_regression
  ls "$R"/records/*llama-3.1-8b-bf16* >/dev/null 2>&1 || record h200-llama-3.1-8b-bf16 "$H/s/l8b-bf16.gguf" 4096
  record h200-llama-3.1-8b-q4_1 "$H/s/l8b-q4_1.gguf" 4096
  record h200-smollm2-135m-q4_1 "$H/s/smollm2.gguf" 2048
  finish verify2
  ;;
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/real-size.sh prepare MODEL.gguf" >&2; exit 2; }
  rm -rf .real1 .real2 && mkdir -p .real1/bin .real1/k .real2/srv .carry1 .carry2
  for t in llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1; do
    m=${t%/*} q=${t#*/}
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --kernels-only --out ".real1/k/h200-$m-$q" 2>&1 | tail -1
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --out ".real2/srv/h200-$m-$q" 2>&1 | tail -1
    rm -rf ".real2/srv/h200-$m-$q/kernels"
  done
  C="--release -p metrale-backend --features cuda"
  for t in cuda_kernels cuda_model contract; do cp "$(exe test $C --no-run --test $t)" .real1/bin/$t; done
  for e in cuda_load_check cuda_bench golden_check; do cp "$(exe build $C --example $e)" .real1/bin/$e; done
  cp "$(exe build --release -p xtask)" .real1/bin/xtask
  strip .real1/bin/*
  kernels2l .real1
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .real1/vocab-8b.gguf >/dev/null
  tar cJf .real1/bin.tar.xz -C .real1 bin k t2 vocab-8b.gguf && rm -rf .real1/bin .real1/k .real1/t2 .real1/vocab-8b.gguf
  tar cJf .real2/srv.tar.xz -C .real2 srv && rm -rf .real2/srv
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  head -c 40000000 "$model" > .carry1/part.aa
  tail -c +40000001 "$model" > .carry2/part.ab
  sha256sum "$model" | cut -d' ' -f1 > .carry2/model.sha256
  for c in ".real1 .peer" ".real2 .carry1" ".carry2"; do
    echo "carry $c: $(du -cb $c | tail -1 | cut -f1) bytes (at most 67108864)"
  done
  ;;
call1)
  rm -rf "$R" "$H/b" && mkdir -p "$R" "$H/b" "$H/s"
  tar xJf .real1/bin.tar.xz -C "$H/b"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  step "load check"
  "$H/b/bin/cuda_load_check" "$H"/b/k/h200-*/kernels > "$R/load-check.txt" 2>&1; echo "rc=$?" | tee -a "$R/load-check.txt"
  kernel_tests llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 GGUF (the issue: under a minute on 16 cores)"
  { time $X --out "$H/s/l8b-bf16.gguf" ; } > "$R/synth-bf16.txt" 2>&1; grep -E "synth-model|real" "$R/synth-bf16.txt"
  step "synth-model: 8B q4_1 GGUF, 8B HF folder, 2-layer HF folder and bf16 GGUF"
  $X --quant q4_1 --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --format hf --out "$H/s/l8b-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --layers 2 --format hf --out "$H/s/l8b2-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --layers 2 --out "$H/s/l8b2-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  df -h "$H" | tail -1 | tee -a "$R/synth.txt"
  finish call1
  ;;
call2)
  mkdir -p "$R" && cp .carry1/part.aa "$H/b/" && tar xJf .real2/srv.tar.xz -C "$H/b"
  G=tests/golden/make_synth_golden_hf.py
  step "HF goldens (f32 on the GPU): 2 layers, then 32"
  python3 $G "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1; tail -2 "$R/golden2.txt"
  python3 $G "$H/s/l8b-hf" --device cuda --out "$R/l8b_golden" > "$R/golden32.txt" 2>&1; tail -2 "$R/golden32.txt"
  C="$H/b/bin/golden_check"
  step "CUDA vs HF and vs CPU: 2 layers (bf16 KV; kernels built for 2 layers)"
  for m in "$H/s/l8b2-hf" "$H/s/l8b2-bf16.gguf"; do
    METRALE_TARGETS=$H/b/t2/targets $C "$m" "$R/l8b2_golden.json" --cuda "$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels" \
      $T8/bf16 --vs-cpu --tol 0.05 | tee -a "$R/check-2l.json"
  done
  export METRALE_TARGETS=$PWD/targets
  step "CUDA vs HF: 32 layers bf16 (GGUF and HF folder), q4_1 (quantised: reported, bound loose)"
  $C "$H/s/l8b-bf16.gguf" "$R/l8b_golden.json" --cuda "$H/b/k/h200-llama-3.1-8b-bf16/kernels" $T8/bf16 --tol 0.1 | tee "$R/check-32l-gguf.json"
  $C "$H/s/l8b-hf" "$R/l8b_golden.json" --cuda "$H/b/k/h200-llama-3.1-8b-bf16/kernels" $T8/bf16 --tol 0.1 | tee "$R/check-32l-hf.json"
  $C "$H/s/l8b-q4_1.gguf" "$R/l8b_golden.json" --cuda "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" $T8/q4_1 --tol 100 \
    --vs-cpu --cpu-tol 0.1 | tee "$R/check-32l-q4_1.json"
  serve8b
  finish call2
  ;;
call3)
  mkdir -p "$R"
  cat "$H/b/part.aa" .carry2/part.ab > "$H/s/smollm2.gguf"
  echo "$(cat .carry2/model.sha256)  $H/s/smollm2.gguf" | sha256sum -c | tee "$R/model-sha256.txt" || exit 1
  smollm2_regression
  step "llama.cpp build (started by call1) done?"
  peer_wait
  record h200-llama-3.1-8b-bf16 "$H/s/l8b-bf16.gguf" 4096
  finish call3
  ;;
call4)
  mkdir -p "$R"
  record h200-llama-3.1-8b-q4_1 "$H/s/l8b-q4_1.gguf" 4096
  record h200-smollm2-135m-q4_1 "$H/s/smollm2.gguf" 2048
  finish call4
  ;;
*)
  sed -n 2,24p "$0"; exit 2 ;;
esac
