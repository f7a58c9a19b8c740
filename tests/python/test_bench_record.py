"""`cargo xtask bench-record` on the built cpu binary with the real model, at a tiny size: the record
it writes names the kernels lock it was built from (digest of targets/kernels.lock, the binary's
blobs match it), holds no machine path, and a second record of the same day is not overwritten.

Env: METRALE_MODEL, METRALE_SERVER_BIN (the built target binary, as for the server tests); the xtask
executable is target/release/xtask of this repo (ci/test.sh builds it).
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
            "--prompt-tokens", "32", "--concurrency", "1,2", "--out", str(tmp_path)]
    for _ in range(2):
        p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    records = sorted(tmp_path.glob("*.json"))
    assert len(records) == 2, "the second record overwrote the first"
    text = records[0].read_text()
    rec = json.loads(text)
    assert rec["schema"] == "metrale.bench-record/v2"
    lock = (REPO / "targets/kernels.lock").read_bytes()
    assert rec["kernels_lock"]["sha256"] == hashlib.sha256(lock).hexdigest()
    assert rec["kernels_lock"]["matches_binary"] is True, rec["kernels_lock"]
    assert rec["model"]["file"] == pathlib.Path(model).name
    assert rec["binary"]["file"] == "metrale-server"
    for machine_path in [str(REPO), os.path.dirname(os.path.abspath(model)), str(tmp_path), "/" + "root/", "/" + "home/"]:
        assert machine_path not in text, f"the record holds the machine path {machine_path!r}"
    assert rec["metrics"]["decode_tok_s"] > 0 and rec["metrics"]["prefill_tok_s"] > 0
    assert [c["concurrency"] for c in rec["metrics"]["concurrent"]] == [1, 2]
