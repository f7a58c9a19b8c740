"""The server under abuse: bounded work, a drain with a deadline, slow and stalled clients, the
connection cap, admission control and a memory limit. Each test starts its own server (the real
binary, the real model) with the flags it needs, and drives it with real sockets and clients.

Timing bounds are stated where they are asserted: /health must answer within 100 ms while other
clients load the server (the product's promise); the other waits are generous multiples of the
timeouts the tests set.
"""

import json
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import model_path, server_binary, start_server, stop_server

HEALTH_BUDGET_S = 0.100


def chat_body(content="What is the capital of France?", **kw):
    return {"messages": [{"role": "user", "content": content}], **kw}


def health_latencies(base, n, gap=0.05):
    """Time n GET /health, each on a fresh connection, with curl in a process of its own (this
    process's client threads would otherwise add their own waits for Python's lock)."""
    out = []
    for _ in range(n):
        r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
                            base + "/health"], capture_output=True, text=True, timeout=30)
        code, t = r.stdout.split()
        assert code == "200", r.stdout
        out.append(float(t))
        time.sleep(gap)
    return out


def sse_lines(resp):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def metric_value(base, name, label=None):
    text = httpx.get(base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name) and (label is None or label in line):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label or ''} not in /metrics:\n{text}")


def wait_running(base, n, timeout=60):
    """Wait until the engine runs n sequences (both requests of a test are in flight)."""
    deadline = time.time() + timeout
    while metric_value(base, "vllm:num_requests_running") < n:
        assert time.time() < deadline, f"{n} requests never ran at once"
        time.sleep(0.01)


def raw_request(port, data: bytes, read_timeout=10.0) -> bytes:
    """Send raw bytes, read until the server closes or read_timeout passes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(read_timeout)
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        except socket.timeout:
            pass
        return b"".join(chunks)


def envelope(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.decode(), json.loads(body)


# --- bounded work -----------------------------------------------------------------------------


def test_health_answers_within_100ms_while_heavy_requests_run(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "8192", "--parallel", "2"])
    try:
        # Each /tokenize of digits near the byte cap costs ~1 s of CPU on the preprocessing pool;
        # the chats carry the longest stop strings allowed.
        cap = 8192 * 81
        heavy = {"content": "7" * (cap - 100)}
        stops = ["x" * 256] * 16

        def tokenize():
            return httpx.post(s.base + "/tokenize", json=heavy, timeout=120).status_code

        def chat():
            return httpx.post(s.base + "/v1/chat/completions", timeout=120,
                              json=chat_body(max_tokens=32, stop=stops)).status_code

        with ThreadPoolExecutor(12) as ex:
            futs = [ex.submit(tokenize) for _ in range(6)] + [ex.submit(chat) for _ in range(6)]
            time.sleep(0.3)
            lat = health_latencies(s.base, 20)
            codes = [f.result() for f in futs]
        assert all(c == 200 for c in codes), codes
        assert max(lat) < HEALTH_BUDGET_S, f"/health latencies (s): {sorted(lat)}"
    finally:
        stop_server(s.proc)


def test_oversized_prompts_are_refused_before_tokenizing(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "1024"])
    try:
        big = "1" * (15 << 20)
        t = time.perf_counter()
        r = httpx.post(s.base + "/v1/chat/completions", json=chat_body(big), timeout=60)
        elapsed = time.perf_counter() - t
        e = r.json()["error"]
        assert r.status_code == 400 and e["code"] == "context_length_exceeded", r.text
        assert "bytes" in e["message"] and "1024 tokens" in e["message"], e
        # Tokenizing 15 MiB takes over a minute; refusing from the length takes well under a second.
        assert elapsed < 2.0, elapsed
        r = httpx.post(s.base + "/tokenize", json={"content": big}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text
        r = httpx.post(s.base + "/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    finally:
        stop_server(s.proc)


RUNAWAY = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
CUBIC = ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}"
         "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_runaway_chat_template_fails_at_start_naming_the_limit(tmp_path):
    t = tmp_path / "runaway.jinja"
    t.write_text(RUNAWAY)
    from conftest import model_path, server_binary
    r = subprocess.run([server_binary(), "--model", model_path(), "--port", "0", "--chat-template", str(t)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "instructions" in r.stderr and "--chat-template" in r.stderr, r.stderr


def test_costly_template_is_stopped_per_request_and_health_stays_up(tmp_path):
    t = tmp_path / "cubic.jinja"
    t.write_text(CUBIC)
    s = start_server(tmp_path / "log", ["--ctx-size", "1024", "--chat-template", str(t)])
    try:
        msgs = [{"role": "user", "content": "a"}] * 1000  # 10^9 loop iterations unbounded
        t0 = time.perf_counter()
        r = httpx.post(s.base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}, timeout=120)
        assert r.status_code == 400 and "instructions" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < 30
        assert max(health_latencies(s.base, 5)) < HEALTH_BUDGET_S
        # The same template answers a small conversation.
        r = httpx.post(s.base + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=60)
        assert r.status_code == 200, r.text
    finally:
        stop_server(s.proc)


# --- graceful drain ---------------------------------------------------------------------------


class InFlight:
    """One streamed and one whole completion of `max_tokens` each, running in threads until both
    run in the engine at once: what a drain has to deal with."""

    def __init__(self, base, max_tokens):
        self.events = []
        self.whole = {}

        def stream():
            with httpx.stream("POST", base + "/v1/completions", timeout=120,
                              json={"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                                    "stream": True}) as r:
                for d in sse_lines(r):
                    self.events.append(d)

        def whole_request():
            r = httpx.post(base + "/v1/completions", timeout=120,
                           json={"prompt": "One, two,", "max_tokens": max_tokens, "ignore_eos": True})
            self.whole["status"] = r.status_code
            self.whole["body"] = r.json()

        self.threads = [threading.Thread(target=stream), threading.Thread(target=whole_request)]
        for th in self.threads:
            th.start()
        wait_running(base, 2)

    def join(self, timeout):
        for th in self.threads:
            th.join(timeout)


def test_drain_lets_streams_finish_then_exits_0(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "1024", "--shutdown-timeout", "60"])
    running = InFlight(s.base, 48)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # No new connections once draining.
    with pytest.raises(httpx.TransportError):
        httpx.get(s.base + "/health", timeout=2)
    running.join(120)
    events, whole = running.events, running.whole
    assert s.proc.wait(timeout=60) == 0, s.log()
    assert events[-1] == "[DONE]", events[-3:]
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length", finish[-3:]
    assert whole["status"] == 200 and whole["body"]["usage"]["completion_tokens"] == 48, whole
    assert "drained" in s.log()


def test_drain_deadline_ends_requests_with_an_error_and_done(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "4096", "--parallel", "2", "--shutdown-timeout", "1"])
    running = InFlight(s.base, 4000)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    running.join(60)
    events, whole = running.events, running.whole
    code = s.proc.wait(timeout=60)
    assert code != 0, s.log()
    assert time.time() - t0 < 10
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert "shut down" in err["message"] and err["type"] == "service_unavailable_error", err
    assert whole["status"] == 503 and "shut down" in whole["body"]["error"]["message"], whole
    assert "drain did not finish" in s.log(), s.log()


def test_sighup_does_not_stop_the_server(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "512"])
    try:
        s.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert s.alive()
        assert httpx.get(s.base + "/health", timeout=5).status_code == 200
        assert "SIGHUP" in s.log()
    finally:
        stop_server(s.proc)


# --- slow, stalled and too many clients -------------------------------------------------------


def test_a_thousand_stalled_sockets_do_not_stop_health(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"the open-file hard limit ({hard}) is too low to hold 1000 sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    s = start_server(tmp_path / "log", ["--ctx-size", "512", "--client-timeout", "8"])
    socks = []
    try:
        for _ in range(1000):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
            socks.append(c)
        deadline = time.time() + 10  # the accept loop catches up with the kernel's backlog
        while metric_value(s.base, "metrale:open_connections") < 1000:
            assert time.time() < deadline, metric_value(s.base, "metrale:open_connections")
            time.sleep(0.05)
        t_end = time.time() + 2
        lat = []
        while time.time() < t_end:  # a byte a second from each, while /health is timed
            for c in socks:
                try:
                    c.sendall(b"X")
                except OSError:
                    pass
            lat += health_latencies(s.base, 5, gap=0.01)
        assert max(lat) < HEALTH_BUDGET_S, f"/health latencies (s): {sorted(lat)[-5:]}"
        # The header timeout (8 s from connecting) closes them all.
        deadline = time.time() + 20
        while time.time() < deadline and metric_value(s.base, "metrale:open_connections") > 5:
            time.sleep(0.2)
        assert metric_value(s.base, "metrale:open_connections") <= 5
    finally:
        for c in socks:
            c.close()
        stop_server(s.proc)


def test_connection_cap_is_a_503_in_the_envelope(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "512", "--max-connections", "4"])
    idle = []
    try:
        # Four idle connections held open, then a fifth must get the 503. The server counts a
        # connection when its accept loop takes it, and on a busy 2-core machine the start-up's
        # /health checks can still count as open when the idle ones arrive (their close not yet
        # taken in): the server then refuses some of these (a 503 and a close, as it should), and
        # once the checks' closes are in it holds fewer than four. So each round replaces any idle
        # connection that heard back, then asks (at most 10 s).
        deadline = time.time() + 10
        while True:
            held = []
            for c in idle:
                try:
                    c.recv(1)  # data or EOF: the server refused it
                except BlockingIOError:
                    held.append(c)  # silent: held open
                    continue
                except OSError:
                    pass  # reset: refused too
                c.close()
            idle = held
            while len(idle) < 4:
                c = socket.create_connection(("127.0.0.1", s.port))
                c.setblocking(False)
                idle.append(c)
            time.sleep(0.2)
            raw = raw_request(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, body = envelope(raw)
            if head.startswith("HTTP/1.1 503") or time.time() > deadline:
                break
        assert head.startswith("HTTP/1.1 503"), head
        assert "retry-after: 1" in head.lower(), head
        assert "--max-connections" in body["error"]["message"], body
    finally:
        for c in idle:
            c.close()
    time.sleep(0.3)
    try:
        assert metric_value(s.base, "metrale:requests_rejected_total", 'reason="max_connections"') >= 1
    finally:
        stop_server(s.proc)


def test_slow_body_is_a_408_and_malformed_chunks_a_400(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "512", "--client-timeout", "2"])
    try:
        t = time.time()
        raw = raw_request(s.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"content\":", read_timeout=10)
        head, body = envelope(raw)
        assert head.startswith("HTTP/1.1 408"), head
        assert body["error"]["code"] == "body_timeout" and "--client-timeout" in body["error"]["message"]
        assert time.time() - t < 8
        raw = raw_request(s.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n")
        head, body = envelope(raw)
        assert head.startswith("HTTP/1.1 400"), head
        assert "chunked" in body["error"]["message"], body
        raw = raw_request(s.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 17\r\n\r\n{\"content\":\"a\"} x")
        head, body = envelope(raw)
        assert head.startswith("HTTP/1.1 400") and "after its JSON" in body["error"]["message"], raw
        assert metric_value(s.base, "metrale:requests_rejected_total", 'reason="body_timeout"') == 1
    finally:
        stop_server(s.proc)


# --- admission control ------------------------------------------------------------------------


def test_a_burst_past_the_queue_gets_429_with_retry_after(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "512", "--parallel", "1", "--max-queue", "4"])
    try:
        def one(i):
            r = httpx.post(s.base + "/v1/completions", timeout=300,
                           json={"prompt": f"Count: {i}", "max_tokens": 16, "ignore_eos": True})
            return r.status_code, r.headers.get("retry-after"), r.json()

        seen = []
        done = threading.Event()

        def watch():  # the queue as /metrics reports it, while the burst runs
            while not done.is_set():
                seen.append((metric_value(s.base, "metrale:requests_queued"),
                             metric_value(s.base, "vllm:num_requests_waiting")))
                time.sleep(0.02)

        w = threading.Thread(target=watch)
        w.start()
        with ThreadPoolExecutor(200) as ex:
            results = list(ex.map(one, range(400)))
        done.set()
        w.join()
        assert seen and max(max(q, e) for q, e in seen) <= 4, f"queue over --max-queue: {max(seen)}"
        codes = [c for c, _, _ in results]
        assert set(codes) <= {200, 429}, sorted(set(codes))
        refused = [(h, b) for c, h, b in results if c == 429]
        assert refused and codes.count(200) >= 4, (codes.count(200), len(refused))
        for h, b in refused:
            assert h == "1" and b["error"]["code"] == "queue_full" and b["error"]["type"] == "rate_limit_error", b
        assert metric_value(s.base, "metrale:requests_rejected_total", 'reason="queue_full"') == len(refused)
        assert httpx.get(s.base + "/health", timeout=5).status_code == 200
    finally:
        stop_server(s.proc)


def test_openai_client_retries_a_429(tmp_path):
    s = start_server(tmp_path / "log", ["--ctx-size", "512", "--parallel", "1", "--max-queue", "1"])
    try:
        c = s.openai(api_key="x", timeout=120, max_retries=8)
        with ThreadPoolExecutor(6) as ex:
            outs = list(ex.map(lambda i: c.completions.create(model="m", prompt=f"{i}", max_tokens=8), range(6)))
        assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)
    finally:
        stop_server(s.proc)


# --- memory -----------------------------------------------------------------------------------


def vm_size(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def test_worst_case_requests_under_an_address_space_limit_do_not_abort(tmp_path):
    args = ["--ctx-size", "8192", "--parallel", "2", "--max-connections", "64"]
    # The server's address space when ready, unlimited; then the limit is that plus 664 MiB, room
    # for one of these requests' worst cases (each reserves ~410 MiB) but not for the two that the
    # two preprocessing threads would run at once (~360 MiB each) without the budget. The server
    # keeps 133 MiB of headroom here, and its address space when ready may hold one more glibc
    # malloc arena (64 MiB) than the probe's did: its budget is then 467 or 403 MiB at 600 (a run
    # of CI measured 403, under the 407 MiB one request needs), 531 or 467 at 664.
    probe = start_server(tmp_path / "probe.log", args)
    base_vm = vm_size(probe.proc.pid)
    stop_server(probe.proc)
    limit = base_vm + (664 << 20)

    def cap_as():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    s = start_server(tmp_path / "log", args, preexec_fn=cap_as)
    try:
        assert "RLIMIT_AS" in s.log(), s.log()
        cap = 8192 * 81
        digits = "7" * (cap - 2000)
        first_tries = []

        def with_retries(path, body):
            # As a well-made client does: on 429, wait Retry-After and try again.
            for attempt in range(120):
                r = httpx.post(s.base + path, json=body, timeout=300)
                if attempt == 0:
                    first_tries.append(r.status_code)
                if r.status_code != 429:
                    return r
                e = r.json()["error"]
                assert e["code"] == "memory_busy" and "RLIMIT_AS" in e["message"], e
                time.sleep(float(r.headers["retry-after"]))
            raise AssertionError(f"{path}: still 429 after 120 tries")

        jobs = [("/tokenize", {"content": digits}), ("/v1/chat/completions", chat_body(digits, max_tokens=1))] * 4
        jobs += [("/v1/chat/completions", chat_body("x" * (15 << 20)))] * 2
        with ThreadPoolExecutor(len(jobs)) as ex:
            rs = list(ex.map(lambda j: with_retries(*j), jobs))
        codes = [r.status_code for r in rs]
        assert s.alive(), s.log()
        # Every cap-size request is served in the end: /tokenize answers, the chats are tokenized in
        # full and then refused for their token count; the 15 MiB ones are refused by their length.
        assert codes == [200, 400] * 4 + [400] * 2, (codes, [r.text[:200] for r in rs])
        assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in rs if r.status_code == 400)
        assert first_tries.count(429) >= 1, f"every request fit at once, so the limit tested nothing: {first_tries}"
        assert httpx.get(s.base + "/health", timeout=5).status_code == 200
    finally:
        stop_server(s.proc)


def test_a_kv_pool_short_of_the_load_preempts_and_answers_everyone(tmp_path):
    # 8 slots but a KV pool of 256 tokens (one sequence of the 256-token context): 16 concurrent
    # greedy chats of ~40 prompt + 120 generated tokens need ~10x the pool. Every one is answered
    # 200 with what it answers alone; the engine preempts (recomputes) instead of failing.
    s = start_server(tmp_path / "log", ["--ctx-size", "256", "--parallel", "8", "--kv-cache-tokens", "256"])
    try:
        log = open(tmp_path / "log").read()
        assert "KV cache: 16 blocks of 16 tokens = 256 tokens" in log, log
        assert "holds 1 sequences at the full context of 256 tokens" in log, log

        def chat(i):
            body = chat_body(f"Count from {i} to {i + 40}, one number per line.", max_tokens=120,
                             temperature=0, ignore_eos=True)
            r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=600)
            return r.status_code, r.json()

        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(chat, range(16)))
        assert all(code == 200 for code, _ in results), [r for r in results if r[0] != 200][:2]
        assert metric_value(s.base, "vllm:num_preemptions_total") > 0
        # what request 3 answers alone, with the pool all to itself
        code, alone = chat(3)
        assert code == 200
        assert alone["choices"][0]["message"]["content"] == results[3][1]["choices"][0]["message"]["content"]
        assert metric_value(s.base, "vllm:kv_cache_usage_perc") == 0.0
    finally:
        stop_server(s.proc)


def test_a_kv_pool_smaller_than_one_context_is_refused_at_start(tmp_path):
    out = subprocess.run(
        [server_binary(), "--model", model_path(),
         "--ctx-size", "512", "--kv-cache-tokens", "100", "--port", "0"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-cache-tokens 100 cannot hold one sequence of the context (512 tokens)" in out.stderr, out.stderr


def test_the_load_script_counts_every_outcome(tmp_path):
    # bench/load/load.py (the GPU machine's 256/512-stream check) against a small pool: all 8 finish.
    s = start_server(tmp_path / "log", ["--ctx-size", "256", "--parallel", "4", "--kv-cache-tokens", "512"])
    try:
        out = tmp_path / "load.json"
        script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "load", "load.py")
        p = subprocess.run(["python3", script, "--base", s.base, "--streams", "8", "--prompt-words", "40",
                            "--max-tokens", "16", "--expect-all-ok", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        r = json.loads(out.read_text())
        assert r["outcomes"] == {"ok": 8} and r["health_after"] == 200, r
        assert r["output_tok_s"] > 0
    finally:
        stop_server(s.proc)


def run_serve_py(*args):
    """bench/serve/serve.py with these arguments; it must exit 0."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "serve", "serve.py")
    p = subprocess.run(["python3", script, *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_serving_benchmark_reports_what_users_see(tmp_path):
    # bench/serve/serve.py (the GPU machine's rate sweep against llama-server) on a small server: a
    # Poisson rate, all at once and a fixed concurrency; every request generates exactly its drawn
    # output length (ignore_eos), and the latencies and goodput are consistent.
    s = start_server(tmp_path / "log", ["--ctx-size", "256", "--parallel", "4"])
    try:
        out = tmp_path / "serve.json"
        run_serve_py("--base", s.base, "--num-prompts", "6", "--rates", "4,inf", "--concurrency", "3",
                     "--prompt-median", "20", "--output-median", "8", "--max-prompt", "64",
                     "--max-output", "16", "--label", "test", "--out", str(out))
        r = json.loads(out.read_text())
        assert [x["rate"] for x in r["runs"]] == [4.0, "inf", None] and r["runs"][2]["concurrency"] == 3
        for x in r["runs"]:
            assert x["completed"] == 6 and x["failed"] == 0, x
            assert x["output_tokens"] == x["drawn_output_tokens"] > 0, x
            assert x["prompt_tokens"] > 6 * 4, x
            assert 0 < x["ttft_ms_p50"] <= x["ttft_ms_p99"] and 0 < x["itl_ms_p50"] <= x["itl_ms_p99"], x
            assert 0 <= x["goodput_req_s"] <= x["request_rate"], x
        assert r["max_rate_meeting_slo"] in (None, r["runs"][0]["request_rate"])
    finally:
        stop_server(s.proc)


def test_the_serving_benchmark_measures_a_long_prompt_among_streams(tmp_path):
    # serve.py --long-prompt: the streams' inter-token gaps before a long prompt arrives and while it
    # is prefilled, split by its arrival and its first token; its TTFT and token count from the
    # server; every stream finished.
    s = start_server(tmp_path / "log", ["--ctx-size", "1024", "--parallel", "4"])
    try:
        out = tmp_path / "among.json"
        run_serve_py("--base", s.base, "--long-prompt", "300", "--among", "3", "--among-output", "128",
                     "--settle", "0.3", "--warmup", "1", "--label", "test", "--out", str(out))
        r = json.loads(out.read_text())
        assert r["streams"] == 3 and r["streams_completed"] == 3 and r["streams_failed"] == 0, r
        assert r["long_ok"] and r["long_prompt_tokens"] > 300 and r["long_ttft_ms"] > 0, r
        assert r["baseline_gaps"] > 0 and r["during_gaps"] > 0, r
        assert 0 < r["itl_ms_p50_baseline"] <= r["itl_ms_p99_baseline"], r
        assert 0 < r["itl_ms_p50_during"] <= r["itl_ms_p99_during"], r
        assert r["itl_p99_ratio"] == r["itl_ms_p99_during"] / r["itl_ms_p99_baseline"], r
        assert r["streams_done_before_long_first_token"] == 0, r
    finally:
        stop_server(s.proc)
