"""Many streaming chat requests at once against a running metrale-server: every request must end
as a finished answer, or be refused cleanly (429 or 503 in the OpenAI error envelope); anything else
(a connection reset, a 5xx without the envelope, a stream that stops without [DONE]) is a failure.
The server must answer /health afterwards. Writes one JSON with the outcome counts, the aggregate
decode rate and time-to-first-token percentiles.

Standard library only (it runs on machines without the openai package).

Usage: python3 bench/load/load.py --base http://127.0.0.1:8080 --streams 256 \
           --prompt-words 140 --max-tokens 256 [--api-key K] [--schema FILE.json] [--out FILE.json]
           [--expect-all-ok]
--expect-all-ok: exit 1 unless every request finished (no refusals either).
--schema: every request asks for JSON output under this JSON schema (OpenAI response_format
json_schema); each answer must then parse as JSON (counted in "invalid_json"), and a request ends
when its JSON is complete (without --schema every request sets ignore_eos and runs to --max-tokens).
bench/structured/long-array.json keeps answers long (60 three-digit numbers), so constrained and
unconstrained decode rates compare.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = ("river mill grain market horse salt wool iron winter fire story wheel spring boat hill road "
         "stone bridge lamp bread field cart rope bell").split()


def prompt(i, n_words):
    # distinct per request (no shared prefix beyond the chat template's)
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n_words)) + f" ({i})"


def one(base, i, args, results):
    u = urllib.parse.urlparse(base)
    req = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt(i, args.prompt_words)}],
        "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.schema_value is None:
        req["ignore_eos"] = True
    else:  # the grammar ends the answer (it allows only the end of text once the JSON is complete)
        req["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "bench", "schema": args.schema_value, "strict": True}}
    body = json.dumps(req)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    t0 = time.perf_counter()
    r = {"i": i}
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=args.timeout)
        c.request("POST", "/v1/chat/completions", body, headers)
        resp = c.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            try:
                err = json.loads(text)["error"]
                r["outcome"] = "refused" if resp.status in (429, 503) else "error"
                r["code"] = err.get("code")
                r["retry_after"] = resp.getheader("Retry-After")
            except (ValueError, KeyError, TypeError):
                r["outcome"] = "error"
                r["detail"] = text[:200]
            results[i] = r
            return
        first = None
        text = []
        done = False
        usage = None
        finish = None
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                r["stream_error"] = ev["error"].get("message")
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                piece = ch.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    if first is None:
                        first = time.perf_counter() - t0
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
        r["ttft_s"] = first
        r["total_s"] = time.perf_counter() - t0
        r["completion_tokens"] = (usage or {}).get("completion_tokens")
        r["finish_reason"] = finish
        ok = done and finish in ("length", "stop") and usage is not None and "stream_error" not in r
        if ok and args.schema_value is not None and finish == "stop":
            try:
                json.loads("".join(text))
            except ValueError:
                r["invalid_json"] = "".join(text)[:200]
        r["outcome"] = "ok" if ok else "error"
    except Exception as e:  # a reset, a timeout: the failures this script exists to find
        r["outcome"] = "error"
        r["detail"] = f"{type(e).__name__}: {e}"
    results[i] = r


def pct(v, q):
    v = sorted(x for x in v if x is not None)
    return v[min(len(v) - 1, int(q * len(v)))] if v else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=140)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--api-key")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out")
    ap.add_argument("--expect-all-ok", action="store_true")
    ap.add_argument("--schema", help="a JSON schema file: every answer is constrained to it")
    args = ap.parse_args()
    args.schema_value = None
    if args.schema:
        with open(args.schema) as f:
            args.schema_value = json.load(f)
    results = [None] * args.streams
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(args.base, i, args, results)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    u = urllib.parse.urlparse(args.base)
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        c.request("GET", "/health")
        health = c.getresponse().status
    except Exception as e:
        health = f"{type(e).__name__}: {e}"
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    ok = [r for r in results if r["outcome"] == "ok"]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    summary = {
        "streams": args.streams, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
        "outcomes": counts,
        "refusal_codes": sorted({f'{r["status"]} {r.get("code")}' for r in results if r["outcome"] == "refused"}),
        "errors": [r for r in results if r["outcome"] == "error"][:5],
        "schema": args.schema,
        "invalid_json": sum(1 for r in ok if "invalid_json" in r),
        "wall_s": wall, "output_tok_s": tokens / wall,
        "ttft_p50_s": pct([r["ttft_s"] for r in ok], 0.5), "ttft_p99_s": pct([r["ttft_s"] for r in ok], 0.99),
        # one stream's decode rate after its first token (what an in-process decode figure measures)
        "stream_decode_tok_s_p50": pct([(r["completion_tokens"] - 1) / (r["total_s"] - r["ttft_s"]) for r in ok
                                        if r["ttft_s"] is not None and (r["completion_tokens"] or 0) > 1
                                        and r["total_s"] > r["ttft_s"]], 0.5),
        "health_after": health,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = counts.get("error", 0) > 0 or health != 200 or summary["invalid_json"] > 0
    if args.expect_all_ok and counts.get("ok", 0) != args.streams:
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
