"""Speculative decoding on the real model over the real API: with prompt lookup, greedy output and
logprobs equal the plain server's, token for token, whole and streamed; proposals are accepted
(the /metrics counters); a request under a grammar runs plainly on the same server. With a draft
model (the model itself, the one other model of its tokenizer at hand), the same output and every
proposal accepted."""

import json
import pathlib

import httpx
import pytest

from conftest import API_KEY, model_path, start_server, stop_server

TEXT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "perplexity" / "text.txt"


def copy_prompts():
    paras = [p.strip() for p in TEXT.read_text().split("\n\n") if len(p.strip()) > 200]
    return [f"Repeat the following text exactly, word for word.\n\n{p[:500]}" for p in paras[3:40:12]]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("spec") / "server.log"
    s = start_server(log, ["--ctx-size", "1024", "--parallel", "2", "--api-key", API_KEY,
                           "--speculative", "ngram", "--num-speculative-tokens", "5"])
    try:
        yield s
    finally:
        stop_server(s.proc)


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return spec_server.openai()


def spec_counts(base):
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, value = line.split(" ")
            out[name.split("{")[0]] = float(value)
    return out


def chat(c, prompt, **kw):
    kw = {"max_tokens": 80, "temperature": 0, **kw}
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], **kw)


def test_greedy_output_and_logprobs_equal_the_plain_servers(client, spec_client, spec_server):
    before = spec_counts(spec_server.base)
    assert "speculative decoding: prompt lookup" in spec_server.log()
    for p in copy_prompts():
        want = chat(client, p, logprobs=True, top_logprobs=2)
        got = chat(spec_client, p, logprobs=True, top_logprobs=2)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
        a, b = want.choices[0].logprobs.content, got.choices[0].logprobs.content
        assert [t.token for t in a] == [t.token for t in b]
        # the CPU backend's rows do not depend on how tokens are grouped into steps: the same bits
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-5
        assert [[t.token for t in x.top_logprobs] for x in a] == [[t.token for t in y.top_logprobs] for y in b]
        # streamed, the same text
        chunks = spec_client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": p}], max_tokens=80, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    after = spec_counts(spec_server.base)
    proposed = after["vllm:spec_decode_num_draft_tokens_total"] - before["vllm:spec_decode_num_draft_tokens_total"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    # copying text: most proposals are right (SmolLM2-135M repeats these passages closely)
    assert proposed > 100 and accepted > 0.3 * proposed, (proposed, accepted)


def test_sampled_output_is_reproducible_from_its_seed(spec_client):
    p = copy_prompts()[0]
    a = chat(spec_client, p, seed=11, temperature=0.8).choices[0].message.content
    b = chat(spec_client, p, seed=11, temperature=0.8).choices[0].message.content
    assert a == b


def test_a_grammar_request_runs_plainly_beside_speculation(client, spec_client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["name", "year"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    p = "Give the name and year of the first Python release as JSON."
    want = chat(client, p, response_format=fmt).choices[0].message.content
    got = chat(spec_client, p, response_format=fmt).choices[0].message.content
    assert got == want
    assert set(json.loads(got)) == {"name", "year"}


def test_a_draft_model_gives_the_plain_output(client, tmp_path):
    s = start_server(tmp_path / "server.log", ["--ctx-size", "1024", "--parallel", "2", "--api-key", API_KEY,
                                               "--speculative", "draft", "--draft-model", model_path(),
                                               "--num-speculative-tokens", "3"])
    try:
        c = s.openai()
        assert "speculative decoding: a draft model" in s.log() and "draft model:" in s.log()
        p = "Write three sentences about the sea."
        want = chat(client, p, max_tokens=48).choices[0].message.content
        assert chat(c, p, max_tokens=48).choices[0].message.content == want
        n = spec_counts(s.base)
        # the draft is the model itself on the same backend: its greedy choice is the model's
        assert n["vllm:spec_decode_num_draft_tokens_total"] > 20
        assert n["vllm:spec_decode_num_accepted_tokens_total"] == n["vllm:spec_decode_num_draft_tokens_total"]
    finally:
        stop_server(s.proc)
