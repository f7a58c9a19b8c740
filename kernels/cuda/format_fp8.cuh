// format_fp8.cuh: the device form of fp8 weights (e4m3 rows, one f32 scale per row) and the
// per-token e4m3 quantization of their products' inputs (W8A8, as vLLM runs FP8 checkpoints)
// Included by common.cuh (its helpers and abi:: constants come first); one weight view of the
// matrix-vector kernels: fetch one 32-element block of one row (`Raw`) and widen its e4m3 values
// to f32. The row's scale is not applied per element: the products multiply each row's finished
// sum by it (`row_scale`), as the CPU reference (runtime/core/src/format/fp8.rs) does.
// e4m3 <-> f16 / f32 conversions are sm_89+ instructions (the fp8 targets are sm_90a).
#pragma once

// e4m3 bytes lo (element 2i) and hi (element 2i + 1) of a 16-bit word -> their f16 pair (exact:
// every e4m3 value is an f16 value)
MT_INLINE unsigned int e4m3x2_to_h2(unsigned short v) {
    unsigned int r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
    return r;
}

// The e4m3 byte nearest x (ties to even, saturating at +-448): the CPU's fp8::f32_to_e4m3.
MT_INLINE unsigned int e4m3_byte(float x) {
    unsigned short b;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(b) : "f"(0.f), "f"(x));
    return b & 0xffu;
}

// The e4m3 value nearest x, as f32: what the CPU's fp8::f32_to_e4m3 then e4m3_to_f32 give.
MT_INLINE float e4m3_round(float x) {
    return __half2float(__ushort_as_half((unsigned short)(e4m3x2_to_h2((unsigned short)e4m3_byte(x)) & 0xffffu)));
}

// The scale of a row of activations whose largest magnitude is amax (fp8::row_scale): amax / 448,
// 1 for a zero (or non-finite) row.
MT_INLINE float fp8_row_scale(float amax) {
    return (amax > 0.f && amax <= 3.4e38f) ? __fdiv_rn(amax, 448.f) : 1.f;
}

// x as an fp8 product reads it: e4m3(x / a) * a (fp8::round_scaled: a division, as the CPU does)
MT_INLINE float fp8_act(float x, float a) { return e4m3_round(__fdiv_rn(x, a)) * a; }

struct WF8 {
    const unsigned char* qs; const float* sc; int rows;
    struct Raw { uint4 a, c; };
    template <int K> MT_INLINE Raw fetch(int row, int b) const {
        const uint4* p = reinterpret_cast<const uint4*>(qs + (size_t)row * K + (size_t)b * 32);
        Raw r;
        r.a = __ldg(p);
        r.c = __ldg(p + 1);
        return r;
    }
    // the block's 32 e4m3 values (unscaled)
    static MT_INLINE void dequant(const Raw& r, float w[32]) {
        const unsigned int wd[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.c.x, r.c.y, r.c.z, r.c.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const unsigned int lo = e4m3x2_to_h2((unsigned short)(wd[j] & 0xffffu));
            const unsigned int hi = e4m3x2_to_h2((unsigned short)(wd[j] >> 16));
            const float2 a = __half22float2(*reinterpret_cast<const half2*>(&lo));
            const float2 b = __half22float2(*reinterpret_cast<const half2*>(&hi));
            w[4 * j] = a.x; w[4 * j + 1] = a.y; w[4 * j + 2] = b.x; w[4 * j + 3] = b.y;
        }
    }
    MT_INLINE float row_scale(int row) const { return __ldg(sc + row); }
    template <int K> MT_INLINE void load(int row, int b, float w[32]) const { dequant(fetch<K>(row, b), w); }
};
