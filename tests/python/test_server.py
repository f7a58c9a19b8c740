"""The real metrale-server binary, driven with the official `openai` client, raw HTTP (httpx) and curl.

Each test states what a user of llama-server / vLLM would expect (see docs/facts.md, "What serving
users expect"). Greedy answers are compared against the model's own other path (streamed vs whole,
token ids vs text), never against hard-coded text, except the "Paris" answer to the reference
question (docs/facts.md, "The reference question").
"""

import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import API_KEY, CTX_SIZE, PARALLEL, REPO, free_port

QUESTION = "What is the capital of France? Answer in one sentence."


def model_id(client):
    return client.models.list().data[0].id


def ask(client, **kw):
    kw.setdefault("model", model_id(client))
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(**kw)


def complete(client, **kw):
    kw.setdefault("model", model_id(client))
    kw.setdefault("temperature", 0)
    return client.completions.create(**kw)


def tokenize(http, text):
    r = http.post("/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def sse_events(http, path, body):
    """POST and return the raw SSE `data:` payloads (strings), checking the framing."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    out = []
    for e in events[:-1]:
        assert e.startswith("data: "), repr(e)
        out.append(e[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


# ---------------------------------------------------------------- start-up, health, curl endpoints


# A chat template whose start-up probe (rendered once while loading) spends most of its fuel at
# --ctx-size 8192: the loading state then lasts a fraction of a second longer than the load itself,
# long enough to observe /health and signal the server from a poll that starts when the server
# prints that it listens.
SLOW_PROBE = ("{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
              "{% for m in messages %}{{ m.content }}{% endfor %}")


def test_health_is_503_while_loading_and_a_signal_stops_the_load(tmp_path):
    template = tmp_path / "slow.jinja"
    template.write_text(SLOW_PROBE)
    binary = os.environ.get("METRALE_SERVER_BIN", str(REPO / "target/release/metrale-server"))
    model = os.environ.get("METRALE_MODEL")
    if not model:
        pytest.skip("METRALE_MODEL is not set")
    port = free_port()
    proc = subprocess.Popen([binary, "--model", model, "--port", str(port), "--ctx-size", "8192",
                             "--chat-template", str(template)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.decode(errors="replace"))
            if "loading model" in lines[-1]:
                break
        base = f"http://127.0.0.1:{port}"
        r = httpx.get(base + "/health", timeout=5)
        assert r.status_code == 503 and r.json() == {"status": "loading"}, "".join(lines)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503 and "/health" in r.json()["error"]["message"], r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, "".join(lines)
        lines += [l.decode(errors="replace") for l in proc.stdout]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted while loading" in "".join(lines), "".join(lines)


def test_a_fifo_as_the_model_is_refused_naming_its_type(tmp_path):
    # A named pipe would block the loader for ever in open(); it is refused at once instead.
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    binary = os.environ.get("METRALE_SERVER_BIN", str(REPO / "target/release/metrale-server"))
    r = subprocess.run([binary, "--model", str(fifo), "--port", "0"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0
    assert "named pipe" in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_health_was_503_loading_then_200(server):
    # Whatever the fixture saw before 200 (possibly nothing on a fast machine) said "loading".
    for status, body in server.health_seen:
        assert status == 503 and body == {"status": "loading"}
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", server.base + "/health"],
                         capture_output=True, text=True, check=True).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "200" and json.loads(body)["status"] == "ok"


def test_startup_prints_capacity(server):
    log = server.log()
    assert "weights" in log and "MiB" in log
    assert f"KV capacity {CTX_SIZE * PARALLEL} tokens" in log, log
    assert f"max concurrency {PARALLEL}" in log, log


def test_metrics_vllm_names_via_curl(server, client):
    ask(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    text = subprocess.run(["curl", "-s", server.base + "/metrics"], capture_output=True, text=True, check=True).stdout
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"]:
        assert name in text, f"{name} missing from /metrics"
    gen = [l for l in text.splitlines() if l.startswith("vllm:generation_tokens_total")]
    assert gen and float(gen[0].split()[-1]) >= 2


def test_tokenize_detokenize_via_curl(server):
    def curl(path, body):
        out = subprocess.run(["curl", "-s", "-H", f"Authorization: Bearer {API_KEY}", "-d", json.dumps(body),
                              server.base + path], capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    text = "Hello world, 123 café 😀"
    toks = curl("/tokenize", {"content": text})["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    # SmolLM2's pre-tokenizer splits every digit alone: "1", "2", "3" are three tokens.
    assert len(curl("/tokenize", {"content": "123"})["tokens"]) == 3
    assert curl("/detokenize", {"tokens": toks})["content"] == text
    # Special-token markup is parsed into its single token.
    assert len(curl("/tokenize", {"content": "<|im_start|>"})["tokens"]) == 1


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id


def test_model_retrieve(client):
    # GET /v1/models/{id}: the served model by its id; any other id is a 404 naming both
    name = client.models.list().data[0].id
    m = client.models.retrieve(name)
    assert m.id == name and m.object == "model" and m.owned_by == "metrale"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    body = e.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model", body
    assert "no-such-model" in body["message"] and name in body["message"], body


# ---------------------------------------------------------------- chat, streaming


def test_chat_paris_greedy(client):
    r = ask(client, messages=[{"role": "user", "content": QUESTION}])
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_reassembles_to_the_whole_answer(client, http):
    msgs = [{"role": "user", "content": QUESTION}]
    whole = ask(client, messages=msgs)
    chunks = list(ask(client, messages=msgs, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1, "one id for every chunk"
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content_chunks[1:])
    assert content_chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # Raw framing: `data: {json}\n\n` ... `data: [DONE]\n\n`; no usage chunk unless asked.
    events = sse_events(http, "/v1/chat/completions",
                        {"model": "m", "messages": msgs, "temperature": 0, "stream": True})
    parsed = [json.loads(e) for e in events]
    assert all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert all(p["choices"] for p in parsed) and all("usage" not in p for p in parsed)
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parsed) == whole.choices[0].message.content


def test_streamed_utf8_is_whole_characters(client):
    # A prompt that makes the model write non-ASCII text; every delta must be complete characters.
    prompt = "Les mots français avec accents: café, élève, très, à, où, "
    whole = complete(client, prompt=prompt, max_tokens=24)
    chunks = list(complete(client, prompt=prompt, max_tokens=24, stream=True))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in whole.choices[0].text
    assert "".join(deltas) == whole.choices[0].text


# ---------------------------------------------------------------- stop strings, max_tokens, usage


PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def test_stop_strings_never_leak(client):
    base = complete(client, prompt=PROMPT, max_tokens=24, stop=None).choices[0].text
    assert len(base) > 12, base
    # A stop string from the middle of the greedy text (likely spanning a token boundary) and a
    # one-character one; the answer must end right before the first occurrence.
    for stop in [base[5:10], base[len(base) // 2], [base[8:11], "zzzz"]]:
        first = min(base.find(s) for s in ([stop] if isinstance(stop, str) else stop) if s in base)
        expect = base[:first]
        r = complete(client, prompt=PROMPT, max_tokens=24, stop=stop)
        assert r.choices[0].text == expect, (stop, base)
        assert r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in complete(client, prompt=PROMPT, max_tokens=24, stop=stop, stream=True)
                           if c.choices)
        assert streamed == expect, (stop, base)


def test_stop_in_chat_stream(client):
    msgs = [{"role": "user", "content": QUESTION}]
    whole = ask(client, messages=msgs).choices[0].message.content
    assert " is " in whole
    chunks = list(ask(client, messages=msgs, stop=" is", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole[:whole.find(" is")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_gives_length_and_exact_usage(client, http):
    r = complete(client, prompt=PROMPT, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.usage.prompt_tokens == len(tokenize(http, PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3
    r = ask(client, messages=[{"role": "user", "content": QUESTION}], max_completion_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_prompt_as_token_ids_equals_text(client, http):
    ids = tokenize(http, PROMPT)
    a = complete(client, prompt=PROMPT, max_tokens=6).choices[0].text
    b = complete(client, prompt=ids, max_tokens=6).choices[0].text
    assert a == b


def test_n_choices(client):
    r = ask(client, messages=[{"role": "user", "content": QUESTION}], n=2, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: identical


# ---------------------------------------------------------------- logprobs, seeds


def test_chat_logprobs(client):
    r = ask(client, messages=[{"role": "user", "content": QUESTION}], logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or len(content) == r.usage.completion_tokens - 1
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy picks the most likely token: it is the first alternative.
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_completion_logprobs(client):
    r = complete(client, prompt=PROMPT, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0


def test_seed_determinism(client):
    kw = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=1.0)
    a = complete(client, seed=42, **kw).choices[0].text
    b = complete(client, seed=42, **kw).choices[0].text
    assert a == b
    others = {complete(client, seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should not all give the same sample"


# ---------------------------------------------------------------- logit_bias


def single_token(http, text):
    ids = tokenize(http, text)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens: {ids}"
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    return ids[0]


def served_vocab(server):
    m = re.search(r"vocab (\d+)", server.log())
    assert m, server.log()
    return int(m.group(1))


def test_logit_bias_plus_100_forces_the_token(client, http):
    banana = single_token(http, " banana")
    messages = [{"role": "user", "content": QUESTION}]
    plain = ask(client, messages=messages, max_tokens=1, logprobs=True)
    assert plain.choices[0].logprobs.content[0].token != " banana"
    bias = {str(banana): 100}
    # chat, greedy, whole answer: every token is " banana", with the logprob of the biased logits (~0)
    r = ask(client, messages=messages, max_tokens=3, logprobs=True, top_logprobs=2, logit_bias=bias)
    first = r.choices[0].logprobs.content[0]
    assert first.token == " banana", r.choices[0].message.content
    assert first.top_logprobs[0].token == " banana"
    assert -1e-3 < first.logprob <= 0, first.logprob
    assert r.choices[0].message.content == " banana" * 3
    # completions, seeded sampling at temperature 1, streamed
    stream = complete(client, prompt=PROMPT, max_tokens=2, temperature=1.0, seed=9, logit_bias=bias, stream=True)
    assert "".join(c.choices[0].text for c in stream) == " banana" * 2


def test_logit_bias_minus_100_bans_the_greedy_token(client, http):
    kw = dict(messages=[{"role": "user", "content": QUESTION}], max_tokens=1, logprobs=True, top_logprobs=5)
    plain = ask(client, **kw).choices[0].logprobs.content[0]
    banned = single_token(http, plain.token)
    r = ask(client, logit_bias={str(banned): -100}, **kw)
    got = r.choices[0].logprobs.content[0]
    assert got.token != plain.token
    assert plain.token not in [t.token for t in got.top_logprobs]
    # greedy on the biased logits: the unbiased runner-up, its logprob renormalised without the banned
    # token (log p2 - log(1 - p1), up to e^-100)
    second = plain.top_logprobs[1]
    assert got.token == second.token
    want = second.logprob - math.log1p(-math.exp(plain.top_logprobs[0].logprob))
    assert abs(got.logprob - want) < 1e-3, (got.logprob, want)
    # the same ban, streamed
    kw.pop("logprobs"), kw.pop("top_logprobs")
    stream = ask(client, logit_bias={str(banned): -100}, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == second.token


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("bias, says", [
    ({"abc": 1}, "'abc'"), ("VOCAB", "outside the vocabulary"), ({"1": 1000}, "1000"),
    ({"1": -100.5}, "-100.5"),
])
def test_bad_logit_bias_is_400_naming_it(server, client, endpoint, bias, says):
    if bias == "VOCAB":
        bias = {str(served_vocab(server)): 1}
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            ask(client, messages=[{"role": "user", "content": "hi"}], max_tokens=1, logit_bias=bias)
        else:
            complete(client, prompt="hi", max_tokens=1, logit_bias=bias)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error"
    assert "logit_bias" in err["message"] and says in err["message"], err["message"]


def test_logit_bias_null_or_empty_is_no_bias(client):
    kw = dict(prompt=PROMPT, max_tokens=4)
    want = complete(client, **kw).choices[0].text
    assert complete(client, logit_bias={}, **kw).choices[0].text == want
    assert complete(client, logit_bias=None, **kw).choices[0].text == want


# ---------------------------------------------------------------- errors


def test_too_long_prompt_is_400_with_both_counts(client, http):
    text = "hello " * (CTX_SIZE + 50)
    n = len(tokenize(http, text))
    assert n > CTX_SIZE
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt=text, max_tokens=1)
    assert e.value.status_code == 400
    msg = e.value.body["message"]
    assert str(n) in msg and str(CTX_SIZE) in msg, msg
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("bad", [
    {"temperature": 5}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0}, {"temperature": "hot"},
    {"top_logprobs": 50, "logprobs": True}, {"stop": [""]}, {"messages": "hi"}, {"messages": []},
])
def test_bad_params_are_400_in_the_envelope(http, bad):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(bad)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError):
        ask(client, messages=[{"role": "user", "content": "hi"}], temperature=3)


def test_api_key_required(server, client):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    code = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-d", "{}",
                           server.base + "/v1/chat/completions"], capture_output=True, text=True).stdout
    assert code == "401"


def test_unknown_route_is_404_and_wrong_method_405_in_the_envelope(http):
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ---------------------------------------------------------------- concurrency, disconnect


def test_concurrent_requests_all_answered(client):
    countries = ["France", "Germany", "Italy", "Spain", "Japan", "Canada"]  # more than --parallel

    def one(c):
        r = ask(client, messages=[{"role": "user", "content": f"What is the capital of {c}?"}], max_tokens=12)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(countries)) as ex:
        results = list(ex.map(one, countries))
    assert len(results) == len(countries)
    for text, finish in results:
        assert text and finish in ("stop", "length")


def metric(http, name):
    text = http.get("/metrics").text
    line = [l for l in text.splitlines() if l.startswith(name)][0]
    return float(line.split()[-1])


def test_prefix_cache_reuses_the_prompt_and_answers_alike(client, http):
    # The same greedy chat request twice: the second one finds its prompt's full KV blocks of 16
    # tokens (all but the last token's block, when the prompt ends a block) registered by the first
    # (prefix caching, on by default) and answers word for word alike.
    msgs = [{"role": "user", "content": "Describe the water cycle in two sentences. " * 3}]
    first = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=12)
    hits = metric(http, "vllm:prefix_cache_hits_total")
    second = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=12)
    p = first.usage.prompt_tokens
    assert p > 32
    assert metric(http, "vllm:prefix_cache_hits_total") - hits == (p - 1) // 16 * 16
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens == first.usage.prompt_tokens


def running(http):
    return metric(http, "vllm:num_requests_running")


def test_client_disconnect_stops_generation(server, http, client):
    # 900 tokens take seconds on the CPU; the client leaves after 3. The generation counter, not a gauge
    # sampled at one instant (racy on a loaded machine), proves the generation stopped early.
    max_tokens = 900
    generated_before = metric(http, "vllm:generation_tokens_total")
    body = {"model": "m", "prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got >= 3:
                    break
        # leaving the block closes the connection mid-stream
    deadline = time.time() + 20
    while running(http) > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert running(http) == 0, "the abandoned generation is still running"
    generated = metric(http, "vllm:generation_tokens_total") - generated_before
    assert 3 <= generated < max_tokens, f"{generated} tokens generated for a client that left after 3"
    assert server.alive()
    r = ask(client, messages=[{"role": "user", "content": QUESTION}])
    assert "Paris" in r.choices[0].message.content


def test_non_streaming_client_disconnect_stops_generation(server, http, client):
    body = {"model": "m", "prompt": "Count: 1, 2, 3,", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=2.0)
    deadline = time.time() + 20
    while running(http) > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert running(http) == 0, "the abandoned generation is still running"
    assert complete(client, prompt=PROMPT, max_tokens=2).choices[0].text


def test_streamed_n2_and_logprobs(http):
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "n": 2,
            "max_tokens": 6, "stream": True, "logprobs": True, "top_logprobs": 2}
    parsed = [json.loads(e) for e in sse_events(http, "/v1/chat/completions", body)]
    for i in (0, 1):
        mine = [p["choices"][0] for p in parsed if p["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        toks = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert len(toks) == 6 and all(len(t["top_logprobs"]) == 2 for t in toks)
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == "".join(t["token"] for t in toks)
