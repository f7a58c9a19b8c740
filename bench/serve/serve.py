"""A serving benchmark: requests with real-looking prompt and output lengths arrive at a server
(metrale-server, or any OpenAI-compatible server such as llama-server) at swept request rates or at
a fixed concurrency; it reports what users see: throughput, time to first token (TTFT), inter-token
latency (ITL) and goodput under a latency SLO.

Workload (seeded, the same for every server and rate): --num-prompts requests whose prompt and
output lengths are drawn from log-normal distributions with ShareGPT-like medians and spreads
(prompt median --prompt-median tokens, output median --output-median, both with sigma 0.8, clipped
to [4, --max-prompt] and [4, --max-output]); a prompt is that many words of a fixed word list
(about a token a word for byte-level BPE vocabularies; the server's own count is what is reported,
from each stream's `usage`). Every request streams, runs greedy, and sets `ignore_eos` so it
generates exactly its drawn output length.

Arrivals: for each rate in --rates, the requests arrive as a Poisson process of that rate (seeded
exponential gaps; `inf` sends them all at once); --concurrency C instead keeps C requests in
flight, each starting when one ends.

Per run it reports: duration, completed and failed requests, request rate, output and total token
rates, TTFT p50/p99, ITL p50/p99 (every gap between content chunks of every request), time per
output token (mean of each request's (E2E - TTFT) / (tokens - 1)), and goodput: the rate of
requests that finished within the SLO (their TTFT <= --slo-ttft-ms and their own ITL p99 <=
--slo-itl-ms). The summary names the highest swept rate whose TTFT p99 and ITL p99 over all
requests meet the SLO.

A long prompt among decoding streams (--long-prompt WORDS --among C): C streams of short prompts
generate --among-output tokens each; once every one has its first token and --settle seconds have
passed, one request with a prompt of WORDS words arrives (a few output tokens). Reported: the
streams' ITL p50/p99 over the gaps that end before it arrives (the baseline) and over the gaps
that overlap its prefill (from its arrival to its first token), their ratio, the long request's
TTFT and prompt tokens; streams that stopped before the long prompt's first token are counted (a
run is only meaningful if none did).

--warmup N short requests go first, one by one, uncounted (a fresh server's one-time costs).
Standard library only (it runs on the GPU machine as is); --plot FILE.png draws TTFT and ITL p50/p99
against the request rate with matplotlib where it is installed (for each --out file given with
--plot-from, several servers on one plot).

Usage:
    python3 bench/serve/serve.py --base http://127.0.0.1:8080 --rates 1,2,4,8,inf \
        --num-prompts 200 [--concurrency 64] [--label metrale] [--out FILE.json]
    python3 bench/serve/serve.py --base http://127.0.0.1:8080 --long-prompt 8000 --among 128 \
        --among-output 512 [--out FILE.json]
    python3 bench/serve/serve.py --plot FILE.png --plot-from A.json B.json
"""

import argparse
import http.client
import json
import math
import random
import sys
import threading
import time
import urllib.parse

WORDS = ("river mill grain market horse salt wool iron winter fire story wheel spring boat hill road "
         "stone bridge lamp bread field cart rope bell north south east west morning evening").split()


def workload(args):
    """(prompt text, output tokens) per request, from the seed alone."""
    rng = random.Random(args.seed)
    out = []
    for i in range(args.num_prompts):
        p = int(min(args.max_prompt, max(4, rng.lognormvariate(math.log(args.prompt_median), 0.8))))
        o = int(min(args.max_output, max(4, rng.lognormvariate(math.log(args.output_median), 0.8))))
        # distinct from the first words on, so no prefix cache is shared beyond the chat template
        text = f"({i}) " + " ".join(WORDS[(i * 7 + j * 3 + j * j) % len(WORDS)] for j in range(p))
        out.append((text, o))
    return out


def percentile(v, q):
    if not v:
        return None
    v = sorted(v)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def one(args, text, max_tokens, t_sched, on_first=None):
    """One streaming request; returns its timings (seconds, relative to its scheduled start) and
    its content chunks' arrival times (`chunks_at`, perf_counter seconds); `on_first()` is called
    when the first content chunk arrives."""
    u = urllib.parse.urlparse(args.base)
    req = {
        "model": args.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    r = {"want_tokens": max_tokens, "ok": False}
    t_start = time.perf_counter()
    r["queued_s"] = t_start - t_sched
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=args.timeout)
        c.request("POST", "/v1/chat/completions", json.dumps(req), headers)
        resp = c.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            r["error"] = resp.read(2000).decode("utf-8", "replace")
            return r
        chunks, done = [], False
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if ev.get("usage"):
                r["prompt_tokens"] = ev["usage"].get("prompt_tokens")
                r["output_tokens"] = ev["usage"].get("completion_tokens")
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    chunks.append(time.perf_counter())
                    if on_first and len(chunks) == 1:
                        on_first()
        c.close()
        t_end = time.perf_counter()
        if not done or not chunks:
            r["error"] = "stream ended without [DONE]" if not done else "no content"
            return r
        r["ttft_s"] = chunks[0] - t_sched  # from when it was due: a client's view of queueing too
        r["itl_s"] = [b - a for a, b in zip(chunks, chunks[1:])]
        r["e2e_s"] = t_end - t_sched
        r["chunks_at"] = chunks
        r.setdefault("output_tokens", len(chunks))
        r["ok"] = True
    except Exception as e:  # a reset or timeout is a failed request, not a crash of the benchmark
        r["error"] = f"{type(e).__name__}: {e}"
    return r


def run(args, reqs, rate=None, concurrency=None):
    results = [None] * len(reqs)
    t0 = time.perf_counter()
    threads = []
    if concurrency:
        nxt = [0]
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(reqs):
                    return
                results[i] = one(args, reqs[i][0], reqs[i][1], time.perf_counter())

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
    else:
        def send(i, text, n, due):
            results[i] = one(args, text, n, due)

        rng = random.Random(args.seed + 1)
        due = t0
        for i, (text, n) in enumerate(reqs):
            if rate != math.inf:
                due += rng.expovariate(rate)
                time.sleep(max(0.0, due - time.perf_counter()))
            t = threading.Thread(target=send, args=(i, text, n, due))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    dur = time.perf_counter() - t0
    return summarize(args, results, dur, rate, concurrency)


def summarize(args, results, dur, rate, concurrency):
    ok = [r for r in results if r and r["ok"]]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    itl = [g * 1e3 for r in ok for g in r["itl_s"]]
    tpot = [(r["e2e_s"] - r["ttft_s"]) * 1e3 / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r.get("prompt_tokens") or 0 for r in ok)
    good = [r for r in ok if r["ttft_s"] * 1e3 <= args.slo_ttft_ms
            and (percentile([g * 1e3 for g in r["itl_s"]], 99) or 0) <= args.slo_itl_ms]
    s = {
        "label": args.label, "base": args.base,
        "rate": "inf" if rate == math.inf else rate, "concurrency": concurrency,
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.get("error", "")[:200] for r in results if r and not r["ok"]}),
        "duration_s": round(dur, 3),
        "request_rate": round(len(ok) / dur, 3),
        "output_tok_s": round(out_tok / dur, 1), "total_tok_s": round((out_tok + in_tok) / dur, 1),
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "drawn_output_tokens": sum(r["want_tokens"] for r in ok),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
        "tpot_ms_mean": (sum(tpot) / len(tpot)) if tpot else None,
        "goodput_req_s": round(len(good) / dur, 3), "good_requests": len(good),
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
    }
    s["meets_slo"] = bool(ok) and len(ok) == len(results) and s["ttft_ms_p99"] <= args.slo_ttft_ms \
        and (s["itl_ms_p99"] or 0) <= args.slo_itl_ms
    return s


def among(args):
    """The long-prompt run (module docs): C decoding streams, then one long prompt among them."""
    c = args.among
    firsts = threading.Semaphore(0)
    results = [None] * c
    t0 = time.perf_counter()

    def stream(i):
        text = f"[{i}] " + " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(32))
        results[i] = one(args, text, args.among_output, time.perf_counter(), on_first=firsts.release)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for _ in range(c):
        if not firsts.acquire(timeout=args.timeout):
            break
    t_all = time.perf_counter()
    time.sleep(args.settle)
    text = "(long) " + " ".join(WORDS[(j * 7 + j * j) % len(WORDS)] for j in range(args.long_prompt))
    t_long = time.perf_counter()
    lr = one(args, text, 4, t_long)
    for t in threads:
        t.join()
    ok = [r for r in results if r and r["ok"]]
    t_first = t_long + lr["ttft_s"] if lr.get("ok") else math.inf
    base, during = [], []
    for r in ok:
        at = r["chunks_at"]
        for a, b in zip(at, at[1:]):
            if a >= t_all and b <= t_long:
                base.append((b - a) * 1e3)
            elif b > t_long and a < t_first:
                during.append((b - a) * 1e3)
    p99b, p99d = percentile(base, 99), percentile(during, 99)
    s = {
        "label": args.label, "base": args.base, "streams": c, "stream_output_tokens": args.among_output,
        "streams_completed": len(ok), "streams_failed": c - len(ok),
        "streams_done_before_long_first_token": sum(1 for r in ok if r["chunks_at"][-1] < t_first),
        "long_prompt_words": args.long_prompt, "long_prompt_tokens": lr.get("prompt_tokens"),
        "long_ok": lr.get("ok", False), "long_error": lr.get("error"),
        "long_ttft_ms": lr["ttft_s"] * 1e3 if lr.get("ok") else None,
        "baseline_gaps": len(base), "during_gaps": len(during),
        "itl_ms_p50_baseline": percentile(base, 50), "itl_ms_p99_baseline": p99b,
        "itl_ms_p50_during": percentile(during, 50), "itl_ms_p99_during": p99d,
        "itl_p99_ratio": (p99d / p99b) if p99b and p99d is not None else None,
        "duration_s": round(time.perf_counter() - t0, 3),
    }
    print(f"{args.label}: {c} streams; a {s['long_prompt_tokens']}-token prompt among them: its TTFT "
          f"{fmt(s['long_ttft_ms'])} ms; the streams' ITL p50/p99 {fmt(s['itl_ms_p50_baseline'])}/"
          f"{fmt(s['itl_ms_p99_baseline'])} ms before it, {fmt(s['itl_ms_p50_during'])}/"
          f"{fmt(s['itl_ms_p99_during'])} ms during its prefill ({fmt(s['itl_p99_ratio'], 2)}x at p99); "
          f"{s['streams_done_before_long_first_token']} streams ended before its first token")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if s["long_ok"] and not s["streams_failed"] else 1


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def plot(args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serve.py: --plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return 1
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for f in args.plot_from:
        d = json.load(open(f))
        runs = [r for r in d["runs"] if r["rate"] not in (None, "inf")]
        x = [r["request_rate"] for r in runs]
        for ax, key, name in ((a1, "ttft", "TTFT"), (a2, "itl", "ITL")):
            ax.plot(x, [r[f"{key}_ms_p50"] for r in runs], "o-", label=f"{d['label']} p50")
            ax.plot(x, [r[f"{key}_ms_p99"] for r in runs], "s--", label=f"{d['label']} p99")
            ax.set_xlabel("completed requests / s")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
    slo = json.load(open(args.plot_from[0]))["slo"]
    a1.axhline(slo["ttft_ms"], color="grey", lw=0.8)
    a2.axhline(slo["itl_ms"], color="grey", lw=0.8)
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"serve.py: wrote {args.plot}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="default")
    ap.add_argument("--label", default="metrale")
    ap.add_argument("--api-key")
    ap.add_argument("--rates", default="", help="requests/s, comma-separated; inf = all at once")
    ap.add_argument("--concurrency", type=int, help="fixed concurrency instead of rates")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--prompt-median", type=float, default=200)
    ap.add_argument("--output-median", type=float, default=150)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-itl-ms", type=float, default=100)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--warmup", type=int, default=4, help="requests sent one by one first, not counted")
    ap.add_argument("--long-prompt", type=int, help="words of one long prompt sent among --among streams")
    ap.add_argument("--among", type=int, default=128, help="decoding streams the long prompt arrives among")
    ap.add_argument("--among-output", type=int, default=512, help="tokens each of those streams generates")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of baseline before the long prompt")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--plot-from", nargs="*", default=[])
    args = ap.parse_args()
    if args.plot:
        return plot(args)
    if not args.rates and not args.concurrency and not args.long_prompt:
        ap.error("give --rates, --concurrency or --long-prompt")
    reqs = workload(args)
    # the first requests of a fresh server pay its one-time costs (pages of the weights, graph
    # captures, allocator growth): a few short ones first, uncounted
    for i in range(args.warmup):
        w = one(args, f"warm-up {i}: " + " ".join(WORDS[:16]), 8, time.perf_counter())
        if not w["ok"]:
            print(f"serve.py: warm-up request failed: {w.get('error')}", file=sys.stderr)
            return 1
    if args.long_prompt:
        return among(args)
    runs = []
    for rate in [float(x) for x in args.rates.split(",") if x]:
        s = run(args, reqs, rate=rate)
        runs.append(s)
        show(s)
    if args.concurrency:
        s = run(args, reqs, concurrency=args.concurrency)
        runs.append(s)
        show(s)
    met = [r["request_rate"] for r in runs if r["concurrency"] is None and r["rate"] != "inf" and r["meets_slo"]]
    out = {
        "label": args.label, "base": args.base, "seed": args.seed, "num_prompts": args.num_prompts,
        "workload": {"prompt_median": args.prompt_median, "output_median": args.output_median, "sigma": 0.8,
                     "max_prompt": args.max_prompt, "max_output": args.max_output},
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "max_rate_meeting_slo": max(met) if met else None,
        "runs": runs,
    }
    print(f"{args.label}: highest swept rate meeting the SLO (TTFT p99 <= {args.slo_ttft_ms:g} ms, "
          f"ITL p99 <= {args.slo_itl_ms:g} ms): {out['max_rate_meeting_slo']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    failed = sum(r["failed"] for r in runs)
    return 1 if failed else 0


def show(s):
    mode = f"concurrency {s['concurrency']}" if s["concurrency"] else f"rate {s['rate']}"
    print(f"{s['label']} {mode}: {s['completed']}/{s['requests']} in {s['duration_s']:.1f} s, "
          f"{s['request_rate']:.2f} req/s, {s['output_tok_s']:.1f} out tok/s; TTFT p50/p99 "
          f"{fmt(s['ttft_ms_p50'])}/{fmt(s['ttft_ms_p99'])} ms, ITL p50/p99 {fmt(s['itl_ms_p50'])}/"
          f"{fmt(s['itl_ms_p99'])} ms, TPOT {fmt(s['tpot_ms_mean'])} ms; goodput {s['goodput_req_s']:.2f} req/s"
          + (f"; errors {s['errors']}" if s["failed"] else ""))


if __name__ == "__main__":
    sys.exit(main())
