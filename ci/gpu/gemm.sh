#!/usr/bin/env bash
# The Hopper GEMMs of h200/llama-3.1-8b/bf16 product by product beside cuBLAS (torch.matmul, bf16)
# on the same shapes in the same call, then the whole model on them, on a synthetic checkpoint made
# on the H200 machine. One call:
#
#   bash ci/gpu/gemm.sh prepare MODEL.gguf   CPU machine: .gm1/ (binaries, kernels, vocabulary)
#   bash ci/gpu/gemm.sh call1  carry .gm1 .gm2  the 8B bf16 GGUF and the 2-layer HF folder; the GEMM
#        kernel tests (every warp-specialised tile and split against the CPU ops; the products at
#        16-300 tokens); gemm_bench --sweep at 16, 64, 256, 512 and 4,096 tokens and cuBLAS on the
#        same shapes (bench/gemm/table.py joins them); cuda_bench (decode of 16, 64 and 256
#        sequences, pp512) with the warp-specialised kernels and without (tma_gemm=off); the 2-layer
#        check against HF transformers; then the rest of the 8B bf16 kernel tests and those of
#        the other h200 targets (`shapes`)
#   bash ci/gpu/gemm.sh bench  carry .gm1 .gm2  the product table alone, then `shapes`
#   bash ci/gpu/gemm.sh prefill carry .gm1 .gm2 .peer  llama.cpp's build started in the background;
#        the attention kernel tests of 8B bf16 (flash and split-K against the CPU ops); cuda_bench
#        (pp512, one 8,192-token prompt in 512-token chunks, decode of 64 and 256 sequences) with
#        flash attention and without (flash_attention=off); the 2-layer check against HF
#        transformers; the rest of the 8B bf16 kernel tests and the other h200 targets' (`shapes`)
#   bash ci/gpu/gemm.sh peer   carry .gm1 .peer  llama.cpp's build, then this build's cuda_bench and
#        llama-bench (pp512, pp8192, tg128) / llama-batched-bench on the same 8B bf16 GGUF (one
#        call, ~8 min); AB_OFF=KEYS adds a cuda_bench run with those tuning keys off, GB_TOKENS=N,...
#        gemm_bench's planned products and the greedy arg-max alone
#   bash ci/gpu/gemm.sh w4a16  carry .gm1 .gm2 .peer  the 8B q4_1 and
#        bf16 GGUFs; the GEMM tests of 8B q4_1 (W4A16 products and the W8A16 LM head against the CPU
#        ops; stop on failure); gemm_bench on 8B q4_1 and bf16 at 16-4,096 tokens and cuBLAS on the
#        same shapes (table.py --w4a16); cuda_bench of 8B q4_1 (decode of 16, 64 and 256
#        sequences, pp512), both on the warp-specialised wq_* kernels and on the one-warpgroup wg_*
#        ones (tma_gemm=off), and of 8B bf16 beside them, and of SmolLM2 q4_1 (batch 1: decode_1); llama.cpp's build (background, from
#        here on); the rest of the 8B q4_1 kernel tests
#        (with .gm3/probes.tar.xz carried too: gemm_bench at 16 and 256 tokens on each kernel
#        folder k-NAME/ in it, variants built from edited copies of the templates); Nsight
#        Compute's warp states of wq_gu at 16 tokens (ncu_gu)
#   bash ci/gpu/gemm.sh w4a16-peer carry .gm1 .gm2 .peer  (right after w4a16, on the same machine)
#        llama.cpp's llama-bench (pp512, tg128) and llama-batched-bench (16, 64, 256) on the same
#        q4_1 GGUF; the GEMM tests of 8B bf16 and the other h200 targets' kernel tests
#   bash ci/gpu/gemm.sh ab     carry .gm1 .gm2  the decode steps of 16 and 64 sequences taken apart
#        (8B q4_1 under the tunings in $AB, bf16 beside them): each stage alone beside the step
#   bash ci/gpu/gemm.sh b1     carry .gm1 .gm2 (.gm3)  SmolLM2 q4_1's cuda_model (decode_1 against the
#        CPU backend) on a synthetic GGUF; 8B q4_1 at batch 1 as built and on each probe folder
#   bash ci/gpu/gemm.sh decode carry .gm1 .gm2 (.gm3)  batched decode's attention: the attention
#        tests of 8B bf16 (stop on failure); cuda_bench of 8B bf16 (16-256 sequences, pp512) with
#        the pairs packed into blocks, without (attention_pack=off) and on the flash kernel
#        (flash_decode=on), of 8B q4_1 beside them,
#        and of 8B bf16 on each probe folder d-NAME/ of .gm3/probes.tar.xz; the rest of the 8B
#        bf16 kernel tests and the other targets' (`shapes`)
#   bash ci/gpu/gemm.sh tests  carry .gm1 .gm2  every kernel test of 8B bf16, then `shapes`
#   bash ci/gpu/gemm.sh norm   carry .gm1 .gm2  the RMSNorm fused into the O and down products'
#        epilogues: the GEMM tests of 8B bf16 and q4_1 (stop on failure); cuda_bench of 8B bf16
#        (16-256 sequences, pp512, one 8,192-token prompt) and 8B q4_1 (16-256, pp512), each beside
#        fused_norm=off; the 2-layer check against HF transformers; the rest of the kernel tests
#        (SKIP_REST=1 skips them)
#   bash ci/gpu/gemm.sh tiles  carry .gm1 .gm2  the greedy arg-max spread over blocks and the QKV
#        product's 96-row tiles: the GEMM and arg-max tests of 8B bf16 and q4_1 (stop on failure);
#        gemm_bench --sweep of 8B bf16 at 32-512 tokens and cuBLAS (SKIP_GB=1 skips it);
#        cuda_bench of 8B bf16 (16-256 sequences, pp512) and q4_1 as built and with
#        argmax_split=off,tma_96=off, interleaved AB_REPS times; the 2-layer check; the rest of the
#        kernel tests (SKIP_REST=1 skips them); GB_TOKENS as `peer`
#   bash ci/gpu/gemm.sh kab    carry .gm1 .gm3  the build's 8B bf16 kernels against other builds of
#        them (.gm3/probes.tar.xz: folders g-NAME/): GEMM tests, gemm_bench's planned products
#        (GB_TOKENS), cuda_bench of each interleaved AB_REPS times, the 2-layer check
#   bash ci/gpu/gemm.sh ncu    carry .gm1  Nsight Compute on the first launch of each kernel in
#        NCU_KERNELS (tma_o,tma_qkv) at NCU_TOKENS (64,256) tokens, 8B bf16 (NCU_SET=full: every
#        section)
#   bash ci/gpu/gemm.sh shapes carry .gm2    the kernel tests of h200/smollm2-135m/{bf16,q4_1},
#        h200/llama-3.2-1b/bf16 and h200/llama-3.1-8b/q4_1 (the GEMMs at other shapes; the
#        mma.sync path's epilogues)
# Each call leaves $OUT/<call>.tgz (its results folder). ci/gpu/README.md says what they predict.
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
# KERNEL_DIR NAME [cuda_bench args]: one cuda_bench run of 8B bf16, its JSON to $R/NAME.json
bench() { local k=$1 n=$2; shift 2; cb_run "$H/s/l8b-bf16.gguf" "$k" $T8/bf16 "$n" "$@"; }

# the 8B bf16 GGUF and the 2-layer HF folder, made from the carried vocabulary
synth_8b_2l() {
  local X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0" a
  step "synth-model: 8B bf16 GGUF, 2-layer HF folder"
  for a in "--out $H/s/l8b-bf16.gguf" "--layers 2 --format hf --out $H/s/l8b2-hf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
}
# the 8B bf16 and q4_1 GGUFs, made from the carried vocabulary
synth_8b() {
  local X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0" a
  step "synth-model: 8B bf16 and q4_1 GGUFs"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
}
# setup_8b_both: .gm1 and .gm2 unpacked, the GPU's clocks, the 8B bf16 and q4_1 GGUFs and the
# 2-layer HF folder; K and KQ the two 8B targets' kernel folders
setup_8b_both() {
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --layers 2 --format hf \
    --out "$H/s/l8b2-hf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels KQ=$H/b/k/h200-llama-3.1-8b-q4_1/kernels
}
# check_2l WHAT: the 2-layer model (kernels built for 2 layers) against HF transformers
check_2l() {
  step "2-layer check against HF transformers ($1)"
  python3 tests/golden/make_synth_golden_hf.py "$H/s/l8b2-hf" --device cuda --out "$R/l8b2_golden" > "$R/golden2.txt" 2>&1
  tail -1 "$R/golden2.txt"
  METRALE_TARGETS=$H/b/t2/targets timeout 120 "$H/b/bin/golden_check" "$H/s/l8b2-hf" "$R/l8b2_golden.json" \
    --cuda "$H/b/k/h200-llama-3.1-8b-2l-bf16/kernels" $T8/bf16 --tol 0.05 --repeat 2 | tee -a "$R/check-2l.jsonl" \
    | python3 -c 'import sys,json; d=json.load(sys.stdin); print("pass", d["pass"], "top20", round(d["max_abs_diff_top20"], 4), "rerun", d["repeat"]["max_abs_diff"])'
}
# tests8 NAME [cuda_kernels args]: the kernel tests of 8B bf16 the args select, to $R/kernel-tests-NAME.txt
tests8() {
  local n=$1; shift
  METRALE_CUDA_TARGET=$T8/bf16 METRALE_CUDA_KERNELS=$H/b/k/h200-llama-3.1-8b-bf16/kernels METRALE_TARGETS=$PWD/targets \
    timeout "${TESTS_TIMEOUT:-120}" "$H/b/bin/cuda_kernels" --nocapture --test-threads=1 "$@" > "$R/kernel-tests-$n.txt" 2>&1
  echo "rc=$?" >> "$R/kernel-tests-$n.txt"
}
# gemm_bench --sweep over the 8B bf16 products, cuBLAS on the same shapes, the joined table
table() {
  local k=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  step "gemm_bench --sweep: every product at ${GEMM_TOKENS:=16,64,256,512,4096} tokens"
  METRALE_TARGETS=$PWD/targets timeout 240 "$H/b/bin/gemm_bench" "$H/s/l8b-bf16.gguf" "$k" $T8/bf16 \
    --tokens "$GEMM_TOKENS" --sweep --out "$R/gemm.jsonl" > "$R/gemm.txt" 2>&1; echo "rc=$?" >> "$R/gemm.txt"
  grep -E "runs|panicked|rc=" "$R/gemm.txt"
  step "cuBLAS (torch.matmul, bf16) on the same shapes"
  timeout 120 python3 bench/gemm/cublas.py --from "$R/gemm.jsonl" --out "$R/cublas.jsonl" > "$R/cublas.txt" 2>&1
  echo "rc=$?" >> "$R/cublas.txt"
  python3 bench/gemm/table.py "$R/gemm.jsonl" "$R/cublas.jsonl" | tee "$R/table.md"
}

# planned: with GB_TOKENS=N,... set, gemm_bench's planned products of 8B bf16 and the greedy arg-max
# alone at those token counts
planned() {
  [ -n "${GB_TOKENS:-}" ] || return 0
  step "gemm_bench at $GB_TOKENS tokens"
  METRALE_TARGETS=$PWD/targets timeout 120 "$H/b/bin/gemm_bench" "$H/s/l8b-bf16.gguf" "$H/b/k/h200-llama-3.1-8b-bf16/kernels" \
    $T8/bf16 --tokens "$GB_TOKENS" --out "$R/gemm-planned.jsonl" > "$R/gemm-planned.txt" 2>&1; echo "rc=$?" >> "$R/gemm-planned.txt"
  grep -E "runs|argmax|panicked|rc=" "$R/gemm-planned.txt"
}

# probes: with .gm3/probes.tar.xz carried, kernel folders k-NAME/ of h200/llama-3.1-8b/q4_1 built
# from edited copies of the templates (`xtask build-target --repo COPY`): each product timed at 16
# and 256 tokens on the 8B q4_1 GGUF in $H/s
probes() {
  [ -f .gm3/probes.tar.xz ] || return 0
  step "probes: gemm_bench on each variant's kernels"
  mkdir -p "$R/probes" "$H/p" && tar xJf .gm3/probes.tar.xz -C "$H/p"
  local v n
  for v in "$H"/p/k-*; do
    n=${v##*/k-}
    METRALE_TARGETS=$PWD/targets timeout 90 "$H/b/bin/gemm_bench" "$H/s/l8b-q4_1.gguf" "$v/kernels" $T8/q4_1 \
      --tokens 16,256 --out "$R/probes/gemm-$n.jsonl" > "$R/probes/gemm-$n.txt" 2>&1; echo "rc=$?" >> "$R/probes/gemm-$n.txt"
    python3 bench/gemm/table.py --probe "$n" "$R/probes/gemm-$n.jsonl"
  done
}

# ncu_gu: Nsight Compute on the first wq_gu launch at 16 tokens (8B q4_1): where its warps wait
# (warp states, scheduler, memory); skipped where ncu is missing or cannot read the counters
ncu_gu() {
  command -v ncu > /dev/null || return 0
  step "ncu: wq_gu at 16 tokens"
  METRALE_TARGETS=$PWD/targets timeout 120 ncu --clock-control none -k regex:wq_gu -c 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis "$H/b/bin/gemm_bench" \
    "$H/s/l8b-q4_1.gguf" "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" $T8/q4_1 --tokens 16 --out "$R/ncu-gemm.jsonl" \
    2>&1 | sed "s|$H/|\$H/|g" > "$R/ncu-wq_gu-16.txt"; echo "rc=${PIPESTATUS[0]}" >> "$R/ncu-wq_gu-16.txt"
  grep -E "Duration|Memory Throughput|Issued Ipc|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Stall|==ERROR|rc=" \
    "$R/ncu-wq_gu-16.txt" | head -24
}

case "${1:-}" in
prepare)
  set -e
  model=${2:-${METRALE_MODEL:-}}
  [ -f "$model" ] || { echo "usage: ci/gpu/gemm.sh prepare MODEL.gguf" >&2; exit 2; }
  rm -rf .gm1 && mkdir -p .gm1/b/bin .gm1/b/k
  kernels2l .gm1/b
  cargo xtask build-target --hw h200 --model llama-3.1-8b --quant bf16 --kernels-only \
    --out .gm1/b/k/h200-llama-3.1-8b-bf16 2>&1 | tail -1
  C="--release -p metrale-backend --features cuda"
  cp "$(exe test $C --no-run --test cuda_kernels)" .gm1/b/bin/cuda_kernels
  for e in cuda_bench gemm_bench golden_check; do cp "$(exe build $C --example $e)" .gm1/b/bin/$e; done
  cp "$(exe test $C --no-run --test cuda_model)" .gm1/b/bin/cuda_model
  cp "$(exe build --release -p xtask)" .gm1/b/bin/xtask
  strip .gm1/b/bin/*
  cargo xtask synth-model llama-3.1-8b --tokenizer "$model" --format vocab --out .gm1/b/vocab-8b.gguf >/dev/null
  cargo xtask synth-model smollm2-135m --tokenizer "$model" --format vocab --out .gm1/b/vocab-smollm2.gguf >/dev/null
  tar cJf .gm1/b.tar.xz -C .gm1 b && rm -rf .gm1/b
  rm -rf .gm2 && mkdir -p .gm2/b/bin .gm2/b/k
  tar xJf .gm1/b.tar.xz -C .gm2 b/bin/cuda_kernels
  for t in smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1; do
    cargo xtask build-target --hw h200 --model ${t%/*} --quant ${t#*/} --kernels-only \
      --out ".gm2/b/k/h200-${t//\//-}" 2>&1 | tail -1
  done
  tar cJf .gm2/b.tar.xz -C .gm2 b && rm -rf .gm2/b
  echo "carry .gm1: $(du -cb .gm1 | tail -1 | cut -f1) bytes, .gm2: $(du -cb .gm2 | tail -1 | cut -f1) bytes + the tree (at most 67108864)"
  ;;
call1)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H"
  GEMM_TOKENS=16,32,64,128,256,512,4096
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b_2l
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  step "cuda_kernels h200/llama-3.1-8b/bf16: the GEMM tests first"
  TESTS_TIMEOUT=150 tests8 gemm tma_gemm gemm_prefill; grep -E "rel err|launches|test result|panicked|rc=" "$R/kernel-tests-gemm.txt" | tail -40
  # a failing GEMM makes the timings meaningless: stop here (and save the device time)
  grep -q "test result: ok" "$R/kernel-tests-gemm.txt" || { finish call1; exit 1; }
  table
  bench "$K" bench-bf16 --batch 16,32,64,128,256 --steps 32 --pp 512
  METRALE_CUDA_TUNING=tma_gemm=off bench "$K" bench-bf16-wgmma --batch 64,256 --steps 32 --pp 512
  check_2l "prompt through the GEMMs"
  step "cuda_kernels h200/llama-3.1-8b/bf16: the rest"
  tests8 rest --skip tma_gemm --skip gemm_prefill; grep -E "test result|panicked|rc=" "$R/kernel-tests-rest.txt"
  # the other targets' kernel tests (the shared epilogues and common.cuh changed with these kernels)
  [ -f .gm2/b.tar.xz ] && tar xJf .gm2/b.tar.xz -C "$H" && kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  finish call1
  ;;
bench)
  # carry .gm1 .gm2: the product table alone (gemm_bench --sweep, cuBLAS), then the other bf16
  # targets' kernel tests
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --out "$H/s/l8b-bf16.gguf" 2>&1 | grep synth-model
  table
  tar xJf .gm2/b.tar.xz -C "$H"
  kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  finish bench
  ;;
peer)
  # carry .gm1 .peer: llama.cpp (llama-bench pp512/tg128, llama-batched-bench at 16, 64 and 256
  # sequences) beside this build's cuda_bench on the same 8B bf16 GGUF, in one call; cuda_bench runs
  # after llama.cpp's build, so the two never share the CPUs
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H"
  step "llama.cpp build (background)"
  bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --out "$H/s/l8b-bf16.gguf" 2>&1 | grep synth-model
  step "llama.cpp build: waiting for it"
  peer_wait
  bench "$H/b/k/h200-llama-3.1-8b-bf16/kernels" bench-bf16 --batch 16,64,256 --steps 32 --pp 512 --long 8192
  # AB_OFF=KEYS: the same run with those tuning keys off, beside it
  [ -n "${AB_OFF:-}" ] && METRALE_CUDA_TUNING=$AB_OFF bench "$H/b/k/h200-llama-3.1-8b-bf16/kernels" bench-bf16-off \
    --batch 16,64,256 --steps 32 --pp 512
  planned
  step "llama.cpp on the same GGUF"
  OUT=$R LLAMACPP_PP=512,8192 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz "$H/s/l8b-bf16.gguf" 16,64,256 2>&1 | tail -12
  finish peer
  ;;
prefill)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H"
  [ -f .peer/llamacpp-src.tgz ] && bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b_2l
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  step "cuda_kernels h200/llama-3.1-8b/bf16: attention first"
  TESTS_TIMEOUT=150 tests8 attention attention; grep -E "rel err|test result|panicked|rc=" "$R/kernel-tests-attention.txt" | tail -30
  grep -q "test result: ok" "$R/kernel-tests-attention.txt" || { finish prefill; exit 1; }
  bench "$K" bench-bf16 --batch 64,256 --steps 32 --pp 512 --long 8192
  METRALE_CUDA_TUNING=flash_attention=off bench "$K" bench-bf16-split --batch 64 --steps 32 --pp 512 --long 8192
  check_2l "prompt through the GEMMs and flash attention"
  step "cuda_kernels h200/llama-3.1-8b/bf16: the rest"
  tests8 rest --skip attention; grep -E "test result|panicked|rc=" "$R/kernel-tests-rest.txt"
  [ -f .gm2/b.tar.xz ] && tar xJf .gm2/b.tar.xz -C "$H" && kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  finish prefill
  ;;
w4a16)
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b
  KQ=$H/b/k/h200-llama-3.1-8b-q4_1/kernels K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  step "cuda_kernels h200/llama-3.1-8b/q4_1: the GEMM tests first"
  METRALE_CUDA_TARGET=$T8/q4_1 METRALE_CUDA_KERNELS=$KQ METRALE_TARGETS=$PWD/targets timeout 200 "$H/b/bin/cuda_kernels" \
    --nocapture --test-threads=1 gemm_prefill > "$R/kernel-tests-q4-gemm.txt" 2>&1; echo "rc=$?" >> "$R/kernel-tests-q4-gemm.txt"
  grep -E "path:|rel err|test result|panicked|rc=" "$R/kernel-tests-q4-gemm.txt" | tail -30
  grep -q "test result: ok" "$R/kernel-tests-q4-gemm.txt" || { finish w4a16; exit 1; }
  step "gemm_bench: 8B q4_1 (W4A16) and bf16 at ${GEMM_TOKENS:=16,64,256,512,4096} tokens, cuBLAS on the same shapes"
  # q4_1 on the warp-specialised wq_* kernels (the default), on the one-warpgroup wg_* kernels
  # (tma_gemm=off: the A/B of the two), and bf16
  for q in q4_1 q4_1-wg bf16; do
    k=$H/b/k/h200-llama-3.1-8b-${q%-wg}/kernels tune=; [ "$q" = q4_1-wg ] && tune=tma_gemm=off
    METRALE_CUDA_TUNING=$tune METRALE_TARGETS=$PWD/targets timeout 150 "$H/b/bin/gemm_bench" "$H/s/l8b-${q%-wg}.gguf" "$k" $T8/${q%-wg} \
      --tokens "$GEMM_TOKENS" --out "$R/gemm-$q.jsonl" > "$R/gemm-$q.txt" 2>&1; echo "rc=$?" >> "$R/gemm-$q.txt"
    grep -E "panicked|rc=" "$R/gemm-$q.txt"
  done
  timeout 120 python3 bench/gemm/cublas.py --from "$R/gemm-bf16.jsonl" --out "$R/cublas.jsonl" > "$R/cublas.txt" 2>&1
  python3 bench/gemm/table.py "$R/gemm-bf16.jsonl" "$R/cublas.jsonl" --w4a16 "$R/gemm-q4_1.jsonl" | tee "$R/table-q4_1.md"
  python3 bench/gemm/table.py "$R/gemm-bf16.jsonl" "$R/cublas.jsonl" --w4a16 "$R/gemm-q4_1-wg.jsonl" > "$R/table-q4_1-wg.md"
  cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1 --batch 16,64,256 --steps 32 --pp 512
  METRALE_CUDA_TUNING=tma_gemm=off cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1-wg --batch 16,64,256 --steps 32 --pp 512
  bench "$K" bench-bf16 --batch 16,64,256 --steps 32 --pp 512
  # SmolLM2 q4_1 at batch 1 (its persistent decode_1 reads the q4_1 layout too; 2026-12-01: tg128
  # ~2,990 tok/s, replay ~341 us), on a synthetic GGUF of its shape
  "$H/b/bin/xtask" synth-model smollm2-135m --tokenizer "$H/b/vocab-smollm2.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/smollm2-q4_1.gguf" 2>&1 | grep synth-model
  cb_run "$H/s/smollm2-q4_1.gguf" "$H/b/k/h200-smollm2-135m-q4_1/kernels" h200/smollm2-135m/q4_1 bench-smollm2-q4_1 --batch 8 --steps 32 --pp 512
  # llama.cpp's build for w4a16-peer only now: its compilers on every core would slow the host
  # side of the steps timed above (16 sequences: 3.9 ms a step measured as 8.0 ms during it)
  [ -f .peer/llamacpp-src.tgz ] && bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  probes
  ncu_gu
  step "cuda_kernels h200/llama-3.1-8b/q4_1: the rest"
  METRALE_CUDA_TARGET=$T8/q4_1 METRALE_CUDA_KERNELS=$KQ METRALE_TARGETS=$PWD/targets timeout "$(left)" "$H/b/bin/cuda_kernels" \
    --nocapture --test-threads=1 --skip gemm_prefill > "$R/kernel-tests-q4-rest.txt" 2>&1; echo "rc=$?" >> "$R/kernel-tests-q4-rest.txt"
  grep -E "test result|panicked|rc=" "$R/kernel-tests-q4-rest.txt"
  finish w4a16
  ;;
w4a16-peer)
  # after w4a16 on the same machine: its q4_1 GGUF and llama.cpp's build are in $H
  rm -rf "$R" && mkdir -p "$R" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  step "llama.cpp build: waiting for it"
  peer_wait 450
  step "llama.cpp on the same q4_1 GGUF"
  OUT=$R bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz "$H/s/l8b-q4_1.gguf" 16,64,256 2>&1 | tail -12
  step "cuda_kernels h200/llama-3.1-8b/bf16: the GEMM and attention tests"
  TESTS_TIMEOUT=150 tests8 gemm tma_gemm gemm_prefill attention; grep -E "rel err|rounded|test result|panicked|rc=" "$R/kernel-tests-gemm.txt" | tail -16
  kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1
  finish w4a16-peer
  ;;
ab)
  # carry .gm1 .gm2: 8B q4_1 and bf16 decode steps taken apart: cuda_bench at 16 and 64 sequences
  # (each step's stages alone beside the step) under each tuning in AB (default: as built, pdl=off,
  # attention_cluster=off, tma_gemm=off), bf16 as built beside them
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model
  KQ=$H/b/k/h200-llama-3.1-8b-q4_1/kernels
  for t in ${AB:-default pdl=off attention_cluster=off tma_gemm=off}; do
    [ "$t" = default ] && t=
    CB_GREP="stages alone|decode batch 16: kernel" METRALE_CUDA_TUNING=$t cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 \
      "ab-q4_1-${t:-default}" --batch 16,64 --steps 25 --pp 16
  done
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --out "$H/s/l8b-bf16.gguf" 2>&1 | grep synth-model
  CB_GREP="stages alone" bench "$H/b/k/h200-llama-3.1-8b-bf16/kernels" ab-bf16 --batch 16,64 --steps 25 --pp 16
  probes
  finish ab
  ;;
decode)
  # carry .gm1 .gm2
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels KQ=$H/b/k/h200-llama-3.1-8b-q4_1/kernels
  step "cuda_kernels h200/llama-3.1-8b/bf16: attention first"
  TESTS_TIMEOUT=150 tests8 attention attention; grep -E "rel err|test result|panicked|rc=" "$R/kernel-tests-attention.txt" | tail -60
  grep -q "test result: ok" "$R/kernel-tests-attention.txt" || { finish decode; exit 1; }
  CB_GREP="stages alone|attention" bench "$K" bench-bf16 --batch 16,64,128,256 --steps 32 --pp 512
  CB_GREP="stages alone|attention" METRALE_CUDA_TUNING=attention_pack=off bench "$K" bench-bf16-nopack --batch 64,128,256 --steps 32 --pp 16
  CB_GREP="stages alone|attention" METRALE_CUDA_TUNING=flash_decode=on bench "$K" bench-bf16-flash --batch 16,64,128,256 --steps 32 --pp 16
  cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1 --batch 16,64,256 --steps 32 --pp 512
  # probes: 8B bf16 kernel folders d-NAME/ in .gm3/probes.tar.xz, each timed the same way
  if [ -f .gm3/probes.tar.xz ]; then
    mkdir -p "$H/p" && tar xJf .gm3/probes.tar.xz -C "$H/p"
    for v in "$H"/p/d-*; do
      n=${v##*/d-}
      METRALE_CUDA_TARGET=$T8/bf16 METRALE_CUDA_KERNELS=$v/kernels METRALE_TARGETS=$PWD/targets timeout 100 \
        "$H/b/bin/cuda_kernels" --nocapture --test-threads=1 attention > "$R/probe-tests-$n.txt" 2>&1
      echo "rc=$?" >> "$R/probe-tests-$n.txt"; grep -E "test result|panicked|rc=" "$R/probe-tests-$n.txt"
      CB_GREP="stages alone|attention" bench "$v/kernels" "bench-bf16-$n" --batch 16,64,128,256 --steps 32 --pp 16
    done
  fi
  # SKIP_REST=1: kernels already tested in an earlier call (the same kernel set hashes)
  if [ -z "${SKIP_REST:-}" ]; then
    step "cuda_kernels h200/llama-3.1-8b/bf16: the rest"
    tests8 rest --skip attention; grep -E "test result|panicked|rc=" "$R/kernel-tests-rest.txt"
    kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  fi
  finish decode
  ;;
b1)
  # carry .gm1 .gm2 (.gm3): SmolLM2 q4_1's whole-model tests (cuda_model: decode_1 and the GEMM
  # decode path against the CPU backend, logits step by step) on a synthetic GGUF of its shape; 8B
  # q4_1 at batch 1 (tg128, each kernel's time) as built and on each probe folder of .gm3
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  X="$H/b/bin/xtask synth-model"
  $X smollm2-135m --tokenizer "$H/b/vocab-smollm2.gguf" --seed 0 --quant q4_1 --out "$H/s/smollm2-q4_1.gguf" 2>&1 | tail -1
  $X llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --quant q4_1 --out "$H/s/l8b-q4_1.gguf" 2>&1 | tail -1
  step "cuda_model h200/smollm2-135m/q4_1 (synthetic weights)"
  METRALE_MODEL=$H/s/smollm2-q4_1.gguf METRALE_CUDA_KERNELS=$H/b/k/h200-smollm2-135m-q4_1/kernels \
    METRALE_CUDA_TARGET=h200/smollm2-135m/q4_1 METRALE_TARGETS=$PWD/targets timeout 240 "$H/b/bin/cuda_model" \
    --nocapture --test-threads=1 > "$R/model-test-smollm2-q4_1.txt" 2>&1; echo "rc=$?" >> "$R/model-test-smollm2-q4_1.txt"
  grep -E "test result|panicked|worst|rc=" "$R/model-test-smollm2-q4_1.txt"
  KQ=$H/b/k/h200-llama-3.1-8b-q4_1/kernels
  cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 b1-q4_1 --batch 1 --steps 25 --pp 16
  if [ -f .gm3/probes.tar.xz ]; then
    # each probe's kernel tests first (8B q4_1 in k-NAME/, SmolLM2 q4_1 in s-NAME/), then its timing
    mkdir -p "$H/p" && tar xJf .gm3/probes.tar.xz -C "$H/p"
    for v in "$H"/p/[ks]-*; do
      n=${v##*/} t=$T8/q4_1; [ "${n%%-*}" = s ] && t=h200/smollm2-135m/q4_1
      step "cuda_kernels $t on probe $n"
      METRALE_CUDA_TARGET=$t METRALE_CUDA_KERNELS=$v/kernels METRALE_TARGETS=$PWD/targets timeout 150 "$H/b/bin/cuda_kernels" \
        --nocapture --test-threads=1 > "$R/probe-tests-$n.txt" 2>&1; echo "rc=$?" >> "$R/probe-tests-$n.txt"
      grep -E "test result|panicked|rc=" "$R/probe-tests-$n.txt"
    done
    for v in "$H"/p/k-*; do cb_run "$H/s/l8b-q4_1.gguf" "$v/kernels" $T8/q4_1 "b1-q4_1-${v##*/k-}" --batch 1 --steps 25 --pp 16; done
  fi
  finish b1
  ;;
tests)
  # carry .gm1 .gm2: every kernel test of h200/llama-3.1-8b/bf16, then `shapes`' (a kernel change's
  # check on all five h200 targets, no benchmark)
  rm -rf "$R" "$H/b" && mkdir -p "$R" && tar xJf .gm1/b.tar.xz -C "$H" && tar xJf .gm2/b.tar.xz -C "$H"
  step "cuda_kernels h200/llama-3.1-8b/bf16: all"
  TESTS_TIMEOUT=300 tests8 all; grep -E "rel err|rounded|test result|panicked|rc=" "$R/kernel-tests-all.txt" | tail -12
  kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  finish tests
  ;;
norm)
  # carry .gm1 .gm2
  setup_8b_both
  step "cuda_kernels h200/llama-3.1-8b/bf16 and q4_1: the GEMM tests first"
  TESTS_TIMEOUT=150 tests8 gemm gemm tma_gemm gemm_prefill
  METRALE_CUDA_TARGET=$T8/q4_1 METRALE_CUDA_KERNELS=$KQ METRALE_TARGETS=$PWD/targets timeout 150 \
    "$H/b/bin/cuda_kernels" --nocapture --test-threads=1 gemm_prefill > "$R/kernel-tests-q4-gemm.txt" 2>&1
  echo "rc=$?" >> "$R/kernel-tests-q4-gemm.txt"
  grep -hE "next input|rel err|test result|panicked|rc=" "$R/kernel-tests-gemm.txt" "$R/kernel-tests-q4-gemm.txt" | tail -40
  grep -q "test result: ok" "$R/kernel-tests-gemm.txt" && grep -q "test result: ok" "$R/kernel-tests-q4-gemm.txt" \
    || { finish norm; exit 1; }
  # each product alone (q4_1 on wq_*, bf16 at 16 on wg_* and from 32 on tma_*), fused and not
  # (SKIP_GB=1 skips it)
  for tu in on off; do
    [ -n "${SKIP_GB:-}" ] && break
    for q in q4_1 bf16; do
      step "gemm_bench 8B $q fused_norm=$tu"
      METRALE_CUDA_TUNING=fused_norm=$tu METRALE_TARGETS=$PWD/targets timeout 120 "$H/b/bin/gemm_bench" \
        "$H/s/l8b-$q.gguf" "$H/b/k/h200-llama-3.1-8b-$q/kernels" $T8/$q --tokens 16,64,256 \
        --out "$R/gemm-$q-$tu.jsonl" > "$R/gemm-$q-$tu.txt" 2>&1; echo "rc=$?" >> "$R/gemm-$q-$tu.txt"
    done
  done
  [ -n "${SKIP_GB:-}" ] || python3 - "$R" <<'PY'
import json, sys
r = sys.argv[1]
for q in ("q4_1", "bf16"):
    t = {}
    for tu in ("on", "off"):
        for l in open(f"{r}/gemm-{q}-{tu}.jsonl"):
            d = json.loads(l)
            if d["planned"]:
                t.setdefault((d["product"], d["ntok"]), {})[tu] = d["us"]
    for (p, n), v in sorted(t.items(), key=lambda x: (x[0][1], x[0][0])):
        print(f"{q} {p:8s} {n:4d} tokens: fused {v.get('on', 0):8.1f} us, not fused {v.get('off', 0):8.1f} us")
PY
  # the decode steps fused and not, interleaved AB_REPS times (the step time drifts with the
  # GPU's clocks over a call)
  for i in $(seq "${AB_REPS:-1}"); do
    CB_GREP="stages alone|gemm" bench "$K" bench-bf16-$i --batch 16,64,128,256 --steps 32 --pp 512
    CB_GREP="stages alone|gemm" METRALE_CUDA_TUNING=fused_norm=off bench "$K" bench-bf16-unfused-$i --batch 16,64,128,256 --steps 32 --pp 512
    cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1-$i --batch 16,64,256 --steps 32 --pp 512
    METRALE_CUDA_TUNING=fused_norm=off cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1-unfused-$i --batch 16,64,256 --steps 32 --pp 512
  done
  [ -n "${LONG:-}" ] && bench "$K" bench-bf16-long --batch 256 --steps 32 --pp 512 --long "$LONG"
  check_2l "fused norm"
  if [ -z "${SKIP_REST:-}" ]; then
    step "cuda_kernels h200/llama-3.1-8b/bf16: the rest"
    tests8 rest --skip gemm; grep -E "test result|panicked|rc=" "$R/kernel-tests-rest.txt"
    kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  fi
  finish norm
  ;;
tiles)
  # carry .gm1 .gm2: the greedy arg-max over several blocks a row and the QKV product's 96-row tiles
  setup_8b_both
  step "cuda_kernels h200/llama-3.1-8b/bf16 and q4_1: the GEMM and arg-max tests first"
  TESTS_TIMEOUT=180 tests8 gemm gemm tma_gemm gemm_prefill lm_head_and_device_argmax
  METRALE_CUDA_TARGET=$T8/q4_1 METRALE_CUDA_KERNELS=$KQ METRALE_TARGETS=$PWD/targets timeout 150 \
    "$H/b/bin/cuda_kernels" --nocapture --test-threads=1 gemm_prefill lm_head_and_device_argmax > "$R/kernel-tests-q4-gemm.txt" 2>&1
  echo "rc=$?" >> "$R/kernel-tests-q4-gemm.txt"
  grep -hE "tma .*x96|argmax:|test result|panicked|rc=" "$R/kernel-tests-gemm.txt" "$R/kernel-tests-q4-gemm.txt" | tail -40
  grep -q "test result: ok" "$R/kernel-tests-gemm.txt" && grep -q "test result: ok" "$R/kernel-tests-q4-gemm.txt" \
    || { finish tiles; exit 1; }
  [ -n "${SKIP_GB:-}" ] || GEMM_TOKENS=${GEMM_TOKENS:-32,64,128,256,512} table
  planned
  # the decode steps as built and with both changes off, interleaved AB_REPS times
  for i in $(seq "${AB_REPS:-1}"); do
    CB_GREP="stages alone|lm_head|gemm_norm_qkv" bench "$K" bench-bf16-$i --batch 16,64,128,256 --steps 32 --pp 512
    CB_GREP="stages alone|lm_head|gemm_norm_qkv" METRALE_CUDA_TUNING=argmax_split=off,tma_96=off \
      bench "$K" bench-bf16-off-$i --batch 16,64,128,256 --steps 32 --pp 512
    cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1-$i --batch 16,64,256 --steps 32 --pp 512
    METRALE_CUDA_TUNING=argmax_split=off cb_run "$H/s/l8b-q4_1.gguf" "$KQ" $T8/q4_1 bench-q4_1-off-$i --batch 16,64,256 --steps 32 --pp 512
  done
  check_2l "arg-max split, 96-row tiles"
  if [ -z "${SKIP_REST:-}" ]; then
    step "cuda_kernels h200/llama-3.1-8b/bf16: the rest"
    tests8 rest --skip gemm --skip lm_head_and_device_argmax; grep -E "test result|panicked|rc=" "$R/kernel-tests-rest.txt"
    kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  fi
  finish tiles
  ;;
kab)
  # carry .gm1 .gm3: the build's 8B bf16 kernels against each folder g-NAME/ of .gm3/probes.tar.xz
  # (another build of the same target, e.g. the commit before): the GEMM tests on the build's, then
  # cuda_bench of each, interleaved AB_REPS times; the 2-layer check
  rm -rf "$R" "$H/b" "$H/s" "$H/p" && mkdir -p "$R" "$H/s" "$H/p" && tar xJf .gm1/b.tar.xz -C "$H"
  tar xJf .gm3/probes.tar.xz -C "$H/p"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  synth_8b_2l
  K=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  step "cuda_kernels h200/llama-3.1-8b/bf16: the GEMM tests"
  TESTS_TIMEOUT=200 tests8 gemm tma_gemm gemm_prefill
  grep -hE "test result|panicked|rc=" "$R/kernel-tests-gemm.txt" | tail -5
  grep -q "test result: ok" "$R/kernel-tests-gemm.txt" || { finish kab; exit 1; }
  GB_TOKENS=${GB_TOKENS:-64,128,256} planned
  for i in $(seq "${AB_REPS:-1}"); do
    CB_GREP="stages alone|gemm_" bench "$K" bench-bf16-$i --batch 16,64,128,256 --steps 32 --pp 512
    for v in "$H"/p/g-*; do
      CB_GREP="stages alone|gemm_" bench "$v/kernels" "bench-bf16-${v##*/g-}-$i" --batch 16,64,128,256 --steps 32 --pp 512
    done
  done
  check_2l "the build"
  finish kab
  ;;
ncu)
  # carry .gm1: Nsight Compute on the first launch of each kernel in NCU_KERNELS (default tma_o,tma_qkv)
  # at each of NCU_TOKENS (default 64,256) tokens, 8B bf16 (gemm_bench's prefill chunk: layer 0's
  # planned launch): speed of light, warp states, scheduler, memory
  rm -rf "$R" "$H/b" "$H/s" && mkdir -p "$R" "$H/s" && tar xJf .gm1/b.tar.xz -C "$H"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$R/gpu.txt"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --out "$H/s/l8b-bf16.gguf" \
    2>&1 | grep synth-model | tee "$R/synth.txt"
  NCU_KERNELS=${NCU_KERNELS:-tma_o,tma_qkv}
  # NCU_SET=full: every section (the memory tables: L1, L2 and DRAM rates each)
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis"
  [ -n "${NCU_SET:-}" ] && sections="--set $NCU_SET"
  for n in $(echo "${NCU_TOKENS:-64,256}" | tr , ' '); do
    for kern in $(echo "$NCU_KERNELS" | tr , ' '); do
      step "ncu: $kern at $n tokens"
      # shellcheck disable=SC2086
      METRALE_TARGETS=$PWD/targets timeout 150 ncu --clock-control none -k "regex:^$kern\$" -c 1 $sections --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        "$H/b/bin/gemm_bench" "$H/s/l8b-bf16.gguf" "$H/b/k/h200-llama-3.1-8b-bf16/kernels" $T8/bf16 --tokens "$n" --out "$R/ncu-gemm.jsonl" 2>&1 | sed "s|$H/|\$H/|g" > "$R/ncu-$kern-$n.txt"
      echo "rc=${PIPESTATUS[0]}" >> "$R/ncu-$kern-$n.txt"
      grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|L2 Hit|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued|Grid Size|Registers Per|==ERROR|rc=" \
        "$R/ncu-$kern-$n.txt" | head -20
      # the stall reasons above 0.3 warps a issued instruction
      awk '/issue_stalled/ && $NF + 0 > 0.3 { print "   ", $1, $NF }' "$R/ncu-$kern-$n.txt"
    done
  done
  finish ncu
  ;;
shapes)
  rm -rf "$R" "$H/b" && mkdir -p "$R" && tar xJf .gm2/b.tar.xz -C "$H"
  kernel_tests smollm2-135m/bf16 llama-3.2-1b/bf16 smollm2-135m/q4_1 llama-3.1-8b/q4_1
  finish shapes
  ;;
*)
  sed -n 2,22p "$0"; exit 2
  ;;
esac
