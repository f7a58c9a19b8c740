#!/usr/bin/env bash
# The Qwen3 family on the H200 machine (h200/qwen3-8b/{bf16,q4_1}, on synthetic checkpoints of the
# real shape made there): the kernels against the CPU reference ops, the model against HF
# transformers, and its numbers beside llama.cpp on the same GGUFs. Two calls made back to back.
#
#   bash ci/gpu/qwen3.sh prepare MODEL.gguf   CPU machine: .q1/ (and .peer/: llama.cpp's source)
#   bash ci/gpu/qwen3.sh call1  carry .q1 .peer   llama.cpp's build (background); cuda_kernels on
#        both targets (the Q/K norm after every QKV path); the checkpoints (bf16 and q4_1 GGUFs, the
#        HF folder, 2-layer HF folder and GGUF); HF transformers goldens (f32 on the GPU, 2 and 36
#        layers); CUDA against them (2 layers also against the CPU backend, kernels built for 2
#        layers); cuda_bench on both targets (batch-1 decode beside the copy-rate floor, 16 / 64 /
#        256 sequences, pp512)
#   bash ci/gpu/qwen3.sh call2  carry nothing     llama-bench (pp512, tg128) and llama-batched-bench
#        (1, 16, 64, 256) on the same GGUFs; bench-record with llama.cpp for both targets
#   bash ci/gpu/qwen3.sh prepare-verify MODEL.gguf   CPU machine: .q2/
#   bash ci/gpu/qwen3.sh verify carry .q2        after a change: cuda_kernels on both qwen3-8b
#        targets and, for what the family's changes touched in the shared templates, on
#        h200/llama-3.1-8b/{bf16,q4_1} and h200/smollm2-135m/q4_1; the 2-layer checks against HF
#        transformers and the CPU backend of qwen3-8b and llama-3.1-8b
#   bash ci/gpu/qwen3.sh prepare-small MODEL.gguf   CPU machine: .q3/
#   bash ci/gpu/qwen3.sh small  carry .q3        h200/qwen3-0.6b/bf16 (query width 2048 over a hidden
#        size of 1024, tied head): cuda_kernels; CUDA against HF transformers and the CPU backend at
#        full depth (28 layers); cuda_bench
#   bash ci/gpu/qwen3.sh prepare-moe MODEL.gguf [BASE_REV]   CPU machine: .q4/ (with BASE_REV also
#        that revision's cuda_bench, targets and 30B-A3B kernels in .q4/b/base, for moe-b1's A/B;
#        with MOE_VARIANTS="NAME=REV ..." each revision's q4_1 kernels in .q4/b/var/NAME; with
#        MOE_EXTRA_TARGETS="MODEL/QUANT ..." those targets' kernels too, for MOE_KT)
#   bash ci/gpu/qwen3.sh moe    carry .q4 .peer  h200/qwen3-30b-a3b/bf16 (128 experts, 8 a token):
#        llama.cpp's build (background); cuda_kernels (the routed experts against the CPU
#        reference, a full tie among them); the 2-layer checkpoints (HF folder, one tensor per
#        expert; GGUF, 3-D experts) against HF transformers and the CPU backend; the full bf16
#        GGUF (61 GB, in /dev/shm when it has the room) and cuda_bench on it (batch-1 decode beside
#        the active experts' bytes, 16 / 64 / 256 sequences, pp512; batch 1 again with
#        attention_one_split=off); timings once llama.cpp's build is done; llama-bench and
#        llama-batched-bench on the file when the call has the time
#   bash ci/gpu/qwen3.sh moe-verify  carry .q4 [.peer]   after a change to the experts' or the
#        attention kernels: llama.cpp's build in the background (with .peer); the kernel tests of
#        both 30B-A3B targets (MOE_KT to name others); the 2-layer checks against HF transformers
#        and the CPU backend; the 48-layer q4_1 GGUF; once the build is done, cuda_bench on it
#        (batch 1, 16, 64, 256, pp512), batch 1 again under each tuning of MOE_B1_AB (default
#        attention_heads=off), the grouped steps under each of MOE_VERIFY_AB (none by default;
#        e.g. moe_wgmma=off), batch 1 under prepare-moe's base revision and variants, llama.cpp on it
#   bash ci/gpu/qwen3.sh moe-verify2  carry nothing   right after moe-verify (the machine keeps ~/):
#        the 48-layer bf16 GGUF, cuda_bench on it (batch 1 again under each of MOE_B1_AB2, default
#        attention_heads=off, and under the base revision), llama.cpp on it
#   bash ci/gpu/qwen3.sh dense-b1  carry .q4   a batch-1 change on the dense stage path: the
#        36-layer Qwen3-8B GGUFs (q4_1, bf16; prepare-moe with MOE_EXTRA_TARGETS="qwen3-8b/q4_1
#        qwen3-8b/bf16") under cuda_bench at batch 1, again under each tuning of DENSE_B1_AB
#   bash ci/gpu/qwen3.sh moe-b1  carry .q4   a short check of a batch-1 change: the kernel tests
#        named by MOE_B1_KT (default attention) of both 30B-A3B targets; the 48-layer q4_1 GGUF
#        under cuda_bench at batch 1 and 256 (MOE_B1_BATCH) and again under each of MOE_B1_AB
#        (default attention_heads=off: the A/B of the last change), and under the base revision's
#        binary and kernels where prepare-moe was given one (bench-*-base: an A/B of a change no
#        tuning switches), and under each variant's kernels (prepare-moe's MOE_VARIANTS: bench-q4_1-var-NAME);
#        the bf16 one at batch 1 likewise, as the time allows (MOE_B1_Q4=0: the bf16 one alone)
#   bash ci/gpu/qwen3.sh moe-probe  carry .q4   where a batch-1 step of the q4_1 target goes: both
#        30B-A3B targets' kernel tests; the 48-layer q4_1 GGUF under cuda_bench (batch 1, 16, 64,
#        256, pp512), batch 1 again under each attention and launch tuning named in MOE_PROBE_TUNINGS;
#        Nsight Compute on one decode step's layer kernels (attention and the routed experts)
#   bash ci/gpu/qwen3.sh moe2   carry nothing    the 48-layer q4_1 GGUF and cuda_bench on it (the q4_1
#        target); llama-bench and llama-batched-bench on both GGUFs; bench-record with llama.cpp
#   bash ci/gpu/qwen3.sh prepare-qwen2 MODEL.gguf   CPU machine: .q5/
#   bash ci/gpu/qwen3.sh qwen2  carry .q5 [.peer]  h200/qwen2.5-7b/{bf16,q4_1} (the qwen2 family: Q/K/V
#        biases, added by qkv_rope): cuda_kernels on both and on h200/qwen3-8b/bf16 (qkv_rope's
#        other feature); the 2-layer HF folder and GGUF against HF transformers and the CPU
#        backend; the 28-layer bf16 GGUF against HF transformers; cuda_bench on both GGUFs; with
#        .peer, llama.cpp's build in the background from the start (timings wait for it), and
#        llama-bench and llama-batched-bench on both GGUFs (moe-verify and moe2 reuse that build);
#        the 2-layer golden comes from the HF folder, transformers' own reading of the GGUF
#        recorded beside it only where gguf-py is installed
# Each call leaves $OUT/<call>.tgz (its results folder).
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
TQ=h200/qwen3-8b

# pack_start, kernels, servers, tools, vocab, pack_end and unpack: real-size.sh
# --- calls (GPU machine)
# others_q4_1 BATCHES MIN_LEFT: cuda_bench on the 48-layer q4_1 GGUF under the base revision's
# binary and kernels (bench-q4_1-base) and under each variant's kernels (bench-q4_1-var-NAME),
# where prepare-moe made them, while the call has MIN_LEFT seconds left
others_q4_1() {
  local b=$H/b/base v
  [ -d "$b" ] && [ "$(left)" -gt "$2" ] && CB=$b/bin/cuda_bench TG=$b/targets CB_TIMEOUT=120 cb_run "$H/s/moe-q4_1.gguf" \
    "$b/k/h200-qwen3-30b-a3b-q4_1/kernels" h200/qwen3-30b-a3b/q4_1 bench-q4_1-base --batch "$1" --steps 64
  for v in "$H"/b/var/*/; do
    [ -d "$v" ] && [ "$(left)" -gt "$2" ] && CB_TIMEOUT=120 cb_run "$H/s/moe-q4_1.gguf" "${v}kernels" \
      h200/qwen3-30b-a3b/q4_1 "bench-q4_1-var-$(basename "$v")" --batch "$1" --steps 64
  done
}
# llamacpp_start: llama.cpp's build in the background (it outlives the call)
llamacpp_start() {
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
}
# peer_bench NAME GGUF: llama-bench (pp512, tg128) and llama-batched-bench (1, 16, 64, 256), once
# the build started by an earlier call is done; tables in $R/llamacpp-NAME/
peer_bench() {
  peer_wait > /dev/null
  step "llama-bench pp512 / tg128 and llama-batched-bench 1, 16, 64, 256: $1 ($(cat "$H/llamacpp/build.done"))"
  mkdir -p "$R/llamacpp-$1"
  OUT=$R/llamacpp-$1 timeout 200 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz "$2" 1,16,64,256 \
    > "$R/llamacpp-$1.txt" 2>&1; echo "rc=$?"; cat "$R/llamacpp-$1/llamacpp-bench.md" "$R/llamacpp-$1/llamacpp-batched.txt"
}

# moe_check2l: the 2-layer 30B-A3B checkpoints (HF folder, one tensor per expert; GGUF) against HF
# transformers (f32 on the GPU) and the CPU backend: prompt in one step (its experts grouped) and
# in 8-token steps (each pair's experts read for it)
moe_check2l() {
  local X="$H/b/bin/xtask synth-model qwen3-30b-a3b --tokenizer $H/b/vocab.gguf --seed 0 --layers 2"
  step "synth-model: 2-layer HF folder and GGUF; HF golden (f32 on the GPU)"
  $X --format hf --out "$H/s/moe2-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --out "$H/s/moe2-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/moe2-hf" --device cuda --out "$R/moe2_golden" 2>&1 | sed "s|$H/|~/|g" > "$R/golden.txt"; tail -1 "$R/golden.txt"
  step "CUDA vs HF and vs CPU, 2 layers: HF folder and GGUF (prompt in one step), GGUF in 8-token steps"
  for a in "moe2-hf" "moe2-bf16.gguf" "moe2-bf16.gguf 8"; do
    set -- $a
    METRALE_TARGETS=$H/b/t2/targets "$H/b/bin/golden_check" "$H/s/$1" "$R/moe2_golden.json" \
      --cuda "$H/b/k/h200-qwen3-30b-a3b-2l-bf16/kernels" h200/qwen3-30b-a3b/bf16 --vs-cpu --tol 0.05 \
      ${2:+--prefill-chunk $2} | tee -a "$R/check-2l.json"
  done
  # the same GGUF under each METRALE_CUDA_TUNING of MOE_2L_TUNINGS (default moe_wgmma=off: the
  # grouped experts' exact products, which the bound holds for; bf16 activations can flip a
  # near-tie of the router, bench/families/README.md), prompt in one step and in 32-token steps
  # (a step's experts are grouped from 16 tokens)
  for tu in ${MOE_2L_TUNINGS-moe_wgmma=off}; do
    for c in "" 32; do
      METRALE_CUDA_TUNING=$tu METRALE_TARGETS=$H/b/t2/targets "$H/b/bin/golden_check" "$H/s/moe2-bf16.gguf" \
        "$R/moe2_golden.json" --cuda "$H/b/k/h200-qwen3-30b-a3b-2l-bf16/kernels" h200/qwen3-30b-a3b/bf16 \
        --tol 0.05 ${c:+--prefill-chunk $c} | tee -a "$R/check-2l-${tu//[=,]/-}.json" | grep -o '"max_abs_diff_top20_per_position":\[[^]]*\]'
    done
  done
  rm -rf "$H/s/moe2-hf" "$H/s/moe2-bf16.gguf"
}
# synth_moe_q4_1: the 48-layer q4_1 30B-A3B GGUF at $H/s/moe-q4_1.gguf
synth_moe_q4_1() {
  "$H/b/bin/xtask" synth-model qwen3-30b-a3b --tokenizer "$H/b/vocab.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/moe-q4_1.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
}
# synth_moe_bf16: the 48-layer bf16 one (61 GB) in /dev/shm (RAM) where it holds 64 GB, else on the
# disk, linked from $H/s/moe.gguf
synth_moe_bf16() {
  local F=$H/s/moe-bf16.gguf
  [ "$(df --output=avail -B1G /dev/shm | tail -1)" -gt 64 ] && F=/dev/shm/moe-bf16.gguf
  echo "moe.gguf -> $F" >> "$R/synth.txt"
  "$H/b/bin/xtask" synth-model qwen3-30b-a3b --tokenizer "$H/b/vocab.gguf" --seed 0 --out "$F" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  ln -sf "$F" "$H/s/moe.gguf"
}

case "${1:-}" in
prepare)
  set -e
  pack_start .q1 prepare "${2:-}"
  kernels .q1 qwen3-8b/bf16 qwen3-8b/q4_1
  servers .q1 qwen3-8b/bf16 qwen3-8b/q4_1
  kernels2l .q1/b h200-qwen3-8b-2l-bf16 qwen3-8b
  tools .q1 cuda_bench golden_check
  vocab .q1 qwen3-8b
  pack_end .q1 .peer
  ;;
prepare-verify)
  set -e
  pack_start .q2 prepare-verify "${2:-}"
  kernels .q2 qwen3-8b/bf16 qwen3-8b/q4_1 llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1
  kernels2l .q2/b h200-qwen3-8b-2l-bf16 qwen3-8b
  kernels2l .q2/b h200-llama-3.1-8b-2l-bf16 llama-3.1-8b
  tools .q2 golden_check
  vocab .q2 qwen3-8b
  vocab .q2 llama-3.1-8b vocab-8b.gguf
  pack_end .q2
  ;;
verify)
  unpack .q2
  kernel_tests qwen3-8b/q4_1 qwen3-8b/bf16 llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1
  G=tests/golden/make_synth_golden_hf.py
  export METRALE_TARGETS=$H/b/t2/targets
  for m in qwen3-8b llama-3.1-8b; do
    v=$H/b/vocab.gguf; [ $m = llama-3.1-8b ] && v=$H/b/vocab-8b.gguf
    step "$m, 2 layers: synth-model, HF golden (f32 on the GPU), CUDA vs HF and vs CPU (GEMM and matrix-vector prompt)"
    "$H/b/bin/xtask" synth-model $m --tokenizer "$v" --seed 0 --layers 2 --format hf --out "$H/s/$m-2l" 2>&1 | grep synth-model
    python3 $G "$H/s/$m-2l" --device cuda --out "$R/$m-2l_golden" > "$R/golden-$m.txt" 2>&1; tail -1 "$R/golden-$m.txt"
    for c in "" "--prefill-chunk 8"; do
      "$H/b/bin/golden_check" "$H/s/$m-2l" "$R/$m-2l_golden.json" --cuda "$H/b/k/h200-$m-2l-bf16/kernels" h200/$m/bf16 \
        --vs-cpu --tol 0.05 $c | tee -a "$R/check-2l-$m.json"
    done
  done
  finish verify
  ;;
prepare-small)
  set -e
  pack_start .q3 prepare-small "${2:-}"
  kernels .q3 qwen3-0.6b/bf16
  tools .q3 cuda_bench golden_check
  vocab .q3 qwen3-0.6b
  pack_end .q3
  ;;
small)
  unpack .q3
  kernel_tests qwen3-0.6b/bf16
  export METRALE_TARGETS=$PWD/targets
  X="$H/b/bin/xtask synth-model qwen3-0.6b --tokenizer $H/b/vocab.gguf --seed 0"
  step "synth-model: bf16 GGUF and HF folder; HF golden (f32 on the GPU, 28 layers)"
  $X --out "$H/s/q06-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --format hf --out "$H/s/q06-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/q06-hf" --device cuda --out "$R/q06_golden" > "$R/golden.txt" 2>&1; tail -1 "$R/golden.txt"
  step "CUDA vs HF and vs CPU, 28 layers: GGUF and HF folder, prompt in one GEMM step; GGUF in 8-token steps"
  for a in "q06-bf16.gguf" "q06-hf" "q06-bf16.gguf 8"; do
    set -- $a
    "$H/b/bin/golden_check" "$H/s/$1" "$R/q06_golden.json" --cuda "$H/b/k/h200-qwen3-0.6b-bf16/kernels" h200/qwen3-0.6b/bf16 \
      --vs-cpu --tol 0.1 ${2:+--prefill-chunk $2} | tee -a "$R/check.json"
  done
  CB_TIMEOUT=120 cb_run "$H/s/q06-bf16.gguf" "$H/b/k/h200-qwen3-0.6b-bf16/kernels" h200/qwen3-0.6b/bf16 bench-bf16 \
    --batch 1,16,64,256 --steps 64 --pp 512
  finish small
  ;;
prepare-moe)
  set -e
  pack_start .q4 prepare-moe "${2:-}"
  kernels .q4 qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1 llama-3.1-8b/q4_1 ${MOE_EXTRA_TARGETS:-}
  if [ -n "${3:-}" ]; then
    # the base revision's binary (its ABI check is against its own kernels), targets and kernels
    base_moe() {
      local q
      mkdir -p "$1/base/bin" "$1/base/k"
      cp "$(exe build --release -p metrale-backend --features cuda --example cuda_bench)" "$1/base/bin/cuda_bench"
      cp -r targets "$1/base/"
      for q in bf16 q4_1; do
        cargo xtask build-target --hw h200 --model qwen3-30b-a3b --quant $q --kernels-only \
          --out "$1/base/k/h200-qwen3-30b-a3b-$q" 2>&1 | tail -1
      done
    }
    in_rev "$3" base_moe "$PWD/.q4/b"
    git rev-parse "$3" > .q4/b/base/rev
  fi
  # MOE_VARIANTS="NAME=REV ...": each revision's q4_1 kernels in .q4/b/var/NAME, which moe-b1 runs
  # under this revision's binary (a variant keeps its ABI: a kernel's body changed, not its
  # parameters)
  var_moe() { cargo xtask build-target --hw h200 --model qwen3-30b-a3b --quant q4_1 --kernels-only --out "$1" 2>&1 | tail -1; }
  for v in ${MOE_VARIANTS:-}; do
    in_rev "${v#*=}" var_moe "$PWD/.q4/b/var/${v%%=*}"
    git rev-parse "${v#*=}" > ".q4/b/var/${v%%=*}/rev"
  done
  servers .q4 qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1
  kernels2l .q4/b h200-qwen3-30b-a3b-2l-bf16 qwen3-30b-a3b
  tools .q4 cuda_bench golden_check
  vocab .q4 qwen3-30b-a3b
  pack_end .q4 .peer
  ;;
moe)
  unpack .q4
  llamacpp_start
  kernel_tests qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1
  moe_check2l
  export METRALE_TARGETS=$PWD/targets
  step "synth-model: the 48-layer bf16 GGUF"
  synth_moe_bf16
  peer_wait 300
  CB_TIMEOUT=200 cb_run "$H/s/moe.gguf" "$H/b/k/h200-qwen3-30b-a3b-bf16/kernels" h200/qwen3-30b-a3b/bf16 bench-bf16 \
    --batch 1,16,64,256 --steps 64 --pp 512
  # llama.cpp on the same file while the machine has it (moe2 skips it when done here)
  [ "$(left)" -gt 150 ] && peer_bench bf16 "$H/s/moe.gguf"
  # batch 1 with a one-token step's attention split by the rule (the A/B of attention_one_split)
  [ "$(left)" -gt 100 ] && METRALE_CUDA_TUNING=attention_one_split=off CB_TIMEOUT=100 cb_run "$H/s/moe.gguf" \
    "$H/b/k/h200-qwen3-30b-a3b-bf16/kernels" h200/qwen3-30b-a3b/bf16 bench-bf16-one-split-off --batch 1 --steps 64
  finish moe
  ;;
moe-check2l)
  # the routed experts' kernel tests of MOE_KT (default the bf16 target) and the 2-layer checks
  # (MOE_2L_TUNINGS: the same checks again under each tuning)
  unpack .q4
  KT_FILTER=moe kernel_tests ${MOE_KT:-qwen3-30b-a3b/bf16}
  moe_check2l
  finish moe-check2l
  ;;
moe-b1)
  # a short check of a batch-1 change: the kernel tests named by MOE_B1_KT (default: attention)
  # of both 30B-A3B targets; the 48-layer q4_1 GGUF under cuda_bench at batch 1 and 256
  # (MOE_B1_BATCH), again under each tuning of MOE_B1_AB; then the bf16 one at batch 1 likewise
  # (default: both tunings on), as the time allows
  unpack .q4
  KT_FILTER=${MOE_B1_KT:-attention} kernel_tests qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1
  export METRALE_TARGETS=$PWD/targets
  # MOE_B1_Q4=0: the bf16 target alone (a change that only its path sees)
  if [ "${MOE_B1_Q4:-1}" = 1 ]; then
    step "synth-model: the 48-layer q4_1 GGUF; cuda_bench at batch 1 and 256"
    synth_moe_q4_1
    K4=$H/b/k/h200-qwen3-30b-a3b-q4_1/kernels
    CB_TIMEOUT=120 cb_run "$H/s/moe-q4_1.gguf" "$K4" h200/qwen3-30b-a3b/q4_1 bench-q4_1 --batch "${MOE_B1_BATCH:-1,256}" --steps 64
    for ab in ${MOE_B1_AB-attention_heads=off}; do
      [ "$(left)" -gt 45 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=120 cb_run "$H/s/moe-q4_1.gguf" "$K4" \
        h200/qwen3-30b-a3b/q4_1 "bench-q4_1-${ab//[=,]/-}" --batch "${MOE_B1_BATCH:-1,256}" --steps 64
    done
    others_q4_1 "${MOE_B1_BATCH:-1,256}" 45
    rm -f "$H/s/moe-q4_1.gguf"
  fi
  B=$H/b/base
  if [ "$(left)" -gt 150 ]; then
    step "synth-model: the 48-layer bf16 GGUF; cuda_bench at batch 1"
    synth_moe_bf16
    KB=$H/b/k/h200-qwen3-30b-a3b-bf16/kernels
    CB_TIMEOUT=90 cb_run "$H/s/moe.gguf" "$KB" h200/qwen3-30b-a3b/bf16 bench-bf16 --batch 1 --steps 64
    for ab in ${MOE_B1_AB-attention_heads=off}; do
      [ "$(left)" -gt 70 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=$(($(left) - 5)) cb_run "$H/s/moe.gguf" "$KB" \
        h200/qwen3-30b-a3b/bf16 "bench-bf16-${ab//[=,]/-}" --batch 1 --steps 64
    done
    [ -d "$B" ] && [ "$(left)" -gt 70 ] && CB=$B/bin/cuda_bench TG=$B/targets CB_TIMEOUT=$(($(left) - 5)) cb_run "$H/s/moe.gguf" \
      "$B/k/h200-qwen3-30b-a3b-bf16/kernels" h200/qwen3-30b-a3b/bf16 "bench-bf16-base" --batch 1 --steps 64
  fi
  finish moe-b1
  ;;
moe-probe)
  unpack .q4
  kernel_tests ${MOE_KT:-qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1}
  export METRALE_TARGETS=$PWD/targets
  step "synth-model: the 48-layer q4_1 GGUF; cuda_bench on it"
  synth_moe_q4_1
  K4=$H/b/k/h200-qwen3-30b-a3b-q4_1/kernels
  CB_TIMEOUT=150 cb_run "$H/s/moe-q4_1.gguf" "$K4" h200/qwen3-30b-a3b/q4_1 bench-q4_1 \
    --batch 1,16,64,256 --steps 64 --pp 512
  for tu in ${MOE_PROBE_TUNINGS:-attention_cluster=off attention_one_split=off pdl=off}; do
    [ "$(left)" -gt 100 ] && METRALE_CUDA_TUNING=$tu CB_TIMEOUT=60 cb_run "$H/s/moe-q4_1.gguf" "$K4" \
      h200/qwen3-30b-a3b/q4_1 "bench-q4_1-${tu//=/-}" --batch 1 --steps 64 --pp 64
  done
  # one decode step's kernels of one layer (past the prefill and the first steps), each replayed
  # by ncu for its sections
  if command -v ncu > /dev/null && [ "$(left)" -gt 90 ]; then
    step "ncu: a batch-1 step's layer kernels, q4_1"
    timeout $(($(left) - 20)) ncu --clock-control none --graph-profiling node \
      --kernel-name 'regex:^(attn_in|attention|attn_out|moe_route|moe_gu|moe_down)$' --launch-skip 900 --launch-count 6 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats \
      "$H/b/bin/cuda_bench" "$H/s/moe-q4_1.gguf" "$K4" h200/qwen3-30b-a3b/q4_1 --batch 1 --steps 25 --pp 64 \
      2>&1 | sed "s|$H/|~/|g" > "$R/ncu-q4_1.txt"
    echo "rc=${PIPESTATUS[0]}"; grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|No Eligible|Cluster" "$R/ncu-q4_1.txt" | head -80
  fi
  finish moe-probe
  ;;
moe-verify)
  unpack .q4
  [ -f .peer/llamacpp-src.tgz ] && llamacpp_start
  kernel_tests ${MOE_KT:-qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1}
  moe_check2l
  export METRALE_TARGETS=$PWD/targets
  step "synth-model: the 48-layer q4_1 GGUF"
  synth_moe_q4_1
  # no timing shares the CPUs with llama.cpp's build
  [ -f .peer/llamacpp-src.tgz ] && peer_wait 300
  K4=$H/b/k/h200-qwen3-30b-a3b-q4_1/kernels
  CB_TIMEOUT=120 cb_run "$H/s/moe-q4_1.gguf" "$K4" h200/qwen3-30b-a3b/q4_1 bench-q4_1 \
    --batch 1,16,64,256 --steps 64 --pp 512
  # batch 1 again under each tuning of MOE_B1_AB (default attention_heads=off), the grouped
  # steps under MOE_VERIFY_AB (none by default)
  for ab in ${MOE_B1_AB-attention_heads=off}; do
    [ "$(left)" -gt 90 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=60 cb_run "$H/s/moe-q4_1.gguf" "$K4" \
      h200/qwen3-30b-a3b/q4_1 "bench-q4_1-${ab//[=,]/-}" --batch 1 --steps 64
  done
  for ab in ${MOE_VERIFY_AB:-}; do
    [ "$(left)" -gt 90 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=60 cb_run "$H/s/moe-q4_1.gguf" "$K4" \
      h200/qwen3-30b-a3b/q4_1 "bench-q4_1-${ab//[=,]/-}" --batch 64,256 --steps 64 --pp 512
  done
  # batch 1 under the base revision and the variants, leaving the peer its time
  others_q4_1 1 120
  [ -f .peer/llamacpp-src.tgz ] && [ "$(left)" -gt 45 ] && peer_bench q4_1 "$H/s/moe-q4_1.gguf"
  finish moe-verify
  ;;
dense-b1)
  # a batch-1 change on the dense stage path beside the 30B-A3B's: the 36-layer Qwen3-8B GGUFs
  # (q4_1, then bf16; their kernels from prepare-moe's MOE_EXTRA_TARGETS) under cuda_bench at
  # batch 1, again under each tuning of DENSE_B1_AB
  unpack .q4
  export METRALE_TARGETS=$PWD/targets
  for q in q4_1 bf16; do
    K=$H/b/k/h200-qwen3-8b-$q/kernels
    [ -d "$K" ] || { echo "no h200/qwen3-8b/$q kernels in .q4: prepare-moe with MOE_EXTRA_TARGETS" | tee -a "$R/steps.txt"; continue; }
    [ "$(left)" -gt 90 ] || break
    step "synth-model: the 36-layer $q Qwen3-8B GGUF"
    "$H/b/bin/xtask" synth-model qwen3-8b --tokenizer "$H/b/vocab.gguf" --seed 0 --quant $q \
      --out "$H/s/qwen3-8b-$q.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
    CB_TIMEOUT=90 cb_run "$H/s/qwen3-8b-$q.gguf" "$K" h200/qwen3-8b/$q "bench-8b-$q" --batch 1 --steps 64
    for ab in ${DENSE_B1_AB:-}; do
      [ "$(left)" -gt 60 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=90 cb_run "$H/s/qwen3-8b-$q.gguf" "$K" \
        h200/qwen3-8b/$q "bench-8b-$q-${ab//[=,]/-}" --batch 1 --steps 64
    done
    rm -f "$H/s/qwen3-8b-$q.gguf"
  done
  finish dense-b1
  ;;
moe-verify2)
  # results go on in moe-verify's folder
  mkdir -p "$R"
  export METRALE_TARGETS=$PWD/targets
  step "synth-model: the 48-layer bf16 GGUF"
  synth_moe_bf16
  KB=$H/b/k/h200-qwen3-30b-a3b-bf16/kernels
  CB_TIMEOUT=200 cb_run "$H/s/moe.gguf" "$KB" h200/qwen3-30b-a3b/bf16 bench-bf16 --batch 1,16,64,256 --steps 64 --pp 512
  for ab in ${MOE_B1_AB2-attention_heads=off}; do
    [ "$(left)" -gt 150 ] && METRALE_CUDA_TUNING=$ab CB_TIMEOUT=100 cb_run "$H/s/moe.gguf" "$KB" \
      h200/qwen3-30b-a3b/bf16 "bench-bf16-${ab//[=,]/-}" --batch 1 --steps 64
  done
  B=$H/b/base
  [ -d "$B" ] && [ "$(left)" -gt 150 ] && CB=$B/bin/cuda_bench TG=$B/targets CB_TIMEOUT=100 cb_run "$H/s/moe.gguf" \
    "$B/k/h200-qwen3-30b-a3b-bf16/kernels" h200/qwen3-30b-a3b/bf16 bench-bf16-base --batch 1 --steps 64
  [ -x "$H/llamacpp/build/bin/llama-bench" ] && [ "$(left)" -gt 90 ] && peer_bench bf16 "$H/s/moe.gguf"
  finish moe-verify2
  ;;
moe2)
  # results go on in moe's folder (its llama.cpp table among them)
  mkdir -p "$R"
  step "synth-model: the 48-layer q4_1 GGUF; cuda_bench on it"
  synth_moe_q4_1
  CB_TIMEOUT=150 cb_run "$H/s/moe-q4_1.gguf" "$H/b/k/h200-qwen3-30b-a3b-q4_1/kernels" h200/qwen3-30b-a3b/q4_1 bench-q4_1 \
    --batch 1,16,64,256 --steps 64 --pp 512
  [ -f "$R/llamacpp-bf16/llamacpp-batched.txt" ] || peer_bench bf16 "$H/s/moe.gguf"
  peer_bench q4_1 "$H/s/moe-q4_1.gguf"
  [ "$(left)" -gt 150 ] && RECORD_CONCURRENCY=1,16,64 record h200-qwen3-30b-a3b-bf16 "$H/s/moe.gguf" 4096
  finish moe2
  ;;
prepare-qwen2)
  set -e
  pack_start .q5 prepare-qwen2 "${2:-}"
  kernels .q5 qwen2.5-7b/bf16 qwen2.5-7b/q4_1 qwen3-8b/bf16
  kernels2l .q5/b h200-qwen2.5-7b-2l-bf16 qwen2.5-7b
  tools .q5 cuda_bench golden_check
  vocab .q5 qwen2.5-7b
  pack_end .q5
  ;;
qwen2)
  unpack .q5
  # llama.cpp's build in the background when its source is carried (moe2 later uses it too)
  [ -f .peer/llamacpp-src.tgz ] && llamacpp_start
  # Q2_KT: the targets whose kernel tests run (default the three)
  kernel_tests ${Q2_KT:-qwen2.5-7b/bf16 qwen2.5-7b/q4_1 qwen3-8b/bf16}
  X="$H/b/bin/xtask synth-model qwen2.5-7b --tokenizer $H/b/vocab.gguf --seed 0"
  G=tests/golden/make_synth_golden_hf.py
  C="$H/b/bin/golden_check"
  step "synth-model: 2-layer HF folder and GGUF, 28-layer HF folder, bf16 and q4_1 GGUFs; HF goldens (f32 on the GPU)"
  for a in "--layers 2 --format hf --out $H/s/q25-2l-hf" "--layers 2 --out $H/s/q25-2l.gguf" \
           "--format hf --out $H/s/q25-hf" "--out $H/s/q25-bf16.gguf" "--quant q4_1 --out $H/s/q25-q4_1.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  # the golden from the HF folder (both 2-layer files are checked against it below); transformers
  # also reads the GGUF where gguf-py is installed (recorded beside it, not asserted)
  g2=; python3 -c "import gguf" 2> /dev/null && g2=$H/s/q25-2l.gguf
  python3 $G "$H/s/q25-2l-hf" $g2 --device cuda --out "$R/q25-2l_golden" > "$R/golden2.txt" 2>&1; tail -4 "$R/golden2.txt"
  python3 $G "$H/s/q25-hf" --device cuda --out "$R/q25_golden" > "$R/golden28.txt" 2>&1; tail -1 "$R/golden28.txt"
  rm -rf "$H/s/q25-hf"
  step "CUDA vs HF and vs CPU, 2 layers: HF folder and GGUF (prompt in one step), GGUF in 8-token steps"
  for a in "q25-2l-hf" "q25-2l.gguf" "q25-2l.gguf 8"; do
    set -- $a
    METRALE_TARGETS=$H/b/t2/targets $C "$H/s/$1" "$R/q25-2l_golden.json" --cuda "$H/b/k/h200-qwen2.5-7b-2l-bf16/kernels" \
      h200/qwen2.5-7b/bf16 --vs-cpu --tol 0.05 ${2:+--prefill-chunk $2} | tee -a "$R/check-2l.json"
  done
  export METRALE_TARGETS=$PWD/targets
  step "CUDA vs HF: 28 layers bf16 GGUF; q4_1 against the CPU backend"
  $C "$H/s/q25-bf16.gguf" "$R/q25_golden.json" --cuda "$H/b/k/h200-qwen2.5-7b-bf16/kernels" h200/qwen2.5-7b/bf16 \
    --tol 0.1 | tee "$R/check-28l.json"
  $C "$H/s/q25-q4_1.gguf" "$R/q25_golden.json" --cuda "$H/b/k/h200-qwen2.5-7b-q4_1/kernels" h200/qwen2.5-7b/q4_1 \
    --tol 100 --vs-cpu --cpu-tol 0.1 | tee "$R/check-28l-q4_1.json"
  [ -f .peer/llamacpp-src.tgz ] && peer_wait 300
  for q in bf16 q4_1; do
    CB_TIMEOUT=120 cb_run "$H/s/q25-$q.gguf" "$H/b/k/h200-qwen2.5-7b-$q/kernels" h200/qwen2.5-7b/$q bench-$q \
      --batch 1,16,64,256 --steps 64 --pp 512
  done
  if [ -f "$H/llamacpp/build.done" ]; then
    for q in bf16 q4_1; do [ "$(left)" -gt 100 ] && peer_bench $q "$H/s/q25-$q.gguf"; done
  fi
  finish qwen2
  ;;
call1)
  unpack .q1
  llamacpp_start
  kernel_tests qwen3-8b/bf16 qwen3-8b/q4_1
  X="$H/b/bin/xtask synth-model qwen3-8b --tokenizer $H/b/vocab.gguf --seed 0"
  step "synth-model: bf16 and q4_1 GGUFs, HF folder, 2-layer HF folder and GGUF"
  for a in "--out $H/s/q8b-bf16.gguf" "--quant q4_1 --out $H/s/q8b-q4_1.gguf" "--format hf --out $H/s/q8b-hf" \
           "--layers 2 --format hf --out $H/s/q8b2-hf" "--layers 2 --out $H/s/q8b2-bf16.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  df -h "$H" | tail -1 | tee -a "$R/synth.txt"
  G=tests/golden/make_synth_golden_hf.py
  step "HF goldens (f32 on the GPU): 2 layers, then 36"
  python3 $G "$H/s/q8b2-hf" --device cuda --out "$R/q8b2_golden" > "$R/golden2.txt" 2>&1; tail -2 "$R/golden2.txt"
  python3 $G "$H/s/q8b-hf" --device cuda --out "$R/q8b_golden" > "$R/golden36.txt" 2>&1; tail -2 "$R/golden36.txt"
  rm -rf "$H/s/q8b-hf"
  C="$H/b/bin/golden_check"
  step "CUDA vs HF and vs CPU: 2 layers (bf16 KV; kernels built for 2 layers), HF folder and GGUF"
  for m in "$H/s/q8b2-hf" "$H/s/q8b2-bf16.gguf"; do
    METRALE_TARGETS=$H/b/t2/targets $C "$m" "$R/q8b2_golden.json" --cuda "$H/b/k/h200-qwen3-8b-2l-bf16/kernels" \
      $TQ/bf16 --vs-cpu --tol 0.05 | tee -a "$R/check-2l.json"
  done
  METRALE_TARGETS=$H/b/t2/targets $C "$H/s/q8b2-hf" "$R/q8b2_golden.json" --cuda "$H/b/k/h200-qwen3-8b-2l-bf16/kernels" \
    $TQ/bf16 --tol 0.05 --prefill-chunk 8 | tee -a "$R/check-2l-mv.json"
  export METRALE_TARGETS=$PWD/targets
  step "CUDA vs HF: 36 layers bf16 GGUF; q4_1 (quantised: against the CPU backend, HF reported)"
  $C "$H/s/q8b-bf16.gguf" "$R/q8b_golden.json" --cuda "$H/b/k/h200-qwen3-8b-bf16/kernels" $TQ/bf16 --tol 0.1 | tee "$R/check-36l.json"
  $C "$H/s/q8b-q4_1.gguf" "$R/q8b_golden.json" --cuda "$H/b/k/h200-qwen3-8b-q4_1/kernels" $TQ/q4_1 --tol 100 \
    --vs-cpu --cpu-tol 0.1 | tee "$R/check-36l-q4_1.json"
  for q in bf16 q4_1; do
    CB_TIMEOUT=150 cb_run "$H/s/q8b-$q.gguf" "$H/b/k/h200-qwen3-8b-$q/kernels" $TQ/$q bench-$q --batch 1,16,64,256 --steps 64 --pp 512
  done
  finish call1
  ;;
call2)
  mkdir -p "$R"
  for q in bf16 q4_1; do peer_bench $q "$H/s/q8b-$q.gguf"; done
  for q in bf16 q4_1; do
    [ "$(left)" -gt 120 ] && RECORD_CONCURRENCY=1,16,64 record h200-qwen3-8b-$q "$H/s/q8b-$q.gguf" 4096
  done
  finish call2
  ;;
*)
  sed -n 2,15p "$0"; exit 2 ;;
esac
