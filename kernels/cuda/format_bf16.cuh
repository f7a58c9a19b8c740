// format_bf16.cuh: the device form of bf16 weights (row-major bf16)
// Included by common.cuh (its helpers and abi:: constants come first); one weight view of the
// matrix-vector kernels: fetch one 32-element block of one row (`Raw`) and dequantise it to f32.
#pragma once

struct WBF16 {
    const __nv_bfloat16* qs; const void* sc; int rows;
    struct Raw { uint4 u[4]; };
    template <int K> MT_INLINE Raw fetch(int row, int b) const {
        const uint4* p = reinterpret_cast<const uint4*>(qs + (size_t)row * K + (size_t)b * 32);
        Raw r;
#pragma unroll
        for (int j = 0; j < 4; ++j) r.u[j] = __ldg(p + j);
        return r;
    }
    static MT_INLINE void dequant(const Raw& r, float w[32]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int wd[4] = {r.u[j].x, r.u[j].y, r.u[j].z, r.u[j].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // bf16 -> f32 is a 16-bit shift: exact.
                w[8 * j + 2 * i] = __uint_as_float(wd[i] << 16);
                w[8 * j + 2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
            }
        }
    }
    template <int K> MT_INLINE void load(int row, int b, float w[32]) const { dequant(fetch<K>(row, b), w); }
    // Streaming view (see WQ80): 16-byte chunks of 8 elements.
    static constexpr int CHUNK = 8;
    struct CRaw { uint4 q; };
    template <int K> MT_INLINE CRaw cfetch(unsigned int u) const {
        CRaw r;
        r.q = __ldg(reinterpret_cast<const uint4*>(qs) + u);
        return r;
    }
    static MT_INLINE float cdot(const CRaw& r, const float* x) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        const float4 a = xv[0], b = xv[1];
        return __uint_as_float(r.q.x << 16) * a.x + __uint_as_float(r.q.x & 0xffff0000u) * a.y +
               __uint_as_float(r.q.y << 16) * a.z + __uint_as_float(r.q.y & 0xffff0000u) * a.w +
               __uint_as_float(r.q.z << 16) * b.x + __uint_as_float(r.q.z & 0xffff0000u) * b.y +
               __uint_as_float(r.q.w << 16) * b.z + __uint_as_float(r.q.w & 0xffff0000u) * b.w;
    }
};

