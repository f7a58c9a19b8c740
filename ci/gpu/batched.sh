#!/usr/bin/env bash
# Batched decode and prefill of h200/llama-3.1-8b/bf16 on the Hopper GEMMs (kernels/cuda/
# gemm_hopper.cu.hbs), on a synthetic checkpoint made on the H200 machine, with llama.cpp on the
# same GGUF in the same run. Two calls made back to back:
#
#   bash ci/gpu/batched.sh prepare MODEL.gguf   CPU machine: .bt1/ (and .peer/)
#   bash ci/gpu/batched.sh call1  carry .bt1 .peer   llama.cpp's build (background); the 8B bf16
#        GGUF and the 2-layer HF folder; cuda_kernels (the GEMM products against the CPU ops at 16,
#        29, 77 and 160 tokens) for both 8B targets and SmolLM2; cuda_bench: batched decode at 1,
#        16, 64 and 256 sequences and pp512, on the Hopper GEMMs and (hopper_gemm=off) on mma.sync
#   bash ci/gpu/batched.sh call2  carry nothing      the 2-layer check against HF transformers
#        (prompt prefilled through the GEMMs; both paths); bench-record with llama.cpp for 8B bf16 at
#        1, 16, 64 and 256 streams (llama-bench pp512/tg128, llama-batched-bench)
#   bash ci/gpu/batched.sh quick  carry .bt1         decode of 2-16 sequences, GEMM path (from two
#        sequences on Hopper) against the matrix-vector kernels
#   bash ci/gpu/batched.sh shapes carry .bt2         cuda_kernels of h200/smollm2-135m/bf16 and
#        h200/llama-3.2-1b/bf16 (the Hopper GEMMs at other shapes)
# Each call leaves $OUT/<call>.tgz (its results folder). ci/gpu/README.md says what they predict.
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
# KERNEL_DIR NAME [cuda_bench args]: one cuda_bench run of 8B bf16, its JSON to $R/NAME.json
bench() { local k=$1 n=$2; shift 2; CB_GREP="gemm|wg_" cb_run "$H/s/l8b-bf16.gguf" "$k" $T8/bf16 "$n" "$@"; }

case "${1:-}" in
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/batched.sh prepare MODEL.gguf" >&2; exit 2; }
  rm -rf .bt1 && mkdir -p .bt1/b/bin .bt1/b/k .bt1/b/srv
  kernels2l .bt1/b
  for t in llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1; do
    cargo xtask build-target --hw h200 --model ${t%/*} --quant ${t#*/} --kernels-only \
      --out ".bt1/b/k/h200-${t//\//-}" 2>&1 | tail -1
  done
  cargo xtask build-target --hw h200 --model llama-3.1-8b --quant bf16 --out .bt1/b/srv/h200-llama-3.1-8b-bf16 2>&1 | tail -1
  rm -rf .bt1/b/srv/h200-llama-3.1-8b-bf16/kernels
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .bt1/b/bin/cuda_kernels
  for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" .bt1/b/bin/$e; done
  cp "$(exe build --release -p xtask)" .bt1/b/bin/xtask
  strip .bt1/b/bin/*
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .bt1/b/vocab-8b.gguf >/dev/null
  tar cJf .bt1/b.tar.xz -C .bt1 b && rm -rf .bt1/b
  # .bt2: the kernel tests and the other bf16 targets' kernels (`shapes`)
  rm -rf .bt2 && mkdir -p .bt2/b/bin .bt2/b/k
  tar xJf .bt1/b.tar.xz -C .bt2 b/bin/cuda_kernels
  for t in smollm2-135m/bf16 llama-3.2-1b/bf16; do
    cargo xtask build-target --hw h200 --model ${t%/*} --quant ${t#*/} --kernels-only \
      --out ".bt2/b/k/h200-${t//\//-}" 2>&1 | tail -1
  done
  tar cJf .bt2/b.tar.xz -C .bt2 b && rm -rf .bt2/b
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  echo "carry .bt1 .peer: $(du -cb .bt1 .peer | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
call1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .bt1/b.tar.xz -C "$H"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 GGUF, 2-layer HF folder"
  for a in "--out $H/s/l8b-bf16.gguf" "--layers 2 --format hf --out $H/s/l8b2-hf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  kernel_tests llama-3.1-8b/bf16
  # a failing GEMM makes the timings meaningless: stop here (and save the device time)
  grep -q "test result: ok" "$R/kernel-tests-llama-3.1-8b-bf16.txt" || { finish call1; exit 1; }
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  bench "$K" bench-bf16 --batch 1,16,64,256 --steps 64 --pp 512
  METRALE_CUDA_TUNING=hopper_gemm=off bench "$K" bench-bf16-mmasync --batch 16,64,256 --steps 32 --pp 512
  kernel_tests llama-3.1-8b/q4_1 smollm2-135m/q4_1
  finish call1
  ;;
call2)
  mkdir -p "$R"
  step "2-layer check: HF golden (f32 on the GPU), then CUDA on each GEMM path"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1
  tail -1 "$R/golden2.txt"
  for t in "" "hopper_gemm=off"; do
    METRALE_TARGETS=$H/b/t2/targets METRALE_CUDA_TUNING=$t "$H/b/bin/golden_check" "$H/s/l8b2-hf" "$R/l8b2_golden.json" \
      --cuda "$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels" $T8/bf16 --tol 0.05 --repeat 2 | tee -a "$R/check-2l.jsonl" \
      | python3 -c 'import sys,json; d=json.load(sys.stdin); print(d["tuning"] or "default", "pass", d["pass"], "top20", round(d["max_abs_diff_top20"], 4), "rerun", d["repeat"]["max_abs_diff"])'
  done
  step "llama.cpp build: waiting for it"
  peer_wait
  RECORD_CONCURRENCY=1,16,64,256 record h200-llama-3.1-8b-bf16 "$H/s/l8b-bf16.gguf" 4096
  finish call2
  ;;
shapes)
  # carry .bt2: the kernel tests of the other bf16 targets the Hopper GEMMs serve on the H200
  # (SmolLM2's 960-row QKV takes 64-row blocks at every tile; Llama-3.2-1B)
  rm -rf "$R" "$H/b" && mkdir -p "$R" && tar xJf .bt2/b.tar.xz -C "$H"
  kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16
  finish shapes
  ;;
quick)
  # carry .bt1: decode of 2-16 sequences with the GEMM path from two sequences (the default) and
  # on the matrix-vector kernels (decode_gemm=off: what ran below 13 before)
  rm -rf "$R" "$H/b" && mkdir -p "$R" "$H/s" && tar xJf .bt1/b.tar.xz -C "$H"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --out "$H/s/l8b-bf16.gguf" 2>&1 | grep synth-model
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  bench "$K" bench-bf16-small --batch 2,4,8,12,16 --steps 32 --pp 64
  METRALE_CUDA_TUNING=decode_gemm=off bench "$K" bench-bf16-small-matvec --batch 2,4,8,12,16 --steps 32 --pp 64
  finish quick
  ;;
*)
  sed -n 2,16p "$0"; exit 2
  ;;
esac
