#!/usr/bin/env bash
# tests/golden/embeddings_golden.json: llama.cpp's embeddings of fixed texts with the default model,
# the reference tests/python/test_embeddings.py compares /v1/embeddings with (cosine >= 0.99).
# llama.cpp: the source ci/gpu/llamacpp.sh packs (llama-cpp-python 0.3.36's vendored copy, ggml
# 0.25.3), its `llama-embedding` built for the CPU:
#   tar xzf .peer/llamacpp-src.tgz -C SRC && cmake -S SRC -B SRC/build -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
#     && cmake --build SRC/build --target llama-embedding
# Mean pooling and Euclidean normalisation (`--pooling mean --embd-normalize 2`), as the server's
# `--embeddings` default.
# Usage: tests/golden/make_embedding_golden.sh LLAMA_EMBEDDING MODEL.gguf > tests/golden/embeddings_golden.json
set -euo pipefail
bin=${1:?usage: make_embedding_golden.sh LLAMA_EMBEDDING MODEL.gguf}
model=${2:?usage: make_embedding_golden.sh LLAMA_EMBEDDING MODEL.gguf}
texts=(
  "The capital of France is Paris."
  "Water boils at 100 degrees Celsius at sea level."
  "def add(a, b):\n    return a + b"
  "A quick brown fox jumps over the lazy dog."
)
{
  for t in "${texts[@]}"; do
    text=$(printf '%b' "$t")
    printf '%s\0' "$text"
    # (a separator no text holds: the default, a newline, would split one text into several)
    "$bin" -m "$model" -p "$text" --pooling mean --embd-normalize 2 --embd-output-format json \
      --embd-separator "<#sep#>" 2>/dev/null
    printf '\0'
  done
} | python3 -c '
import hashlib, json, sys
parts = sys.stdin.buffer.read().split(b"\0")[:-1]
items = []
for text, out in zip(parts[0::2], parts[1::2]):
    items.append({"text": text.decode(), "embedding": json.loads(out)["data"][0]["embedding"]})
model = sys.argv[1]
print(json.dumps({
    "reference": "llama.cpp llama-embedding (llama-cpp-python 0.3.36 vendored source, ggml 0.25.3, CPU build), --pooling mean --embd-normalize 2",
    "model": model.rsplit("/", 1)[-1],
    "model_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
    "items": items,
}, indent=1))
' "$model"
