#!/usr/bin/env python3
"""Join gemm_bench's and cublas.py's JSON lines (one call, one GPU) into the per-shape table of
bench/gemm/README.md: for each product and token count, cuBLAS's time and rate, the launch metrale
runs (its planned kernel) and the fastest one the sweep found, each with its ratio to cuBLAS
(cuBLAS time over ours: above 1 is faster than the library), and the floor (the FLOPs at the
989 TFLOP/s dense bf16 peak or the weights at the measured copy rate, whichever is longer).

    python3 bench/gemm/table.py gemm.jsonl cublas.jsonl > table.md

With --w4a16 Q41.jsonl (gemm_bench on the q4_1 target, W4A16, same call): the q4_1 table instead,
each product's W4A16 time beside cuBLAS bf16 and metrale's bf16 launch on the same shape, and its
own floor (the q4_1 weights at the copy rate, or the FLOPs at the peak).

    python3 bench/gemm/table.py gemm-bf16.jsonl cublas.jsonl --w4a16 gemm-q4_1.jsonl > table-q4_1.md

With --probe NAME GEMM.jsonl: one line, each product's time (the planned launch) at each token
count of a kernel variant's gemm_bench run (ci/gpu/gemm.sh's probes).

    python3 bench/gemm/table.py --probe NAME gemm-NAME.jsonl
"""
import json
import sys


def w4a16(ours, lib, path):
    q4 = [json.loads(l) for l in open(path) if l.strip()]
    print("| product | tokens | cuBLAS bf16 us (TFLOP/s) | metrale bf16 us | W4A16 us (TFLOP/s) | vs cuBLAS | vs metrale bf16 | "
          "conversion + product us | W4A16 floor us | GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in q4:
        if r["kernel"] != "wgmma":
            continue
        key = (r["product"], r["ntok"])
        c = lib.get(key)
        b = next((x for x in ours if (x["product"], x["ntok"]) == key and x["planned"] and x["kernel"] != "with_act"), None)
        act = next((x for x in q4 if (x["product"], x["ntok"]) == key and x["kernel"] == "with_act"), None)
        cub = f"{c['us']:.1f} ({c['tflops']:.0f})" if c else "-"
        print(f"| {key[0]} | {key[1]} | {cub} | {b['us']:.1f} | " if b else f"| {key[0]} | {key[1]} | {cub} | - | ", end="")
        print(f"{r['us']:.1f} ({r['tflops']:.0f}) | {c['us'] / r['us']:.2f} | " if c else f"{r['us']:.1f} ({r['tflops']:.0f}) | - | ", end="")
        print(f"{b['us'] / r['us']:.2f} | " if b else "- | ", end="")
        print(f"{act['us']:.1f} | " if act else "- | ", end="")
        print(f"{r['floor_us']:.1f} | {r['weight_gbs']:.0f} |")


def probe(name, path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    print(name + ": " + " ".join(f"{r['product']}@{r['ntok']} {r['us']:.1f} us ({r['weight_gbs']:.0f} GB/s)"
                                 for r in rows if r["kernel"] == "wgmma"))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        return probe(sys.argv[2], sys.argv[3])
    ours = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    lib = {(r["product"], r["ntok"]): r for r in (json.loads(l) for l in open(sys.argv[2]) if l.strip())}
    if len(sys.argv) > 4 and sys.argv[3] == "--w4a16":
        return w4a16(ours, lib, sys.argv[4])
    order = []
    for r in ours:
        key = (r["product"], r["ntok"])
        if key not in order:
            order.append(key)
    print("| product | tokens | cuBLAS us (TFLOP/s) | metrale runs | us (TFLOP/s) | vs cuBLAS | best in sweep | us | vs cuBLAS | conversion + product us | floor us |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for key in order:
        rows = [r for r in ours if (r["product"], r["ntok"]) == key]
        c = lib.get(key)
        run = next((r for r in rows if r["planned"] and r["kernel"] != "with_act"), None)
        best = min((r for r in rows if r["kernel"] != "with_act"), key=lambda r: r["us"])
        act = next((r for r in rows if r["kernel"] == "with_act"), None)

        def name(r):
            return "wgmma" if r["kernel"] == "wgmma" else f"tma {r['tile']} /{r['splits']}"

        def ratio(r):
            return f"{c['us'] / r['us']:.2f}" if c and r else "-"

        print(
            f"| {key[0]} | {key[1]} | {c['us']:.1f} ({c['tflops']:.0f}) | " if c else f"| {key[0]} | {key[1]} | - | ",
            end="",
        )
        print(
            f"{name(run) if run else '-'} | {run['us']:.1f} ({run['tflops']:.0f}) | {ratio(run)} | "
            if run else "- | - | - | ",
            end="",
        )
        print(f"{name(best)} | {best['us']:.1f} | {ratio(best)} | {act['us']:.1f} | {rows[0]['floor_us']:.1f} |" if act else
              f"{name(best)} | {best['us']:.1f} | {ratio(best)} | - | {rows[0]['floor_us']:.1f} |")


if __name__ == "__main__":
    main()
