"""Start-up failures of the real binary: each exits non-zero at once with one line saying what to do."""

import os
import subprocess

import pytest

from conftest import REPO


def binary():
    b = os.environ.get("METRALE_SERVER_BIN", str(REPO / "target/release/metrale-server"))
    if not os.path.isfile(b):
        pytest.fail(f"server binary {b} not found: cargo build --release -p metrale-server")
    return b


def run(*args, env_model=False):
    env = dict(os.environ)
    if not env_model:
        env.pop("METRALE_MODEL", None)
    return subprocess.run([binary(), *args], capture_output=True, text=True, timeout=60, env=env)


def test_missing_model_file_says_how_to_get_one():
    r = run("--model", "/nonexistent/model.gguf", "--port", "0")
    assert r.returncode == 1
    assert "model not found" in r.stderr and "fetch-model" in r.stderr, r.stderr


def test_no_model_flag_is_a_usage_error():
    r = run()
    assert r.returncode == 2 and "--model" in r.stderr


@pytest.mark.parametrize("flags", [["--parallel", "0"], ["--ctx-size", "0"], ["--threads", "0"], ["--port", "70000"],
                                   ["--num-speculative-tokens", "0", "--speculative", "ngram"],
                                   ["--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
                                   ["--speculative", "eagle"], ["--speculative", "draft"],
                                   ["--draft-model", "/x.gguf"], ["--max-num-batched-tokens", "0"]])
def test_bad_flags_fail_early(flags, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    r = run("--model", str(model), *flags)
    assert r.returncode in (1, 2), r.stderr
    assert flags[0] in r.stderr, r.stderr


def test_bad_chat_template_is_refused_before_loading(tmp_path):
    model = os.environ.get("METRALE_MODEL")
    if not model:
        pytest.skip("METRALE_MODEL is not set")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ broken")
    r = run("--model", model, "--port", "0", "--chat-template", str(tpl))
    assert r.returncode == 1 and "--chat-template" in r.stderr and "not a valid template" in r.stderr, r.stderr


def test_not_a_model_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    r = run("--model", str(bad), "--port", "0")
    assert r.returncode == 1 and "error:" in r.stderr and str(bad) in r.stderr, r.stderr


def test_attestation_and_target_info_need_no_model():
    r = run("--attestation")
    if r.returncode == 0:  # a target build: the in-toto statement
        assert '"_type": "https://in-toto.io/Statement/v1"' in r.stdout
    else:  # a generic build says so and how to make a target build
        assert r.returncode == 1 and "build-target" in r.stderr, r.stderr
    r = run("--target-info")
    assert r.returncode == 0 and r.stdout.strip()
