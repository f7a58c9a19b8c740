#!/usr/bin/env bash
# A/B of kernel folders of the same target on the GPU machine, alternated (A B C A B C ...) so that
# drift hits all alike: cuda_bench's batch-1 decode (tg128 in process, the GPU replay) with each.
# Usage (device, repo root, after first-call.sh unpacked ~/b and the model is ~/m/model.gguf):
#   ROUNDS=3 TARGET=h200/smollm2-135m/q4_1 bash ci/gpu/ab.sh KERNELS_A KERNELS_B [...]
# One line per run; every log and JSON in $OUT/ab.tgz.
set -uo pipefail
rounds=${ROUNDS:-3} target=${TARGET:-h200/smollm2-135m/q4_1}
R=$HOME/ab && rm -rf "$R" && mkdir -p "$R"
for i in $(seq 1 "$rounds"); do
  for dir in "$@"; do
    v=$(basename "$dir")
    timeout 150 ~/b/bin/cuda_bench ~/m/model.gguf "$dir" "$target" --batch 1 --pp 64 \
      --out "$R/$v-$i.json" --trace "$R/$v-$i.trace" > "$R/$v-$i.log" 2>&1
    echo "$v round $i: tg128 $(grep -ho 'median [0-9.]* tok/s' "$R/$v-$i.log" | tail -1), replay $(grep -ho 'replay alone: [0-9.]* us' "$R/$v-$i.log" | cut -d' ' -f3)"
  done
done
tar czf "$OUT/ab.tgz" -C "$HOME" ab
