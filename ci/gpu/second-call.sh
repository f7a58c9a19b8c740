#!/usr/bin/env bash
# The second GPU call (see README.md here): assemble the model, run the whole-model tests, the decode
# benchmark with the persistent kernel (plus its per-stage trace) and with the per-stage graphs, then
# (argument `peer`) llama.cpp on the same file, and (when .carry2/srv.tar.xz holds the built h200
# server binary and xtask) the HTTP serving check and `xtask bench-record`. Everything lands in $OUT/results.tgz (the device tool
# returns only a few files per call).
# Usage (on the device, repo root, after the first call unpacked ~/b and ~/m): bash ci/gpu/second-call.sh [peer]
set -uo pipefail
R=$HOME/results && rm -rf $R && mkdir -p $R
cat ~/m/part.aa .carry2/part.ab > ~/m/model.gguf && sha256sum ~/m/model.gguf | tee $R/model-sha256.txt
K=$HOME/b/k/h200-smollm2-135m-q4_1/kernels
export METRALE_MODEL=$HOME/m/model.gguf METRALE_CUDA_KERNELS=$K
bench() { timeout 120 ~/b/bin/cuda_bench ~/m/model.gguf $K h200/smollm2-135m/q4_1 "$@"; }
timeout 300 ~/b/bin/cuda_model --nocapture --test-threads=1 > $R/model-test.txt 2>&1; echo "cuda_model rc=$?" | tee -a $R/model-test.txt
grep -E "test result|rel L2|panicked" $R/model-test.txt
for run in ${RUNS:-1 2}; do
  bench --out $R/bench-decode1-$run.json --trace $R/trace-$run.bin > $R/bench-decode1-$run.log 2>&1
  [ -n "${GRAPHS:-1}" ] && METRALE_CUDA_DECODE1=0 bench --batch 1 --out $R/bench-graphs-$run.json > $R/bench-graphs-$run.log 2>&1
  [ -n "${AHEAD:-1}" ] && METRALE_CUDA_RUN_AHEAD=1 bench --batch 1 --pp 64 --out $R/bench-ahead-$run.json > $R/bench-ahead-$run.log 2>&1
done
for fl in ${FLAGS:-}; do
  METRALE_CUDA_DECODE1_FLAGS=$fl bench --batch 1 --pp 64 --out $R/bench-flags$fl.json --trace $R/trace-flags$fl.bin > $R/bench-flags$fl.log 2>&1
done
for sp in ${SPLITS:-}; do
  METRALE_CUDA_DECODE1_SPLITS=$sp bench --batch 1 --pp 64 --out $R/bench-split$sp.json --trace $R/trace-split$sp.bin > $R/bench-split$sp.log 2>&1
done
grep -H "decode b=1\|decode batch 1:\|tg128" $R/bench-*.log
if [ "${1:-}" = peer ]; then (cd ~ && OUT=$R bash ~/peer/llamacpp-bench.sh ~/peer/llamacpp-src.tgz ~/m/model.gguf 1,8,32,64) > $R/llamacpp.txt 2>&1; tail -12 $R/llamacpp.txt; fi
if [ -f .carry2/srv.tar.xz ]; then
  # the built h200 binary (cargo xtask build-target ... --out) and xtask: serving check and bench-record
  mkdir -p ~/srv && tar xJf .carry2/srv.tar.xz -C ~/srv
  python3 ci/gpu/serve_check.py ~/srv/metrale-server ~/m/model.gguf 8090 > $R/serve-h200.txt 2>&1; tail -2 $R/serve-h200.txt
  ~/srv/xtask bench-record ~/srv/metrale-server --model ~/m/model.gguf --out $R/records > $R/bench-record.log 2>&1; tail -3 $R/bench-record.log
  [ -n "${AHEAD:-1}" ] && { METRALE_CUDA_RUN_AHEAD=1 ~/srv/xtask bench-record ~/srv/metrale-server --model ~/m/model.gguf --out $R/records-ahead > $R/bench-record-ahead.log 2>&1; tail -3 $R/bench-record-ahead.log; }
  ~/srv/metrale-server --attestation > $R/attestation-embedded.json 2>/dev/null; sha256sum ~/srv/metrale-server >> $R/model-sha256.txt
fi
tar czf $OUT/results.tgz -C $HOME results
