#!/usr/bin/env bash
# Speculative decoding on the CUDA backend (issue 23), on the H200 machine, in three calls made
# back to back (the machine keeps ~/ while warm): what a verification step costs and what each
# acceptance rate buys at the 8B shape, batch-1 decode against the copy-rate floor at depth, the
# real SmolLM2 with prompt lookup beside llama.cpp's n-gram speculation, and greedy exactness.
#
#   bash ci/gpu/spec.sh prepare MODEL.gguf   CPU machine: .sp1/ (kernels of llama-3.1-8b/{bf16,q4_1},
#        the tools, the 8B vocabulary), .sp2/ (h200/smollm2-135m/q4_1's kernels, server and
#        cuda_model), .peer/ (llama.cpp's source), and the default model xz-compressed in three parts
#        (.sp1/part.aa, .sp2/part.ab, .sp3/part.ac: a call carries at most 64 MiB with the tree)
#   bash ci/gpu/spec.sh call1  carry .sp1 .peer   llama.cpp's build in the background (cores 2-15,
#        niced; every timing here runs on cores 0-1); the 8B bf16 and q4_1 GGUFs; the kernel tests
#        of both; on each: cuda_bench batch 1 at depths 0, 8192, 32768 (the copy-rate floor, same
#        run), spec_bench (k = 4: plain batch-1 decode, then proposals replayed from it corrupted at
#        0, 10, 25, 50, 75%: tok/s, acceptance, the verification step against a plain step, tokens
#        equal to plain), then spec_bench again with `decode_gemm=off` (the step's products on the
#        matrix-vector kernels instead of the tensor-core GEMMs) and, on q4_1, `tma_gemm=off` (the
#        one-warpgroup GEMMs instead of the warp-specialised ones)
#   bash ci/gpu/spec.sh curve  carry .sp1         call1's figures alone, in ~3 minutes: the 8B GGUFs,
#        cuda_bench at depths and spec_bench by default on each (no peer, no kernel tests, no A/B)
#   bash ci/gpu/spec.sh steps  (carry nothing; after call1 or curve on the same machine) where a
#        5-token step's time goes: cuda_bench --batch 1,5 on both 8B files, each stage timed alone,
#        across layers, and the step's graph; gemm_bench's q4_1 products at 5 and 16 tokens, and
#        Nsight Compute on layer 0's four W4A16 launches of a 5-token chunk
#   bash ci/gpu/spec.sh narrow carry .sp1        the narrow GEMMs (q4_1, chunks of at most 8 tokens)
#        against the warp-specialised ones in one call: their kernel tests, cuda_bench --batch 1,5
#        with both (floors at depth on the default), spec_bench with both, gemm_bench at 5 and 16
#        tokens, batch 1 with its products on the narrow GEMMs too (narrow_one); then bf16's floors
#        at depth and spec_bench as time allows
#   bash ci/gpu/spec.sh narrow2 carry .sp1 .peer  after a change to the narrow GEMMs: their kernel
#        tests, cuda_bench --batch 1,5 at depths, spec_bench (q4_1), and llama.cpp's tg128 at the
#        same depths (built in the background meanwhile)
#   bash ci/gpu/spec.sh call2  carry .sp2          SmolLM2's files and the model's second part
#   bash ci/gpu/spec.sh call3  carry .sp3          the model's last part; the model assembled and
#        checked; cuda_model's exactness test (100 prompts, greedy verification against plain greedy
#        decoding, divergences only at near-ties) and the rest of cuda_model; bench/spec/run.sh:
#        metrale-server plain and with --speculative ngram, llama-server plain and with its n-gram
#        speculation, same GGUF and prompts; llama-bench tg128 at depths 0, 8192, 32768 on the 8B files
# Each call leaves $OUT/<call>.tgz (its results folder).
REAL_SIZE_LIB=1 source "$(dirname "$0")/real-size.sh"
PARTS=$H/parts

# the SmolLM2 calls: a fresh results folder, the carried files added to ~/b, the model's part kept
more() {
  rm -rf "$R" && mkdir -p "$R" "$PARTS"
  [ ! -f "$1/b.tar.xz" ] || tar xJf "$1/b.tar.xz" -C "$H"
  cp "$1"/part.* "$1"/model.sha256 "$PARTS/" 2>/dev/null
  ls -la "$PARTS" | tee "$R/parts.txt"
}

case "${1:-}" in
prepare)
  set -e
  pack_start .sp1 prepare "${2:-}"
  rm -rf .sp2 .sp3 && mkdir -p .sp2/b/bin .sp2/b/k .sp2/b/srv .sp3
  kernels .sp1 llama-3.1-8b/bf16 llama-3.1-8b/q4_1
  tools .sp1 spec_bench cuda_bench gemm_bench
  vocab .sp1 llama-3.1-8b vocab-8b.gguf
  pack_end .sp1 .peer
  kernels .sp2 smollm2-135m/q4_1
  servers .sp2 smollm2-135m/q4_1
  cp "$(exe test --release -p metrale-backend --features cuda --no-run --test cuda_model)" .sp2/b/bin/cuda_model
  pack_end .sp2
  # the model in three parts, each call's carry under 64 MiB with the tree (1.5 MB kept in hand)
  xz -T0 -6 -c "$model" > .sp3/model.xz
  sha256sum "$model" | cut -d' ' -f1 > .sp3/model.sha256
  tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
  room() { echo $((67108864 - 1500000 - tree - $(du -cb "$@" | tail -1 | cut -f1))); }
  a=$(room .sp1 .peer) b=$(room .sp2)
  head -c "$a" .sp3/model.xz > .sp1/part.aa
  head -c $((a + b)) .sp3/model.xz | tail -c +$((a + 1)) > .sp2/part.ab
  tail -c +$((a + b + 1)) .sp3/model.xz > .sp3/part.ac && rm .sp3/model.xz
  for c in ".sp1 .peer" .sp2 .sp3; do
    echo "carry $c: $(du -cb $c | tail -1 | cut -f1) bytes + the tree ($tree; at most 67108864)"
  done
  ;;
call1|curve)
  unpack .sp1
  mkdir -p "$PARTS" && cp .sp1/part.* "$PARTS/"
  if [ "$1" = call1 ]; then
    step "llama.cpp build (background, cores 2-15, niced)"
    taskset -c 2-15 nice -n 10 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  fi
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  [ "$1" = curve ] || kernel_tests llama-3.1-8b/bf16 llama-3.1-8b/q4_1
  taskset -pc 0,1 $$ > /dev/null  # this shell and what it starts from here on: cores 0-1
  export METRALE_TARGETS=$PWD/targets
  order="q4_1 bf16"
  [ "$1" = call1 ] || order="bf16 q4_1"
  for q in $order; do
    k=$H/b/k/h200-llama-3.1-8b-$q/kernels
    CB_TIMEOUT=120 cb_run "$H/s/l8b-$q.gguf" "$k" $T8/$q floor-$q \
      --batch 1 --steps 128 --depth 8192,32768
    tunings="decode_gemm=on"
    [ "$1" = curve ] || tunings="$tunings decode_gemm=off"
    [ "$1" = curve ] || [ $q = bf16 ] || tunings="$tunings tma_gemm=off"
    for g in $tunings; do
      step "spec_bench $q $g: k = 4, 128 tokens, corrupted 0/10/25/50/75%, 3 repetitions"
      f=$R/spec-$q-${g/=/-}
      METRALE_CUDA_TUNING=$g timeout 150 "$H/b/bin/spec_bench" "$H/s/l8b-$q.gguf" --cuda "$k" $T8/$q \
        --k 4 --tokens 128 --rates 0,10,25,50,75 --reps 3 --out "$f.json" > "$f.txt" 2>&1
      echo "rc=$?" >> "$f.txt"; cat "$f.txt"
      finish "$1"  # what has run so far, should the call be cut short
      [ "$(left)" -gt 60 ] || break 2
    done
  done
  finish "$1"
  ;;
steps)
  rm -rf "$R" && mkdir -p "$R"
  export METRALE_TARGETS=$PWD/targets
  for q in q4_1 bf16; do
    CB_GREP="decode batch|across layers" CB_TIMEOUT=150 cb_run "$H/s/l8b-$q.gguf" \
      "$H/b/k/h200-llama-3.1-8b-$q/kernels" $T8/$q "steps-$q" --batch 1,5 --steps 64
    [ "$(left)" -gt 60 ] || break
  done
  # each q4_1 product alone at 5 and 16 tokens, then Nsight Compute on layer 0's four W4A16
  # launches of a 5-token chunk (caches flushed before each: weights from memory)
  step "gemm_bench q4_1 at 5 and 16 tokens"
  METRALE_TARGETS=$PWD/targets timeout 120 "$H/b/bin/gemm_bench" "$H/s/l8b-q4_1.gguf" \
    "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" $T8/q4_1 --tokens 5,16 --out "$R/gemm-q4_1.jsonl" \
    > "$R/gemm-q4_1.txt" 2>&1; echo "rc=$?" >> "$R/gemm-q4_1.txt"; tail -14 "$R/gemm-q4_1.txt"
  if command -v ncu > /dev/null && [ "$(left)" -gt 90 ]; then
    step "ncu: layer 0's W4A16 products at 5 tokens"
    METRALE_TARGETS=$PWD/targets timeout 150 ncu --clock-control none -k 'regex:^wq_(qkv|o|gu|down)$' -c 4 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      "$H/b/bin/gemm_bench" "$H/s/l8b-q4_1.gguf" "$H/b/k/h200-llama-3.1-8b-q4_1/kernels" $T8/q4_1 --tokens 5 \
      --out "$R/ncu-gemm.jsonl" 2>&1 | sed "s|$H/|\$H/|g" > "$R/ncu-wq-5.txt"
    echo "rc=${PIPESTATUS[0]}" >> "$R/ncu-wq-5.txt"
    grep -E "^  wq_|Duration|DRAM Throughput|Grid Size|Achieved Occupancy|No Eligible|Warp Cycles Per Issued|rc=" "$R/ncu-wq-5.txt" | head -40
    awk '/issue_stalled/ && $NF + 0 > 0.5 { print "   ", $1, $NF }' "$R/ncu-wq-5.txt" | head -30
  fi
  finish steps
  ;;
narrow)
  # the narrow GEMMs (wn_*) against the warp-specialised ones (narrow_gemm=off), same call: their
  # kernel tests, the 5-token step's decomposition, the verification step and the acceptance
  # curve on q4_1; the H200 curve of both 8B targets (floors at depth, spec_bench)
  unpack .sp1
  export METRALE_TARGETS=$PWD/targets
  X="$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0"
  step "synth-model: 8B bf16 and q4_1 GGUFs"
  for a in "--out $H/s/l8b-bf16.gguf" "--quant q4_1 --out $H/s/l8b-q4_1.gguf"; do
    $X $a 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  done
  KT_FILTER=gemm kernel_tests llama-3.1-8b/q4_1
  taskset -pc 0,1 $$ > /dev/null
  kq=$H/b/k/h200-llama-3.1-8b-q4_1/kernels kb=$H/b/k/h200-llama-3.1-8b-bf16/kernels
  CB_GREP="decode batch 5|across layers" CB_TIMEOUT=150 cb_run "$H/s/l8b-q4_1.gguf" "$kq" $T8/q4_1 floor-q4_1 \
    --batch 1,5 --steps 64 --depth 8192,32768
  METRALE_CUDA_TUNING=narrow_gemm=off CB_GREP="decode batch 5|across layers" CB_TIMEOUT=120 \
    cb_run "$H/s/l8b-q4_1.gguf" "$kq" $T8/q4_1 steps-q4_1-narrow-off --batch 5 --steps 64 --pp 64
  finish narrow
  for g in narrow_gemm=on narrow_gemm=off; do
    step "spec_bench q4_1 $g: k = 4, 128 tokens, corrupted 0/10/25/50/75%, 3 repetitions"
    f=$R/spec-q4_1-${g/=/-}
    METRALE_CUDA_TUNING=$g timeout 150 "$H/b/bin/spec_bench" "$H/s/l8b-q4_1.gguf" --cuda "$kq" $T8/q4_1 \
      --k 4 --tokens 128 --rates 0,10,25,50,75 --reps 3 --out "$f.json" > "$f.txt" 2>&1
    echo "rc=$?" >> "$f.txt"; cat "$f.txt"
  done
  finish narrow
  # batch 1 with its one-token layer products on the narrow GEMMs too (narrow_one)
  METRALE_CUDA_TUNING=narrow_one=on CB_GREP="decode batch 1: (median|the step)" CB_TIMEOUT=90 \
    cb_run "$H/s/l8b-q4_1.gguf" "$kq" $T8/q4_1 floor-q4_1-narrow-one --batch 1 --steps 64 --pp 64
  finish narrow
  step "gemm_bench q4_1 at 5 and 16 tokens"
  METRALE_TARGETS=$PWD/targets timeout 90 "$H/b/bin/gemm_bench" "$H/s/l8b-q4_1.gguf" "$kq" $T8/q4_1 \
    --tokens 5,16 --out "$R/gemm-q4_1.jsonl" > "$R/gemm-q4_1.txt" 2>&1; echo "rc=$?" >> "$R/gemm-q4_1.txt"
  tail -14 "$R/gemm-q4_1.txt"
  finish narrow
  if [ "$(left)" -gt 150 ]; then
    CB_TIMEOUT=120 cb_run "$H/s/l8b-bf16.gguf" "$kb" $T8/bf16 floor-bf16 --batch 1 --steps 128 --depth 8192,32768
    finish narrow
  fi
  if [ "$(left)" -gt 60 ]; then
    step "spec_bench bf16: k = 4, 128 tokens, corrupted 0/10/25/50/75%, 3 repetitions"
    f=$R/spec-bf16-decode_gemm-on
    timeout $(($(left) - 10)) "$H/b/bin/spec_bench" "$H/s/l8b-bf16.gguf" --cuda "$kb" $T8/bf16 \
      --k 4 --tokens 128 --rates 0,10,25,50,75 --reps 3 --out "$f.json" > "$f.txt" 2>&1
    echo "rc=$?" >> "$f.txt"; cat "$f.txt"
  fi
  finish narrow
  ;;
narrow2)
  # the narrow GEMMs again (after a change to them), beside llama.cpp's tg128 at depth: llama.cpp
  # builds in the background while the kernel tests, cuda_bench and spec_bench of q4_1 run
  unpack .sp1
  peer=0 depth=""
  if [ -f .peer/llamacpp-src.tgz ]; then  # without .peer: the narrow figures alone, no depths
    peer=1 depth="--depth 8192,32768"
    step "llama.cpp build (background, cores 2-15, niced)"
    taskset -c 2-15 nice -n 10 bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
  fi
  step "synth-model: 8B q4_1 GGUF"
  "$H/b/bin/xtask" synth-model llama-3.1-8b --tokenizer "$H/b/vocab-8b.gguf" --seed 0 --quant q4_1 \
    --out "$H/s/l8b-q4_1.gguf" 2>&1 | grep synth-model | tee -a "$R/synth.txt"
  KT_FILTER=gemm kernel_tests llama-3.1-8b/q4_1
  taskset -pc 0,1 $$ > /dev/null
  export METRALE_TARGETS=$PWD/targets
  kq=$H/b/k/h200-llama-3.1-8b-q4_1/kernels
  # shellcheck disable=SC2086
  CB_GREP="decode batch 5|across layers" CB_TIMEOUT=150 cb_run "$H/s/l8b-q4_1.gguf" "$kq" $T8/q4_1 floor-q4_1 \
    --batch 1,5 --steps 64 $depth
  step "spec_bench q4_1: k = 4, 128 tokens, corrupted 0/10/25/50/75%, 3 repetitions"
  f=$R/spec-q4_1-decode_gemm-on
  timeout 120 "$H/b/bin/spec_bench" "$H/s/l8b-q4_1.gguf" --cuda "$kq" $T8/q4_1 \
    --k 4 --tokens 128 --rates 0,10,25,50,75 --reps 3 --out "$f.json" > "$f.txt" 2>&1
  echo "rc=$?" >> "$f.txt"; cat "$f.txt"
  finish narrow2
  [ $peer = 1 ] || exit 0
  step "llama.cpp build: waiting for it"
  peer_wait $(( $(left) - 45 ))
  if [ "$(left)" -gt 35 ]; then
    step "llama-bench tg128 at depths 0, 8192, 32768: q4_1"
    timeout "$(( $(left) - 5 ))" "$H/llamacpp/build/bin/llama-bench" -m "$H/s/l8b-q4_1.gguf" -ngl 99 -fa 1 -p 0 \
      -n 128 -d 0,8192,32768 -r 3 -o md > "$R/llama-bench-depth-q4_1.md" 2> "$R/llama-bench-depth-q4_1.err"
    echo "rc=$?"; cat "$R/llama-bench-depth-q4_1.md"
  fi
  finish narrow2
  ;;
call2)
  more .sp2
  finish call2
  ;;
call3)
  more .sp3
  M=$H/s/smollm2.gguf
  step "the default model from its three parts"
  cat "$PARTS"/part.aa "$PARTS"/part.ab "$PARTS"/part.ac | xz -d > "$M"
  echo "$(cat "$PARTS/model.sha256")  $M" | sha256sum -c | tee -a "$R/parts.txt" || { finish call3; exit 1; }
  (
    export METRALE_MODEL=$M METRALE_CUDA_KERNELS=$H/b/k/h200-smollm2-135m-q4_1/kernels
    export METRALE_CUDA_TARGET=h200/smollm2-135m/q4_1 METRALE_TARGETS=$PWD/targets
    step "cuda_model: speculative verification against plain greedy, 100 prompts"
    timeout 120 "$H/b/bin/cuda_model" speculative --nocapture --test-threads=1 > "$R/spec-exact.txt" 2>&1
    echo "rc=$?" >> "$R/spec-exact.txt"; grep -E "parts from|verification:|test result|panicked|rc=" "$R/spec-exact.txt"
    step "cuda_model: the rest"
    timeout 200 "$H/b/bin/cuda_model" --skip speculative --nocapture --test-threads=1 > "$R/model-test.txt" 2>&1
    echo "rc=$?" >> "$R/model-test.txt"; grep -E "test result|panicked|rc=" "$R/model-test.txt"
  )
  step "llama.cpp build: waiting for it"
  peer_wait 240
  B=$H/llamacpp/build/bin
  step "bench/spec/run.sh: metrale-server and llama-server, plain and n-gram speculation, SmolLM2 Q4_1"
  t=$(( $(left) - 60 )); [ $t -gt 30 ] || t=30
  timeout $t bash bench/spec/run.sh "$R/spec-smollm2" "$M" \
    "$H/b/srv/h200-smollm2-135m-q4_1/metrale-server" "$B/llama-server" > "$R/spec-smollm2.txt" 2>&1
  echo "rc=$?" >> "$R/spec-smollm2.txt"; cat "$R/spec-smollm2.txt"
  for q in q4_1 bf16; do
    [ "$(left)" -gt 50 ] || break
    step "llama-bench tg128 at depths 0, 8192, 32768: $q"
    timeout "$(( $(left) - 10 ))" "$B/llama-bench" -m "$H/s/l8b-$q.gguf" -ngl 99 -fa 1 -p 0 -n 128 \
      -d 0,8192,32768 -r 3 -o md > "$R/llama-bench-depth-$q.md" 2> "$R/llama-bench-depth-$q.err"
    echo "rc=$?"; cat "$R/llama-bench-depth-$q.md"
  done
  finish call3
  ;;
*)
  sed -n 2,39p "$0"; exit 2 ;;
esac
