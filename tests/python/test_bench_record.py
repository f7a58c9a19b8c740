"""`cargo xtask bench-record` on the built cpu binary with the real model, at a tiny size: the record
it writes names the kernels lock it was built from (digest of targets/kernels.lock, the binary's
blobs match it), holds no machine path, and a second record of the same day is not overwritten.

Env: METRALE_MODEL, METRALE_SERVER_BIN (the built target binary, as for the server tests); the xtask
executable is target/release/xtask of this repo (ci/test.sh builds it). METRALE_LLAMA_BENCH (llama.cpp's
llama-bench, with llama-batched-bench beside it) runs the `--peer` test; without it that test skips.
"""

import hashlib
import json
import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_record_names_the_lock_and_no_machine_path(tmp_path):
    model = os.environ.get("METRALE_MODEL")
    binary = os.environ.get("METRALE_SERVER_BIN")
    if not model or not binary:
        pytest.skip("METRALE_MODEL and METRALE_SERVER_BIN (a cargo xtask build-target binary) are needed")
    xtask = REPO / "target/release/xtask"
    if not xtask.is_file():
        pytest.fail(f"{xtask} not found: cargo build --release -p xtask")
    args = [str(xtask), "bench-record", binary, "--model", model, "--reps", "1", "--gen-tokens", "8",
            "--prompt-tokens", "32", "--stream-prompt-tokens", "24", "--concurrency", "1,2",
            "--memory-bandwidth-gbs", "20", "--out", str(tmp_path)]
    for _ in range(2):
        p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    records = sorted(tmp_path.glob("*.json"))
    assert len(records) == 2, "the second record overwrote the first"
    text = records[0].read_text()
    rec = json.loads(text)
    assert rec["schema"] == "metrale.bench-record/v4"
    lock = (REPO / "targets/kernels.lock").read_bytes()
    assert rec["kernels_lock"]["sha256"] == hashlib.sha256(lock).hexdigest()
    assert rec["kernels_lock"]["matches_binary"] is True, rec["kernels_lock"]
    assert rec["model"]["file"] == pathlib.Path(model).name
    assert rec["binary"]["file"] == "metrale-server"
    for machine_path in [str(REPO), os.path.dirname(os.path.abspath(model)), str(tmp_path), "/" + "root/", "/" + "home/"]:
        assert machine_path not in text, f"the record holds the machine path {machine_path!r}"
    assert rec["metrics"]["decode_tok_s"] > 0 and rec["metrics"]["prefill_tok_s"] > 0
    assert [c["concurrency"] for c in rec["metrics"]["concurrent"]] == [1, 2]
    for c in rec["metrics"]["concurrent"]:
        assert c["streams_ok"] == c["concurrency"] and c["streams_failed"] == 0, c
        assert c["prompt_tokens"] == 24
        # the engine's steps in the run: each stream's tokens need one step each at least, and a
        # step's backend share is part of its time
        e = c["engine"]
        assert e["steps"] >= 8 and 0 < e["backend_ms"] <= e["step_ms"], c
        assert abs(e["host_ms"] - (e["step_ms"] - e["backend_ms"])) < 1e-9, c
        assert c["itl_tok_s"] > 0, c
    floors = rec["floors"]
    assert floors["weight_bytes"] == os.path.getsize(model)
    assert abs(floors["decode_tok_s"] - 20e9 / os.path.getsize(model)) < 1e-6 * floors["decode_tok_s"]
    assert rec["peer"] is None


def test_bench_record_takes_an_empty_concurrency_as_none_and_names_a_bad_one(tmp_path):
    model = os.environ.get("METRALE_MODEL")
    binary = os.environ.get("METRALE_SERVER_BIN")
    if not model or not binary:
        pytest.skip("METRALE_MODEL and METRALE_SERVER_BIN are needed")
    xtask = REPO / "target/release/xtask"
    base = [str(xtask), "bench-record", binary, "--model", model, "--reps", "1", "--gen-tokens", "4",
            "--prompt-tokens", "16", "--out", str(tmp_path)]
    p = subprocess.run(base + ["--concurrency", ""], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rec = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rec["metrics"]["concurrent"] == []
    p = subprocess.run(base + ["--concurrency", "1,two"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "`two` is not a positive integer" in p.stderr, p.stderr


def test_bench_record_runs_the_peer_in_the_same_run(tmp_path):
    model = os.environ.get("METRALE_MODEL")
    binary = os.environ.get("METRALE_SERVER_BIN")
    llama_bench = os.environ.get("METRALE_LLAMA_BENCH")
    if not model or not binary or not llama_bench:
        pytest.skip("METRALE_MODEL, METRALE_SERVER_BIN and METRALE_LLAMA_BENCH (llama.cpp's llama-bench) are needed")
    xtask = REPO / "target/release/xtask"
    args = [str(xtask), "bench-record", binary, "--model", model, "--reps", "2", "--gen-tokens", "16",
            "--prompt-tokens", "64", "--stream-prompt-tokens", "32", "--concurrency", "1,4",
            "--peer", os.path.dirname(llama_bench), "--peer-args", "-t 2", "--peer-source", "test build",
            "--out", str(tmp_path)]
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr
    rec = json.loads(next(tmp_path.glob("*.json")).read_text())
    peer = rec["peer"]
    assert peer["name"] == "llama.cpp" and peer["build"]["commit"] and peer["source"] == "test build", peer
    tests = {(r["n_prompt"], r["n_gen"]) for r in peer["llama_bench"]["results"]}
    assert tests == {(64, 0), (0, 16)}, tests
    assert [r["b"] for r in peer["batched_bench"]["rows"]] == [1, 4]
    assert peer["ratios"]["decode_vs_tg"] > 0 and peer["ratios"]["prefill_vs_pp"] > 0
    assert [c["concurrency"] for c in peer["ratios"]["concurrent_vs_batched_s_tg"]] == [1, 4]
    assert all(c["peer_s_tg"] > 0 and c["ratio"] > 0 for c in peer["ratios"]["concurrent_vs_batched_s_tg"])
    assert pathlib.Path(model).name in peer["llama_bench"]["args"]
    assert str(os.path.dirname(os.path.abspath(model))) not in json.dumps(peer)
