// The mma.sync GEMM machinery (m16n8k16, f16 operands split hi + lo, f32 accumulation) shared by
// gemm.cu.hbs (the layer products of prompt chunks) and moe.cu.hbs (the routed experts grouped by
// expert): the block tile of BM tokens x BN weight rows, its k steps through shared memory, the
// fragment layout of the result, and the activation split. gemm.cu.hbs's header says why the
// numerics match the f32 CPU reference to ~1e-6. A template includes this after common.cuh and
// after defining NORM_EPS (split_row's RMSNorm).
#pragma once
namespace gm {

constexpr int THREADS = abi::GEMM_THREADS;
constexpr int BM = abi::GEMM_BM, BN = abi::GEMM_BN, BK = 32;  // BK: one quant block; a k step stages S of them
static_assert(THREADS == 128 && BM == 32 && BN == 64, "the warp layout below (4 warps side by side, each 32 tokens x 16 columns) is written for this tile");

// Quant blocks per k step for row length K: 4, 3, 2 or 1, whichever divides K/32 first (fewer
// steps = fewer barrier + global round trips per block; 4 keeps the shared tiles under 48 KiB).
template <int K> struct Steps {
    static constexpr int NB = K / BK;
    static constexpr int S = NB % 4 == 0 ? 4 : (NB % 3 == 0 ? 3 : (NB % 2 == 0 ? 2 : 1));
};

template <int S> struct Smem {
    static constexpr int AS = S * BK + 8;  // row stride in halves: 16*S + 4 words, conflict-free fragment loads
    __align__(16) __half ahi[BM][AS];
    __align__(16) __half alo[BM][AS];
    __align__(16) __half b[BN][AS];
    float sx[S][BM];             // per quant block: sum of its 32 activations per token (exact f32)
    float wd[S][BN], wm[S][BN];  // per quant block and output column: scale d and offset m (q4_1), the row's scale and 0 (fp8), or 1 and 0
};

MT_INLINE void mma16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

MT_INLINE unsigned lds32(const __half* p) { return *reinterpret_cast<const unsigned*>(p); }

MT_INLINE unsigned pack_h2(__half a, __half b) {
    __half2 h = __halves2half2(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

// Activation tile of one k step, from the split activations (hi, lo: f16 [rows][K]; sx: f32
// [rows][K/32] block sums): thread i copies row t (its tile row i/4: t < 0 stages zeros),
// elements (i%4)*8 .. +8 of each of the step's S quant blocks.
template <int K>
struct ATile {
    static constexpr int S = Steps<K>::S, NB = K / BK;
    uint4 h[S], l[S];
    float sx[S];
    MT_INLINE void fetch(const __half* hi, const __half* lo, const float* asx, int t, int ks) {
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const int kb = ks * S + j;
            const size_t e = (size_t)t * K + kb * BK + (threadIdx.x & 3) * 8;
            if (t >= 0) {
                h[j] = *reinterpret_cast<const uint4*>(hi + e);
                l[j] = *reinterpret_cast<const uint4*>(lo + e);
                sx[j] = asx[(size_t)t * NB + kb];
            } else {
                h[j] = l[j] = make_uint4(0u, 0u, 0u, 0u);
                sx[j] = 0.f;
            }
        }
    }
    MT_INLINE void store(Smem<S>& s) const {
        const int r = threadIdx.x >> 2;
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const int c0 = j * BK + (threadIdx.x & 3) * 8;
            *reinterpret_cast<uint4*>(&s.ahi[r][c0]) = h[j];
            *reinterpret_cast<uint4*>(&s.alo[r][c0]) = l[j];
            if ((threadIdx.x & 3) == 0) s.sx[j][r] = sx[j];
        }
    }
};

// Weight tile of one k step (32 of the BN rows x S quant blocks; a block holds BN/32 of them), thread
// i: row ro + i/4, quarter i%4 of each quant block.
template <class W, int K> struct BTile;

template <int K> struct BTile<mt::WQ41, K> {
    static constexpr int S = Steps<K>::S;
    unsigned q[S];  // word (i%4) of each block's 16 nibble bytes: elements 4c..4c+3 (low) and 16+4c.. (high)
    half2 dm[S];
    MT_INLINE void fetch(const mt::WQ41& w, int n, int ks) {
        const int c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const int kb = ks * S + j;
            const size_t i = w.template at<K>(n, kb);
            q[j] = __ldg(reinterpret_cast<const unsigned*>(w.qs + i) + c);
            if (c == 0) dm[j] = __ldg(w.sc + i);
        }
    }
    MT_INLINE void store(Smem<S>& s, int ro) const {
        const int r = ro + (threadIdx.x >> 2), c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j) {
            __half l[4], h[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned byte = (q[j] >> (8 * i)) & 0xffu;
                l[i] = __uint2half_rn(byte & 0xfu);
                h[i] = __uint2half_rn(byte >> 4);
            }
            *reinterpret_cast<uint2*>(&s.b[r][j * BK + 4 * c]) = make_uint2(pack_h2(l[0], l[1]), pack_h2(l[2], l[3]));
            *reinterpret_cast<uint2*>(&s.b[r][j * BK + 16 + 4 * c]) = make_uint2(pack_h2(h[0], h[1]), pack_h2(h[2], h[3]));
            if (c == 0) {
                const float2 f = __half22float2(dm[j]);
                s.wd[j][r] = f.x;
                s.wm[j][r] = f.y;
            }
        }
    }
};

template <int K> struct BTile<mt::WBF16, K> {
    static constexpr int S = Steps<K>::S;
    uint4 u[S];  // elements 8c .. 8c+7 of each block of the row
    MT_INLINE void fetch(const mt::WBF16& w, int n, int ks) {
        const int c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j)
            u[j] = __ldg(reinterpret_cast<const uint4*>(w.qs + (size_t)n * K + (size_t)(ks * S + j) * BK + 8 * c));
    }
    MT_INLINE void store(Smem<S>& s, int ro) const {
        const int r = ro + (threadIdx.x >> 2), c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const unsigned wd[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
            unsigned o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                o[i] = pack_h2(__float2half_rn(__uint_as_float(wd[i] << 16)), __float2half_rn(__uint_as_float(wd[i] & 0xffff0000u)));
            *reinterpret_cast<uint4*>(&s.b[r][j * BK + 8 * c]) = make_uint4(o[0], o[1], o[2], o[3]);
            if (c == 0) {
                s.wd[j][r] = 1.f;
                s.wm[j][r] = 0.f;
            }
        }
    }
};

// fp8 rows: the e4m3 bytes widened to f16 (exact), the row's scale as every block's d (m = 0).
template <int K> struct BTile<mt::WF8, K> {
    static constexpr int S = Steps<K>::S;
    uint2 u[S];  // bytes 8c .. 8c+7 of each block of the row
    float sc;    // the row's scale
    MT_INLINE void fetch(const mt::WF8& w, int n, int ks) {
        const int c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j)
            u[j] = __ldg(reinterpret_cast<const uint2*>(w.qs + (size_t)n * K + (size_t)(ks * S + j) * BK + 8 * c));
        if (c == 0) sc = w.row_scale(n);
    }
    MT_INLINE void store(Smem<S>& s, int ro) const {
        const int r = ro + (threadIdx.x >> 2), c = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const uint4 o = make_uint4(mt::e4m3x2_to_h2((unsigned short)(u[j].x & 0xffffu)),
                                       mt::e4m3x2_to_h2((unsigned short)(u[j].x >> 16)),
                                       mt::e4m3x2_to_h2((unsigned short)(u[j].y & 0xffffu)),
                                       mt::e4m3x2_to_h2((unsigned short)(u[j].y >> 16)));
            *reinterpret_cast<uint4*>(&s.b[r][j * BK + 8 * c]) = o;
            if (c == 0) {
                s.wd[j][r] = sc;
                s.wm[j][r] = 0.f;
            }
        }
    }
};

// The MMAs of quant block j of the staged k step, scaled into acc: d * sum(q * a) + m * sum(a) per
// output column (d = 1, m = 0 for bf16).
template <int S>
MT_INLINE void block_mma(const Smem<S>& s, int j, float acc[2][2][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = 0, wn = warp, g = lane >> 2, tq = lane & 3;
    float tmp[2][2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) tmp[mt][nt][i] = 0.f;
#pragma unroll
    for (int kk = j * BK; kk < (j + 1) * BK; kk += 16) {
        unsigned ah[2][4], al[2][4], bf[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int r = wm * 32 + mt * 16 + g;
            ah[mt][0] = lds32(&s.ahi[r][kk + 2 * tq]);
            ah[mt][1] = lds32(&s.ahi[r + 8][kk + 2 * tq]);
            ah[mt][2] = lds32(&s.ahi[r][kk + 8 + 2 * tq]);
            ah[mt][3] = lds32(&s.ahi[r + 8][kk + 8 + 2 * tq]);
            al[mt][0] = lds32(&s.alo[r][kk + 2 * tq]);
            al[mt][1] = lds32(&s.alo[r + 8][kk + 2 * tq]);
            al[mt][2] = lds32(&s.alo[r][kk + 8 + 2 * tq]);
            al[mt][3] = lds32(&s.alo[r + 8][kk + 8 + 2 * tq]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int c = wn * 16 + nt * 8 + g;
            bf[nt][0] = lds32(&s.b[c][kk + 2 * tq]);
            bf[nt][1] = lds32(&s.b[c][kk + 8 + 2 * tq]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                mma16816(tmp[mt][nt], ah[mt], bf[nt]);
                mma16816(tmp[mt][nt], al[mt], bf[nt]);
            }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int r = wm * 32 + mt * 16 + g;
        const float sx0 = s.sx[j][r], sx1 = s.sx[j][r + 8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int c = wn * 16 + nt * 8 + 2 * tq;
            const float d0 = s.wd[j][c], d1 = s.wd[j][c + 1], q0 = s.wm[j][c], q1 = s.wm[j][c + 1];
            acc[mt][nt][0] += d0 * tmp[mt][nt][0] + q0 * sx0;
            acc[mt][nt][1] += d1 * tmp[mt][nt][1] + q1 * sx0;
            acc[mt][nt][2] += d0 * tmp[mt][nt][2] + q0 * sx1;
            acc[mt][nt][3] += d1 * tmp[mt][nt][3] + q1 * sx1;
        }
    }
}

// acc[mt][nt][i] of this block's tile (BM rows of A, weight rows n0..) for row length K, where
// this thread stages A row ta (its tile row threadIdx.x / 4; -1: past the rows). Fragment layout of
// mma m16n8k16 (f32 C): i = 0, 1: tile row g, columns 2*tq, 2*tq+1; i = 2, 3: tile row g + 8;
// g = lane / 4, tq = lane % 4; tile row = wm*32 + mt*16 + ..., column = n0 + wn*16 + nt*8 + ...
// Weight loads start before griddepcontrol.wait (they do not depend on the kernel before).
template <int K>
MT_INLINE void tile_mma(const __half* hi, const __half* lo, const float* asx,
                        const mt::WLayer& w, int ta, int n0, Smem<Steps<K>::S>& s, float acc[2][2][4]) {
    constexpr int S = Steps<K>::S;
    constexpr int NKS = K / (BK * S);
    constexpr int RG = BN / 32;  // weight row groups a thread stages
    const int nb = n0 + (threadIdx.x >> 2);  // the weight row this thread stages in group 0
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    BTile<mt::WLayer, K> bt[RG];
#pragma unroll
    for (int gi = 0; gi < RG; ++gi) bt[gi].fetch(w, nb + 32 * gi, 0);
    mt::pdl_wait();
    ATile<K> at;
    at.fetch(hi, lo, asx, ta, 0);
    for (int ks = 0; ks < NKS; ++ks) {
        at.store(s);
#pragma unroll
        for (int gi = 0; gi < RG; ++gi) bt[gi].store(s, 32 * gi);
        __syncthreads();
        if (ks + 1 < NKS) {  // next step's loads in flight during the MMAs
            at.fetch(hi, lo, asx, ta, ks + 1);
#pragma unroll
            for (int gi = 0; gi < RG; ++gi) bt[gi].fetch(w, nb + 32 * gi, ks + 1);
        }
#pragma unroll
        for (int j = 0; j < S; ++j) block_mma(s, j, acc);
        __syncthreads();
    }
}

// Calls f(token, column, v0, v1) for each valid (token, adjacent column pair) this thread holds.
template <class F>
MT_INLINE void for_each_pair(const float acc[2][2][4], int m0, int n0, int ntok, F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = 0, wn = warp, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int t = m0 + wm * 32 + mt * 16 + g + 8 * hr;
                if (t < ntok) f(t, n0 + wn * 16 + nt * 8 + 2 * tq, acc[mt][nt][2 * hr], acc[mt][nt][2 * hr + 1]);
            }
}


// One warp per token: a = x (NORM: x * rsqrt(mean(x^2) + eps) * norm_w, as the CPU's rmsnorm; fp8
// weights: then quantized per token, mt::fp8_act), split into hi = f16(a), lo = f16(a - hi) and the
// f32 sum of each 32-element block; lane L owns blocks L, L + 32, ... of the row.
template <int K, bool NORM>
MT_INLINE void split_row(const float* x, const float* __restrict__ norm_w, __half* __restrict__ hi,
                         __half* __restrict__ lo, float* __restrict__ asx, int ntok) {
    constexpr int NB = K / BK;
    mt::pdl_wait();
    const int lane = threadIdx.x & 31, t = blockIdx.x * (abi::SPLIT_THREADS / 32) + (threadIdx.x >> 5);
    if (t < ntok) {
        const float* xr = x + (size_t)t * K;
        float sc = 1.f;
        if (NORM) {
            const float4* p = reinterpret_cast<const float4*>(xr);
            float ss = 0.f;
            for (int i = lane; i < K / 4; i += 32) {
                const float4 v = p[i];
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            ss = mt::warp_sum(ss);
            sc = rsqrtf(ss / (float)K + NORM_EPS);
        }
        // fp8 weights (mt::RowScaled): the row quantized as their products' input, per token
        // (mt::fp8_act, with the largest magnitude of the row as it enters the product)
        float a8 = 1.f;
        if constexpr (mt::RowScaled<mt::WLayer>::ON) {
            const float4* p = reinterpret_cast<const float4*>(xr);
            const float4* pw = reinterpret_cast<const float4*>(norm_w);
            float amax = 0.f;
            for (int i = lane; i < K / 4; i += 32) {
                float4 v = p[i];
                if (NORM) {
                    const float4 nw = pw[i];
                    v = make_float4(v.x * sc * nw.x, v.y * sc * nw.y, v.z * sc * nw.z, v.w * sc * nw.w);
                }
                amax = fmaxf(fmaxf(fmaxf(amax, fabsf(v.x)), fmaxf(fabsf(v.y), fabsf(v.z))), fabsf(v.w));
            }
            a8 = mt::fp8_row_scale(mt::warp_max(amax));
        }
        for (int b = lane; b < NB; b += 32) {
            const float4* p = reinterpret_cast<const float4*>(xr + b * BK);
            const float4* pw = reinterpret_cast<const float4*>(norm_w + b * BK);
            unsigned h[16], l[16];
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float4 v = p[i];
                if (NORM) {
                    const float4 nw = pw[i];
                    v = make_float4(v.x * sc * nw.x, v.y * sc * nw.y, v.z * sc * nw.z, v.w * sc * nw.w);
                }
                if constexpr (mt::RowScaled<mt::WLayer>::ON)
                    v = make_float4(mt::fp8_act(v.x, a8), mt::fp8_act(v.y, a8), mt::fp8_act(v.z, a8), mt::fp8_act(v.w, a8));
                const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const __half h0 = __float2half_rn(f[2 * k]), h1 = __float2half_rn(f[2 * k + 1]);
                    h[2 * i + k] = pack_h2(h0, h1);
                    l[2 * i + k] = pack_h2(__float2half_rn(f[2 * k] - __half2float(h0)), __float2half_rn(f[2 * k + 1] - __half2float(h1)));
                }
                sum += v.x + v.y + v.z + v.w;
            }
            uint4* ph = reinterpret_cast<uint4*>(hi + (size_t)t * K + b * BK);
            uint4* pl = reinterpret_cast<uint4*>(lo + (size_t)t * K + b * BK);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ph[i] = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
                pl[i] = make_uint4(l[4 * i], l[4 * i + 1], l[4 * i + 2], l[4 * i + 3]);
            }
            asx[(size_t)t * NB + b] = sum;
        }
    }
    mt::pdl_launch();
}
}  // namespace gm
