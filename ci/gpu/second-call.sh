#!/usr/bin/env bash
# The second GPU call (carry .carry2, right after the first; ci/gpu/README.md): assemble the model,
# run the whole-model tests and the backend contract on the CUDA backend, llama.cpp on the same file,
# the decode/prefill benchmark (default runtime choices twice, run-ahead off twice), the HTTP serving
# check and bench-record (default, and run-ahead off). Everything lands in $OUT/second.tgz.
# Usage (device, repo root): bash ci/gpu/second-call.sh
set -uo pipefail
R=$HOME/results && rm -rf "$R" && mkdir -p "$R"
cat ~/m/part.aa .carry2/part.ab > ~/m/model.gguf
echo "$(cat .carry2/model.sha256)  $HOME/m/model.gguf" | sha256sum -c | tee "$R/model-sha256.txt" || exit 1
K=$HOME/b/k/h200-smollm2-135m-q4_1/kernels
export METRALE_MODEL=$HOME/m/model.gguf METRALE_CUDA_KERNELS=$K METRALE_CUDA_TARGET=h200/smollm2-135m/q4_1
timeout 300 ~/b/bin/cuda_model --nocapture --test-threads=1 > "$R/model-test.txt" 2>&1; echo "cuda_model rc=$?" | tee -a "$R/model-test.txt"
grep -E "test result|rel L2|panicked" "$R/model-test.txt"
timeout 120 ~/b/bin/contract --nocapture --test-threads=1 > "$R/contract.txt" 2>&1; echo "contract rc=$?" | tee -a "$R/contract.txt"
grep -E "test result|panicked|contract:" "$R/contract.txt"
# llama.cpp first: its build (started by the first call) must not share the CPUs with our timings
(OUT=$R bash ci/gpu/llamacpp.sh bench .peer/llamacpp-src.tgz ~/m/model.gguf 1,8,32,64) > "$R/llamacpp.txt" 2>&1; tail -12 "$R/llamacpp.txt"
bench() { timeout 150 ~/b/bin/cuda_bench ~/m/model.gguf "$K" h200/smollm2-135m/q4_1 "$@"; }
for run in 1 2; do
  bench --out "$R/bench-$run.json" $([ $run = 1 ] && echo --trace "$R/trace.bin") > "$R/bench-$run.log" 2>&1
  METRALE_CUDA_TUNING=run_ahead=off bench --batch 1 --pp 64 --out "$R/bench-no-ahead-$run.json" > "$R/bench-no-ahead-$run.log" 2>&1
done
grep -H "decode b=1\|decode batch\|tg128\|prefill 512:" "$R"/bench-*.log
mkdir -p ~/srv && tar xJf .carry2/srv.tar.xz -C ~/srv
python3 ci/gpu/serve_check.py ~/srv/metrale-server ~/m/model.gguf 8090 > "$R/serve.txt" 2>&1; tail -2 "$R/serve.txt"
~/srv/xtask bench-record ~/srv/metrale-server --model ~/m/model.gguf --out "$R/records" > "$R/bench-record.log" 2>&1; tail -4 "$R/bench-record.log"
METRALE_CUDA_TUNING=run_ahead=off ~/srv/xtask bench-record ~/srv/metrale-server --model ~/m/model.gguf --out "$R/records-no-ahead" > "$R/bench-record-no-ahead.log" 2>&1; tail -4 "$R/bench-record-no-ahead.log"
~/srv/metrale-server --attestation > "$R/attestation-embedded.json" 2>/dev/null
tar czf "$OUT/second.tgz" -C "$HOME" results
