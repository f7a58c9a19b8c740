#!/usr/bin/env python3
"""llama.cpp loads the GGUFs `cargo xtask synth-model` writes, and computes what metrale computes.

For each GGUF given, start llama-server and metrale-server on it (CPU, one slot), send the same
prompts, greedy, 12 tokens, with the top 5 logprobs at each position, and compare: the prompt's
tokens (/tokenize on both), the generated tokens up to the first difference, and the top-5
logprobs above -10 at every position both generated alike (largest absolute difference). Random weights put
some positions near a tie, where the two may part (bf16 weights, f32 arithmetic on both sides but
in another order): a difference is reported with the margin between the top two logprobs there,
and counts as agreement when that margin is below `--tie` (default 0.02 nats). Exit status 1 when
a file does not load, tokenizes differently, or parts away from a tie.

Not part of CI (llama.cpp's build takes ~15 minutes on two cores); run it where llama.cpp is built:

    cargo xtask synth-model tests/golden/tiny-qwen3moe.toml --out q.gguf
    python3 tests/llamacpp/check_synth.py --llama-server path/to/llama-server \\
        --metrale-server target/release/metrale-server q.gguf ...
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "In 1969, the first people to walk on the Moon",
           "Qwen and Llama are"]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def start(cmd, port, log):
    p = subprocess.Popen(cmd + ["--port", str(port)], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    for _ in range(240):
        if p.poll() is not None:
            return p, f"exited with {p.returncode} (see {log})"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return p, None
        except Exception:
            pass
        time.sleep(0.5)
    return p, f"not ready after 120 s (see {log})"


def llama_run(port, prompt, n, text_of):
    """llama-server's greedy tokens and top logprobs, each token named by metrale's text for its id
    (`text_of`: llama.cpp renders unused control tokens as empty text)."""
    r = post(port, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 5,
                                   "top_k": 1, "samplers": ["top_k"]})
    out = []
    for step in r["completion_probabilities"]:
        out.append((text_of(step["id"]), {text_of(t["id"]): t["logprob"] for t in step["top_logprobs"]}))
    return out


def metrale_run(port, prompt, n):
    r = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5,
                                       "ignore_eos": True})
    lp = r["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["top_logprobs"]))


def tokens_of(port, prompt):
    return post(port, "/tokenize", {"content": prompt})["tokens"]  # the same API on both


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--metrale-server", required=True)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--tie", type=float, default=0.02)
    ap.add_argument("--log-dir", help="where the servers' logs go (default: a new temporary folder)")
    ap.add_argument("gguf", nargs="+")
    args = ap.parse_args()
    logs = args.log_dir or tempfile.mkdtemp(prefix="check_synth-")
    bad = 0
    for path in args.gguf:
        name = path.rsplit("/", 1)[-1]
        lp, lerr = start([args.llama_server, "-m", path, "-c", "512", "-np", "1", "-t", "2"], 18431, f"{logs}/{name}.llama.log")
        mp, merr = start([args.metrale_server, "-m", path, "-c", "512", "--parallel", "1"], 18432, f"{logs}/{name}.metrale.log")
        try:
            if lerr or merr:
                print(f"{name}: llama-server {lerr or 'loaded'}; metrale-server {merr or 'loaded'}")
                bad += 1
                continue
            worst, same, total, parted = 0.0, 0, 0, []
            names = {}

            def text_of(i):
                if i not in names:
                    names[i] = post(18432, "/detokenize", {"tokens": [i]})["content"]
                return names[i]

            for prompt in PROMPTS:
                lt, mt = tokens_of(18431, prompt), tokens_of(18432, prompt)
                if lt != mt:
                    print(f"{name}: {prompt!r} tokenizes as {lt} in llama.cpp, {mt} in metrale")
                    bad += 1
                    continue
                a = llama_run(18431, prompt, args.tokens, text_of)
                b = metrale_run(18432, prompt, args.tokens)
                for i, ((ta, pa), (tb, pb)) in enumerate(zip(a, b)):
                    total += 1
                    # tokens likelier than e^-10 (the random models put the rest near -70, where
                    # f32 sums in another order differ by tenths)
                    common = [t for t in set(pa) & set(pb) if max(pa[t], pb[t]) > -10]
                    worst = max([worst] + [abs(pa[t] - pb[t]) for t in common])
                    if ta != tb:
                        top = sorted(pb.values(), reverse=True)
                        margin = top[0] - top[1] if len(top) > 1 else float("inf")
                        parted.append((prompt, i, ta, tb, margin))
                        if margin >= args.tie:
                            bad += 1
                        break
                    same += 1
            print(f"{name}: loads in both; {same} of {total} generated tokens equal; "
                  f"top-5 logprobs differ by at most {worst:.2e}"
                  + "".join(f"; {p!r} parts at token {i} ({ta!r} vs {tb!r}, margin {m:.3g})"
                            for p, i, ta, tb, m in parted))
        finally:
            for p in (lp, mp):
                p.terminate()
                p.wait()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
