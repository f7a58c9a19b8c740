#!/usr/bin/env python3
"""The serving check on the GPU machine: start the h200 metrale-server binary, time process start
to /health 200 and to the first streamed token of a chat request, check that the greedy answer to
the reference question (docs/facts.md) names Paris, then stop the server. Standard library only (the device machine
has no network to install anything).

Usage: serve_check.py SERVER_BINARY MODEL.gguf [PORT]   (prints one JSON line last; exit 1 on failure)
"""
import json
import subprocess
import sys
import time
import urllib.request

server, model = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if len(sys.argv) > 3 else 8090
base = f"http://127.0.0.1:{port}"
t0 = time.monotonic()
proc = subprocess.Popen([server, "--model", model, "--port", str(port), "--parallel", "8", "--ctx-size", "4096"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
result = {"ok": False}
try:
    ready = None
    while time.monotonic() - t0 < 60:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    ready = time.monotonic() - t0
                    break
        except Exception:
            pass
        time.sleep(0.02)
    if ready is None:
        raise SystemExit("server not ready after 60 s")
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        "temperature": 0,
        "max_tokens": 32,
        "stream": True,
    }
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t_req = time.monotonic()
    first = None
    text = ""
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                if first is None:
                    first = time.monotonic()
                text += delta
    # a second, non-streaming request: warm latency
    body2 = dict(body, stream=False)
    t2 = time.monotonic()
    with urllib.request.urlopen(urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body2).encode(),
                                                       headers={"Content-Type": "application/json"}), timeout=60) as r:
        answer2 = json.loads(r.read())["choices"][0]["message"]["content"]
    warm_ms = (time.monotonic() - t2) * 1e3
    result = {
        "ok": "Paris" in text and answer2 == text,
        "answer": text,
        "process_start_to_ready_s": round(ready, 3),
        "process_start_to_first_token_s": round(first - t0, 3) if first else None,
        "request_to_first_token_ms": round((first - t_req) * 1e3, 2) if first else None,
        "warm_request_ms_32_tokens": round(warm_ms, 2),
    }
finally:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    print(out[-3000:])
    print(json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
