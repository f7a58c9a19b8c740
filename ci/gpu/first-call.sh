#!/usr/bin/env bash
# The first GPU call (carry .gpu .carry1 .peer; ci/gpu/README.md): unpack into ~/b and ~/m, start
# llama.cpp's build in the background, record the GPU, load every kernel of the four h200 targets
# (cubin and PTX), and run the per-kernel tests of each. Usage (device, repo root): bash ci/gpu/first-call.sh
set -uo pipefail
R=$HOME/results && rm -rf "$R" ~/b && mkdir -p "$R" ~/b ~/m
cp .carry1/part.aa ~/m/ && tar xJf .gpu/bin.tar.xz -C ~/b && tar xJf .gpu/k.tar.xz -C ~/b
bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz > "$R/llamacpp-build.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$R/gpu.txt"
~/b/bin/cuda_load_check ~/b/k/h200-*/kernels > "$R/load-check.txt" 2>&1; echo "cuda_load_check rc=$?" | tee -a "$R/load-check.txt"
tail -2 "$R/load-check.txt"
for t in smollm2-135m/q4_1 smollm2-135m/bf16 llama-3.2-1b/q4_1 llama-3.2-1b/bf16; do
  f=$R/kernel-tests-${t//\//-}.txt
  METRALE_CUDA_TARGET=h200/$t METRALE_CUDA_KERNELS=$HOME/b/k/h200-${t//\//-}/kernels \
    timeout 300 ~/b/bin/cuda_kernels --nocapture --test-threads=1 > "$f" 2>&1
  echo "cuda_kernels h200/$t rc=$?" | tee -a "$f"
  grep -E "test result|panicked" "$f"
done
tar czf "$OUT/first.tgz" -C "$HOME" results
