#!/usr/bin/env bash
# Speculative verification on the CUDA backend (issue 23), on the H200 machine, in one call of ~6
# minutes: what a verification step costs and what each acceptance rate buys at the 8B shape, and
# that greedy verification reproduces plain greedy decoding.
#
#   bash ci/gpu/spec.sh prepare MODEL.gguf   CPU machine: .sp1/ (kernels of llama-3.1-8b/{bf16,q4_1},
#                                            the tools, the 8B vocabulary)
#   bash ci/gpu/spec.sh call  carry .sp1      the 8B bf16 and q4_1 GGUFs; the kernel tests of both;
#        spec_bench on each (k = 4: plain batch-1 decode, then proposals replayed from it corrupted
#        at 0, 10, 25, 50, 75%: tok/s, acceptance, the verification step against a plain step,
#        tokens equal to plain), cuda_bench batch 1 beside it (the copy-rate floor, same call)
# The SmolLM2 exactness test (`cuda_model`'s speculative_verification_matches_plain_greedy, on
# the real model) runs with the rest of cuda_model in `real-size.sh verify2`.
# Leaves $OUT/call.tgz (its results folder).
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"

case "${1:-}" in
prepare)
  set -e
  pack_start .sp1 prepare "${2:-}"
  kernels .sp1 llama-3.1-8b/bf16 llama-3.1-8b/q4_1
  tools .sp1 spec_bench cuda_bench
  vocab .sp1 llama-3.1-8b vocab-8b.gguf
  pack_end .sp1
  ;;
call)
  unpack .sp1
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  kernel_tests llama-3.1-8b/bf16 llama-3.1-8b/q4_1
  export METRALE_TARGETS=$PWD/targets
  for q in bf16 q4_1; do
    k=$H/b/k/h200-llama-3.1-8b-$q/kernels
    CB_TIMEOUT=90 cb_run "$H/s/l8b-$q.gguf" "$k" $T8/$q floor-$q --batch 1 --steps 128
    step "spec_bench $q: k = 4, 128 tokens, corrupted 0/10/25/50/75%, 3 repetitions"
    timeout 150 "$H/b/bin/spec_bench" "$H/s/l8b-$q.gguf" --cuda "$k" $T8/$q --k 4 --tokens 128 \
      --rates 0,10,25,50,75 --reps 3 --out "$R/spec-$q.json" > "$R/spec-$q.txt" 2>&1
    echo "rc=$?" >> "$R/spec-$q.txt"; cat "$R/spec-$q.txt"
  done
  finish call
  ;;
*)
  sed -n 2,14p "$0"; exit 2 ;;
esac
