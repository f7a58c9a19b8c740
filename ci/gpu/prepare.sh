#!/usr/bin/env bash
# Build everything the GPU checks need on the CPU machine and pack it into git-ignored folders that
# the device tool carries (see ci/gpu/README.md). Usage: ci/gpu/prepare.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-${METRALE_MODEL:-/work/cache/model/SmolLM2-135M-Instruct.Q4_1.gguf}}
rm -rf .gpu && mkdir -p .gpu/bin .gpu/k
for m in smollm2-135m llama-3.2-1b; do
  for q in q4_1 bf16; do
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --kernels-only --out ".gpu/k/h200-$m-$q" | tail -1
  done
done
# Executables by the paths cargo reports for THIS build (--features cuda): the unhashed copies under
# target/release/examples/ are overwritten by any other build of the workspace without the feature.
exe() { cargo "$@" --release -p metrale-backend --features cuda --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json; [print(j["executable"]) for j in map(json.loads, sys.stdin) if j.get("executable")]' | tail -1; }
cp "$(exe test --no-run --test cuda_kernels)" .gpu/bin/cuda_kernels
cp "$(exe test --no-run --test cuda_model)" .gpu/bin/cuda_model
cp "$(exe build --example cuda_load_check)" .gpu/bin/cuda_load_check
cp "$(exe build --example cuda_bench)" .gpu/bin/cuda_bench
strip .gpu/bin/*
# binaries travel compressed (16 MB -> ~5 MB) so that one call holds them, the first model half and llama.cpp
tar cJf .gpu/bin.tar.xz -C .gpu bin && rm -rf .gpu/bin
# llama.cpp for the side-by-side benchmark: the source tarball (/work/shared/gpu/pack-llamacpp.sh) and its script
if [ -f .peer/llamacpp-src.tgz ] && [ -f /work/shared/gpu/llamacpp-bench.sh ]; then cp -f /work/shared/gpu/llamacpp-bench.sh .peer/; fi
rm -rf .carry1 .carry2 && mkdir -p .carry1 .carry2
head -c 40000000 "$model" > .carry1/part.aa
tail -c +40000001 "$model" > .carry2/part.ab
# the h200 server binary as `cargo xtask build-target` emits it (not stripped: bench-record hashes it) and a
# stripped xtask, for second-call.sh's serving check and bench-record
rm -rf .gpu/srv && cargo xtask build-target --hw h200 --model smollm2-135m --quant q4_1 --out .gpu/srv | tail -1
mkdir -p .gpu/srvpack && cp .gpu/srv/metrale-server .gpu/srv/attestation.json .gpu/srvpack/
cp "$(cargo build --release -p xtask --message-format=json 2>/dev/null | python3 -c 'import sys,json; [print(j["executable"]) for j in map(json.loads, sys.stdin) if j.get("executable")]' | tail -1)" .gpu/srvpack/xtask
strip .gpu/srvpack/xtask && tar cJf .carry2/srv.tar.xz -C .gpu/srvpack . && rm -rf .gpu/srv .gpu/srvpack
du -sh .gpu .carry1 .carry2 .peer 2>/dev/null || true
