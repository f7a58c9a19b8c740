#!/usr/bin/env bash
# FP8 (e4m3) layer weights on the H200 machine (h200/{smollm2-135m,llama-3.1-8b}/fp8, W8A8 on the
# per-stage kernels and the mma.sync GEMMs): the kernels against the CPU reference ops, the 8B
# shape against the CPU backend on the same FP8 weights and against HF transformers on the bf16
# file they were quantized from, and the 8B numbers beside the bf16 target's on the same file in
# the same call. One call.
#
#   bash ci/gpu/fp8.sh prepare MODEL.gguf   CPU machine: .f1/ (MODEL: the vocabulary's source)
#   bash ci/gpu/fp8.sh call  carry .f1      cuda_kernels on both fp8 targets; the 2-layer 8B HF
#        folder and bf16 GGUF, quantized at load, against the CPU backend (same FP8 weights) and
#        HF transformers (f32, on the bf16 weights: the difference is FP8's rounding); the 32-layer
#        bf16 GGUF and cuda_bench on it as h200/llama-3.1-8b/fp8 (quantized at load) and as
#        h200/llama-3.1-8b/bf16: batch-1 decode beside the copy-rate floor, 16 / 64 / 256
#        sequences, pp512
#   bash ci/gpu/fp8.sh kv8   carry .f1      the fp8 KV cache (h200/llama-3.1-8b/bf16-fp8kv): its
#        kernel tests (qkv_rope writing each head vector with its scale, attention reading it);
#        the 2-layer 8B HF folder and GGUF against the CPU backend with the same fp8 cache and
#        against HF transformers; the 32-layer bf16 GGUF under cuda_bench with the fp8 cache and
#        with bf16's, batch-1 decode at 0, 8,192 and 32,768 cached positions and pp512
# Each call leaves $OUT/<call>.tgz (its results folder).
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"

# check2l QUANT HF_TOL WHAT: the 2-layer HF folder and bf16 GGUF and HF's golden (f32 on the
# GPU); golden_check on h200/llama-3.1-8b/QUANT's 2-layer kernels against HF (within HF_TOL) and
# the CPU backend with the same weights and cache (0.05), prompt in one GEMM step and in 8-token steps
check2l() {
  step "synth-model: 2-layer HF folder and bf16 GGUF; HF golden (f32 on the GPU)"
  $X --layers 2 --format hf --out "$H/s/l8b2-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --layers 2 --out "$H/s/l8b2-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden.txt" 2>&1
  tail -1 "$R/golden.txt"
  step "$3: 2 layers, prompt in one GEMM step and in 8-token steps"
  local a file chunk k2=$H/b/k/h200-llama-3.1-8b-2l-$1/kernels
  for a in "l8b2-hf" "l8b2-bf16.gguf" "l8b2-bf16.gguf 8"; do
    read -r file chunk <<< "$a"
    METRALE_TARGETS=$H/b/t2/targets "$H/b/bin/golden_check" "$H/s/$file" "$R/l8b2_golden.json" --cuda "$k2" \
      "h200/llama-3.1-8b/$1" --vs-cpu --tol "$2" --cpu-tol 0.05 ${chunk:+--prefill-chunk $chunk} | tee -a "$R/check-2l.json"
  done
}
# bench8b "QUANT..." CUDA_BENCH_ARGS...: the 32-layer bf16 GGUF (in /dev/shm when it has the
# room), then cuda_bench on it as h200/llama-3.1-8b/QUANT for each QUANT, in that order
bench8b() {
  local q qs=$1 b=/dev/shm; shift
  step "synth-model: the 32-layer bf16 GGUF"
  [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 20000000 ] || b=$H/s
  $X --out "$b/l8b-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  for q in $qs; do
    CB_TIMEOUT=200 cb_run "$b/l8b-bf16.gguf" "$H/b/k/h200-llama-3.1-8b-$q/kernels" h200/llama-3.1-8b/$q bench-$q "$@"
  done
}

case "${1:-}" in
prepare)
  set -e
  pack_start .f1 prepare "${2:-}"
  kernels .f1 smollm2-135m/fp8 llama-3.1-8b/fp8 llama-3.1-8b/bf16 llama-3.1-8b/bf16-fp8kv
  kernels2l .f1/b h200-llama-3.1-8b-2l-fp8 llama-3.1-8b fp8
  kernels2l .f1/b h200-llama-3.1-8b-2l-bf16-fp8kv llama-3.1-8b bf16-fp8kv
  tools .f1 cuda_bench golden_check
  vocab .f1 llama-3.1-8b vocab-8b.gguf
  pack_end .f1
  ;;
call)
  unpack .f1
  kernel_tests smollm2-135m/fp8 llama-3.1-8b/fp8
  export METRALE_TARGETS=$PWD/targets
  check2l fp8 0.5 "CUDA fp8 vs CPU fp8 (same weights) and vs HF (bf16 weights)"
  bench8b "fp8 bf16" --batch 1,16,64,256 --steps 128 --pp 512
  finish fp8
  ;;
kv8)
  unpack .f1
  kernel_tests llama-3.1-8b/bf16-fp8kv
  export METRALE_TARGETS=$PWD/targets
  check2l bf16-fp8kv 0.2 "CUDA vs CPU (both with the fp8 KV cache) and vs HF (f32)"
  bench8b "bf16-fp8kv bf16" --batch 1 --steps 64 --pp 512 --depth 8192,32768
  finish kv8
  ;;
*)
  sed -n '2,15p' "$0"
  exit 2
  ;;
esac
