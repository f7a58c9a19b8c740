"""Reference dequantisation of the GGUF block formats beyond Q4_0 / Q4_1 / Q8_0 (Q5_0, Q5_1, the
K-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS and MXFP4), and MXFP4's reference quantizer, for runtime/core/tests/gguf_quants_golden.rs.

Reference: gguf-py's `gguf.quants.dequantize` (the llama.cpp project's pure-Python/numpy GGUF
library, PyPI `gguf`; nobody in this project wrote it). For each of Q4_K, Q5_K, Q6_K, Q5_0 and
Q5_1: 6 blocks (super-blocks) of seeded random bytes (every bit pattern of the packed scales,
nibbles and high bits occurs), their f16 fields (`d`, and `dmin` / `m` where the format has one)
replaced by random finite values of either sign in [1e-3, 1) so the values are finite, dequantised
by gguf-py; then MXFP4: 8 blocks of random bytes (every scale byte's range but the NaN 255 of
E8M0, every code) dequantised. gguf_mxfp4_quantize_golden.bin: 64 blocks of seeded normal values
at scales 1e-3 to 1e3 (and one block of zeros), as f32, then gguf-py's MXFP4 bytes of them
(`quants.quantize`, llama.cpp's reference quantizer in numpy).

Writes gguf_quants_golden.bin next to this script: per format, u32 ggml type, u32 blocks, the
blocks' bytes, then the blocks' values as f32, all little-endian.

Usage (a venv with numpy and gguf): python make_gguf_quants_golden.py
"""
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

BLOCKS = 6
rng = np.random.default_rng(0)
out = bytearray()
for t, f16_at in ((T.Q4_K, (0, 2)), (T.Q5_K, (0, 2)), (T.Q6_K, (208,)), (T.Q5_0, (0,)),
                  (T.Q5_1, (0, 2))):
    elems, size = quants.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
    for b in range(BLOCKS):
        for at in f16_at:
            v = np.float16(rng.uniform(1e-3, 1.0) * rng.choice([-1.0, 1.0]))
            raw[b, at:at + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    y = quants.dequantize(raw.reshape(-1), t).astype("<f4")
    assert y.shape == (BLOCKS * elems,) and np.isfinite(y).all()
    out += struct.pack("<II", int(t), BLOCKS) + raw.tobytes() + y.tobytes()
# MXFP4 (after the others, so their blocks stay those of the seed's first draws)
elems, size = quants.GGML_QUANT_SIZES[T.MXFP4]
raw = rng.integers(0, 256, size=(8, size), dtype=np.uint8)
raw[:, 0] = rng.integers(0, 255, size=8)
y = quants.dequantize(raw.reshape(-1), T.MXFP4).astype("<f4")
assert y.shape == (8 * elems,) and np.isfinite(y).all()
out += struct.pack("<II", int(T.MXFP4), 8) + raw.tobytes() + y.tobytes()
here = os.path.dirname(os.path.abspath(__file__))
x = np.concatenate([rng.standard_normal(32 * 64).astype(np.float32)
                    * np.repeat(np.float32(10.0) ** rng.uniform(-3, 3, 64).astype(np.float32), 32),
                    np.zeros(32, dtype=np.float32)]).astype("<f4")
q = quants.quantize(x.reshape(1, -1), T.MXFP4).reshape(-1)
with open(os.path.join(here, "gguf_mxfp4_quantize_golden.bin"), "wb") as f:
    f.write(x.tobytes() + q.tobytes())
# the read-only formats (what llama-quantize writes for the Q2_K, Q3_K_S/M/L, IQ4_NL and IQ4_XS
# mixes), as the first five: random bytes, their f16 fields random finite values
for t, f16_at in ((T.Q2_K, (80, 82)), (T.Q3_K, (108,)), (T.IQ4_NL, (0,)), (T.IQ4_XS, (0,))):
    elems, size = quants.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
    for b in range(BLOCKS):
        for at in f16_at:
            v = np.float16(rng.uniform(1e-3, 1.0) * rng.choice([-1.0, 1.0]))
            raw[b, at:at + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    y = quants.dequantize(raw.reshape(-1), t).astype("<f4")
    assert y.shape == (BLOCKS * elems,) and np.isfinite(y).all()
    out += struct.pack("<II", int(t), BLOCKS) + raw.tobytes() + y.tobytes()
path = os.path.join(here, "gguf_quants_golden.bin")
with open(path, "wb") as f:
    f.write(out)
print(f"wrote {path}: {len(out)} bytes")
