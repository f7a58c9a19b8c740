#!/usr/bin/env bash
# llama.cpp beside metrale on the same GPU and the same GGUF: the peer of bench/ and bench-record.
#
#   ci/gpu/llamacpp.sh pack OUT.tgz          (CPU machine, with network) the llama.cpp source vendored in
#                                            the llama-cpp-python sdist on PyPI, checked against the
#                                            registry's sha256, as a ~10 MB tarball to carry
#   ci/gpu/llamacpp.sh bench SRC.tgz GGUF [BATCHES]
#                                            (GPU machine) build llama-bench, llama-batched-bench,
#                                            llama-server, llama-quantize and llama-perplexity once
#                                            (CUDA, sm_90; ~5 min on 16 cores, in the background: run it
#                                            early, run it again to wait and measure), then llama-bench
#                                            pp512/tg128 (-fa 1, 5 repetitions; LLAMACPP_PP=512,8192
#                                            for more prompt sizes) and llama-batched-bench
#                                            (128 prompt + 128 generated tokens per sequence) at BATCHES
#                                            (default 1,8,32,64); tables to $OUT (else the working dir)
set -euo pipefail
VERSION=0.3.36   # llama-cpp-python; its vendored llama.cpp is ggml 0.25.3
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
cmd=${1:-}
case "$cmd" in
pack)
  out=${2:?usage: llamacpp.sh pack OUT.tgz}
  tmp=$(mktemp -d)
  python3 - "$VERSION" "$SDIST_SHA256" "$tmp/sdist.tar.gz" <<'PY'
import hashlib, json, sys, urllib.request
version, pinned, dest = sys.argv[1:4]
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req))["files"]
sdist = [f for f in files if f["filename"] == f"llama_cpp_python-{version}.tar.gz"][0]
data = urllib.request.urlopen(sdist["url"]).read()
got = hashlib.sha256(data).hexdigest()
if got != pinned or got != sdist["hashes"]["sha256"]:
    sys.exit(f"llama-cpp-python {version} sdist: sha256 {got}; pinned {pinned}, registry {sdist['hashes']['sha256']}")
open(dest, "wb").write(data)
print(f"llama-cpp-python {version} sdist, sha256 {got}")
PY
  tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
  src=$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp
  mkdir -p "$(dirname "$out")"
  # the CUDA backend and what the two benchmarks need; not the docs, models or other backends
  tar czf "$out" -C "$src" --exclude=./docs --exclude=./models --exclude=./.git \
    --exclude=./ggml/src/ggml-vulkan --exclude=./ggml/src/ggml-sycl --exclude=./ggml/src/ggml-cann \
    --exclude=./ggml/src/ggml-metal --exclude=./ggml/src/ggml-opencl --exclude=./ggml/src/ggml-musa \
    --exclude=./ggml/src/ggml-webgpu .
  rm -rf "$tmp"
  ls -la "$out"
  ;;
bench)
  src=${2:?usage: llamacpp.sh bench SRC.tgz GGUF [BATCHES]}
  gguf=${3:-}
  batches=${4:-1,8,32,64}
  dir=$HOME/llamacpp
  if [ ! -f "$dir/build.done" ] && [ ! -d "$dir/build" ]; then
    mkdir -p "$dir" && tar xzf "$src" -C "$dir"
    (cd "$dir" && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release > cmake.log 2>&1) || { tail -20 "$dir/cmake.log"; exit 1; }
    # in a session of its own, so that it outlives this command
    (cd "$dir" && setsid nohup bash -c 'cmake --build build --target llama-bench llama-batched-bench llama-server llama-quantize llama-perplexity -j 16 > build.log 2>&1; echo "rc=$?" > build.done' > /dev/null 2>&1 &)
  fi
  [ -n "$gguf" ] || { echo "llama.cpp build started in $dir"; exit 0; }
  for _ in $(seq 1 120); do [ -f "$dir/build.done" ] && break; sleep 5; done
  [ -f "$dir/build.done" ] || { echo "llama.cpp still building after 10 min; run this again"; exit 3; }
  grep -q "rc=0" "$dir/build.done" || { tail -30 "$dir/build.log"; exit 1; }
  out=${OUT:-.}
  bin=$dir/build/bin
  "$bin/llama-bench" -m "$gguf" -ngl 99 -fa 1 -p "${LLAMACPP_PP:-512}" -n 128 -r 5 -o md 2>/dev/null | tee "$out/llamacpp-bench.md"
  "$bin/llama-batched-bench" -m "$gguf" -ngl 99 -c 70000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl "$batches" 2>/dev/null \
    | grep '^|' | tee "$out/llamacpp-batched.txt"
  ;;
*)
  sed -n '2,14p' "$0"
  exit 2
  ;;
esac
