#!/usr/bin/env bash
# Batch-1 decode at the bandwidth floor on the H200 machine (h200/llama-3.1-8b/{bf16,q4_1}, on
# synthetic checkpoints made there): correctness after a decode-path change, the per-kernel and
# per-token timings beside the copy-rate floor, at depths 0, 8192 and 32768, this tree's kernels
# against a base revision's, and llama.cpp in the same run. Two calls made back to back.
#
#   bash ci/gpu/floor.sh prepare MODEL.gguf [BASE_REV]   CPU machine: .fl1/ (and .peer/)
#   bash ci/gpu/floor.sh call1   carry .fl1 .peer   llama.cpp's build (background); the 8B
#        checkpoints; cuda_kernels on both targets; the 2-layer check (this tree's kernels, default
#        and pdl=off, and BASE's, 3 repeats each); cuda_bench on both targets: copy rate, batch-1
#        decode and its kernels, pp512, depth 8192 and 32768 (q4_1 again with the attention's
#        transpose-reduce off); then BASE's kernels at depth 0 (with BASE_REV)
#   bash ci/gpu/floor.sh call2   carry nothing      llama-bench tg128 at depths 0, 8192 and 32768 on
#        the same GGUFs; each target's server at one stream over HTTP (load.py) to compare with the
#        in-process figure; bench-record with llama.cpp for both targets (1 and 16 streams)
#   bash ci/gpu/floor.sh quick   carry .fl1         after a change: both targets' kernel tests and
#        batch-1 decode (q4_1 also at depth 8192)
#   bash ci/gpu/floor.sh call3   carry .fl1         the 2-layer check at depth 8192 (an 8192-token
#        prompt) against HF transformers and the CPU backend; one decode step's q4_1 layer kernels
#        under Nsight Compute
#   bash ci/gpu/floor.sh prepare-ab MODEL.gguf NAME=DIR...   CPU machine: .fl1/ (and .peer/) with
#        both 8B targets' kernels from this tree and from each DIR (a folder holding kernels/ and
#        targets/, such as a worktree of another revision; the kernels' ABI must be this tree's),
#        the SmolLM2 kernels, cuda_kernels, cuda_bench and xtask
#   bash ci/gpu/floor.sh ab      carry .fl1 .peer   kernel variants side by side in one call:
#        llama.cpp's build (background, when .peer is carried); the 8B GGUFs; this tree's kernel
#        tests (8B q4_1 and bf16, SmolLM2); cuda_bench batch 1 for this tree's kernels and each
#        variant (those AB_BF16 and AB_Q4_1 name alone, "none" for none: default base on bf16, all
#        on q4_1), alternating, twice each (the
#        greedy texts must agree); this tree's at depths 8192 and 32768; llama-bench tg128 at the
#        same depths; Nsight Compute on a decode step's kernels (q4_1 layer, bf16 attn_in, ffn_out
#        and LM head)
#   bash ci/gpu/floor.sh ab-depth carry .fl1        q4_1 batch 1 at depths 0, 8192, 32768 for each
#        kernel set AB_DEPTH names in turn ("this": this tree's; default "this base this")
# Each call leaves $OUT/<call>.tgz (its results folder). ci/gpu/README.md says what they predict.
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
Q="bf16 q4_1"
# KERNEL_DIR QUANT NAME [cuda_bench args]: one cuda_bench run, its JSON to $R/NAME.json (BASE=1:
# BASE's own cuda_bench and targets, which its kernels' ABI matches)
bench() {
  local k=$1 q=$2 n=$3 cb=$H/b/bin/cuda_bench tg=$PWD/targets; shift 3
  [ "${BASE:-}" = 1 ] && cb=$H/b/base/bin/cuda_bench tg=$H/b/base/targets
  CB=$cb TG=$tg CB_TIMEOUT=200 cb_run "$H/s/l8b-$q.gguf" "$k" $T8/$q "$n" "$@"
}

# ncu_step SECONDS QUANT REGEX SKIP COUNT NAME [cuda_bench args]: Nsight Compute (clocks left
# alone, graph nodes one by one) on COUNT launches of the kernels REGEX matches, after SKIP of
# them, in a batch-1 cuda_bench run of the 8B QUANT file and this tree's kernels; $R/NAME.txt
ncu_step() {
  local s=$1 q=$2 re=$3 skip=$4 count=$5 n=$6; shift 6
  METRALE_TARGETS=$PWD/targets timeout "$s" ncu --clock-control none --graph-profiling node \
    --kernel-name "regex:^($re)\$" --launch-skip "$skip" --launch-count "$count" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    "$H/b/bin/cuda_bench" "$H/s/l8b-$q.gguf" "$H/b/k/h200-llama-3.1-8b-$q/kernels" $T8/$q --batch 1 "$@" \
    > "$R/$n.txt" 2>&1
  echo "rc=$?"; grep -E "^  [a-z_0-9]+ \(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit Reg|Warp Cycles Per Issued|No Eligible" "$R/$n.txt" | head -70
}

case "${1:-}" in
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}} base=${3:-}
  [ -f "$model" ] || { echo "usage: ci/gpu/floor.sh prepare MODEL.gguf [BASE_REV]" >&2; exit 2; }
  rm -rf .fl1 && mkdir -p .fl1/b/bin .fl1/b/k .fl1/b/srv
  kernels2l .fl1/b
  k32() {  # DIR SUFFIX: both 8B targets' kernels
    for q in $Q; do
      cargo xtask build-target --hw h200 --model llama-3.1-8b --quant $q --kernels-only --out "$1/k/h200-llama-3.1-8b-$q$2" 2>&1 | tail -1
    done
  }
  k32 .fl1/b ""
  # SmolLM2's kernels share the attention and the staging: its kernel tests run too
  cargo xtask build-target --hw h200 --model smollm2-135m --quant q4_1 --kernels-only --out .fl1/b/k/h200-smollm2-135m-q4_1 2>&1 | tail -1
  if [ -n "$base" ]; then
    # BASE's kernels, and the binaries and targets of BASE that load them (the kernels' ABI is
    # checked against the loading binary's)
    base_bins() {
      mkdir -p "$1/base/bin" "$1/base/t2"
      local C="--release -p metrale-backend --features cuda"
      for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" "$1/base/bin/$e"; done
      cp -r targets "$1/base/"
      kernels2l "$1/base" h200-llama-3.1-8b-2l-bf16
      k32 "$1/base" ""
    }
    in_rev "$base" base_bins "$PWD/.fl1/b"
    git rev-parse "$base" > .fl1/b/base/rev
  fi
  for q in $Q; do
    cargo xtask build-target --hw h200 --model llama-3.1-8b --quant $q --out ".fl1/b/srv/h200-llama-3.1-8b-$q" 2>&1 | tail -1
    rm -rf ".fl1/b/srv/h200-llama-3.1-8b-$q/kernels"
  done
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .fl1/b/bin/cuda_kernels
  for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" .fl1/b/bin/$e; done
  cp "$(exe build --release -p xtask)" .fl1/b/bin/xtask
  strip .fl1/b/bin/* .fl1/b/base/bin/* 2>/dev/null || true
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .fl1/b/vocab-8b.gguf >/dev/null
  tar cJf .fl1/b.tar.xz -C .fl1 b && rm -rf .fl1/b
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  echo "carry .fl1 .peer: $(du -cb .fl1 .peer | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
prepare-ab)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/floor.sh prepare-ab MODEL.gguf NAME=DIR..." >&2; exit 2; }
  shift 2
  rm -rf .fl1 && mkdir -p .fl1/b/bin .fl1/b/k
  for q in $Q; do
    cargo xtask build-target --hw h200 --model llama-3.1-8b --quant $q --kernels-only --out ".fl1/b/k/h200-llama-3.1-8b-$q" 2>&1 | tail -1
  done
  cargo xtask build-target --hw h200 --model smollm2-135m --quant q4_1 --kernels-only --out .fl1/b/k/h200-smollm2-135m-q4_1 2>&1 | tail -1
  for v in "$@"; do
    n=${v%%=*} d=${v#*=}
    [ -d "$d/kernels" ] && [ -d "$d/targets" ] || { echo "$d: no kernels/ and targets/ there" >&2; exit 2; }
    for q in $Q; do
      cargo xtask build-target --hw h200 --model llama-3.1-8b --quant $q --kernels-only --repo "$d" \
        --out ".fl1/b/k/h200-llama-3.1-8b-$q-$n" 2>&1 | tail -1
    done
    (cd "$d" && git rev-parse HEAD 2>/dev/null; git -C "$d" status --short 2>/dev/null) > ".fl1/b/k/variant-$n.txt" || true
  done
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .fl1/b/bin/cuda_kernels
  cp "$(exe build $C --example cuda_bench)" .fl1/b/bin/cuda_bench
  cp "$(exe build --release -p xtask)" .fl1/b/bin/xtask
  strip .fl1/b/bin/*
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .fl1/b/vocab-8b.gguf >/dev/null
  tar cJf .fl1/b.tar.xz -C .fl1 b && rm -rf .fl1/b
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  echo "carry .fl1 .peer: $(du -cb .fl1 .peer | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
ab)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .fl1/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  cat "$H"/b/k/variant-*.txt > "$R/variants.txt" 2>/dev/null
  peer=0
  if [ -f .peer/llamacpp-src.tgz ]; then
    peer=1
    step "llama.cpp build (background, cores 2-15, niced)"
    taskset -c 2-15 nice -n 10 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  fi
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs"
  for q in $Q; do $X --quant $q --out "$H/s/l8b-$q.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"; done
  taskset -pc 0,1 $$ > /dev/null
  KT_FILTER="attn attention ffn lm_head" kernel_tests llama-3.1-8b/q4_1
  KT_FILTER="attn attention ffn lm_head" kernel_tests llama-3.1-8b/bf16 smollm2-135m/q4_1
  finish ab
  CB_GREP="across layers"
  # this tree's kernels (suffix "") and each variant's, alternating, twice: a drift of the GPU
  # shows as a difference between the two rounds of the same kernels
  for round in 1 2; do
    for q in q4_1 bf16; do
      for k in "$H/b/k/h200-llama-3.1-8b-$q" "$H"/b/k/h200-llama-3.1-8b-$q-*; do
        [ -d "$k" ] || continue
        v=${k##*/h200-llama-3.1-8b-$q}
        # the variants AB_BF16 and AB_Q4_1 name alone (default: base on bf16, all on q4_1)
        names=${AB_Q4_1:-${v#-}}; [ $q = bf16 ] && names=${AB_BF16:-base}
        [ -n "$v" ] && [[ " $names " != *" ${v#-} "* ]] && continue
        CB_TIMEOUT=100 bench "$k/kernels" $q "ab-$q${v:--this}-$round" --batch 1 --steps 128 --pp 64
      done
    done
    finish ab
  done
  step "greedy texts: each variant's against this tree's (the same model and kernels' arithmetic)"
  for f in "$R"/ab-*.txt; do printf '%s %s\n' "$(grep -m1 '^text:' "$f" | sha1sum | cut -c1-12)" "${f##*/}"; done | sort | tee "$R/texts.txt"
  for q in $Q; do
    CB_TIMEOUT=150 bench "$H/b/k/h200-llama-3.1-8b-$q/kernels" $q "depth-$q" --batch 1 --steps 64 --pp 64 --depth 8192,32768
  done
  finish ab
  if [ $peer = 1 ]; then
    step "llama.cpp build: waiting for it"
    peer_wait $(( $(left) - 100 ))
    for q in q4_1 bf16; do
      [ "$(left)" -gt 50 ] || break
      step "llama-bench tg128 at depths 0, 8192, 32768: $q"
      timeout "$(( $(left) - 40 ))" "$H/llamacpp/build/bin/llama-bench" -m "$H/s/l8b-$q.gguf" -ngl 99 -fa 1 -p 0 \
        -n 128 -d 0,8192,32768 -r 3 -o md > "$R/llama-bench-depth-$q.md" 2> "$R/llama-bench-depth-$q.err"
      echo "rc=$?"; cat "$R/llama-bench-depth-$q.md"
    done
    finish ab
  fi
  if [ "$(left)" -gt 60 ]; then
    step "ncu: a q4_1 decode step's layer kernels (this tree's)"
    ncu_step $(( $(left) - 10 )) q4_1 'attn_in|attention|attn_out|ffn_in|ffn_out' 400 5 ncu-q4_1 --steps 16 --pp 16
  fi
  if [ "$(left)" -gt 60 ]; then
    step "ncu: a bf16 decode step's attn_in, ffn_out and LM head (this tree's)"
    ncu_step $(( $(left) - 10 )) bf16 'attn_in|ffn_out|lm_head_1' 200 3 ncu-bf16 --steps 16 --pp 16
  fi
  finish ab
  ;;
ab-depth)
  # carry .fl1: q4_1 batch 1 at depths 0, 8192 and 32768 for each kernel set AB_DEPTH names in
  # turn ("this": this tree's; default "this base this")
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .fl1/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model
  taskset -pc 0,1 $$ > /dev/null
  n=0
  for v in ${AB_DEPTH:-this base this}; do
    n=$((n + 1))
    k=$H/b/k/h200-llama-3.1-8b-q4_1-$v
    [ "$v" = this ] && k=$H/b/k/h200-llama-3.1-8b-q4_1
    CB_TIMEOUT=60 bench "$k/kernels" q4_1 "depth-q4_1-$v-$n" --batch 1 --steps 64 --pp 64 --depth 8192,32768
  done
  finish depth
  ;;
call1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .fl1/b.tar.xz -C "$H"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs, 2-layer HF folder"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf" "--layers 2 --format hf --out $H/s/l8b2-hf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  kernel_tests llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1
  step "2-layer check: HF golden (f32 on the GPU), then CUDA 3 times per kernel set and choice"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1
  tail -1 "$R/golden2.txt"
  for run in "this:" "this:pdl=off" "base:"; do
    b=$H/b t=${run#*:}
    [ "${run%%:*}" = base ] && b=$H/b/base
    [ -d "$b/k" ] || continue
    METRALE_TARGETS=$b/t2/targets METRALE_CUDA_TUNING=$t "$b/bin/golden_check" "$H/s/l8b2-hf" "$R/l8b2_golden.json" \
      --cuda "$b/k/h200-llama-3.1-8b-2l-bf16/kernels" $T8/bf16 --tol 0.05 --repeat 3 | tee -a "$R/check-2l.jsonl" \
      | python3 -c 'import sys,json; d=json.load(sys.stdin); print(sys.argv[1], d["tuning"] or "default", "pass", d["pass"], "top20", round(d["max_abs_diff_top20"], 4), "rerun", d["repeat"]["max_abs_diff"])' "$run"
  done
  for q in q4_1 bf16; do
    bench "$H/b/k/h200-llama-3.1-8b-$q/kernels" $q "bench-$q" --batch 1 --steps 128 --depth 8192,32768
  done
  # the attention without its transpose-reduce (on by default), where the KV dominates
  METRALE_CUDA_TUNING=attention_transpose=off bench "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" q4_1 bench-q4_1-notranspose \
    --batch 1 --steps 64 --depth 8192,32768
  for q in q4_1 bf16; do
    k=$H/b/base/k/h200-llama-3.1-8b-$q/kernels
    [ -d "$k" ] && BASE=1 bench "$k" $q "bench-$q-base" --batch 1 --steps 128
  done
  finish call1
  ;;
call2)
  mkdir -p "$R"
  step "llama.cpp build: waiting for it"
  peer_wait
  B=$H/llamacpp/build/bin
  for q in $Q; do
    step "llama-bench tg128 at depths 0, 8192, 32768: $q"
    timeout 240 "$B/llama-bench" -m "$H/s/l8b-$q.gguf" -ngl 99 -fa 1 -p 0 -n 128 -d 0,8192,32768 -r 3 -o md \
      > "$R/llama-bench-depth-$q.md" 2> "$R/llama-bench-depth-$q.err"; echo "rc=$?"; cat "$R/llama-bench-depth-$q.md"
  done
  for q in $Q; do
    step "server, one stream over HTTP: $q"
    "$H/b/srv/h200-llama-3.1-8b-$q/metrale-server" --model "$H/s/l8b-$q.gguf" --port 8092 --parallel 4 --ctx-size 4096 \
      > "$R/serve-$q.log" 2>&1 &
    SP=$!
    for _ in $(seq 600); do curl -sf localhost:8092/health >/dev/null && break; sleep 0.2; done
    for rep in 1 2 3; do
      timeout 60 python3 bench/load/load.py --base http://127.0.0.1:8092 --streams 1 --prompt-words 20 \
        --max-tokens 256 --out "$R/http-1-$q-$rep.json" | grep -E "output_tok_s|stream_decode|outcomes"
    done
    kill $SP; wait $SP
  done
  # batch 1 and 16 streams (the 64- and 256-stream figures are the tensor-core work's)
  for q in $Q; do RECORD_CONCURRENCY=1,16 record h200-llama-3.1-8b-$q "$H/s/l8b-$q.gguf" 4096; done
  finish call2
  ;;
quick)
  # carry .fl1: a short re-measure after a change: both 8B targets' kernel tests, their batch-1
  # decode at depth 0 (and q4_1 at 8192)
  rm -rf "$R" "$H/b" && mkdir -p "$R" "$H/s" && tar xJf .fl1/b.tar.xz -C "$H"
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  for q in $Q; do $X --quant $q --out "$H/s/l8b-$q.gguf" 2>&1 | grep synth-model; done
  kernel_tests llama-3.1-8b/bf16 llama-3.1-8b/q4_1
  bench "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" q4_1 bench-q4_1 --batch 1 --steps 128 --depth 8192
  bench "$H/b/k/h200-llama-3.1-8b-bf16/kernels" bf16 bench-bf16 --batch 1 --steps 128
  finish quick
  ;;
call3)
  # carry .fl1: correctness at depth 8192 (the 2-layer model against HF transformers, f32 on the
  # GPU, on an 8192-token prompt; then against the CPU backend if it finishes in time), and the
  # q4_1 layer kernels of one decode step under Nsight Compute
  rm -rf "$R" "$H/b" && mkdir -p "$R" "$H/s" && tar xJf .fl1/b.tar.xz -C "$H"
  [ -d "$H/s/l8b2-hf" ] || "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 \
    --layers 2 --format hf --out "$H/s/l8b2-hf" 2>&1 | grep synth-model
  step "HF golden at depth 8192 (2 layers, f32 on the GPU)"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --prompt-tokens 8192 \
    --out "$R/l8b2_d8192_golden" > "$R/golden-d8192.txt" 2>&1
  tail -2 "$R/golden-d8192.txt"
  step "golden_check CUDA at depth 8192"
  METRALE_TARGETS=$H/b/t2/targets "$H/b/bin/golden_check" "$H/s/l8b2-hf" "$R/l8b2_d8192_golden.json" \
    --cuda "$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels" $T8/bf16 --tol 0.05 --repeat 1 | tee "$R/check-2l-d8192.json" \
    | python3 -c 'import sys,json; d=json.load(sys.stdin); print("pass", d["pass"], "top20", round(d["max_abs_diff_top20"], 4), "rerun", d["repeat"]["max_abs_diff"])'
  step "golden_check CUDA and the CPU backend at depth 8192 (at most 150 s)"
  METRALE_TARGETS=$H/b/t2/targets timeout 150 "$H/b/bin/golden_check" "$H/s/l8b2-hf" "$R/l8b2_d8192_golden.json" \
    --cuda "$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels" $T8/bf16 --tol 0.05 --vs-cpu > "$R/check-2l-d8192-cpu.json" 2>&1
  echo "rc=$?"; tail -c 600 "$R/check-2l-d8192-cpu.json"
  [ -f "$H/s/l8b-q4_1.gguf" ] || "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 \
    --quant q4_1 --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model
  step "ncu: one decode step's layer kernels, q4_1"
  ncu_step 150 q4_1 'attn_in|attention|attn_out|ffn_in|ffn_out' 400 5 ncu-q4_1 --steps 16
  finish call3
  ;;
*)
  sed -n 2,15p "$0"; exit 2
  ;;
esac
