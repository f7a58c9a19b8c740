"""The API details a new user hits, each tried as that user would: a finish on a stop string is a
`stop` in /metrics (not an abort); `usage.prompt_tokens_details.cached_tokens` when the prefix
cache served part of the prompt; CORS with its preflight; SSE keep-alive comments during a long
prefill; several API keys and a key file; one log line per request, as JSON with --log-format json.
"""

import json
import subprocess
import time

import httpx
import pytest

from conftest import model_path, server_binary, start_server, stop_server


def success(http, reason):
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no request_success_total for {reason}")


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_a_stop_string_finish_counts_as_stop_not_abort(client, http):
    stops, aborts = success(http, "stop"), success(http, "abort")
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=40,
                                       stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    # the engine notices the dropped sequence on its next iteration
    for _ in range(50):
        if success(http, "stop") == stops + 1:
            break
        time.sleep(0.05)
    assert success(http, "stop") == stops + 1
    assert success(http, "abort") == aborts


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    msgs = [{"role": "user", "content": "List three rivers of Europe and one fact about each. " * 3}]
    first = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=4)
    second = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=4)
    p = first.usage.prompt_tokens
    assert p > 32
    assert second.usage.prompt_tokens_details.cached_tokens == (p - 1) // 16 * 16
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    d = tmp_path_factory.mktemp("web")
    keys = d / "keys.txt"
    keys.write_text("# the team's keys\nkey-from-file\n\n")
    log = d / "log"
    s = start_server(log, ["--ctx-size", "2048", "--parallel", "2", "--cors-origins", ORIGIN,
                           "--api-key", "key-a,key-b", "--api-key-file", str(keys),
                           "--sse-keepalive", "1", "--log-format", "json"])
    try:
        yield s, log
    finally:
        stop_server(s.proc)


def test_cors_preflight_and_allowed_origins(web):
    s, _ = web
    pre = httpx.options(s.base + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204, pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.get(s.base + "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer key-a"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(s.base + "/v1/models", headers={"Origin": "http://evil.example",
                                                      "Authorization": "Bearer key-a"})
    assert "access-control-allow-origin" not in other.headers


def test_several_api_keys_and_a_key_file(web):
    s, _ = web
    for key, code in [("key-a", 200), ("key-b", 200), ("key-from-file", 200), ("key-c", 401), ("key-a,key-b", 401)]:
        r = httpx.get(s.base + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == code, (key, r.status_code)


def test_a_key_file_without_keys_is_refused_at_start(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("# nothing\n")
    out = subprocess.run([server_binary(), "--model", model_path(), "--api-key-file", str(f), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds no key" in out.stderr, out.stderr


def test_keepalive_comments_during_a_long_prefill(web):
    s, _ = web
    # ~1,500 prompt tokens take seconds to prefill on the CPU; the stream sends `: keep-alive`
    # each second of silence before its first token
    body = {"model": "m", "messages": [{"role": "user", "content": "one two three four five " * 300}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", s.base + "/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": "Bearer key-b"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
    def has_text(l):
        if not l.startswith("data: {"):
            return False
        return any(c.get("delta", {}).get("content") for c in json.loads(l[6:]).get("choices", []))

    first_data = next((i for i, l in enumerate(lines) if has_text(l)), None)
    assert first_data is not None, lines
    assert ": keep-alive" in lines[:first_data], lines[:10]
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines


def test_one_json_log_line_per_request(web):
    s, log = web
    r = httpx.post(s.base + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                   json={"model": "m", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    rid = r.json()["id"]
    for _ in range(50):
        entries = [json.loads(l) for l in open(log) if l.startswith('{"') and '"event":"request"' in l]
        mine = [e for e in entries if e["id"] == rid]
        if mine:
            break
        time.sleep(0.05)
    assert len(mine) == 1, entries
    e = mine[0]
    assert e["kind"] == "completion" and e["outcome"] == "ok"
    assert e["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert e["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert e["finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert 0 < e["ttft_s"] <= e["duration_s"]


def test_a_small_step_budget_prefills_in_pieces_with_the_same_answers(client, server, tmp_path):
    """--max-num-batched-tokens 48 --long-prefill-token-threshold 24: a 300-token prompt is
    prefilled 24 tokens a step between another request's decode steps; both answers equal the
    default server's (the CPU backend's rows do not depend on how tokens are grouped into
    steps). Without the threshold a prompt takes the backend's chunk (the CPU's 256)."""
    import concurrent.futures

    s = start_server(tmp_path / "log", ["--ctx-size", "1024", "--parallel", "2", "--api-key", "k",
                                        "--max-num-batched-tokens", "48",
                                        "--long-prefill-token-threshold", "24"])
    try:
        assert ("scheduler: up to 48 tokens a step (decodes first, then prompt chunks of up to 24 "
                "a request)") in s.log()
        # the default server: the CPU backend's own chunk (BackendInfo::prefill_chunk)
        assert "prompt chunks of up to 256 a request" in server.log()
        small = s.openai(api_key="k")
        long_prompt = "Summarise: " + " ".join(f"item {i} is blue;" for i in range(60))
        asks = [("Count from one to twenty.", 60), (long_prompt, 16)]

        def ask(c, p, n):
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": p}],
                                          max_tokens=n, temperature=0)
            return r.choices[0].message.content, r.usage.prompt_tokens

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(lambda a: ask(small, *a), asks))
        want = [ask(client, *a) for a in asks]
        assert got == want
        assert want[1][1] > 200
    finally:
        stop_server(s.proc)
