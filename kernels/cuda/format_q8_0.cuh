// format_q8_0.cuh: the device form of q8_0 weights (int8 rows, a half scale per block)
// Included by common.cuh (its helpers and abi:: constants come first); one weight view of the
// matrix-vector kernels: fetch one 32-element block of one row (`Raw`) and dequantise it to f32.
#pragma once

struct WQ80 {
    const signed char* qs; const half* sc; int rows;
    struct Raw { uint4 a, c; half d; };
    template <int K> MT_INLINE Raw fetch(int row, int b) const {
        constexpr int NB = K / 32;
        const uint4* p = reinterpret_cast<const uint4*>(qs + ((size_t)row * NB + b) * 32);
        Raw r;
        r.a = __ldg(p);
        r.c = __ldg(p + 1);
        r.d = __ldg(sc + (size_t)row * NB + b);
        return r;
    }
    static MT_INLINE void dequant(const Raw& r, float w[32]) {
        const float d = __half2float(r.d);
        const unsigned int wd[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.c.x, r.c.y, r.c.z, r.c.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const unsigned int u = wd[j] ^ 0x80808080u;  // signed -> unsigned + 128
#pragma unroll
            for (int i = 0; i < 4; ++i) w[4 * j + i] = (magic_byte(u, i) - MAGIC_S8) * d;
        }
    }
    template <int K> MT_INLINE void load(int row, int b, float w[32]) const { dequant(fetch<K>(row, b), w); }
    // Streaming view (whole rows, see lm_head_1): qs as consecutive 16-byte chunks of CHUNK
    // elements; chunk u of a K-column matrix is chunk u % (K / CHUNK) of row u / (K / CHUNK).
    static constexpr int CHUNK = 16;
    struct CRaw { uint4 q; half d; };
    template <int K> MT_INLINE CRaw cfetch(unsigned int u) const {
        constexpr unsigned int C = K / CHUNK;
        CRaw r;
        r.q = __ldg(reinterpret_cast<const uint4*>(qs) + u);
        r.d = __ldg(sc + (size_t)(u / C) * (K / 32) + (u % C) / 2);
        return r;
    }
    // sum over the chunk of w * x, x = CHUNK f32 at a 16-byte aligned address: d * sum(q * x)
    static MT_INLINE float cdot(const CRaw& r, const float* x) {
        const float4* xv = reinterpret_cast<const float4*>(x);
        const unsigned int wd[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 v = xv[j];
            const unsigned int u = wd[j] ^ 0x80808080u;  // signed -> unsigned + 128
            s += (magic_byte(u, 0) - MAGIC_S8) * v.x + (magic_byte(u, 1) - MAGIC_S8) * v.y +
                 (magic_byte(u, 2) - MAGIC_S8) * v.z + (magic_byte(u, 3) - MAGIC_S8) * v.w;
        }
        return s * __half2float(r.d);
    }
};

