#!/usr/bin/env bash
# Build benchmark: cold and warm `cargo xtask build-target` for one target on this machine.
# Writes bench/build.json and bench/build.md. Not a test: numbers only, nothing asserted.
#   cold: empty kernel cache (a fresh --cache folder), so every kernel is rendered, hashed and compiled by
#         NVRTC, then the server binary is relinked with the new pack;
#   warm: the same command again, nothing changed (all kernels cached, cargo has nothing to do).
# Each is measured for --kernels-only (the compiler part) and for the full command (+ server binary).
# Usage: bench/build-bench.sh [hw model quant]   (default h200 smollm2-135m q4_1)
set -euo pipefail
cd "$(dirname "$0")/.."
HW=${1:-h200}; MODEL=${2:-smollm2-135m}; QUANT=${3:-q4_1}
cargo build --release --quiet -p xtask
X=target/release/xtask
"$X" toolchain >/dev/null
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
OUT="$TMP/out"
now() { date +%s.%N; }
run() { # label, args...
  local label=$1; shift
  local t0 t1
  t0=$(now); "$X" build-target --hw "$HW" --model "$MODEL" --quant "$QUANT" --out "$OUT" "$@" 2>"$TMP/$label.log"; t1=$(now)
  echo "$label $(echo "$t1 - $t0" | bc -l)" >> "$TMP/times"
  tail -2 "$TMP/$label.log" | head -1 | sed "s/^/  $label: /" >&2
}
# make sure the server's dependencies are built, so "full" measures our part, not a cold cargo build
"$X" build-target --hw "$HW" --model "$MODEL" --quant "$QUANT" --out "$OUT" 2>/dev/null
run kernels_cold --kernels-only --cache "$TMP/cache-k"
run kernels_warm --kernels-only --cache "$TMP/cache-k"
run full_cold --cache "$TMP/cache-f"
run full_warm --cache "$TMP/cache-f"
get() { awk -v k="$1" '$1==k {printf "%.2f", $2}' "$TMP/times"; }
NK=$(grep -c . <(ls "$OUT/kernels"))
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cat > bench/build.json <<JSON
{
  "target": "$HW/$MODEL/$QUANT",
  "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
  "commit": "$COMMIT",
  "machine": {"cpus": $(nproc), "cpu": "$CPU", "mem_gib": $(awk '/MemTotal/ {printf "%.0f", $2/1048576}' /proc/meminfo)},
  "compiler": "NVRTC 13.0.88 (pinned wheels)",
  "blobs": $NK,
  "seconds": {
    "kernels_only_cold": $(get kernels_cold),
    "kernels_only_warm": $(get kernels_warm),
    "full_cold": $(get full_cold),
    "full_warm": $(get full_warm)
  },
  "aims": {"cold_lt_s": 60, "warm_lt_s": 2}
}
JSON
cat > bench/build.md <<MD
# Build benchmark: \`cargo xtask build-target --hw $HW --model $MODEL --quant $QUANT\`

Made by \`bench/build-bench.sh\` on $(date -u +%Y-%m-%d) at commit $COMMIT; machine: $(nproc) CPUs ($CPU).
Cold = empty kernel cache (every kernel compiled by NVRTC 13.0.88, cubin + PTX); warm = same command again.
"full" adds the per-target server binary (the kernel pack is embedded by metrale-kernels' build.rs, so a
changed pack recompiles metrale-kernels and its dependents and relinks; the dependencies are prebuilt).

| step | cold (s) | warm (s) | aim |
| --- | ---: | ---: | --- |
| kernels only ($NK blobs) | $(get kernels_cold) | $(get kernels_warm) | cold < 60, warm < 2 |
| full (kernels + server binary) | $(get full_cold) | $(get full_warm) | cold < 60, warm < 2 |

Other builds running on the machine at the same time (shared cargo target dir) lengthen the "full" numbers.
MD
cat bench/build.json
