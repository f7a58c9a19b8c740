#!/usr/bin/env python3
"""cuBLAS (through torch.matmul, bf16) on the shapes metrale's gemm_bench timed: the library's rate
on the same products, in the same call on the same GPU, for bench/gemm/table.py to put beside ours.

For each (product, rows, k, ntok) in gemm_bench's JSON lines: C[ntok][rows] = A[ntok][k] @ W[rows][k]^T
with bf16 A, W and C (what nn.Linear runs), random normal inputs (never zeros: they run faster),
timed as gemm_bench times its kernels: a CUDA graph of enough products for ~2 ms, replayed 7 times,
host clock around each replay and a synchronize, microseconds per product, the median.

    python3 bench/gemm/cublas.py --from gemm.jsonl --out cublas.jsonl
"""
import argparse
import json
import statistics
import time

import torch


def time_graph(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    v = []
    for _ in range(7):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        v.append((time.perf_counter() - t0) * 1e6 / reps)
    return statistics.median(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", required=True, help="gemm_bench's JSON lines")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    shapes = []
    for line in open(a.src):
        r = json.loads(line)
        key = (r["product"], r["rows"], r["k"], r["ntok"])
        if key not in shapes:
            shapes.append(key)
    torch.manual_seed(0)
    out = []
    weights = {}
    for product, rows, k, ntok in shapes:
        if (rows, k) not in weights:
            weights[(rows, k)] = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = weights[(rows, k)]
        x = torch.randn(ntok, k, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(ntok, rows, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * rows * k * ntok
        # enough products for ~2 ms at ~500 TFLOP/s, 3 to 100
        reps = max(3, min(100, int(2e-3 / max(flops / 500e12, 1e-6))))
        us = time_graph(lambda: torch.matmul(x, w.t(), out=c), reps)
        row = {"product": product, "rows": rows, "k": k, "ntok": ntok, "us": round(us, 3),
               "tflops": round(flops / us / 1e6, 2), "weight_gbs": round(rows * k * 2 / us / 1e3, 1),
               "torch": torch.__version__, "device": torch.cuda.get_device_name()}
        out.append(row)
        print(f"cuBLAS {product:8} n={ntok:5} {us:9.2f} us {row['tflops']:7.1f} TFLOP/s", flush=True)
        del x, c
    with open(a.out, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
