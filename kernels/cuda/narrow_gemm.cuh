// The narrow GEMMs of q4_1 weights (wn_*, gemm_hopper.cu.hbs): the layer products of a chunk of at
// most abi::WN_TOKENS tokens (a speculative verification step of one sequence, a decode step of a
// few) on mma.sync m16n8k16, the tokens the instruction's N side (8) and the weight rows its M side.
// A template includes this after wg_gemm.cuh (its cp16, tile_out, tile_scales, lop3_and_or).
//
// Why not the wq_* kernels at these sizes: a wq_* block stages 256 rows of weights through shared
// memory for a token tile of 16, and its fixed costs (the ring's barriers, one block per SM, the
// split-K combine of 256-row partials) are paid for 5 tokens as for 16. Here each warp streams its
// own 16 weight rows straight from memory into registers, wn::D panels ahead (the first of them
// before the PDL wait: weights are never written by a kernel), as the batch-1
// matrix-vector kernels do, and the tensor cores make the token count nearly free: an MMA covers
// 16 rows x 16 elements of K for all 8 tokens.
//
// Block: abi::WN_THREADS threads, warp w on rows f0 + 16w .. f0 + 16w + 15 (f0 = blockIdx.y *
// WN_ROWS), every warp on the same span of K: split z = blockIdx.z of gridDim.z, whole q4_1 panels
// (128 elements, abi::Q41_PANEL blocks). The span's activations (f16 [ntok][K], as the wq_* kernels
// read them) are staged once in shared memory, abi::WN_PANEL_BYTES a panel, then the warps run.
//
// Fragments. Thread (g = lane / 4, q = lane % 4) loads block q of each panel of rows g and g + 8:
// 16 bytes of nibbles and its (d, m) each. The order of K inside one MMA is free as long as both
// operands follow it, so k16 step s of a panel (s = 0..7) takes from each thread's block its
// elements e = 4s .. 4s + 3 (word s % 4 of the block's nibbles: byte b holds element b in its low
// nibble and b + 16 in its high one, so the low nibbles for s < 4, the high ones after): the A
// columns 2q, 2q + 1 get elements (e, e + 2) (bytes 0 and 2 of the word, one lop3), the columns
// 2q + 8, 2q + 9 get (e + 1, e + 3), and B's rows 2q.. / 2q + 8.. the same elements of token g's
// activations. A weight becomes f16 as in
// wg_gemm.cuh's FQ41: (1024 + q) by OR-ing in the exponent, exactly q after one subtraction (the
// high nibble: (1024 + 16q) / 16 - 64), then q * d + m in one rounding; the numerics are the wq_*
// kernels' (f16 weights and activations, f32 accumulation), only the order of the sums differs.
//
// Shared memory: panel p of the span is WN_PANEL_BYTES: token t's 256 bytes, block qq's 64 of
// them, in four 16-byte chunks, chunk j stored at slot j ^ ((qq >> 1) | ((t & 1) << 1)), so that
// the 8 threads of a quarter warp (tokens g, g + 1; blocks 0..3) read 8 different 16-byte slots of
// one 128-byte bank window.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(METRALE_GA_f16) && defined(METRALE_W_q4_1)
namespace wg {
namespace wn {
constexpr int N = abi::WN_TOKENS, T = abi::WN_THREADS, WARPS = T / 32, F = abi::WN_ROWS;
constexpr int PK = abi::Q41_PANEL * 32;  // elements of K a panel
constexpr int D = 4;                     // panels of weights in flight per thread
static_assert(N == 8 && F == 16 * WARPS && abi::WN_PANEL_BYTES == N * PK * 2, "one n8 MMA tile of tokens");
static_assert(abi::Q41_PANEL == 4, "a thread's block of each panel: lane % 4");

MT_INLINE void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
MT_INLINE unsigned u(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }
MT_INLINE __half2 hh(unsigned v) { return *reinterpret_cast<__half2*>(&v); }

// One row's block (16 bytes of nibbles, (d, m)) as the A halves of the 8 k16 steps of a panel:
// step s takes elements e = 4s .. 4s + 3 (word s % 4, low nibbles for s < 4, high ones after);
// out[s][0] = columns 2q, 2q + 1 (elements e, e + 2), out[s][1] = columns 2q + 8, 2q + 9 (e + 1, e + 3).
MT_INLINE void dequant(const uint4& v, unsigned dmw, unsigned (&out)[8][2]) {
    const __half2 dm = hh(dmw), d2 = __low2half2(dm), m2 = __high2half2(dm);
    const __half2 k1024 = __float2half2_rn(1024.f), k16th = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
    const unsigned wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const unsigned t[2] = {wd[w], wd[w] >> 8};  // bytes 0, 2 and bytes 1, 3 at bits 0 and 16
#pragma unroll
        for (int o = 0; o < 2; ++o) {
            const __half2 lo = __hsub2(hh(lop3_and_or(t[o], 0x000F000Fu, 0x64006400u)), k1024);
            const __half2 hi = __hfma2(hh(lop3_and_or(t[o], 0x00F000F0u, 0x64006400u)), k16th, km64);
            out[w][o] = u(__hfma2(lo, d2, m2));
            out[4 + w][o] = u(__hfma2(hi, d2, m2));
        }
    }
}

// The 16-byte slot of chunk j of block qq of token t in a staged panel (bytes).
MT_INLINE int slot(int t, int qq, int j) { return t * 256 + qq * 64 + 16 * (j ^ ((qq >> 1) | ((t & 1) << 1))); }
}  // namespace wn

// The product over the block's rows and split (above), then tile_out (the split-K combine and
// epi). `rows`: the matrix's rows (its panels' stride); `sin`: where the input is an unscaled
// RMSNorm, its squares' partials.
template <int K, class Epi>
MT_INLINE void gemm_narrow(const act_t* a, const void* wq, const void* wsc, int rows, int ntok, float* ws, unsigned int* counters,
                           const float* sin, Epi epi) {
    using namespace wn;
    constexpr int NP = K / PK;
    static_assert(K % PK == 0, "whole panels");
    extern __shared__ __align__(16) unsigned char wn_smem[];
    __shared__ __align__(16) float ot[N * (F + 4)];
    const uint4* qs = static_cast<const uint4*>(wq);
    const unsigned* sc = static_cast<const unsigned*>(wsc);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int f0 = blockIdx.y * F, r0 = f0 + 16 * warp + g;
    const int splits = gridDim.z, z = blockIdx.z;
    const int p0 = z * NP / splits, np = (z + 1) * NP / splits - p0;
    // block q of panel p of row r (uint4 of qs, half2 of sc): the panelled layout of common.cuh
    auto at = [&](int p, int r) { return ((size_t)(p0 + p) * rows + r) * abi::Q41_PANEL + q; };
    uint4 wa[D], wb[D];
    unsigned da[D], db[D];
#pragma unroll
    for (int i = 0; i < D; ++i)
        if (i < np) {
            wa[i] = __ldg(qs + at(i, r0));
            wb[i] = __ldg(qs + at(i, r0 + 8));
            da[i] = __ldg(sc + at(i, r0));
            db[i] = __ldg(sc + at(i, r0 + 8));
        }
    mt::pdl_wait();
    // the span's activations: chunk c = ((t * np + p) * 4 + qq) * 4 + j, 16 bytes each
    const int nt = min(N, ntok);
    const unsigned st = (unsigned)__cvta_generic_to_shared(wn_smem);
    for (int c = threadIdx.x; c < nt * np * 16; c += T) {
        const int j = c & 3, qq = (c >> 2) & 3, p = (c >> 4) % np, t = (c >> 4) / np;
        cp16(st + p * abi::WN_PANEL_BYTES + slot(t, qq, j), a + (size_t)t * K + (size_t)(p0 + p) * PK + qq * 32 + j * 8, true);
    }
    cp_commit();
    if (sin) tile_scales<N, T>(tile_rs, sin, 0, ntok, threadIdx.x);  // seen after the barriers below
    cp_wait<0>();
    __syncthreads();
    const bool tok = g < nt;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i0 = 0; i0 < np; i0 += D) {
#pragma unroll
        for (int j = 0; j < D; ++j) {
            const int i = i0 + j;
            if (i >= np) break;
            const uint4 va = wa[j], vb = wb[j];
            const unsigned ma = da[j], mb = db[j];
            if (i + D < np) {  // refill the slot: panel i + D
                wa[j] = __ldg(qs + at(i + D, r0));
                wb[j] = __ldg(qs + at(i + D, r0 + 8));
                da[j] = __ldg(sc + at(i + D, r0));
                db[j] = __ldg(sc + at(i + D, r0 + 8));
            }
            uint4 x[4];
            const unsigned pa = st + i * abi::WN_PANEL_BYTES;
#pragma unroll
            for (int c = 0; c < 4; ++c) x[c] = tok ? lds128(pa + slot(g, q, c)) : make_uint4(0u, 0u, 0u, 0u);
            unsigned ha[8][2], hb[8][2];
            dequant(va, ma, ha);
            dequant(vb, mb, hb);
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                // token g's elements 4s .. 4s + 3 of block q: 8 bytes, half s % 2 of chunk s / 2
                const uint4& xc = x[s >> 1];
                const unsigned x0 = (s & 1) ? xc.z : xc.x, x1 = (s & 1) ? xc.w : xc.y;
                const unsigned b0 = prmt(x0, x1, 0x5410u), b1 = prmt(x0, x1, 0x7632u);  // (e, e + 2), (e + 1, e + 3)
                // rows g and g + 8, columns 2q.. and 2q + 8..: dequant's out[s]
                const unsigned af[4] = {ha[s][0], hb[s][0], ha[s][1], hb[s][1]};
                mma(acc, af, b0, b1);
            }
        }
    }
    // rows 16 warp + g (+ 8), tokens 2q, 2q + 1 -> ot[token][row]
    constexpr int FP = F + 4;
    const int f = 16 * warp + g;
    ot[(2 * q) * FP + f] = acc[0];
    ot[(2 * q + 1) * FP + f] = acc[1];
    ot[(2 * q) * FP + f + 8] = acc[2];
    ot[(2 * q + 1) * FP + f + 8] = acc[3];
    __syncthreads();
    tile_out<N, F, T>(ot, 0, f0, ntok, ws, counters, threadIdx.x, sin ? tile_rs : nullptr, [] { __syncthreads(); }, epi);
    mt::pdl_launch();
}
}  // namespace wg
#define WN_BODY(...) __VA_ARGS__
#else
#define WN_BODY(...)
#endif
