// common.h: what metrale's Metal kernels share (SIMD-group reductions, the Q4_1 block).
// Included with a quoted #include, so it is part of every including kernel's closure hash.
#pragma once
#include <metal_stdlib>
using namespace metal;

namespace mt {

// Q4_1 block as stored in GGUF: f16 scale d, f16 min m, 16 bytes of nibbles (w = q*d + m);
// the low nibble of byte j is element j, the high nibble element j + 16.
struct BlockQ4_1 {
    half d;
    half m;
    uchar qs[16];
};

inline float simd_total(float v) { return simd_sum(v); }

}  // namespace mt
