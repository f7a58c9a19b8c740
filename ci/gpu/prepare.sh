#!/usr/bin/env bash
# Build everything the GPU checks need on the CPU machine and pack it into the git-ignored folders the
# device tool carries (ci/gpu/README.md): one call carries at most 64 MiB, so the default model (94 MiB)
# travels in two halves, one per call.
#   .gpu/    bin.tar.xz (cuda_kernels, cuda_model, contract tests; cuda_load_check, cuda_bench examples;
#            built with --features cuda, stripped) and k.tar.xz (the four h200 targets' kernels)
#   .carry1/ the model's first 40 MB        .peer/  llama.cpp's source (ci/gpu/llamacpp.sh pack)
#   .carry2/ the rest of the model, its sha256, and srv.tar.xz (the h200 metrale-server as build-target
#            emits it, its attestation.json, a stripped xtask for bench-record)
# Usage: ci/gpu/prepare.sh MODEL.gguf   (default $METRALE_MODEL; `cargo xtask fetch-model smollm2-135m` prints it)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-${METRALE_MODEL:-}}
[ -f "$model" ] || { echo "usage: ci/gpu/prepare.sh MODEL.gguf (or set METRALE_MODEL)" >&2; exit 2; }
rm -rf .gpu .carry1 .carry2 && mkdir -p .gpu/bin .gpu/k .carry1 .carry2
for m in smollm2-135m llama-3.2-1b; do
  for q in q4_1 bf16; do
    cargo xtask build-target --hw h200 --model "$m" --quant "$q" --kernels-only --out ".gpu/k/h200-$m-$q" 2>&1 | tail -1
  done
done
# executables by the paths cargo reports for THIS build (--features cuda): the unhashed copies under
# target/release/examples/ are overwritten by any other build of the workspace without the feature
exe() { cargo "$@" --release -p metrale-backend --features cuda --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json; [print(j["executable"]) for j in map(json.loads, sys.stdin) if j.get("executable")]' | tail -1; }
for t in cuda_kernels cuda_model contract; do cp "$(exe test --no-run --test $t)" .gpu/bin/$t; done
for e in cuda_load_check cuda_bench; do cp "$(exe build --example $e)" .gpu/bin/$e; done
strip .gpu/bin/*
tar cJf .gpu/bin.tar.xz -C .gpu bin && rm -rf .gpu/bin
tar cJf .gpu/k.tar.xz -C .gpu k && rm -rf .gpu/k
[ -f .peer/llamacpp-src.tgz ] || bash ci/gpu/llamacpp.sh pack .peer/llamacpp-src.tgz
head -c 40000000 "$model" > .carry1/part.aa
tail -c +40000001 "$model" > .carry2/part.ab
sha256sum "$model" | cut -d' ' -f1 > .carry2/model.sha256
rm -rf .gpu/srv && cargo xtask build-target --hw h200 --model smollm2-135m --quant q4_1 --out .gpu/srv 2>&1 | tail -1
mkdir -p .gpu/srvpack && cp .gpu/srv/metrale-server .gpu/srv/attestation.json .gpu/srvpack/
cp "$(cargo build --release -p xtask --message-format=json 2>/dev/null | python3 -c 'import sys,json; [print(j["executable"]) for j in map(json.loads, sys.stdin) if j.get("executable")]' | tail -1)" .gpu/srvpack/xtask
strip .gpu/srvpack/xtask && tar cJf .carry2/srv.tar.xz -C .gpu/srvpack . && rm -rf .gpu/srv .gpu/srvpack
du -sh .gpu .carry1 .carry2 .peer
echo "first call carries .gpu .carry1 .peer: $(du -cb .gpu .carry1 .peer | tail -1 | cut -f1) bytes; second .carry2: $(du -sb .carry2 | cut -f1)"
