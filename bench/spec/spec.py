#!/usr/bin/env python3
"""Speculative decoding on a copy-heavy workload, against a running server's chat API.

Every request asks the model to reproduce or lightly edit a passage it is given (the work prompt
lookup exists for: editing, quoting, extraction), greedy, one at a time (batch 1, where decoding
is bound by reading the weights and speculation pays). The passages are cut from
`bench/perplexity/text.txt` (CPython's pydoc topics, PSF licence), so the run is the same on every
machine.

Requests stream; for each it records the completion text, its tokens (`usage`), the time to its
first piece and from the first piece to the last (the decode, which speculation speeds; the
prompt's prefill is the same with or without it); from the
server's /metrics before and after, the speculative counters (metrale and vLLM:
`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`), or llama-server's per-response `timings.draft_n` and
`draft_n_accepted`. It reports decode tok/s (the tokens after the first over the summed decode
times), the
acceptance rate (accepted over proposed) and the mean accepted length (tokens a verification step
produced: 1 + accepted / drafts).

`--compare RUN.json`: the texts must equal that run's, request by request (greedy speculation
must not change the output); the report says which differ and the ratio of the two tok/s.

    python3 bench/spec/spec.py --base http://127.0.0.1:8080 --label plain --out plain.json
    python3 bench/spec/spec.py --base http://127.0.0.1:8081 --label ngram --out ngram.json \\
        --compare plain.json
"""
import argparse
import http.client
import json
import os
import re
import statistics
import sys
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "perplexity", "text.txt")

TASKS = [
    "Repeat the following text exactly, word for word, and nothing else.\n\n{p}",
    "Rewrite the following text with every occurrence of the word \"the\" in capitals (THE), "
    "changing nothing else.\n\n{p}",
    "Put the following documentation into a Markdown quote block (each line starting with "
    "\"> \"), unchanged.\n\n{p}",
]


def passages(n, chars):
    """`n` passages of about `chars` characters, each a run of whole paragraphs from its own
    section of the text, evenly spread over it."""
    text = open(TEXT, encoding="utf-8").read()
    paras = [p for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]
    out = []
    step = max(1, len(paras) // n)
    for i in range(n):
        j, cur = i * step, []
        while j < len(paras) and sum(len(x) for x in cur) < chars:
            cur.append(paras[j].strip())
            j += 1
        out.append("\n\n".join(cur))
    return out


def workload(args):
    return [TASKS[i % len(TASKS)].format(p=p)
            for i, p in enumerate(passages(args.num_prompts, args.passage_chars))]


def http_json(base, method, path, body=None, timeout=600):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def spec_counters(base):
    """The speculative counters of a server's /metrics (zeros where it has none)."""
    status, data = http_json(base, "GET", "/metrics")
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    if status != 200:
        return out
    names = {"spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
             "spec_decode_num_accepted_tokens": "accepted"}
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^[a-z]+:(spec_decode_num_[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in names:
            out[names[m.group(1)]] += float(m.group(2))
    return out


def one(args, text):
    """One streamed request: its text, token counts, and the times of its first and last pieces."""
    body = {"model": args.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": args.max_tokens, "temperature": 0, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    u = urllib.parse.urlparse(args.base)
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=args.timeout)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise SystemExit(f"request failed: HTTP {resp.status}: {resp.read(500)!r}")
    pieces, usage, timings, first, last = [], {}, {}, None, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        ev = json.loads(line[5:])
        usage = ev.get("usage") or usage
        timings = ev.get("timings") or timings
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                last = time.perf_counter()
                first = first or last
                pieces.append(piece)
    c.close()
    t1 = time.perf_counter()
    n = usage.get("completion_tokens", len(pieces))
    return {"seconds": t1 - t0, "first_token_s": (first or t1) - t0,
            # decode alone: the tokens after the first over the time from the first to the last
            "decode_seconds": (last or t1) - (first or t1),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": n, "text": "".join(pieces),
            # llama-server's own counts, where it gives them
            "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--model", default="default")
    ap.add_argument("--label", required=True, help="what ran, for the report")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--passage-chars", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1, help="requests run first and not counted")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--compare", help="an earlier run's JSON whose texts these must equal")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    prompts = workload(args)
    for p in prompts[:args.warmup]:
        one(args, p)
    before = spec_counters(args.base)
    results = [one(args, p) for p in prompts]
    after = spec_counters(args.base)
    c = {k: after[k] - before[k] for k in after}
    if not c["draft_tokens"] and any(r["draft_n"] for r in results):
        c["draft_tokens"] = float(sum(r["draft_n"] or 0 for r in results))
        c["accepted"] = float(sum(r["draft_n_accepted"] or 0 for r in results))
    tokens = sum(r["completion_tokens"] for r in results)
    decode_tokens = sum(r["completion_tokens"] - 1 for r in results)
    decode_secs = sum(r["decode_seconds"] for r in results)
    per_req = [(r["completion_tokens"] - 1) / r["decode_seconds"] for r in results if r["decode_seconds"] > 0]
    summary = {
        "label": args.label,
        "requests": len(results),
        "completion_tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in results),
        "tok_per_s": decode_tokens / decode_secs,
        "tok_per_s_median_request": statistics.median(per_req),
        "time_to_first_token_s_median": statistics.median(r["first_token_s"] for r in results),
        "proposed_tokens": c["draft_tokens"],
        "accepted_tokens": c["accepted"],
        "acceptance": c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else None,
        "mean_accepted_length": 1 + c["accepted"] / c["drafts"] if c["drafts"] else None,
    }
    settings = dict(vars(args))
    for k in ("out", "compare"):  # file names only: a report names no machine's paths
        settings[k] = settings[k] and os.path.basename(settings[k])
    report = {"schema": "metrale-spec-v1", "settings": settings, "summary": summary,
              "results": results}
    if args.compare:
        ref = json.load(open(args.compare))
        differ = [i for i, (a, b) in enumerate(zip(results, ref["results"])) if a["text"] != b["text"]]
        report["compare"] = {"against": ref["summary"]["label"], "texts_differ": differ,
                             "speedup": summary["tok_per_s"] / ref["summary"]["tok_per_s"]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    s = summary
    line = (f"{s['label']}: {s['requests']} requests, {s['completion_tokens']} tokens, "
            f"{s['tok_per_s']:.1f} tok/s (median request {s['tok_per_s_median_request']:.1f})")
    if s["acceptance"] is not None:
        line += f"; {s['accepted_tokens']:.0f} of {s['proposed_tokens']:.0f} proposed accepted ({100 * s['acceptance']:.1f}%)"
    if s["mean_accepted_length"] is not None:
        line += f", {s['mean_accepted_length']:.2f} tokens a verification step"
    print(line)
    if args.compare:
        cmp = report["compare"]
        print(f"  against {cmp['against']}: {cmp['speedup']:.2f}x; texts that differ: {cmp['texts_differ'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
