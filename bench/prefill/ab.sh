#!/usr/bin/env bash
# The A/B of h200-2026-12-03/ab/: three builds of attention_flash in one call on the H200.
#   v1: the first version (K fragments by 32-bit shared loads, exp2f)
#   b2: K fragments by ldmatrix.x4 (two k steps per instruction), ex2.approx (the committed kernel)
#   b3: b2 with __launch_bounds__(128, 3) (3 blocks per SM: 168 registers, 40 bytes of stack)
# Made on the CPU machine: `bash ci/gpu/gemm.sh prepare MODEL.gguf` (.gm1: binaries and vocabulary),
# then each variant's kernels from its source: `cargo xtask build-target --hw h200 --model
# llama-3.1-8b --quant bf16 --kernels-only --out .fl1/k/NAME`, and this file copied to .fl1/run.sh;
# run there as `bash .fl1/run.sh`, carrying .gm1 and .fl1.
set -u
H=$HOME; R=$H/results; rm -rf $R $H/b $H/s; mkdir -p $R $H/s; tar xJf .gm1/b.tar.xz -C $H
$H/b/bin/xtask synth-model llama-3.1-8b --tokenizer $H/b/vocab-8b.gguf --seed 0 --out $H/s/l8b-bf16.gguf 2>&1 | grep synth-model
for v in v1 b2 b3; do
  K=$PWD/.fl1/k/$v/kernels
  echo "== $v"
  METRALE_CUDA_TARGET=h200/llama-3.1-8b/bf16 METRALE_CUDA_KERNELS=$K METRALE_TARGETS=$PWD/targets timeout 100 $H/b/bin/cuda_kernels --nocapture --test-threads=1 flash > $R/test-$v.txt 2>&1; grep -E "attention_flash: rel|test result" $R/test-$v.txt
  METRALE_TARGETS=$PWD/targets timeout 150 $H/b/bin/cuda_bench $H/s/l8b-bf16.gguf $K h200/llama-3.1-8b/bf16 --batch 8 --steps 25 --pp 512 --long 8192,16384 --out $R/$v.json > $R/$v.txt 2>&1; grep -E "prefill 512:|attention_flash|prefill of one" $R/$v.txt
done
tar czf $OUT/fl.tgz -C $H results
