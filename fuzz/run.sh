#!/usr/bin/env bash
# fuzz/run.sh TARGET SECONDS [extra libFuzzer flags...]: fuzz one target for a while (CI: 20 s each).
# Installs what it needs itself (cargo-fuzz from crates.io, pinned), builds the target with coverage
# instrumentation on the stable toolchain (RUSTC_BOOTSTRAP=1 lets stable accept the nightly flags
# cargo-fuzz passes), then runs libFuzzer on the checked-in seeds (corpus/TARGET, read only) plus a
# working corpus under target/ that grows between runs. Exits non-zero, loudly, on a crash, a panic, a
# leak of the memory bounds, a timeout or a build failure; the crashing input is saved under
# artifacts/TARGET/ and its path printed. TARGET=all runs every target for SECONDS each.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")"
CARGO_FUZZ_VERSION=0.13.2
TARGETS=(gguf gguf_model hf_config request_json chat_template)

die() { echo "fuzz/run.sh: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: fuzz/run.sh TARGET SECONDS [libFuzzer flags] (TARGET: ${TARGETS[*]} or all)"
target=$1 seconds=$2
shift 2
[[ $seconds =~ ^[1-9][0-9]*$ ]] || die "SECONDS must be a whole number of at least 1, got '$seconds'"
if [ "$target" = all ]; then
    for t in "${TARGETS[@]}"; do "$self" "$t" "$seconds" "$@"; done
    exit 0
fi
[[ " ${TARGETS[*]} " == *" $target "* ]] || die "unknown target '$target' (known: ${TARGETS[*]})"

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    echo "fuzz/run.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION" >&2
    cargo install --locked --quiet cargo-fuzz --version "$CARGO_FUZZ_VERSION" \
        || die "cargo install cargo-fuzz $CARGO_FUZZ_VERSION failed"
fi

export RUSTC_BOOTSTRAP=1
# -s none: no sanitizer (the code under test is safe Rust; the harness's counting allocator bounds
# memory); -a: debug assertions and overflow checks; -O: optimised.
FLAGS=(-s none -a -O)
cargo fuzz build "${FLAGS[@]}" "$target" || die "building fuzz target $target failed"

seeds=corpus/$target
[ "$target" = gguf_model ] && seeds=corpus/gguf # the same GGUF seeds
work=target/corpus-work/$target
mkdir -p "$work" "artifacts/$target"
echo "fuzz/run.sh: $target for $seconds s (seeds: fuzz/$seeds, working corpus: fuzz/$work)" >&2
# -timeout: one input taking 10 s is a hang; -rss_limit_mb: a backstop above the harness's own cap
if ! cargo fuzz run "${FLAGS[@]}" "$target" "$work" "$seeds" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$@"; then
    echo "fuzz/run.sh: FAILED: $target found a crash, panic, hang or memory-bound violation;" \
         "input saved under fuzz/artifacts/$target/ (reproduce: cd fuzz &&" \
         "RUSTC_BOOTSTRAP=1 cargo fuzz run -s none -a -O $target artifacts/$target/FILE)" >&2
    exit 1
fi
