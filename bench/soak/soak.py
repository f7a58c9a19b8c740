#!/usr/bin/env python3
"""Soak and chaos: run a server binary at saturation with a mix of well-formed and hostile traffic,
then drain it with SIGTERM, and check that nothing unexpected happened.

Traffic (each worker loops, picking by weight):
  chat            whole answers, n in 1..3, random sampling, sometimes stop strings
  chat_stream     streamed, usage asked for; must end with finish_reason and [DONE]
  completion      streamed completions with stop strings
  drop_stream     a stream the client abandons after a few chunks
  drop_whole      a whole request the client abandons after 0.2 s
  too_long        a prompt over the context (tokens) -> 400 context_length_exceeded
  too_many_bytes  a prompt over the byte cap -> 400 without tokenizing
  bad_json        malformed JSON / trailing bytes -> 400
  tokenize        /tokenize of a few kB
and every `--burst-every` seconds a burst of `--burst` small requests at once, past --max-queue:
each must be answered 200 or 429 queue_full with Retry-After.

An outcome outside what its kind allows is an unexpected error (the run fails if there is one).
Reported: requests by kind and outcome, p50/p99 latency of whole answers, the server's RSS
sampled each second and its slope over the run after warm-up (least squares, MiB/min; the run fails
if it passes --max-rss-slope both there and over the run's last quarter: a leak keeps growing, while
one step of the allocator's inside the window followed by a plateau is not one), and the drain
(exit code, time).

The server runs with glibc's MALLOC_ARENA_MAX set to --malloc-arenas (default 2; 0 leaves glibc's
default of 8 per core): with the default, each thread that first allocates under contention gets an
arena of its own, and the arenas' pages add ~15 MiB over the first minutes and then stop (the 600 s
run in bench/soak/README.md); in a two-minute run that growth is a slope of 1-6 MiB/min that says
nothing about leaks. With two arenas it stops within seconds, so what grows after warm-up is what
the server keeps.

Usage: soak.py --server-bin BIN --model GGUF [--duration 600] [--out FILE.json]
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def slope_per_min(samples):
    """Least-squares slope of (t seconds, bytes) in MiB per minute."""
    if len(samples) < 3:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [b / 2**20 for _, b in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "List the planets of the solar system.",
    "Explain what a CPU does in one sentence.",
]


class Soak:
    def __init__(self, base, ctx, byte_cap, rng):
        self.base = base
        self.ctx = ctx
        self.byte_cap = byte_cap
        self.rng = rng
        self.counts = {}
        self.unexpected = []
        self.latency = []
        self.backoff = 0.0

    def note(self, kind, outcome, ok, detail=""):
        key = f"{kind}:{outcome}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if not ok and len(self.unexpected) < 1000:
            self.unexpected.append({"kind": kind, "outcome": outcome, "detail": str(detail)[:300]})

    def msgs(self):
        return [{"role": "user", "content": self.rng.choice(QUESTIONS)}]

    async def chat(self, c):
        r = self.rng
        body = {"messages": self.msgs(), "max_tokens": r.randint(8, 48), "n": r.randint(1, 3),
                "temperature": r.choice([0, 0.7, 1.0]), "seed": r.randint(0, 1000)}
        if r.random() < 0.5:
            body["stop"] = [r.choice(["\n", ".", " the", "Paris", "x" * 200])]
        t = time.perf_counter()
        resp = await c.post("/v1/chat/completions", json=body)
        if resp.status_code == 200:
            j = resp.json()
            ok = len(j["choices"]) == body["n"] and all(ch["finish_reason"] in ("stop", "length")
                                                       for ch in j["choices"])
            if ok:
                self.latency.append(time.perf_counter() - t)
            self.note("chat", "200", ok, "" if ok else j)
        else:
            self.note("chat", str(resp.status_code), self.retry_later(resp), resp.text)

    def retry_later(self, resp):
        """A 429 with Retry-After and a known code is an allowed answer under saturation."""
        if resp.status_code != 429:
            return False
        code = resp.json().get("error", {}).get("code")
        after = resp.headers.get("retry-after")
        if after is None or code not in ("queue_full", "memory_busy"):
            return False
        self.backoff = float(after)  # as a well-behaved client does
        return True

    async def stream(self, c, kind, path, body, drop_after=None):
        done = False
        finish = []
        chunks = 0
        async with c.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                self.note(kind, str(resp.status_code), self.retry_later(resp), resp.text)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                j = json.loads(data)
                if "error" in j:
                    self.note(kind, "error-event", False, j)
                    return
                for ch in j.get("choices", []):
                    if ch.get("finish_reason"):
                        finish.append(ch["finish_reason"])
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    self.note(kind, "dropped", True)
                    return  # leaving the block closes the connection
        ok = done and len(finish) == body.get("n", 1)
        self.note(kind, "200", ok, "" if ok else f"done={done} finish={finish}")

    async def chat_stream(self, c):
        r = self.rng
        body = {"messages": self.msgs(), "max_tokens": r.randint(8, 48), "stream": True,
                "stream_options": {"include_usage": True}, "n": r.randint(1, 2)}
        await self.stream(c, "chat_stream", "/v1/chat/completions", body)

    async def completion(self, c):
        r = self.rng
        body = {"prompt": "Once upon a time", "max_tokens": r.randint(8, 48), "stream": True,
                "stop": [".", "\n\n"], "temperature": 0.8, "seed": r.randint(0, 1000)}
        await self.stream(c, "completion", "/v1/completions", body)

    async def drop_stream(self, c):
        body = {"prompt": "The history of", "max_tokens": 200, "stream": True, "ignore_eos": True}
        await self.stream(c, "drop_stream", "/v1/completions", body, drop_after=self.rng.randint(1, 5))

    async def drop_whole(self, c):
        try:
            resp = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "A long story:", "max_tokens": 300,
                                                                            "ignore_eos": True}), timeout=0.2)
            self.note("drop_whole", str(resp.status_code), self.retry_later(resp), resp.text)
        except asyncio.TimeoutError:
            self.note("drop_whole", "dropped", True)

    async def expect_400(self, c, kind, path, content, code=None, raw=None):
        if raw is not None:
            resp = await c.post(path, content=raw, headers={"content-type": "application/json"})
        else:
            resp = await c.post(path, json=content)
        if resp.status_code == 400:
            err = resp.json().get("error", {})
            ok = code is None or err.get("code") == code
            self.note(kind, "400", ok, err)
        else:
            self.note(kind, str(resp.status_code), self.retry_later(resp), resp.text)

    async def too_long(self, c):
        words = " ".join(["word"] * (self.ctx + 64))
        await self.expect_400(c, "too_long", "/v1/completions", {"prompt": words, "max_tokens": 4},
                              "context_length_exceeded")

    async def too_many_bytes(self, c):
        await self.expect_400(c, "too_many_bytes", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x" * (self.byte_cap + 1)}]},
                              "context_length_exceeded")

    async def bad_json(self, c):
        raw = self.rng.choice([b'{"prompt": "a",', b'{"prompt": "a"} trailing', b'[1,2', b'{"prompt": 5}'])
        await self.expect_400(c, "bad_json", "/v1/completions", None, raw=raw)

    async def tokenize(self, c):
        resp = await c.post("/tokenize", json={"content": "The quick brown fox. " * self.rng.randint(10, 200)})
        ok = resp.status_code == 200 and len(resp.json()["tokens"]) > 0
        self.note("tokenize", str(resp.status_code), ok or self.retry_later(resp), "" if ok else resp.text)

    async def one(self, c):
        kinds = [(self.chat, 30), (self.chat_stream, 20), (self.completion, 15), (self.drop_stream, 8),
                 (self.drop_whole, 5), (self.too_long, 5), (self.too_many_bytes, 3), (self.bad_json, 4),
                 (self.tokenize, 10)]
        f = self.rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        try:
            await f(c)
        except (httpx.TransportError, httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            self.note(f.__name__, type(e).__name__, False, repr(e))
        if self.backoff:
            delay, self.backoff = self.backoff, 0.0
            await asyncio.sleep(delay)

    async def burst(self, n):
        async def small(c, i):
            try:
                resp = await c.post("/v1/completions", json={"prompt": f"Count {i}:", "max_tokens": 4})
                ok = resp.status_code == 200 or self.retry_later(resp)
                self.note("burst", str(resp.status_code), ok, "" if ok else resp.text)
            except httpx.HTTPError as e:
                self.note("burst", type(e).__name__, False, repr(e))

        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base, timeout=300, limits=limits) as c:
            await asyncio.gather(*(small(c, i) for i in range(n)))


async def run(args):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(args.log, "wb") if args.log else subprocess.DEVNULL
    cmd = [args.server_bin, "--model", args.model, "--port", str(port), "--ctx-size", str(args.ctx),
           "--parallel", str(args.parallel), "--max-queue", str(args.max_queue), "--shutdown-timeout", "60"]
    env = dict(os.environ)
    if args.malloc_arenas:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arenas)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                sys.exit(f"the server exited with {proc.returncode} before it was ready (log: {args.log})")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() - t0 > 180:
                sys.exit("the server was not ready after 180 s")
            await asyncio.sleep(0.05)
        # The prompt byte cap, from the server's own refusal of a text far over it.
        r = httpx.post(base + "/tokenize", json={"content": "x" * (args.ctx * 1024)}, timeout=30)
        if r.status_code != 400:
            sys.exit(f"/tokenize took {args.ctx * 1024} bytes; expected a 400 naming the byte cap: {r.text[:200]}")
        byte_cap = int(r.json()["error"]["message"].split("at most ")[1].split(" bytes")[0])
        soak = Soak(base, args.ctx, byte_cap, random.Random(args.seed))
        rss = []
        stop_at = time.time() + args.duration
        start = time.time()

        async def worker():
            limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
            async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as c:
                while time.time() < stop_at:
                    await soak.one(c)

        async def sampler():
            while time.time() < stop_at:
                b = rss_bytes(proc.pid)
                if b is not None:
                    rss.append((time.time() - start, b))
                await asyncio.sleep(1.0)

        async def bursts():
            while True:
                await asyncio.sleep(args.burst_every)
                if time.time() + 5 >= stop_at:
                    return
                await soak.burst(args.burst)

        tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        tasks += [asyncio.create_task(sampler()), asyncio.create_task(bursts())]
        await asyncio.gather(*tasks)

        # Chaos at the end: SIGTERM with requests in flight; they must finish and the exit be 0.
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            inflight = [asyncio.create_task(soak.chat(c)) for _ in range(args.parallel)]
            await asyncio.sleep(0.3)
            t_sig = time.time()
            proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*inflight)
        code = await asyncio.to_thread(proc.wait, 120)
        drain_s = time.time() - t_sig
        if code != 0:
            soak.note("drain", f"exit {code}", False)

        warm = [(t, b) for t, b in rss if t >= args.duration * args.warmup]
        slope = slope_per_min(warm)
        # a leak keeps growing to the end; growth that has stopped (one allocator step in the
        # window, a plateau after it) is not one: the last quarter must grow too
        tail = [(t, b) for t, b in rss if t >= args.duration * 0.75]
        tail_slope = slope_per_min(tail)
        total = sum(soak.counts.values())
        report = {
            "schema": "metrale-soak-v1",
            "binary": os.path.basename(args.server_bin),
            "model": os.path.basename(args.model),
            "settings": {k: getattr(args, k) for k in ("duration", "concurrency", "ctx", "parallel", "max_queue",
                                                       "burst", "burst_every", "seed", "malloc_arenas")},
            "requests": total,
            "requests_per_s": round(total / max(args.duration, 1), 2),
            "by_kind_outcome": dict(sorted(soak.counts.items())),
            "unexpected_errors": len(soak.unexpected),
            "unexpected_samples": soak.unexpected[:20],
            "latency_whole_chat_s": {"n": len(soak.latency), "p50": pct(soak.latency, 50),
                                     "p99": pct(soak.latency, 99)},
            "rss_mib": {"first": rss[0][1] / 2**20 if rss else None, "last": rss[-1][1] / 2**20 if rss else None,
                        "max": max(b for _, b in rss) / 2**20 if rss else None,
                        "slope_after_warmup_mib_per_min": round(slope, 3),
                        "slope_last_quarter_mib_per_min": round(tail_slope, 3), "samples": len(rss),
                        "every_10_s": [round(b / 2**20, 1) for t, b in rss[::10]]},
            "drain": {"exit_code": code, "seconds": round(drain_s, 2)},
        }
        failed = []
        if report["unexpected_errors"]:
            failed.append(f"{report['unexpected_errors']} unexpected errors")
        if slope > args.max_rss_slope and tail_slope > args.max_rss_slope:
            failed.append(f"RSS grows {slope:.2f} MiB/min after warm-up and {tail_slope:.2f} in the "
                          f"last quarter (limit {args.max_rss_slope})")
        report["pass"] = not failed
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if failed:
            sys.exit("soak failed: " + "; ".join(failed))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-bin", required=True)
    p.add_argument("--model", default=os.environ.get("METRALE_MODEL"))
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=16, help="client workers looping over the mix")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--burst-every", type=float, default=20)
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run left out of the RSS slope")
    p.add_argument("--max-rss-slope", type=float, default=2.0, help="MiB/min")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--malloc-arenas", type=int, default=2,
                   help="MALLOC_ARENA_MAX for the server (0: glibc's default); see the module docs")
    p.add_argument("--out")
    p.add_argument("--log", help="server log file")
    args = p.parse_args()
    if not args.model:
        sys.exit("--model (or METRALE_MODEL) is required")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
