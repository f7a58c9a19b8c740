import httpx, json, sys, time, statistics
# usage: python ttft.py BASE_URL ITEMS (73 items: a 505-token prompt of the default model)
base = sys.argv[1]
words = " ".join(f"item {i} is blue;" for i in range(int(sys.argv[2])))
prompt = "Summarise: " + words
n = httpx.post(f"{base}/tokenize", json={"content": prompt}).json()
ntok = len(n.get("tokens", []))
ts = []
for rep in range(6):
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": "m", "prompt": prompt + f" ({rep})", "max_tokens": 1, "stream": True, "temperature": 0}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "choices" in line:
                ts.append(time.perf_counter() - t0)
                break
print(json.dumps({"prompt_tokens": ntok, "ttft_ms": [round(1000 * t, 1) for t in ts], "median_ms": round(1000 * statistics.median(ts[1:]), 1)}))
