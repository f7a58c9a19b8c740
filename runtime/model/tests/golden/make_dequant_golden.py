#!/usr/bin/env python3
"""Golden dequantised rows of the real default GGUF, from the `gguf` Python package (gguf-py, the
GGUF library of the llama.cpp project; its numpy dequantisation is an implementation independent of
ours). For each chosen (tensor, row): the first 64 values (two whole 32-element blocks, so nibble
order and block scales are pinned) plus the row's sum and sum of squares in float64.

Usage: make_dequant_golden.py MODEL_GGUF   (or set METRALE_MODEL; venv: pip install gguf numpy)
MODEL_GGUF is SmolLM2-135M-Instruct.Q4_1.gguf (`cargo xtask fetch-model smollm2-135m` fetches it).
Writes dequant_gguf_py.json next to this script; tests/real_model.rs compares
metrale_core::dtype::dequantize_row with it.
"""
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("METRALE_MODEL")
if not MODEL:  # before the third-party imports, so the usage line shows without them
    sys.exit("usage: make_dequant_golden.py MODEL_GGUF (or set METRALE_MODEL): the path of "
             "SmolLM2-135M-Instruct.Q4_1.gguf")

import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf import quants  # noqa: E402

PICKS = [
    ("token_embd.weight", [0, 1, 2, 905, 19556, 49151]),   # Q8_0
    ("blk.0.attn_q.weight", [0, 1, 300, 575]),             # Q4_1
    ("blk.0.attn_k.weight", [0, 191]),                     # Q4_1
    ("blk.29.ffn_down.weight", [0, 575]),                  # Q4_1, rows of 1536
    ("blk.15.ffn_gate.weight", [7, 1535]),                 # Q4_1
    ("blk.0.attn_norm.weight", [0]),                       # F32
    ("output_norm.weight", [0]),                           # F32
]


def main():
    r = gguf.GGUFReader(MODEL)
    by_name = {t.name: t for t in r.tensors}
    out = []
    for name, rows in PICKS:
        t = by_name[name]
        full = quants.dequantize(t.data, t.tensor_type)  # shape [n_rows, row_len] (numpy order)
        full = np.asarray(full, dtype=np.float32).reshape(-1, int(t.shape[0]))
        for row in rows:
            v = full[row]
            out.append({
                "tensor": name,
                "type": t.tensor_type.name,
                "row": row,
                "row_len": int(v.shape[0]),
                "first64": [float(x) for x in v[:64]],
                "sum": float(v.astype(np.float64).sum()),
                "sumsq": float((v.astype(np.float64) ** 2).sum()),
            })
    doc = {
        "reference": "gguf-py (pip gguf) quants.dequantize",
        "gguf_py_version": __import__("importlib.metadata").metadata.version("gguf"),
        "model": os.path.basename(MODEL),
        "model_sha256": hashlib.sha256(open(MODEL, "rb").read()).hexdigest(),
        "made_by": "runtime/model/tests/golden/make_dequant_golden.py",
        "rows": out,
    }
    with open(os.path.join(HERE, "dequant_gguf_py.json"), "w") as f:
        json.dump(doc, f, indent=0)
    print(len(out), "rows")


if __name__ == "__main__":
    main()
