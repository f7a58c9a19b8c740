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
#   bash ci/gpu/qwen3.sh prepare-moe MODEL.gguf   CPU machine: .q4/
#   bash ci/gpu/qwen3.sh moe    carry .q4 .peer  h200/qwen3-30b-a3b/bf16 (128 experts, 8 a token):
#        llama.cpp's build (background); cuda_kernels (the routed experts against the CPU
#        reference, a full tie among them); the 2-layer checkpoints (HF folder, one tensor per
#        expert; GGUF, 3-D experts) against HF transformers and the CPU backend; the full bf16
#        GGUF (61 GB, in /dev/shm when it has the room) and cuda_bench on it (batch-1 decode beside
#        the active experts' bytes, 16 / 64 / 256 sequences, pp512)
#   bash ci/gpu/qwen3.sh moe2   carry nothing    the 48-layer q4_1 GGUF and cuda_bench on it (the q4_1
#        target); llama-bench and llama-batched-bench on both GGUFs; bench-record with llama.cpp
# Each call leaves $OUT/<call>.tgz (its results folder).
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
TQ=h200/qwen3-8b

case "${1:-}" in
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/qwen3.sh prepare MODEL.gguf" >&2; exit 2; }
  rm -rf .q1 && mkdir -p .q1/b/bin .q1/b/k .q1/b/srv
  for q in bf16 q4_1; do
    cargo xtask build-target --hw h200 --model qwen3-8b --quant $q --kernels-only --out .q1/b/k/h200-qwen3-8b-$q 2>&1 | tail -1
    cargo xtask build-target --hw h200 --model qwen3-8b --quant $q --out .q1/b/srv/h200-qwen3-8b-$q 2>&1 | tail -1
    rm -rf .q1/b/srv/h200-qwen3-8b-$q/kernels
  done
  kernels2l .q1/b h200-qwen3-8b-2l-bf16 qwen3-8b
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .q1/b/bin/cuda_kernels
  for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" .q1/b/bin/$e; done
  cp "$(exe build --release -p xtask)" .q1/b/bin/xtask
  strip .q1/b/bin/* .q1/b/srv/*/metrale-server
  cargo xtask synth-model qwen3-8b --tokenizer "$model" --format vocab --out .q1/b/vocab.gguf >/dev/null
  tar cJf .q1/b.tar.xz -C .q1 b && rm -rf .q1/b
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  echo "carry .q1 .peer: $(du -cb .q1 .peer | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
prepare-verify)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/qwen3.sh prepare-verify MODEL.gguf" >&2; exit 2; }
  rm -rf .q2 && mkdir -p .q2/b/bin .q2/b/k
  for t in qwen3-8b/bf16 qwen3-8b/q4_1 llama-3.1-8b/bf16 llama-3.1-8b/q4_1 smollm2-135m/q4_1; do
    m=${t%/*} q=${t#*/}
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --kernels-only --out ".q2/b/k/h200-$m-$q" 2>&1 | tail -1
  done
  kernels2l .q2/b h200-qwen3-8b-2l-bf16 qwen3-8b
  kernels2l .q2/b h200-llama-3.1-8b-2l-bf16 llama-3.1-8b
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .q2/b/bin/cuda_kernels
  cp "$(exe build $C --example golden_check)" .q2/b/bin/golden_check
  cp "$(exe build --release -p xtask)" .q2/b/bin/xtask
  strip .q2/b/bin/*
  cargo xtask synth-model qwen3-8b --tokenizer "$model" --format vocab --out .q2/b/vocab.gguf >/dev/null
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .q2/b/vocab-8b.gguf >/dev/null
  tar cJf .q2/b.tar.xz -C .q2 b && rm -rf .q2/b
  echo "carry .q2: $(du -cb .q2 | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
verify)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .q2/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
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
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/qwen3.sh prepare-small MODEL.gguf" >&2; exit 2; }
  rm -rf .q3 && mkdir -p .q3/b/bin .q3/b/k
  cargo xtask build-target --hw h200 --model qwen3-0.6b --quant bf16 --kernels-only --out .q3/b/k/h200-qwen3-0.6b-bf16 2>&1 | tail -1
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .q3/b/bin/cuda_kernels
  for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" .q3/b/bin/$e; done
  cp "$(exe build --release -p xtask)" .q3/b/bin/xtask
  strip .q3/b/bin/*
  cargo xtask synth-model qwen3-0.6b --tokenizer "$model" --format vocab --out .q3/b/vocab.gguf >/dev/null
  tar cJf .q3/b.tar.xz -C .q3 b && rm -rf .q3/b
  echo "carry .q3: $(du -cb .q3 | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
small)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .q3/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
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
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/qwen3.sh prepare-moe MODEL.gguf" >&2; exit 2; }
  rm -rf .q4 && mkdir -p .q4/b/bin .q4/b/k
  for q in bf16 q4_1; do
    cargo xtask build-target --hw h200 --model qwen3-30b-a3b --quant $q --kernels-only --out .q4/b/k/h200-qwen3-30b-a3b-$q 2>&1 | tail -1
  done
  kernels2l .q4/b h200-qwen3-30b-a3b-2l-bf16 qwen3-30b-a3b
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .q4/b/bin/cuda_kernels
  for e in cuda_bench golden_check; do cp "$(exe build $C --example $e)" .q4/b/bin/$e; done
  cp "$(exe build --release -p xtask)" .q4/b/bin/xtask
  mkdir -p .q4/b/srv
  for q in bf16 q4_1; do
    cargo xtask build-target --hw h200 --model qwen3-30b-a3b --quant $q --out .q4/b/srv/h200-qwen3-30b-a3b-$q 2>&1 | tail -1
    rm -rf .q4/b/srv/h200-qwen3-30b-a3b-$q/kernels
  done
  strip .q4/b/bin/* .q4/b/srv/*/metrale-server
  [ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
  cargo xtask synth-model qwen3-30b-a3b --tokenizer "$model" --format vocab --out .q4/b/vocab.gguf >/dev/null
  tar cJf .q4/b.tar.xz -C .q4 b && rm -rf .q4/b
  echo "carry .q4: $(du -cb .q4 | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
moe)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .q4/b.tar.xz -C "$H"
  step "llama.cpp build (background)"
  [ -f .peer/llamacpp-src.tgz ] && bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  kernel_tests qwen3-30b-a3b/bf16 qwen3-30b-a3b/q4_1
  X="$H/b/bin/xtask synth-model qwen3-30b-a3b --tokenizer $H/b/vocab.gguf --seed 0 --layers 2"
  step "synth-model: 2-layer HF folder and GGUF; HF golden (f32 on the GPU)"
  $X --format hf --out "$H/s/moe2-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  $X --out "$H/s/moe2-bf16.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/moe2-hf" --device cuda --out "$R/moe2_golden" > "$R/golden.txt" 2>&1; tail -1 "$R/golden.txt"
  export METRALE_TARGETS=$H/b/t2/targets
  step "CUDA vs HF and vs CPU, 2 layers: HF folder and GGUF (prompt in one step), GGUF in 8-token steps"
  for a in "moe2-hf" "moe2-bf16.gguf" "moe2-bf16.gguf 8"; do
    set -- $a
    "$H/b/bin/golden_check" "$H/s/$1" "$R/moe2_golden.json" --cuda "$H/b/k/h200-qwen3-30b-a3b-2l-bf16/kernels" \
      h200/qwen3-30b-a3b/bf16 --vs-cpu --tol 0.05 ${2:+--prefill-chunk $2} | tee -a "$R/check-2l.json"
  done
  rm -rf "$H/s/moe2-hf" "$H/s/moe2-bf16.gguf"
  export METRALE_TARGETS=$PWD/targets
  # the full file where it fits: /dev/shm (RAM) if it holds 64 GB, else the disk
  F=$H/s/moe-bf16.gguf
  [ "$(df --output=avail -B1G /dev/shm | tail -1)" -gt 64 ] && F=/dev/shm/moe-bf16.gguf
  step "synth-model: the 48-layer bf16 GGUF ($F)"
  "$H/b/bin/xtask" synth-model qwen3-30b-a3b --tokenizer "$H/b/vocab.gguf" --seed 0 --out "$F" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  ln -sf "$F" "$H/s/moe.gguf"
  CB_TIMEOUT=200 cb_run "$H/s/moe.gguf" "$H/b/k/h200-qwen3-30b-a3b-bf16/kernels" h200/qwen3-30b-a3b/bf16 bench-bf16 \
    --batch 1,16,64,256 --steps 64 --pp 512
  finish moe
  ;;
moe2)
  mkdir -p "$R"
  step "synth-model: the 48-layer q4_1 GGUF; cuda_bench on it"
  "$H/b/bin/xtask" synth-model qwen3-30b-a3b --tokenizer "$H/b/vocab.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/moe-q4_1.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  CB_TIMEOUT=150 cb_run "$H/s/moe-q4_1.gguf" "$H/b/k/h200-qwen3-30b-a3b-q4_1/kernels" h200/qwen3-30b-a3b/q4_1 bench-q4_1 \
    --batch 1,16,64,256 --steps 64 --pp 512
  step "llama.cpp build (started by moe) done?"
  for _ in $(seq 120); do [ -f "$H/llamacpp/build.done" ] && break; sleep 5; done
  cat "$H/llamacpp/build.done"
  for q in bf16 q4_1; do
    f=$H/s/moe.gguf; [ $q = q4_1 ] && f=$H/s/moe-q4_1.gguf
    step "llama-bench pp512 / tg128 and llama-batched-bench 1, 16, 64, 256: $q"
    mkdir -p "$R/llamacpp-$q"
    OUT=$R/llamacpp-$q timeout 200 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz "$f" 1,16,64,256 \
      > "$R/llamacpp-$q.txt" 2>&1; echo "rc=$?"; cat "$R/llamacpp-$q/llamacpp-bench.md" "$R/llamacpp-$q/llamacpp-batched.txt"
  done
  [ "$(left)" -gt 150 ] && RECORD_CONCURRENCY=1,16,64 record h200-qwen3-30b-a3b-bf16 "$H/s/moe.gguf" 4096
  finish moe2
  ;;
call1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .q1/b.tar.xz -C "$H"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
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
  step "llama.cpp build (started by call1) done?"
  for _ in $(seq 120); do [ -f "$H/llamacpp/build.done" ] && break; sleep 5; done
  cat "$H/llamacpp/build.done"
  for q in bf16 q4_1; do
    step "llama-bench pp512 / tg128 and llama-batched-bench 1, 16, 64, 256: $q"
    mkdir -p "$R/llamacpp-$q"
    OUT=$R/llamacpp-$q timeout 200 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz "$H/s/q8b-$q.gguf" 1,16,64,256 \
      > "$R/llamacpp-$q.txt" 2>&1; echo "rc=$?"; cat "$R/llamacpp-$q/llamacpp-bench.md"; cat "$R/llamacpp-$q/llamacpp-batched.txt"
  done
  for q in bf16 q4_1; do
    [ "$(left)" -gt 120 ] && RECORD_CONCURRENCY=1,16,64 record h200-qwen3-8b-$q "$H/s/q8b-$q.gguf" 4096
  done
  finish call2
  ;;
*)
  sed -n 2,15p "$0"; exit 2 ;;
esac
