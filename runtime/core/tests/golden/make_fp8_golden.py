"""The e4m3 codec as torch implements it (`torch.float8_e4m3fn`), the reference of
runtime/core/src/fp8.rs (checked by runtime/core/tests/fp8_golden.rs).

Writes fp8_e4m3_golden.json next to this script:
- "decode": the value of every byte 0..255 as torch reads it (a string "nan" for NaN);
- "encode": [f32 bits, byte] pairs: torch's cast of each input after clamping it to +-448, as
  vLLM quantizes (torch's cast alone gives NaN past 448 in some versions); the inputs are every
  midpoint between neighbouring e4m3 values (ties, both signs), each value itself, values just
  beside the midpoints, the subnormal range, and 4,000 seeded normal draws at scales 1e-3..1e3.

Usage (torch installed): python make_fp8_golden.py
"""
import json
import os

import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
codes = torch.arange(256, dtype=torch.uint8)
vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
decode = ["nan" if np.isnan(v) else float(v) for v in vals.tolist()]

finite = sorted({v for v in vals.tolist() if not np.isnan(v) and v >= 0})
inputs = []
for a, b in zip(finite, finite[1:]):
    mid = np.float32((a + b) / 2)
    inputs += [mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(1e9)), a]
inputs += [np.float32(448.0), np.float32(449.0), np.float32(480.0), np.float32(1e6), np.float32(0.0)]
rng = np.random.default_rng(0)
for scale in [1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3]:
    inputs += list((rng.standard_normal(4000 // 7) * scale).astype(np.float32))
inputs = np.array(inputs, dtype=np.float32)
inputs = np.concatenate([inputs, -inputs])
x = torch.from_numpy(inputs).clamp(-448.0, 448.0)
bytes_ = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
encode = [[int(b), int(q)] for b, q in zip(inputs.view(np.uint32), bytes_)]

out = {
    "reference": "torch %s float8_e4m3fn (clamped to +-448 before the cast, as vLLM does)" % torch.__version__,
    "decode": decode,
    "encode": encode,
}
with open(os.path.join(here, "fp8_e4m3_golden.json"), "w") as f:
    json.dump(out, f, separators=(",", ":"))
print(len(encode), "encode pairs")
