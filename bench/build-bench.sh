#!/usr/bin/env bash
# Build benchmark: cold and warm `cargo xtask build-target` for one target on this machine.
# Writes bench/build.json and bench/build.md. Not a test: numbers only, nothing asserted.
#   kernels cold: empty kernel cache (a fresh --cache folder): every kernel rendered, hashed, compiled by NVRTC;
#   kernels warm: the same command again (all cached);
#   full cold: a copy of the sources with one comment line appended to kernels/cuda/common.cuh and an empty
#              cache: every kernel recompiles and the new pack makes cargo rebuild metrale-kernels and its
#              dependents and relink the server (its third-party dependencies are prebuilt);
#   full warm: the same command again (nothing changed: all cached, cargo has nothing to do).
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
for i in 1 2 3; do run kernels_warm --kernels-only --cache "$TMP/cache-k"; done
SRC="$TMP/src"; mkdir -p "$SRC"; cp -r kernels targets "$SRC/"
echo "// build-bench $(date +%s%N)" >> "$SRC/kernels/cuda/common.cuh"
run full_cold --cache "$TMP/cache-f" --repo "$SRC"
for i in 1 2 3; do run full_warm --cache "$TMP/cache-f" --repo "$SRC"; done
# the median of a label's runs (warm runs are repeated 3 times: the machine is shared)
get() { awk -v k="$1" '$1==k {print $2}' "$TMP/times" | sort -g | awk '{a[NR]=$1} END {printf "%.2f", a[int((NR+1)/2)]}'; }
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
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
  "warm_runs": 3,
  "load_average_after": "$LOAD",
  "aims": {"cold_lt_s": 60, "warm_lt_s": 2}
}
JSON
cat > bench/build.md <<MD
# Build benchmark: \`cargo xtask build-target --hw $HW --model $MODEL --quant $QUANT\`

Made by \`bench/build-bench.sh\` on $(date -u +%Y-%m-%d) at commit $COMMIT; machine: $(nproc) CPUs ($CPU).
Kernels cold = empty kernel cache (every kernel compiled by NVRTC 13.0.88, cubin + PTX); warm = same command again.
Full cold = after a one-line edit of kernels/cuda/common.cuh, empty cache: every kernel recompiles, and the new
kernel pack makes cargo rebuild metrale-kernels and its dependents (backend, engine, server) and relink the
binary (third-party dependencies prebuilt). Full warm = the same command again: nothing compiles, cargo is a no-op.

| step | cold (s) | warm (s) | aim |
| --- | ---: | ---: | --- |
| kernels only ($NK blobs) | $(get kernels_cold) | $(get kernels_warm) | cold < 60, warm < 2 |
| full (kernels + server binary) | $(get full_cold) | $(get full_warm) | cold < 60, warm < 2 |

Warm numbers are the median of 3 runs. Load average after the runs: $LOAD (other builds sharing the machine and
the cargo target dir lengthen the "full" numbers; on an idle machine full warm measured 0.2 s).
MD
cat bench/build.json
