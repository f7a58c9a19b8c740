// The Hopper GEMM machinery (wgmma.mma_async, sm_90a) shared by gemm_hopper.cu.hbs (the layer
// products of prompt chunks and of many-sequence decode steps) and moe.cu.hbs (the routed experts
// grouped by expert): the block shapes the host plans with (layout::wg_*, layout::wq_*), the
// weight formats' stages (FBf16, FQ41, FQ80), the one-warpgroup kernel `gemm` and the
// warp-specialised `gemm_ws`, the split-K combine and the epilogue walk (`tile_out`). A template
// includes this after common.cuh and gemm_epi.cuh (with their shape constants and the
// METRALE_W_* / METRALE_E_* / METRALE_GA_* defines), and wraps the entry bodies that use it in
// WG_BODY (one-warpgroup) or WQ_BODY (warp-specialised): outside the sm_90a cubin of a target
// these kernels serve, the bodies are compiled out and the host never launches them.
//
// The product is computed transposed (out^T = W * a^T): the weight rows are the instruction's M
// side (64 per block, 128 for the 128-token tile) and the tokens its N side (tile_n = 16, 32, 64 or
// 128), so a decode step of 16 sequences wastes no tensor-core work, and both operands are K-major
// in memory as they are stored (weights [rows][K], activations [ntok][K]). Each pipeline stage holds
// 64 elements of K of both tiles (one 128-byte row per token, and per bf16 weight row; quantized
// rows take 40 (q4_1) or 68 (q8_0) of their 128 bytes) in the 128-byte-swizzled layout the matrix
// descriptors name; cp.async fills stages STAGES - 2 ahead (weights before the PDL wait) while one
// k-step's MMAs run behind the next one's issue. bf16 weights are the MMAs' A operand in shared
// memory; quantized weights are dequantised by each thread into its A fragments in registers
// (`FQ41`, `FQ80` below: W4A16, W8A16), the blocks of their stage overlapping the MMAs of the last.
// The warp-specialised blocks (`gemm_ws`, quantized weights) hold the same stages without a
// block-wide barrier per k-step: a producer warpgroup keeps up to 16 stages in flight, and two
// consumer warpgroups (256 weight rows between them) wait only for their data.
// Split-K (grid.z > 1, for products whose tiles alone would leave SMs idle): each split writes its
// partial tile to `ws`; the last split to finish (a ticket in `counters`, reset by it) adds the
// partials in split order, so the result does not depend on which finished last, and applies the
// epilogue.
//
// Numerics: bf16 weights enter exactly; activations are rounded once to bf16 (2^-9 relative), f32
// accumulation. That is what bf16 serving engines compute; the mma.sync path (hi/lo f16 pairs) is
// the one that matches the f32 CPU reference to 1e-6. Quantized weights: activations and the
// dequantised weights each rounded once to f16 (2^-11 relative), f32 accumulation.
//
// Rows (below): which rows of the activations a block reads. The dense products take token tile
// blockIdx.x and weight-row tile blockIdx.y; the grouped experts name the tile of an expert's
// pairs, each tile row's activation row through moe_sort's order, and the expert's first weight row.
#pragma once

namespace wg {
// A block's rows of the activations and of the weights. The dense products: token tile blockIdx.x
// (rows t0 = blockIdx.x * N ..), weight-row tile blockIdx.y from row 0. The routed experts grouped
// by expert (moe.cu.hbs): rows t0.. of one expert's `ntok` pairs (a tile of moe_sort's list), tile
// row t reading the activations' row map[t] / div (map: the expert's span of moe_sort's order; div
// K for gate/up, whose input is the pair's token, 1 for down, whose input is the pair's own row),
// and the expert's weight rows from f0.
struct Rows {
    const int* map = nullptr;
    int div = 1, t0 = 0, f0 = 0;
    MT_INLINE int src(int t) const { return map ? map[t] / div : t; }
    template <int N> MT_INLINE int first() const { return map ? t0 : (int)blockIdx.x * N; }
};

constexpr int BM = abi::WG_BM, BK = abi::WG_BK;
static_assert(BK * 2 == 128, "a stage row is one 128-byte swizzle row of bf16");

// The block shape of token tile N and weight rows of RB bytes per stage (the host computes the same:
// layout::wg_*; codegen asserts they agree): MT = weight-row tiles of 64 per block (two for the
// 128-token tile, which is compute-bound: 128 x 128 per block reads 1.5x fewer operand bytes per
// MMA than 64 x 128), the bytes of a stage's weight rows (rounded up to the 1024 bytes of the token
// rows' swizzle), its shared-memory budget (two blocks per SM, but one for the 128-token tile of
// bf16 weights), pipeline stages and dynamic shared memory.
__host__ __device__ constexpr int row_tiles(int n) { return n >= 128 ? 2 : 1; }
__host__ __device__ constexpr int weight_bytes(int n, int rb) { return (BM * row_tiles(n) * rb + 1023) / 1024 * 1024; }
__host__ __device__ constexpr int budget(int n, int rb) { return n >= 128 && rb == 128 ? abi::WG_SMEM_LARGE : abi::WG_SMEM_SMALL; }
__host__ __device__ constexpr int stage_bytes(int n, int rb) { return weight_bytes(n, rb) + n * BK * 2; }
__host__ __device__ constexpr int stages(int n, int rb) {
    return budget(n, rb) / stage_bytes(n, rb) < abi::WG_MAX_STAGES ? budget(n, rb) / stage_bytes(n, rb) : abi::WG_MAX_STAGES;
}
__host__ __device__ constexpr int smem_bytes(int n, int rb) { return stages(n, rb) * stage_bytes(n, rb) + 1024; }  // + alignment to 1024
}  // namespace wg

// The warp-specialised blocks of quantized weights (wq_*, gemm_ws below; the host computes the same:
// layout::wq_*): 256 weight rows (two consumer warpgroups of two 64-row tiles each: a stage's token
// rows serve 256 weight rows, and at 128 tokens a consumer's accumulators are 128 registers), stages
// of WQ_KS * 64 elements of K (RB bytes a weight row, the rows rounded up to 1024 bytes, then
// WQ_KS tiles of n token rows of 128 bytes), as many as fit in WQ_SMEM, at most WQ_MAX_STAGES.
namespace wq {
constexpr int ROWS = 4 * abi::WG_BM;
__host__ __device__ constexpr int weight_bytes(int rb) { return (ROWS * rb + 1023) / 1024 * 1024; }
__host__ __device__ constexpr int stage_bytes(int n, int rb) { return weight_bytes(rb) + abi::WQ_KS * n * abi::WG_BK * 2; }
__host__ __device__ constexpr int stages(int n, int rb) {
    return abi::WQ_SMEM / stage_bytes(n, rb) < abi::WQ_MAX_STAGES ? abi::WQ_SMEM / stage_bytes(n, rb) : abi::WQ_MAX_STAGES;
}
__host__ __device__ constexpr int smem_bytes(int n, int rb) { return stages(n, rb) * stage_bytes(n, rb) + 1024; }
}  // namespace wq

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && (defined(METRALE_W_bf16) || defined(METRALE_GA_f16))
#include "wgmma.cuh"
#include "mbarrier.cuh"

namespace wg {

// 16 (8, 4) bytes global -> shared, zero-filled when !valid (the source is then not read).
MT_INLINE void cp16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the
// bulk copy engine, completing as transaction bytes on mbarrier `bar`
MT_INLINE void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src),
                 "r"(bytes), "r"(bar)
                 : "memory");
}
MT_INLINE void cp8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
MT_INLINE void cp4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
MT_INLINE void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> MT_INLINE void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy.
MT_INLINE void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
MT_INLINE uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
MT_INLINE unsigned lds32(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
MT_INLINE unsigned prmt(unsigned a, unsigned b, unsigned sel) { return __byte_perm(a, b, sel); }
MT_INLINE unsigned lop3_and_or(unsigned a, unsigned mask, unsigned bits) {  // (a & mask) | bits
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}
MT_INLINE unsigned h2u(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }
MT_INLINE __half2 u2h(unsigned u) { return *reinterpret_cast<__half2*>(&u); }

// The token rows of a stage: tile rows t0.. (N) after the weight rows' WB bytes, elements k0..k0+63
// of each (one 128-byte swizzle row of 16-bit activations), 16-byte chunk i of the stage's rows x
// 8 chunks per thread step; rows past ntok are zeros.
template <int K, int N, int WB>
MT_INLINE void load_a(unsigned st, const act_t* a, int t0, int ntok, int k0, const Rows& rows) {
    const unsigned sb = st + WB;
    static_assert(N * 8 % abi::WG_THREADS == 0, "token tiles are multiples of 16");
#pragma unroll
    for (int it = 0; it < N * 8 / abi::WG_THREADS; ++it) {
        const int i = threadIdx.x + it * abi::WG_THREADS, r = i >> 3, c = i & 7, t = t0 + r;
        const bool ok = t < ntok;
        cp16(sb + r * 128 + ((c ^ (r & 7)) << 4), a + (size_t)(ok ? rows.src(t) : 0) * K + k0 + c * 8, ok);
    }
}

// The weight formats of a stage. Each moves the R weight rows' elements k0..k0 + 64 * KS - 1
// (ROW_BYTES per row) to the start of the stage (load, before the PDL wait: no kernel writes
// weights) and issues the stage's MMAs into acc (step: rows r0.. of the stage for this warpgroup,
// B from the stage's token rows at `tok`: KS tiles of 64 elements, N rows of 128 swizzled bytes
// each), leaving at most the last stage's commit groups in flight.
// KS: 64-element k-steps a stage holds (1 in the one-warpgroup kernels; 2 in the warp-specialised
// ones, so each q4_1 row's stage is 64 contiguous bytes of nibbles, two 32-byte sectors, not one).
//
// bf16 (one-warpgroup kernels): the rows as stored, 128-byte swizzled, both operands from shared
// memory (bf16 activations).
struct FBf16 {
    const __nv_bfloat16* w;
    MT_INLINE FBf16(const void* qs, const void*, int) : w(static_cast<const __nv_bfloat16*>(qs)) {}
    template <int K, int R> MT_INLINE void load(unsigned st, int f0, int k0) const {
#pragma unroll
        for (int it = 0; it < R * 8 / abi::WG_THREADS; ++it) {
            const int i = threadIdx.x + it * abi::WG_THREADS, r = i >> 3, c = i & 7;
            cp16(st + r * 128 + ((c ^ (r & 7)) << 4), w + (size_t)(f0 + r) * K + k0 + c * 8, true);
        }
    }
    static constexpr int KS = 1;
    static constexpr int ROW_BYTES = 128;
    static constexpr bool ZEROED = true;  // the accumulators start at zero (the SS wrappers accumulate)
    template <int N, int MT, int RS>
    MT_INLINE void step(float (&acc)[MT][N / 2], unsigned st, unsigned tok, bool, int r0) const {
        const unsigned long long db = desc(tok);
        wgmma_fence();
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const unsigned long long da = desc(st + (r0 + m * BM) * 128);
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) Wg<N>::mma(acc[m], da + 2 * kk, db + 2 * kk);  // +32 bytes per k16
        }
        wgmma_commit();
        wgmma_wait<1>();  // k-step i-1's MMAs are done; i's keep running
    }
};

// Quantized weights (f16 activations): each thread dequantises its rows' A fragments from the
// stage into registers and the MMAs read them there (WgRs), a 32-element block (two k16 steps) at
// a time: before writing a block's fragments the warpgroup waits for the MMAs of the block before
// the last, so the dequantisation of one block overlaps the MMAs of the previous one.
// Thread (warp w, lane l; g = l / 4, q = l % 4) holds rows 16w + g and 16w + g + 8 of each 64-row
// tile, columns 2q, 2q + 1, 2q + 8, 2q + 9 of each k16 step (wgmma.cuh, WgRs). SEL gathers the
// bytes of columns 2q, 2q + 1 from a pair of words into bytes 0 and 2 of one.
// The commit groups (blocks) left in flight after each block's MMAs: at small N an MMA group is
// a few cycles of tensor work behind a wgmma's fixed latency, so two blocks' MMAs run while the
// next block is dequantised (their fragments stay live: 8 registers a block at N <= 64); at 128 one
// (the fragments of two row tiles are 16 registers a block beside 128 accumulators). At most the
// two blocks of the last stage stay in flight, so the stage a load refills (two back) is free.
__host__ __device__ constexpr int inflight(int n) { return n <= 64 ? 2 : 1; }
MT_INLINE unsigned frag_sel() {
    const unsigned q = threadIdx.x & 3;
    return (2 * q) | ((2 * q + 1) << 8);
}

// The MMAs of 32-element block b of a stage (k16 steps 2b, 2b + 1; B from token tile b / 2 of the
// stage at `tok`) from the fragments a, then the wait that leaves inflight(N) blocks' MMAs running
// (the block before those is done: its registers are free). `more`: the tile's accumulators hold
// earlier k-steps (else block 0's first MMA overwrites them).
template <int N, int MT>
MT_INLINE void rs_block(float (&acc)[MT][N / 2], const unsigned (&a)[MT][2][4], unsigned tok, int b, bool more) {
    const unsigned long long db = desc(tok + (b >> 1) * N * 128) + 2 * 2 * (b & 1);  // +32 bytes per k16
    wgmma_fence();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) WgRs<N>::mma(acc[m], a[m][kk], db + 2 * kk, more || b || kk);
    wgmma_commit();
    wgmma_wait<inflight(N)>();
}

// q4_1: per row its 2 * KS blocks' 16 nibble bytes as stored, then every row's 2 * KS (d, m)
// half2; k16 step 0 of a block is the low nibbles of its bytes 0..15, step 1 the high ones (GGUF's
// order). A nibble pair becomes f16 (1024 + q) by OR-ing in the exponent (1024 + 16q for the high
// nibble), exactly q after one subtraction (one FMA by 1/16 for the high nibble), then q * d + m
// in one rounding (FMA): the weight to f16's 2^-11.
template <int KS_> struct FQ41 {
    static constexpr int KS = KS_, NBS = 2 * KS;  // 32-element blocks a row holds in a stage
    const uint4* qs;
    const __half2* sc;
    int rows;
    MT_INLINE FQ41(const void* q, const void* s, int rows_)
        : qs(static_cast<const uint4*>(q)), sc(static_cast<const __half2*>(s)), rows(rows_) {}
    // Rows f0.. of the panelled layout (common.cuh): a stage lies inside one panel, where its R
    // rows' blocks are R * P consecutive blocks. Where the stage is the whole panel (the
    // warp-specialised kernels: `bar`, the stage's full barrier, given) its nibbles and its (d, m)
    // pairs are two contiguous spans: thread 0 moves them with two bulk copies that complete on the
    // barrier (bulk_bytes of them, which the producer expects). Else each of the 128 threads copies
    // 16-byte pieces with cp.async.
    template <int K, int R> __host__ __device__ static constexpr int bulk_bytes() { return mt::q41_panel<K>() == NBS ? R * NBS * 20 : 0; }
    template <int K, int R> MT_INLINE void load(unsigned st, int f0, int k0, unsigned bar = 0) const {
        constexpr int P = mt::q41_panel<K>();
        static_assert(P % NBS == 0, "a stage lies inside one panel");
        const int b0 = k0 / 32;
        const size_t p0 = (size_t)(b0 / P) * rows * P + (size_t)f0 * P + b0 % P;
        if (bulk_bytes<K, R>() > 0 && bar != 0) {
            if (threadIdx.x == 0) {
                bulk_copy(st, qs + p0, R * NBS * 16, bar);
                bulk_copy(st + R * 16 * NBS, sc + p0, R * NBS * 4, bar);
            }
            return;
        }
        static_assert(R * NBS % abi::WG_THREADS == 0, "whole copies per thread");
#pragma unroll 4  // (fully unrolled, the warp-specialised producer's addresses spill)
        for (int it = 0; it < R * NBS / abi::WG_THREADS; ++it) {
            const int i = threadIdx.x + it * abi::WG_THREADS, r = i / NBS, b = i % NBS;
            cp16(st + r * 16 * NBS + b * 16, qs + p0 + r * P + b, true);
        }
        for (int r = threadIdx.x; r < R; r += abi::WG_THREADS) {
            const unsigned dst = st + R * 16 * NBS + r * 4 * NBS;
            if (KS == 1) cp8(dst, sc + p0 + r * P);
            else cp16(dst, sc + p0 + r * P, true);
        }
    }
    static constexpr int ROW_BYTES = 20 * NBS;
    static constexpr bool ZEROED = false;  // the first MMA of the tile overwrites its accumulators
    template <int N, int MT, int R>
    MT_INLINE void step(float (&acc)[MT][N / 2], unsigned st, unsigned tok, bool more, int r0) const {
        const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2;
        const unsigned sel = frag_sel();
        const __half2 k1024 = __float2half2_rn(1024.f), k16th = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
#pragma unroll
        for (int b = 0; b < NBS; ++b) {
            unsigned a[MT][2][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = r0 + m * BM + 16 * warp + g + 8 * h;
                    const uint4 v = lds128(st + r * 16 * NBS + b * 16);
                    const __half2 dm = u2h(lds32(st + R * 16 * NBS + r * 4 * NBS + b * 4));
                    const __half2 d2 = __low2half2(dm), m2 = __high2half2(dm);
                    const unsigned t[2] = {prmt(v.x, v.y, sel), prmt(v.z, v.w, sel)};  // columns 2q.., 2q + 8..
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const __half2 lo = __hsub2(u2h(lop3_and_or(t[j], 0x000F000Fu, 0x64006400u)), k1024);
                        const __half2 hi = __hfma2(u2h(lop3_and_or(t[j], 0x00F000F0u, 0x64006400u)), k16th, km64);
                        a[m][0][2 * j + h] = h2u(__hfma2(lo, d2, m2));
                        a[m][1][2 * j + h] = h2u(__hfma2(hi, d2, m2));
                    }
                }
            rs_block<N, MT>(acc, a, tok, b, more);
        }
    }
};

// q8_0 (an LM head with q4_1 layers): per row its 2 * KS blocks' 32 int8 as stored, then every
// row's 2 * KS d. A byte pair becomes f16 (1024 + 128 + q) by flipping the sign bit and OR-ing in
// the exponent, exactly q after one subtraction, then q * d in one rounding.
template <int KS_> struct FQ80 {
    static constexpr int KS = KS_, NBS = 2 * KS;
    const signed char* qs;
    const __half* sc;
    MT_INLINE FQ80(const void* q, const void* s, int) : qs(static_cast<const signed char*>(q)), sc(static_cast<const __half*>(s)) {}
    template <int K, int R> __host__ __device__ static constexpr int bulk_bytes() { return 0; }
    template <int K, int R> MT_INLINE void load(unsigned st, int f0, int k0, unsigned = 0) const {
        constexpr int NB = K / 32;
        static_assert(R * 2 * NBS % abi::WG_THREADS == 0, "whole copies per thread");
#pragma unroll 4  // (fully unrolled, the warp-specialised producer's addresses spill)
        for (int it = 0; it < R * 2 * NBS / abi::WG_THREADS; ++it) {
            const int i = threadIdx.x + it * abi::WG_THREADS, r = i / (2 * NBS), c = i % (2 * NBS);
            cp16(st + r * 32 * NBS + c * 16, qs + (size_t)(f0 + r) * K + k0 + c * 16, true);
        }
        for (int r = threadIdx.x; r < R; r += abi::WG_THREADS) {
            const unsigned dst = st + R * 32 * NBS + r * 2 * NBS;
            if (KS == 1) cp4(dst, sc + (size_t)(f0 + r) * NB + k0 / 32);
            else cp8(dst, sc + (size_t)(f0 + r) * NB + k0 / 32);
        }
    }
    static constexpr int ROW_BYTES = 34 * NBS;
    static constexpr bool ZEROED = false;  // the first MMA of the tile overwrites its accumulators
    template <int N, int MT, int R>
    MT_INLINE void step(float (&acc)[MT][N / 2], unsigned st, unsigned tok, bool more, int r0) const {
        const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2;
        const unsigned sel = frag_sel();
        const __half2 k1152 = __float2half2_rn(1152.f);
#pragma unroll
        for (int b = 0; b < NBS; ++b) {
            unsigned a[MT][2][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = r0 + m * BM + 16 * warp + g + 8 * h;
                    const __half d = __ushort_as_half((unsigned short)(lds32(st + R * 32 * NBS + r * 2 * NBS + (b >> 1) * 4) >> (16 * (b & 1))));
                    const __half2 d2 = __half2half2(d);
#pragma unroll
                    for (int kk = 0; kk < 2; ++kk) {
                        const uint4 v = lds128(st + r * 32 * NBS + b * 32 + kk * 16);
                        const unsigned t[2] = {prmt(v.x, v.y, sel) ^ 0x00800080u, prmt(v.z, v.w, sel) ^ 0x00800080u};
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            const __half2 q = __hsub2(u2h(lop3_and_or(t[j], 0x00FF00FFu, 0x64006400u)), k1152);
                            a[m][kk][2 * j + h] = h2u(__hmul2(q, d2));
                        }
                    }
                }
            rs_block<N, MT>(acc, a, tok, b, more);
        }
    }
};

// The tile's accumulators to zero: where no MMA overwrites them (bf16 stages accumulate from the
// first, and a split without k-steps adds nothing).
template <int MT, int R> MT_INLINE void zero(float (&acc)[MT][R]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < R; ++i) acc[m][i] = 0.f;
}

// The finished tile goes through shared memory as ot[token][row] (f32; F rows padded by 4 so the
// fragment stores are free of bank conflicts): the fragment layout of the MMAs in, rows in order
// out, so that the split-K combine and the epilogue run as plain loops with coalesced accesses.
// acc_out: this thread's accumulators of rows r0 + 64m + 16w + g + 8h (warp w of its warpgroup),
// tokens 8j + 2q + c.
template <int N, int MT, int FP>
MT_INLINE void acc_out(float* ot, const float (&acc)[MT][N / 2], int r0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int f = r0 + BM * m + 16 * warp + g + 8 * h, t = 8 * j + 2 * tq;
                ot[t * FP + f] = acc[m][4 * j + 2 * h];
                ot[(t + 1) * FP + f] = acc[m][4 * j + 2 * h + 1];
            }
}

// The tile in ot (rows f0.., tokens t0..) by T threads (tid 0..T-1, synchronised by sync()): with
// K split (gridDim.z > 1), this split's partial to ws, and the last split of the tile to finish
// (a ticket in `counters`, reset by it) adds the partials in split order, so the result does not
// depend on which finished last; then epi on every (token, adjacent row pair), consecutive threads
// on consecutive pairs of one token, CH pairs a thread at a time with every load of the CH (the
// token's position and cache block, the rotation, the residual) before their stores: a store
// through a pointer the compiler cannot tell apart from a later load would otherwise make each
// pair one memory round trip (the QKV epilogue of a 256-row, 128-token tile is 64 pairs a thread).
// Returns early in the splits that are not last.
// `rs`: the tile's tokens' RMSNorm factors (tile_scales) where the input is an unscaled norm,
// applied before epi; where epi writes the next product's input (epi::Residual with `an`), the new
// residual goes back into the tile, and a second pass sums each token's 32 columns' squares into
// ss (a thread a 32-column run, from a rotated start so a warp's reads hit 32 banks; the order is
// fixed, so the bits are).
template <int N, int F, int T, class Sync, class Epi>
MT_INLINE void tile_out(float* ot, int t0, int f0, int ntok, float* ws, unsigned int* counters, int tid, const float* rs, Sync sync,
                        Epi epi) {
    constexpr int FP = F + 4, TILE = F * N;
    const int splits = gridDim.z, z = blockIdx.z;
    if (splits > 1) {
        // float4s of the tile (F is a multiple of 4, and so is FP): element e = 4 * (tid + T * i)
        static_assert(F % 4 == 0 && TILE % (4 * T) == 0, "whole float4s per thread");
        constexpr int V = TILE / (4 * T), CV = V < 8 ? V : 8;
        __shared__ int last;
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float4* part = reinterpret_cast<float4*>(ws + (size_t)tile * splits * TILE);
        auto at = [&](int i) -> float4& {
            const int e = 4 * (tid + T * i);
            return *reinterpret_cast<float4*>(ot + (e / F) * FP + e % F);
        };
#pragma unroll 4
        for (int i = 0; i < V; ++i) __stcg(part + (size_t)z * (TILE / 4) + tid + T * i, at(i));
        __threadfence();
        sync();
        if (tid == 0) last = atomicAdd(counters + tile, 1u) == (unsigned)(splits - 1);
        sync();
        if (!last) return;
        __threadfence();
        // every split's partials in split order, CV float4s a thread at a time: the loads of a
        // chunk are independent, so they are in flight together (one round trip per chunk and
        // split, not per element)
        for (int i0 = 0; i0 < V; i0 += CV) {
            float4 v[CV];
#pragma unroll
            for (int c = 0; c < CV; ++c) v[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int sp = 0; sp < splits; ++sp) {
#pragma unroll
                for (int c = 0; c < CV; ++c) {
                    const float4 p = sp == z ? at(i0 + c) : __ldcg(part + (size_t)sp * (TILE / 4) + tid + T * (i0 + c));
                    v[c].x += p.x;
                    v[c].y += p.y;
                    v[c].z += p.z;
                    v[c].w += p.w;
                }
            }
#pragma unroll
            for (int c = 0; c < CV; ++c) at(i0 + c) = v[c];
        }
        if (tid == 0) counters[tile] = 0u;
        sync();
    }
    constexpr int CH = 8;
    static_assert(F % abi::SS_COLS == 0 && abi::SS_COLS == 32, "whole 32-column runs a tile");
    const bool nrm = epi::writes_norm(epi);
    const int nt = min(N, ntok - t0), pairs = nt * (F / 2);
    for (int e0 = tid; e0 < pairs; e0 += CH * T) {  // whole warps (pairs is a multiple of 32)
        typename Epi::Row rw[CH];
        typename Epi::Pre pv[CH];
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int e = min(e0 + c * T, pairs - 1), t = e / (F / 2), f = 2 * (e % (F / 2));
            rw[c] = epi.row(t0 + t);
            pv[c] = epi.pre(rw[c], f0 + f);
        }
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int e = e0 + c * T, t = e / (F / 2), f = 2 * (e % (F / 2));
            if (e < pairs) {
                float2* o = reinterpret_cast<float2*>(ot + t * FP + f);
                float2 v = *o;
                if (rs) {
                    v.x *= rs[t];
                    v.y *= rs[t];
                }
                const float2 y = epi.post(rw[c], f0 + f, pv[c], v.x, v.y);
                if (nrm) *o = y;
            }
        }
    }
    if (nrm) {
        sync();
        constexpr int RUNS = F / abi::SS_COLS;
        float* ss = epi::ss_out(epi);
        for (int k = tid; k < nt * RUNS; k += T) {
            const int t = k / RUNS, run = k % RUNS;
            const float* o = ot + t * FP + run * abi::SS_COLS;
            float q = 0.f;
#pragma unroll 8
            for (int j = 0; j < abi::SS_COLS; ++j) {
                const float y = o[(j + tid) & (abi::SS_COLS - 1)];
                q += y * y;
            }
            ss[(size_t)(t0 + t) * (HIDDEN / abi::SS_COLS) + f0 / abi::SS_COLS + run] = q;
        }
    }
}

// The RMSNorm factors of the N tokens of a tile from t0 (gemm_epi.cuh's norm_scale; rows past the
// chunk take the last token's) into rs[N], by T threads, T / N of them a token.
__shared__ float tile_rs[128];
template <int N, int T> MT_INLINE void tile_scales(float* rs, const float* sin, int t0, int ntok, int tid) {
    constexpr int L = T / N;
    static_assert(N <= 128 && L >= 1 && L <= 32 && L * N == T, "whole lane groups a token");
    const int t = tid / L;
    const float v = epi::norm_scale<L>(sin, min(t0 + t, ntok - 1));
    if (tid % L == 0) rs[t] = v;
}

// The block's tile (one warpgroup): features f0 = blockIdx.y * 64 * MT .., tokens t0 =
// blockIdx.x * N .., K steps of split blockIdx.z; then (split-K) the combine, then epi.
// `sin`: where the input is an unscaled RMSNorm (QKV, gate/up), its squares' partials.
template <int N, int K, class W, class Epi>
MT_INLINE void gemm(const act_t* a, const W& w, int ntok, float* ws, unsigned int* counters, const float* sin, Epi epi,
                    const Rows& rows = {}) {
    constexpr int RB = W::ROW_BYTES, MT = row_tiles(N), F = MT * BM, S = stages(N, RB), NK = K / BK, R = N / 2;
    constexpr int SB = stage_bytes(N, RB), WB = weight_bytes(N, RB);
    static_assert(K % BK == 0, "row lengths must be multiples of 64");
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int t0 = rows.first<N>(), f0 = rows.f0 + blockIdx.y * F;
    const int splits = gridDim.z, z = blockIdx.z;
    const int kb0 = z * NK / splits, nk = (z + 1) * NK / splits - kb0;

    float acc[MT][R];
    if (W::ZEROED) zero(acc);

    // Stages in flight: D = S - 2 loads ahead, and one k-step's MMAs running while the next
    // iteration waits for its data and issues its loads (the buffer a load refills was read by the
    // MMAs of two k-steps back, which every warp has waited for before the barrier).
    constexpr int D = S - 2;
    static_assert(D >= 1, "at least three stages");
    // prologue: stages 0 .. D-1, the weights before the wait (no kernel writes them)
#pragma unroll
    for (int s = 0; s < D; ++s)
        if (s < nk) w.template load<K, F>(base + s * SB, f0, (kb0 + s) * BK);
    mt::pdl_wait();
#pragma unroll
    for (int s = 0; s < D; ++s) {
        if (s < nk) load_a<K, N, WB>(base + s * SB, a, t0, ntok, (kb0 + s) * BK, rows);
        cp_commit();
    }
    if (sin) tile_scales<N, abi::WG_THREADS>(tile_rs, sin, t0, ntok, threadIdx.x);  // seen after the loop's barriers
    for (int i = 0; i < nk; ++i) {
        cp_wait<D - 1>();  // stage i has landed (this thread's part)
        fence_async_shared();
        __syncthreads();  // ... everyone's; and every warp's MMAs of k-step i-2 are done
        {
            const int j = i + D;  // into the buffer k-step i-2 used
            if (j < nk) {
                const unsigned st = base + (j % S) * SB;
                w.template load<K, F>(st, f0, (kb0 + j) * BK);
                load_a<K, N, WB>(st, a, t0, ntok, (kb0 + j) * BK, rows);
            }
            cp_commit();
        }
        const unsigned st = base + (i % S) * SB;
        w.template step<N, MT, F>(acc, st, st + WB, i > 0, 0);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < MT; ++m) pin(acc[m]);
    if (!W::ZEROED && nk <= 0) zero(acc);  // a split without k-steps (never planned) adds nothing
    cp_wait<0>();
    __syncthreads();  // every warp is done with the stages: the tile goes through shared memory
    static_assert(N * (F + 4) * 4 <= S * SB, "the output tile fits in the stages' shared memory");
    float* ot = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));
    acc_out<N, MT, F + 4>(ot, acc, 0);
    __syncthreads();
    tile_out<N, F, abi::WG_THREADS>(ot, t0, f0, ntok, ws, counters, threadIdx.x, sin ? tile_rs : nullptr, [] { __syncthreads(); },
                                    epi);
    mt::pdl_launch();
}

// The tile width the host chose (plan::wg_plan).
template <int K, int ROWS, class W, class Epi>
MT_INLINE void gemm_any(int tile_n, const act_t* a, const void* w, const void* wsc, int ntok, float* ws, unsigned int* counters,
                        const float* sin, Epi epi) {
    const W f(w, wsc, ROWS);
    switch (tile_n) {
    case 16: gemm<16, K>(a, f, ntok, ws, counters, sin, epi); break;
    case 32: gemm<32, K>(a, f, ntok, ws, counters, sin, epi); break;
    case 64: gemm<64, K>(a, f, ntok, ws, counters, sin, epi); break;
    default: gemm<128, K>(a, f, ntok, ws, counters, sin, epi); break;
    }
}

#if defined(METRALE_GA_f16)
// The warp-specialised blocks of quantized weights (wq_*): the producer warpgroup's 128 threads
// copy each stage's token rows with cp.async, each thread arriving on the stage's full barrier once
// its copies have landed, and its weights (q4_1: thread 0's two bulk copies of the stage's spans,
// which the barrier expects as transaction bytes; q8_0: cp.async by every thread), so the barrier
// completes when the whole stage has;
// two consumer warpgroups, each on its 64 * MT weight rows of the block, wait for it, dequantise
// and issue the MMAs, and give the stage back (empty barrier, one arrival per consumer warp) once
// the MMAs that read it are done. The producer runs up to S stages ahead, with no block-wide
// barrier per stage: the weight bytes in flight are the stages' (8 stages of 256 rows x 128
// elements at 16 tokens: 160 KiB), and the consumers wait only for data.
// mbarriers: full[S], then empty[S].
__shared__ alignas(8) unsigned long long wq_bars[2 * abi::WQ_MAX_STAGES];

MT_INLINE void consumers_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

template <int N, int K, class W, class Epi>
MT_INLINE void gemm_ws(const act_t* a, const W& w, int ntok, float* ws, unsigned int* counters, const float* sin, Epi epi,
                       const Rows& rows = {}) {
    constexpr int RB = W::ROW_BYTES, KS = W::KS, SK = KS * BK, MT = wq::ROWS / BM / 2, F = wq::ROWS;
    constexpr int S = wq::stages(N, RB), NK = K / SK, R = N / 2;
    constexpr int SB = wq::stage_bytes(N, RB), WB = wq::weight_bytes(RB);
    static_assert(KS == abi::WQ_KS && K % SK == 0, "stages of WQ_KS * 64 elements of K");
    static_assert(S >= 2 && S <= abi::WQ_MAX_STAGES, "stages");
    static_assert(!W::ZEROED, "the quantized formats' first MMA overwrites the accumulators");
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned full0 = smem_u32(wq_bars), empty0 = full0 + 8 * S;
    const int t0 = rows.first<N>(), f0 = rows.f0 + blockIdx.y * F;
    const int splits = gridDim.z, z = blockIdx.z;
    const int kb0 = z * NK / splits, nk = (z + 1) * NK / splits - kb0;

    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar::init(full0 + 8 * s, abi::WG_THREADS + 1);  // every producer thread's copies, thread 0's expect
            mbar::init(empty0 + 8 * s, 8);               // the 8 consumer warps
        }
        mbar::init_fence();
    }
    __syncthreads();

    // Registers: 72 a producer thread (its copy loops' addresses: 40 or 56 spill at 256 tokens),
    // 216 a consumer thread (128 accumulators at 256 tokens, the fragments of two blocks, the
    // dequantisation's temporaries); 128 * 72 + 256 * 216 fit the SM's 64K.
    if (threadIdx.x < abi::WG_THREADS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n" ::: "memory");
        // the first stages' weights before the wait (the ring is empty; no kernel writes weights)
        // (thread 0 first tells each stage's full barrier the bytes the bulk copies will bring)
        constexpr unsigned TX = W::template bulk_bytes<K, F>();
        const int pre = min(S, nk);
        for (int s = 0; s < pre; ++s) {
            if (threadIdx.x == 0) mbar::expect(full0 + 8 * s, TX);
            w.template load<K, F>(base + s * SB, f0, (kb0 + s) * SK, full0 + 8 * s);
        }
        mt::pdl_wait();
        int s = 0;
        unsigned ph = 0;
        for (int i = 0; i < nk; ++i) {
            const unsigned st = base + s * SB;
            if (i >= pre) {
                mbar::wait(empty0 + 8 * s, ph ^ 1);
                if (threadIdx.x == 0) mbar::expect(full0 + 8 * s, TX);
                w.template load<K, F>(st, f0, (kb0 + i) * SK, full0 + 8 * s);
            }
#pragma unroll
            for (int j = 0; j < KS; ++j) load_a<K, N, WB>(st + j * N * BK * 2, a, t0, ntok, (kb0 + i) * SK + j * BK, rows);
            mbar::arrive_cp_async(full0 + 8 * s);
            if (++s == S) {
                s = 0;
                ph ^= 1;
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
        mt::pdl_wait();  // the epilogue reads what earlier kernels wrote
        const int r0 = (threadIdx.x / abi::WG_THREADS - 1) * MT * BM, tid = threadIdx.x - abi::WG_THREADS;
        // the tokens' RMSNorm factors while the first stage is on its way (seen after consumers_sync)
        if (sin) tile_scales<N, 2 * abi::WG_THREADS>(tile_rs, sin, t0, ntok, tid);
        float acc[MT][R];
        int s = 0, prev = 0;
        unsigned ph = 0;
        for (int i = 0; i < nk; ++i) {
            mbar::wait(full0 + 8 * s, ph);
            fence_async_shared();  // cp.async wrote the token rows through the generic proxy, wgmma reads them through the async one
            const unsigned st = base + s * SB;
            w.template step<N, MT, F>(acc, st, st + WB, i > 0, r0);
            // k-step i-1's MMAs are done (step leaves at most this k-step's blocks in flight)
            if (i > 0 && (threadIdx.x & 31) == 0) mbar::arrive(empty0 + 8 * prev);
            prev = s;
            if (++s == S) {
                s = 0;
                ph ^= 1;
            }
        }
        wgmma_wait<0>();
#pragma unroll
        for (int m = 0; m < MT; ++m) pin(acc[m]);
        if (nk <= 0) zero(acc);  // a split without k-steps (never planned) adds nothing
        // Both consumers' MMAs are done with the stages, and every copy has landed (each was
        // waited for): the tile goes through the stages' shared memory.
        consumers_sync();
        static_assert(N * (F + 4) * 4 <= S * SB, "the output tile fits in the stages' shared memory");
        float* ot = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));
        acc_out<N, MT, F + 4>(ot, acc, r0);
        consumers_sync();
        tile_out<N, F, 2 * abi::WG_THREADS>(ot, t0, f0, ntok, ws, counters, tid, sin ? tile_rs : nullptr, [] { consumers_sync(); }, epi);
    }
    mt::pdl_launch();
}

template <int K, int ROWS, class W, class Epi>
MT_INLINE void gemm_ws_any(int tile_n, const act_t* a, const void* w, const void* wsc, int ntok, float* ws, unsigned int* counters,
                           const float* sin, Epi epi) {
    const W f(w, wsc, ROWS);
    switch (tile_n) {
    case 16: gemm_ws<16, K>(a, f, ntok, ws, counters, sin, epi); break;
    case 32: gemm_ws<32, K>(a, f, ntok, ws, counters, sin, epi); break;
    case 64: gemm_ws<64, K>(a, f, ntok, ws, counters, sin, epi); break;
    default: gemm_ws<128, K>(a, f, ntok, ws, counters, sin, epi); break;
    }
}
#endif

// The formats of the layer matrices and of the LM head (common.cuh's WLayer, WEmbed).
// FLayerWs, FHeadWs: the quantized formats' stages in the warp-specialised kernels.
#if defined(METRALE_W_bf16)
typedef FBf16 FLayer;
#else
typedef FQ41<1> FLayer;
typedef FQ41<abi::WQ_KS> FLayerWs;
#endif
#if defined(METRALE_E_bf16) && defined(METRALE_W_bf16)
typedef FBf16 FHead;
#elif defined(METRALE_E_q8_0) && !defined(METRALE_W_bf16)
typedef FQ80<1> FHead;
typedef FQ80<abi::WQ_KS> FHeadWs;
#else
#define WG_NO_HEAD 1  // the head's format does not match the activations' type: never launched
#endif

}  // namespace wg
#define WG_BODY(...) __VA_ARGS__
#else
#define WG_BODY(...)
#endif

// The warp-specialised entries' bodies (quantized weights with f16 activations).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(METRALE_GA_f16)
#define WQ_BODY(...) __VA_ARGS__
#else
#define WQ_BODY(...)
#endif
