"""FP8 weights over HTTP with the official openai client, on the cpu backend: a synthetic FP8
checkpoint in compressed-tensors' layout (`cargo xtask synth-model --quant fp8 --format hf`,
SmolLM2-135M's shape, 2 layers) served as it is, and the bf16 folder of the same seed served with
`--quantization fp8` (quantized at load). The quantizer is the same, so the two serve the same
model: greedy answers equal token for token, logprobs equal. Both say what they run in the
start-up log. `--quantization fp8` on a Q4_1 file is refused at start, naming the type.

Needs METRALE_MODEL (the default model: the synthetic ones' tokenizer, and the Q4_1 file).
"""

import os
import pathlib
import subprocess

import pytest

from conftest import server_binary, start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]


def synth(d, *args):
    tok = os.environ["METRALE_MODEL"]
    p = subprocess.run([str(REPO / "target/release/xtask"), "synth-model", "smollm2-135m", "--layers", "2",
                        "--tokenizer", tok, "--seed", "5", "--format", "hf", *args, "--out", str(d)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    if not os.environ.get("METRALE_MODEL"):
        pytest.skip("METRALE_MODEL (the default model: the synthetic models' tokenizer) is needed")
    d = tmp_path_factory.mktemp("fp8")
    return synth(d / "fp8", "--quant", "fp8"), synth(d / "bf16")


def answers(client):
    out = []
    for q in ["Name a river.", "Count to five.", "What is a mill?"]:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                           temperature=0, max_tokens=24, logprobs=True)
        c = r.choices[0]
        out.append((c.message.content, [t.logprob for t in c.logprobs.content]))
    return out


def test_an_fp8_checkpoint_and_bf16_quantized_at_load_serve_the_same_model(folders, tmp_path):
    fp8, bf16 = folders
    got = []
    for model, args, says in [
        (fp8, [], "fp8 e4m3 from the checkpoint"),
        (bf16, ["--quantization", "fp8"], "quantized at load: 14 matrices to fp8 e4m3"),
    ]:
        log = tmp_path / f"{model.name}.log"
        s = start_server(log, ["--ctx-size", "256", "--parallel", "2", *args], model=str(model))
        try:
            got.append(answers(s.openai(api_key="none")))
        finally:
            stop_server(s.proc)
        text = log.read_text()
        assert says in text, text
    (a, b) = got
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert la == pytest.approx(lb, abs=1e-6)
    assert any(t for t, _ in a), "the answers are not empty"


def test_quantization_fp8_refuses_a_block_quantized_file(tmp_path):
    if not os.environ.get("METRALE_MODEL"):
        pytest.skip("METRALE_MODEL is needed")
    p = subprocess.run([server_binary(), "--model", os.environ["METRALE_MODEL"], "--port", "0",
                        "--quantization", "fp8"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--quantization fp8" in p.stderr and "q4_1" in p.stderr and "bf16, f16 or f32" in p.stderr, p.stderr


def test_an_fp8_kv_cache_serves_the_default_model(tmp_path):
    """`--kv-cache-dtype fp8` on the real model: answers, the start-up line names the cache's type,
    and the cache takes under a third of the f32 cache's bytes for the same tokens."""
    if not os.environ.get("METRALE_MODEL"):
        pytest.skip("METRALE_MODEL is needed")
    sizes = {}
    for kv in ["f32", "fp8"]:
        log = tmp_path / f"{kv}.log"
        s = start_server(log, ["--ctx-size", "512", "--parallel", "2", "--kv-cache-dtype", kv])
        try:
            r = s.openai(api_key="none").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0, max_tokens=16)
            assert r.choices[0].message.content
        finally:
            stop_server(s.proc)
        line = next(l for l in log.read_text().splitlines() if "KV cache:" in l)
        assert f" {kv};" in line, line
        num, unit = line.split(" tokens, ")[1].split(f" {kv};")[0].split()
        sizes[kv] = float(num) * {"MiB": 1, "GiB": 1024}[unit]
    assert sizes["fp8"] < sizes["f32"] / 3, sizes
