#!/usr/bin/env bash
# metrale's test command (README.md's second command; .ci/run calls it). On a fresh machine it installs
# everything the tests need itself: the pinned compiler wheels (cargo xtask toolchain), the default model
# (cargo xtask fetch-model), a Python venv with the official openai client, Chromium and chromedriver
# from the distribution (apt-get, for the chat page's browser test); checks formatting and
# lints; then builds once, in release, and runs every test: the Rust workspace's (tidy and the kernels
# lock among them), the server tests that drive the real binary, a two-minute soak of that binary, and
# a short run of every fuzz target.
# Fails loudly: any step that fails stops the run with its exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
# each step's header with the minutes and seconds since the start (where a slow run spent its time)
step() { local t=$(($(date +%s) - T0)); printf '\n==> [%d:%02d] %s\n' $((t / 60)) $((t % 60)) "$*" >&2; }
trap 'step "end (exit status $?)"' EXIT

step "format and lints (cargo fmt, clippy -D warnings, with and without the cuda feature)"
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo clippy --release --workspace --all-targets --features metrale-backend/cuda,metrale-server/cuda -- -D warnings

step "build (release, once)"
cargo build --release --workspace --all-targets
# the plain server (no target compiled in: any family), kept before the tests' target builds
# replace target/release/metrale-server; tests/python/test_harmony.py serves a synthetic gpt-oss
mkdir -p target/ci-dist/plain && cp target/release/metrale-server target/ci-dist/plain/

step "toolchain (NVRTC + CUDA headers from pinned wheels)"
cargo xtask toolchain
export METRALE_REQUIRE_TOOLCHAIN=1

step "default model"
METRALE_MODEL=$(cargo xtask fetch-model smollm2-135m | tail -n 1)
export METRALE_MODEL
test -f "$METRALE_MODEL" || { echo "fetch-model did not print a model path (got '$METRALE_MODEL')" >&2; exit 1; }

step "headless Chromium and chromedriver (the chat page's browser test)"
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  apt-get update -q
  apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
export METRALE_REQUIRE_BROWSER=1

step "python client venv (official openai package)"
venv=target/venv-tests
[ -x $venv/bin/python ] || python3 -m venv $venv
$venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt

step "cargo test (release)"
cargo test --release --workspace

step "the CUDA backend's host-side unit tests (no GPU needed: launch plans, repacking, tuning, the GEMM threshold)"
cargo test --release -p metrale-backend --features cuda --lib cuda::

step "structured output: the mask benchmark runs (bench/structured/README.md)"
target/release/examples/mask_bench "$METRALE_MODEL" --streams 1,4 --tokens 16 --out target/mask-bench.json

step "build the cpu target (the binary users run: embedded target, presets, model check)"
cargo xtask build-target --hw cpu --model smollm2-135m --quant q4_1 --out target/ci-dist/cpu-smollm2-135m-q4_1

step "server tests (openai client + curl against the built binary and the real model)"
METRALE_SERVER_BIN=$PWD/target/ci-dist/cpu-smollm2-135m-q4_1/metrale-server \
METRALE_GPT_OSS_SERVER_BIN=$PWD/target/ci-dist/plain/metrale-server \
    $venv/bin/python -m pytest -q tests/python

step "soak (120 s: mixed and hostile traffic, bursts past the queue, disconnects, then SIGTERM)"
$venv/bin/python bench/soak/soak.py --server-bin target/ci-dist/cpu-smollm2-135m-q4_1/metrale-server \
    --model "$METRALE_MODEL" --duration 120 --warmup 0.5 --max-rss-slope 3 --out target/soak-120s.json \
    --log target/soak-120s.log

step "fuzz (every target, 20 s each, seeds in fuzz/corpus)"
fuzz/run.sh all 20
