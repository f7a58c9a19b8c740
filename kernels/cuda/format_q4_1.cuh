// format_q4_1.cuh: the device form of q4_1 weights (layout in common.cuh's header comment:
// panels of uint4 nibbles and half2 (d, m))
// Included by common.cuh (its helpers and abi:: constants come first); one weight view of the
// matrix-vector kernels: fetch one 32-element block of one row (`Raw`) and dequantise it to f32.
#pragma once

// 32-element blocks per panel of a q4_1 matrix with rows of K elements (the host's
// layout::q41_panel): abi::Q41_PANEL where it divides the row's blocks, else the whole row.
template <int K> __host__ __device__ constexpr int q41_panel() {
    return (K / 32) % abi::Q41_PANEL == 0 ? abi::Q41_PANEL : K / 32;
}

struct WQ41 {
    const uint4* qs; const half2* sc; int rows;
    struct Raw { uint4 q; half2 dm; };
    // where block b of row `row` sits in qs and sc
    template <int K> MT_INLINE size_t at(int row, int b) const {
        constexpr int P = q41_panel<K>();
        return (size_t)(b / P) * rows * P + (size_t)row * P + b % P;
    }
    template <int K> MT_INLINE Raw fetch(int row, int b) const {
        const size_t i = at<K>(row, b);
        Raw r;
        r.q = __ldg(qs + i);
        r.dm = __ldg(sc + i);
        return r;
    }
    static MT_INLINE void dequant(const Raw& r, float w[32]) {
        const float2 dm = __half22float2(r.dm);
        const unsigned int wd[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int lo = wd[j] & 0x0f0f0f0fu, hi = (wd[j] >> 4) & 0x0f0f0f0fu;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w[4 * j + i] = (magic_byte(lo, i) - MAGIC) * dm.x + dm.y;
                w[16 + 4 * j + i] = (magic_byte(hi, i) - MAGIC) * dm.x + dm.y;
            }
        }
    }
    template <int K> MT_INLINE void load(int row, int b, float w[32]) const { dequant(fetch<K>(row, b), w); }
};

