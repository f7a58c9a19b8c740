// common.cuh: what every metrale CUDA kernel shares: warp/block reductions, the device weight
// formats and their dequantisation, the padded shared-memory layout of activation rows, RMSNorm
// staging and the "two rows per warp" matrix-vector core.
//
// Contract with the runtime (runtime/backend/src/cuda/): weights are repacked at load time into
// the layouts below; activations are f32, row-major [token][feature].
//
// Weight formats (a matrix has ROWS rows of K elements, K a multiple of 32; NB = K/32 blocks per row):
//   q4_1: qs  = uint4  [NB/P][ROWS][P]  (the 16 nibble bytes of each GGUF block, GGUF nibble order:
//                                        low nibble of byte j is element j, high nibble element j+16)
//         sc  = half2  [NB/P][ROWS][P]  (d, m): w = q*d + m
//         panelled: P = q41_panel<K>() blocks of K (abi::Q41_PANEL, or NB where that does not divide
//         NB: row-major), so that one warp-specialised GEMM stage of every row tile is one span
//   q8_0: qs  = int8   [ROWS][NB][32]  (32-byte aligned)
//         sc  = half   [ROWS][NB]      w = q*d
//   bf16: qs  = bf16   [ROWS][K]       sc unused (may be null)
// Each format's device view (fetch a block of a row, dequantise it) is its own header,
// format_<name>.cuh, included below; the template picks the format of the layer matrices
// (METRALE_W_*) and of the embedding / LM head (METRALE_E_*) with a macro defined before including
// this header.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef METRALE_ABI
#error "render {{> abi}} (the host<->kernel ABI: constants and device structs) before including common.cuh"
#endif

#define MT_INLINE __device__ __forceinline__

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace mt {

constexpr int WARP = 32;

MT_INLINE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

MT_INLINE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Programmatic dependent launch (sm_90+): a kernel may start while the previous one in the stream
// is still running. Before pdl_wait() it may only read weights (never written by any kernel) and
// the step's inputs the host copied before its first launch (positions, slots; through L2,
// `__ldcg`, never a stale line in this SM's L1), and must write nothing; pdl_wait() returns once every earlier kernel has completed and its writes are
// visible. pdl_launch() lets the next kernel start its own prologue. Both are no-ops before sm_90
// and when the launch did not ask for PDL.
// Whatever follows the wait before a kernel's first dependent load lengthens every step: a flag
// read from the constant bank there (the removed `pdl_early` switch) cost a Qwen3-30B-A3B batch-1
// step ~7% over its 338 kernels (bench/families/README.md). Anything a kernel can learn without the
// previous kernel's output, it learns before the wait.
// Since the kernels' lifetimes overlap, activations are never read through the non-coherent
// read-only path (ld.global.nc: `__ldg`, or a `const __restrict__` pointer), which assumes the data
// does not change while the kernel lives: read-only parameters and helper arguments that point at
// activations are plain `const T*`, and only weights use `__ldg`.
// Where the dense kernels (embed, attn_in, attn_out, ffn_in, ffn_out, the LM heads) let the next
// one launch is the weight format's choice, measured (bench/floor/README.md, 2026-12-07):
// pdl_trigger_early() right after their own wait, pdl_trigger_late() at their end; each is
// pdl_launch() where the format says so and nothing elsewhere. On q4_1 layers the trigger comes
// early: the next kernel's blocks then take each SM as this kernel's blocks leave it and have their
// first weights in flight while its last blocks finish (a batch-1 step 2.5-4% faster at 8,192 and
// 32,768 cached positions on an H100, the same at depth 0). On bf16 layers an early trigger made
// the step 0.5-0.8% slower (the next kernel's loads compete with this one's last, longer rows), so
// it comes at the end. The next kernel's blocks cannot launch before every block of this one has
// started (the trigger counts blocks that have run it or exited), so they never hold an SM this
// grid still needs.
#if defined(METRALE_W_q4_1)
constexpr bool PDL_TRIGGER_EARLY = true;
#else
constexpr bool PDL_TRIGGER_EARLY = false;
#endif
MT_INLINE void pdl_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
MT_INLINE void pdl_launch() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
MT_INLINE void pdl_trigger_early() {
    if constexpr (PDL_TRIGGER_EARLY) pdl_launch();
}
MT_INLINE void pdl_trigger_late() {
    if constexpr (!PDL_TRIGGER_EARLY) pdl_launch();
}

// Thread-block clusters (sm_90+): a kernel launched with a cluster dimension can read the shared
// memory of the other blocks of its cluster. Before sm_90 (or without a cluster launch) the cluster
// is the block alone: cluster_size() == 1.
MT_INLINE unsigned int cluster_size() {
    unsigned int n = 1;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
MT_INLINE unsigned int cluster_rank() {
    unsigned int r = 0;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
// Every thread of every block of the cluster: shared-memory writes before it are visible to the
// cluster's reads after it.
MT_INLINE void cluster_sync() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// Read the f32 at shared address p (this block's layout) in block `rank` of the cluster.
MT_INLINE float ld_cluster(const float* p, unsigned int rank) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
#else
    v = *p;
#endif
    return v;
}

// Activation rows in shared memory: each 32-element block is padded to abi::PADDED_BLOCK (36)
// floats, so that lane L reading block L with 16-byte loads is free of bank conflicts.
MT_INLINE int pad_idx(int e) { return (e >> 5) * abi::PADDED_BLOCK + (e & 31); }
template <int K> struct Padded {
    static_assert(K % 32 == 0, "row length must be a multiple of 32");
    static constexpr int FLOATS = (K / 32) * abi::PADDED_BLOCK;
};

// v reduced over the whole block (blockDim.x a multiple of 32, at most 1024): summed, or with MAX
// its largest (for v >= 0: lanes past the block's warps count as 0). `red` holds 32 floats.
template <bool MAX> MT_INLINE float block_reduce(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.f;
    return MAX ? warp_max(r) : warp_sum(r);
}
MT_INLINE float block_sum(float v, float* red) { return block_reduce<false>(v, red); }
// Largest of v >= 0 over the whole block.
MT_INLINE float block_max(float v, float* red) { return block_reduce<true>(v, red); }

// Norm weights of one row, held in registers by the abi::MV_THREADS threads of a block: loaded before
// the dependency wait (they are weights), consumed by stage_row.
template <int K> struct NormW {
    static constexpr int IT = (K + abi::MV_THREADS - 1) / abi::MV_THREADS;
    float v[IT];
    const float* p = nullptr;  // the weights themselves (the 16-bit staging reads whole blocks)
    MT_INLINE void load(const float* __restrict__ w) {
        p = w;
#pragma unroll
        for (int i = 0; i < IT; ++i) {
            const int e = threadIdx.x + i * abi::MV_THREADS;
            v[i] = e < K ? w[e] : 0.f;
        }
    }
};

// ---- small integers to f32 without I2F (a quarter-rate conversion): the float with bits
// 0x4B000000 | u is exactly 2^23 + u for u < 2^23, so subtracting 2^23 leaves u exactly. ----
// byte i (0..3) of w as 2^23 + byte (one PRMT)
MT_INLINE float magic_byte(unsigned int w, int i) { return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650u | (unsigned int)i)); }
constexpr float MAGIC = 8388608.f;           // 2^23: magic_byte(w, i) - MAGIC = byte i, unsigned
constexpr float MAGIC_S8 = 8388608.f + 128.f; // for signed bytes stored as byte ^ 0x80

// ---- weight formats: each loads one 32-element block of one row, dequantised to f32 ----
// `rows`: the matrix's rows (the stride of q4_1's panels; unused by the other formats).

#include "format_q4_1.cuh"

// Blocks per panel of W's layout for rows of K elements: q4_1's panels, the whole row for the
// row-major formats.
template <class W, int K> struct Panel {
    static constexpr int P = K / 32;
};
template <int K> struct Panel<WQ41, K> {
    static constexpr int P = q41_panel<K>();
};

#include "format_q8_0.cuh"
#include "format_bf16.cuh"
#include "format_fp8.cuh"

#if defined(METRALE_W_q4_1)
typedef WQ41 WLayer;
#elif defined(METRALE_W_bf16)
typedef WBF16 WLayer;
#elif defined(METRALE_W_fp8)
typedef WF8 WLayer;
#else
#error "define METRALE_W_<quant> (q4_1, bf16 or fp8) before including common.cuh"
#endif

// Formats whose rows carry one scale applied to each row's finished sum (fp8), and whose products
// quantize their input rows to e4m3 per token (fp8_act) where they are staged.
template <class W> struct RowScaled {
    static constexpr bool ON = false;
};
template <> struct RowScaled<WF8> {
    static constexpr bool ON = true;
};

#if defined(METRALE_E_q8_0)
typedef WQ80 WEmbed;
#elif defined(METRALE_E_bf16)
typedef WBF16 WEmbed;
#else
#error "define METRALE_E_<quant> (q8_0 or bf16) before including common.cuh"
#endif

// Build a weight view of a matrix of `rows` rows from the two raw pointers the runtime passes.
template <class W> MT_INLINE W make_w(const void* qs, const void* sc, int rows) {
    W w;
    w.qs = reinterpret_cast<decltype(w.qs)>(qs);
    w.sc = reinterpret_cast<decltype(w.sc)>(sc);
    w.rows = rows;
    return w;
}

// How many tokens a block stages in shared memory for a row length K (static smem stays within
// abi::TOK_TILE_BYTES; the host's mirror is metrale-abi's layout::tok_tile, asserted per template).
template <int K> struct TokTile {
    static constexpr int BYTES = Padded<K>::FLOATS * 4;
    static constexpr int RAW = abi::TOK_TILE_BYTES / BYTES;
    static constexpr int N = RAW < 1 ? 1 : (RAW > abi::TOK_TILE_MAX ? abi::TOK_TILE_MAX : RAW);
};

// ---- staged activation rows ----
// A matrix-vector kernel stages each token's input row in shared memory once, in the form the dot
// product of its weight format reads (XRow<W, K>):
//   - bf16 and q8_0 weights: f32, each 32-element block padded to abi::PADDED_BLOCK floats (Padded);
//   - q4_1 weights where the target asks for it ([quant] activations = "i16": the template defines
//     METRALE_A_i16): 16-bit integer blocks, the CPU backend's quantized activations
//     (runtime/backend/src/cpu/qact.rs): d = max|x| / 32767, q = round(x / d) (half away from
//     zero), and the f32 sum s of the block's x. A block's dot product is then
//     d_w * d * (sum of q_w * q, exact in integers: dp2a) + m_w * s, as on the CPU. Per block
//     Q16_WORDS words: 16 words of i16 pairs (elements 2i and 2i+1 in the low and high halves of
//     word i), d, s and two words of padding (lane L reading block L's four 16-byte words is then
//     free of bank conflicts). Against the f32 dot product this moves a result by ~1.5e-5
//     relative (half a step of 1/32767 of the block's largest value per element) and takes a
//     quarter of the instructions: the f32 path spent ~4 per weight on unpacking and multiplying,
//     which kept the q4_1 matrix-vector kernels instruction-bound at batch 1.
constexpr int Q16_WORDS = 20;
template <class W, int K> struct XRow {
    static constexpr bool Q16 = false;
    static constexpr int WORDS = Padded<K>::FLOATS;
};
#if defined(METRALE_A_i16)
template <int K> struct XRow<WQ41, K> {
    static_assert(K % 32 == 0, "row length must be a multiple of 32");
    static constexpr bool Q16 = true;
    static constexpr int WORDS = (K / 32) * Q16_WORDS;
};
#endif

// Stage row x[K] into shared memory xs in W's form (XRow), optionally RMS-normalised and scaled by
// the norm weights nw. Every load of x is issued before the first use (one memory round trip).
// Needs blockDim.x == abi::MV_THREADS.
//   - f32 rows: element e is thread e % MV_THREADS's; for fp8 weights (RowScaled) each value
//     quantized as the product's input, e4m3(x / a) * a with a = max|x| / 448 over the row (red:
//     32 floats of shared memory, also without NORM).
//   - 16-bit rows: 32-element block b is thread b % MV_THREADS's, whole: its largest value, scale,
//     rounding and sum need no other thread (a warp per block spent 11 dependent shuffles per block
//     and serialised K / 32 / MV_WARPS of them per warp: ~8 us per 14336-wide row).
// GIVEN (with NORM): the norm's scale 1 / rms is known (passed as eps) and the weights are read
// from nw.p (shared or global memory; nw.v unused) with plain loads: no block sum.
template <class W, int K, bool NORM, bool GIVEN = false>
MT_INLINE void stage_row(const float* x, const NormW<K>& nw, float eps, float* xs, float* red) {
    static_assert(NORM || !GIVEN, "a given scale is a norm's");
    if constexpr (XRow<W, K>::Q16) {
        constexpr int NB = K / 32;
        constexpr int R = (NB + abi::MV_THREADS - 1) / abi::MV_THREADS;  // blocks per thread
        float v[R][32];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = threadIdx.x + r * abi::MV_THREADS;
            const float4* xb = reinterpret_cast<const float4*>(x + 32 * b);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 f = b < NB ? xb[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                v[r][4 * j] = f.x; v[r][4 * j + 1] = f.y; v[r][4 * j + 2] = f.z; v[r][4 * j + 3] = f.w;
            }
        }
        if constexpr (NORM) {
            float scale = eps;
            if constexpr (!GIVEN) {
                float ss = 0.f;
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < 32; ++i) ss += v[r][i] * v[r][i];
                scale = rsqrtf(block_sum(ss, red) / (float)K + eps);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int b = threadIdx.x + r * abi::MV_THREADS;
                if (b >= NB) continue;
                const float4* wb = reinterpret_cast<const float4*>(nw.p + 32 * b);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 f = GIVEN ? wb[j] : __ldg(wb + j);
                    v[r][4 * j] *= scale * f.x; v[r][4 * j + 1] *= scale * f.y;
                    v[r][4 * j + 2] *= scale * f.z; v[r][4 * j + 3] *= scale * f.w;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = threadIdx.x + r * abi::MV_THREADS;
            if (b >= NB) continue;
            float amax = 0.f, s = 0.f;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                amax = fmaxf(amax, fabsf(v[r][i]));
                s += v[r][i];
            }
            const float d = amax / 32767.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            unsigned int pk[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                int q[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const float t = v[r][2 * i + k] * inv;
                    q[k] = (int)fminf(fmaxf(t + copysignf(0.5f, t), -32767.f), 32767.f);
                }
                pk[i] = ((unsigned int)q[0] & 0xffffu) | ((unsigned int)q[1] << 16);
            }
            uint4* blk = reinterpret_cast<uint4*>(xs + b * Q16_WORDS);
#pragma unroll
            for (int j = 0; j < 4; ++j) blk[j] = make_uint4(pk[4 * j], pk[4 * j + 1], pk[4 * j + 2], pk[4 * j + 3]);
            blk[4] = make_uint4(__float_as_uint(d), __float_as_uint(s), 0u, 0u);
        }
    } else {
        constexpr int IT = NormW<K>::IT;
        float v[IT];
#pragma unroll
        for (int i = 0; i < IT; ++i) {
            const int e = threadIdx.x + i * abi::MV_THREADS;
            v[i] = e < K ? x[e] : 0.f;
        }
        float scale = GIVEN ? eps : 1.f;
        if (NORM && !GIVEN) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < IT; ++i) ss += v[i] * v[i];
            const float tot = block_sum(ss, red);
            scale = rsqrtf(tot / (float)K + eps);
        }
        if constexpr (RowScaled<W>::ON) {  // fp8: the row quantized per token (fp8_act)
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < IT; ++i) {
                if (NORM) v[i] *= scale * (GIVEN ? nw.p[threadIdx.x + i * abi::MV_THREADS] : nw.v[i]);
                amax = fmaxf(amax, fabsf(v[i]));
            }
            const float a = fp8_row_scale(block_max(amax, red));
#pragma unroll
            for (int i = 0; i < IT; ++i) {
                const int e = threadIdx.x + i * abi::MV_THREADS;
                if (e < K) xs[pad_idx(e)] = fp8_act(v[i], a);
            }
        } else {
#pragma unroll
            for (int i = 0; i < IT; ++i) {
                const int e = threadIdx.x + i * abi::MV_THREADS;
                if (e >= K) continue;
                xs[pad_idx(e)] = NORM ? v[i] * scale * (GIVEN ? nw.p[e] : nw.v[i]) : v[i];
            }
        }
    }
}

// One warp computes rows r0 and r0+1 of W (K columns) against the nt (<= TB) staged activation rows
// in xs (stage_row's form for W, stride XRow<W, K>::WORDS; the generic version reads f32 rows). Result (already warp-reduced, valid on every lane) in acc.
// `ah` holds what the warp has in flight of rows r0 and r0+1 (Ahead, filled by `prefetch` before
// the kernel's dependency wait, then by the rows2_dot before); once consumed it is refilled from
// rows r_next, r_next+1 (r_next < 0: none), so the next row pair's first loads are in flight while
// this one computes.
// With q4_1 panels of 4 blocks (PanelLanes) the lanes follow the memory instead: lane l reads row
// r0 + ((l >> 2) & 1), blocks 16c + 4 (l >> 3) + (l & 3) (c = 0, 1, ...), so that 8 lanes read the
// two rows' 128 contiguous bytes of one panel and a warp's load is 4 whole lines, as a row-major
// row's 512 bytes are (block `lane` of each row reads 64-byte halves of 8 lines).
template <class W, int K> struct PanelLanes {
    static constexpr bool ON = false;
};
#if defined(METRALE_A_i16)
template <int K> struct PanelLanes<WQ41, K> {
    static constexpr bool ON = q41_panel<K>() == 4 && (K / 32) % 16 == 0 && K / 32 >= 32;
};
#endif
MT_INLINE int panel_lane_row(int lane) { return (lane >> 2) & 1; }
MT_INLINE int panel_lane_block(int lane, int c) { return 16 * c + 4 * (lane >> 3) + (lane & 3); }

// The largest divisor of n that is at most 4: the depth of a panel lane's ring of loads. A ring of
// 8 (a 4096-wide row pair whole) measured slower: ffn_in 31.0 -> 40.9 us across layers on an H100,
// its 80 registers holding the next pair while the current one computes (bench/floor/README.md).
__host__ __device__ constexpr int ring_depth(int n) {
    return n % 4 == 0 ? 4 : n % 3 == 0 ? 3 : n % 2 == 0 ? 2 : 1;
}
// What a warp has in flight for its next row pair. In general block `lane` of each row (p0, p1).
// On q4_1 panels a ring of the lane's next G blocks (G = ring_depth of the NC blocks a lane reads
// a row): rows2_dot_panels refills a slot as soon as it has consumed it, from the same row pair
// while it has blocks left, then from the next, so each lane keeps G loads in flight from the
// kernel's dependency wait to its last row pair.
template <class W, int K, bool RING = PanelLanes<W, K>::ON> struct Ahead {
    static constexpr bool IS_RING = false;
    typename W::Raw p0, p1;
};
template <class W, int K> struct Ahead<W, K, true> {
    static constexpr bool IS_RING = true;
    static constexpr int NC = K / 32 / 16;  // blocks a lane reads of its row
    static constexpr int G = ring_depth(NC);
    typename W::Raw raw[G];
};

template <class W, int K>
MT_INLINE void prefetch2(const W& w, int r0, typename W::Raw& p0, typename W::Raw& p1) {
    const int lane = threadIdx.x & 31;
    if (r0 >= 0 && lane < K / 32) {
        p0 = w.template fetch<K>(r0, lane);
        p1 = w.template fetch<K>(r0 + 1, lane);
    }
}
// Fill `ah` with the first loads of row pair r0 (r0 < 0: nothing).
template <class W, int K> MT_INLINE void prefetch(const W& w, int r0, Ahead<W, K>& ah) {
    if constexpr (Ahead<W, K>::IS_RING) {
        const int lane = threadIdx.x & 31;
        if (r0 >= 0) {
#pragma unroll
            for (int j = 0; j < Ahead<W, K>::G; ++j)
                ah.raw[j] = w.template fetch<K>(r0 + panel_lane_row(lane), panel_lane_block(lane, j));
        }
    } else {
        prefetch2<W, K>(w, r0, ah.p0, ah.p1);
    }
}

template <int K, int TB, class W>
MT_INLINE void rows2_dot(const W& w, int r0, int r_next, const float* xs, int nt, float acc[2][TB], Ahead<W, K>& ah) {
    constexpr int NB = K / 32;
    constexpr int XS = Padded<K>::FLOATS;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[r][t] = 0.f;
    for (int b = lane; b < NB; b += 32) {
        float w0[32], w1[32];
        if (b == lane) {
            W::dequant(ah.p0, w0);
            W::dequant(ah.p1, w1);
            prefetch2<W, K>(w, r_next, ah.p0, ah.p1);
        } else {
            W::dequant(w.template fetch<K>(r0, b), w0);
            W::dequant(w.template fetch<K>(r0 + 1, b), w1);
        }
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            if (t < nt) {
                const float4* xv = reinterpret_cast<const float4*>(xs + t * XS + b * abi::PADDED_BLOCK);
                float a0 = 0.f, a1 = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 v = xv[j];
                    a0 += w0[4 * j] * v.x + w0[4 * j + 1] * v.y + w0[4 * j + 2] * v.z + w0[4 * j + 3] * v.w;
                    a1 += w1[4 * j] * v.x + w1[4 * j + 1] * v.y + w1[4 * j + 2] * v.z + w1[4 * j + 3] * v.w;
                }
                acc[0][t] += a0;
                acc[1][t] += a1;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[r][t] = warp_sum(acc[r][t]);
    if constexpr (RowScaled<W>::ON) {
        const float s0 = w.row_scale(r0), s1 = w.row_scale(r0 + 1);
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            acc[0][t] *= s0;
            acc[1][t] *= s1;
        }
    }
}

// rows2_dot for q4_1 weights against Q16 rows (XRow<WQ41, K>): integer block sums by dp2a (two
// 16-bit activations times two weight nibbles widened to bytes), one scale per block and token.
// Nibble byte j of a block holds element j (low) and j + 16 (high): word j of the 16 bytes,
// masked, gives elements 4j..4j+3 as bytes; shifted by 4, elements 16+4j..16+4j+3.
// A lane has several blocks in flight (at 20 bytes per 32 weights a q4_1 lane otherwise moves too
// little per memory round trip to keep up with the bandwidth). Two versions: rows2_dot_panels where
// the lanes follow q4_1's panels (PanelLanes: one row a lane, Ahead's ring of up to 4 blocks in
// flight throughout), rows2_dot_pairs elsewhere (block `lane` of both rows, G at a time).
#if defined(METRALE_A_i16)
// A q4_1 block as dp2a reads it: word i's nibbles widened to bytes, elements 4i.. (lo) and
// 16 + 4i.. (hi), and (d, m).
struct Q41Bytes {
    int lo[4], hi[4];
    float2 dm;
    MT_INLINE explicit Q41Bytes(const WQ41::Raw& raw) {
        const unsigned int wd[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = (int)(wd[i] & 0x0f0f0f0fu);
            hi[i] = (int)((wd[i] >> 4) & 0x0f0f0f0fu);
        }
        dm = __half22float2(raw.dm);
    }
};
// sum over a q4_1 block of w * x for staged Q16 block `blk`: d_w * d * (integer dot) + m_w * s
MT_INLINE float q41_block_dot(const Q41Bytes& w, const float* blk) {
    const uint4* xv = reinterpret_cast<const uint4*>(blk);
    const uint4 x0 = xv[0], x1 = xv[1], x2 = xv[2], x3 = xv[3];
    const float2 ds = *reinterpret_cast<const float2*>(blk + 16);
    const int xw[16] = {(int)x0.x, (int)x0.y, (int)x0.z, (int)x0.w, (int)x1.x, (int)x1.y, (int)x1.z, (int)x1.w,
                        (int)x2.x, (int)x2.y, (int)x2.z, (int)x2.w, (int)x3.x, (int)x3.y, (int)x3.z, (int)x3.w};
    int is = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        is = __dp2a_lo(xw[2 * i], w.lo[i], is);
        is = __dp2a_hi(xw[2 * i + 1], w.lo[i], is);
        is = __dp2a_lo(xw[8 + 2 * i], w.hi[i], is);
        is = __dp2a_hi(xw[8 + 2 * i + 1], w.hi[i], is);
    }
    return w.dm.x * ds.x * (float)is + w.dm.y * ds.y;
}

// rows2_dot on q4_1 panels (PanelLanes): each lane sums its row's NC blocks from the ring `ah`
// (Ahead: G loads in flight; a slot is refilled once consumed, from this row pair while it has
// blocks left, then from row pair r_next), then both rows are reduced over the warp (a lane adds
// nothing to the row it does not read).
template <int K, int TB>
MT_INLINE void rows2_dot_panels(const WQ41& w, int r0, int r_next, const float* xs, int nt, float acc[2][TB],
                                Ahead<WQ41, K>& ah) {
    constexpr int NC = Ahead<WQ41, K>::NC;
    constexpr int G = Ahead<WQ41, K>::G;
    constexpr int XW = XRow<WQ41, K>::WORDS;
    const int lane = threadIdx.x & 31, rl = panel_lane_row(lane);
    float a[TB];
#pragma unroll
    for (int t = 0; t < TB; ++t) a[t] = 0.f;
    for (int c0 = 0; c0 < NC; c0 += G) {
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const int c = c0 + j;
            const Q41Bytes wb(ah.raw[j]);
            if (c0 + G < NC)
                ah.raw[j] = w.template fetch<K>(r0 + rl, panel_lane_block(lane, c + G));
            else if (r_next >= 0)
                ah.raw[j] = w.template fetch<K>(r_next + rl, panel_lane_block(lane, j));
            const float* blk = xs + panel_lane_block(lane, c) * Q16_WORDS;
#pragma unroll
            for (int t = 0; t < TB; ++t)
                if (t < nt) a[t] += q41_block_dot(wb, blk + t * XW);
        }
    }
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        acc[0][t] = warp_sum(rl == 0 ? a[t] : 0.f);
        acc[1][t] = warp_sum(rl == 1 ? a[t] : 0.f);
    }
}

template <int K, int TB>
MT_INLINE void rows2_dot_pairs(const WQ41& w, int r0, int r_next, const float* xs, int nt, float acc[2][TB],
                               Ahead<WQ41, K>& ah) {
    constexpr int NB = K / 32;
    constexpr int NBL = (NB + 31) / 32;  // blocks per lane (lanes past NB % 32 have one fewer)
    constexpr int G = NBL < 4 ? NBL : 4;
    constexpr int XW = XRow<WQ41, K>::WORDS;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[r][t] = 0.f;
    for (int g0 = 0; g0 < NBL; g0 += G) {
        WQ41::Raw raw[G][2];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const int b = lane + 32 * (g0 + j);
            if (g0 + j < NBL && b < NB) {
                if (g0 + j == 0) {
                    raw[j][0] = ah.p0;
                    raw[j][1] = ah.p1;
                } else {
                    raw[j][0] = w.template fetch<K>(r0, b);
                    raw[j][1] = w.template fetch<K>(r0 + 1, b);
                }
            }
        }
        if (g0 == 0) prefetch2<WQ41, K>(w, r_next, ah.p0, ah.p1);  // the next row pair's first blocks
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const int b = lane + 32 * (g0 + j);
            if (g0 + j >= NBL || b >= NB) continue;
            int lo[2][4], hi[2][4];
            float2 dm[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const unsigned int wd[4] = {raw[j][r].q.x, raw[j][r].q.y, raw[j][r].q.z, raw[j][r].q.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    lo[r][i] = (int)(wd[i] & 0x0f0f0f0fu);
                    hi[r][i] = (int)((wd[i] >> 4) & 0x0f0f0f0fu);
                }
                dm[r] = __half22float2(raw[j][r].dm);
            }
#pragma unroll
            for (int t = 0; t < TB; ++t) {
                if (t < nt) {
                    const float* blk = xs + t * XW + b * Q16_WORDS;
                    const uint4* xv = reinterpret_cast<const uint4*>(blk);
                    const uint4 x0 = xv[0], x1 = xv[1], x2 = xv[2], x3 = xv[3];
                    const float2 ds = *reinterpret_cast<const float2*>(blk + 16);
                    const int xw[16] = {(int)x0.x, (int)x0.y, (int)x0.z, (int)x0.w, (int)x1.x, (int)x1.y, (int)x1.z, (int)x1.w,
                                        (int)x2.x, (int)x2.y, (int)x2.z, (int)x2.w, (int)x3.x, (int)x3.y, (int)x3.z, (int)x3.w};
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        int is = 0;
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            is = __dp2a_lo(xw[2 * i], lo[r][i], is);
                            is = __dp2a_hi(xw[2 * i + 1], lo[r][i], is);
                            is = __dp2a_lo(xw[8 + 2 * i], hi[r][i], is);
                            is = __dp2a_hi(xw[8 + 2 * i + 1], hi[r][i], is);
                        }
                        acc[r][t] += dm[r].x * ds.x * (float)is + dm[r].y * ds.y;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[r][t] = warp_sum(acc[r][t]);
}

template <int K, int TB>
MT_INLINE void rows2_dot(const WQ41& w, int r0, int r_next, const float* xs, int nt, float acc[2][TB],
                         Ahead<WQ41, K>& ah) {
    if constexpr (PanelLanes<WQ41, K>::ON) rows2_dot_panels<K, TB>(w, r0, r_next, xs, nt, acc, ah);
    else rows2_dot_pairs<K, TB>(w, r0, r_next, xs, nt, acc, ah);
}
#endif

// Running (max, sum of exp(v - max), first index of the max) of a stream of values; NaN skipped.
struct Acc {
    float m, s;
    int i;
};
static_assert(sizeof(Acc) == abi::ACC_BYTES, "the host sizes the partials buffers by abi::ACC_BYTES");

MT_INLINE void acc_push(Acc& a, float v, int i) {
    if (isnan(v)) return;
    if (a.i < 0 || v > a.m) {
        a.s = (a.i < 0 || a.m == -INFINITY) ? 1.f : a.s * expf(a.m - v) + 1.f;
        a.m = v;
        a.i = i;
    } else {
        a.s += (v == -INFINITY) ? 0.f : expf(v - a.m);
    }
}

MT_INLINE Acc acc_merge(Acc a, Acc b) {
    if (b.i < 0) return a;
    if (a.i < 0) return b;
    Acc r;
    const bool b_wins = b.m > a.m || (b.m == a.m && b.i < a.i);
    r.m = b_wins ? b.m : a.m;
    r.i = b_wins ? b.i : a.i;
    const float ea = a.m == -INFINITY ? (r.m == -INFINITY ? 1.f : 0.f) : expf(a.m - r.m);
    const float eb = b.m == -INFINITY ? (r.m == -INFINITY ? 1.f : 0.f) : expf(b.m - r.m);
    r.s = a.s * ea + b.s * eb;
    return r;
}

MT_INLINE Acc acc_shfl(const Acc& a, int o) {
    Acc b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
    b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
    return b;
}

// Matrix-vector kernels: blockDim.x = MV_THREADS, grid = (row-pair groups, token tiles).
constexpr int MV_THREADS = abi::MV_THREADS;
constexpr int MV_WARPS = MV_THREADS / 32;

}  // namespace mt

// ---- The paged KV cache ----
// K and V of position p of the sequence in slot s live in pool block
// tables[s * max_blocks + p / KV_BLOCK], laid out [block][layer][kv_head][KV_BLOCK][head_dim], with
// elements of type kv_t: the target's `[quant] kv` (a template defines METRALE_KV_bf16 for bf16,
// METRALE_KV_fp8 for fp8; f32 otherwise). A bf16 cache rounds each value to nearest even when it is
// written (as the CPU backend does), and readers widen it to f32. An fp8 cache holds each head
// vector (one position's K or V of one KV head) as e4m3 bytes with its own f32 scale, max|x| / 448
// (the CPU backend's KvStore::Fp8): a (block, layer, KV head) segment is its KV_BLOCK x head_dim
// bytes followed by the KV_BLOCK positions' scales (kv_seg, kv_scale_off); qkv_rope writes it
// (the whole head in one warp), attention reads it.
#if defined(METRALE_KV_bf16)
using kv_t = __nv_bfloat16;
#elif defined(METRALE_KV_fp8)
using kv_t = unsigned char;
#else
using kv_t = float;
#endif

// ---- The 16-bit activations of the Hopper GEMMs ----
// act_t: bf16 against bf16 weights; f16 against quantized weights, which enter the MMAs
// dequantised to f16 (an f16 weight carries 2 more bits than bf16, and q * d + m of a q4_1 nibble
// is one FMA in f16). f16 saturates at 65504: the conversions clamp there (bf16 would keep the
// range at 8 bits of precision). The GEMMs' conversion kernels write it, and so do the kernels
// that hand their output straight to a product (attention to O, gate/up to down).
#if defined(METRALE_W_bf16)
typedef __nv_bfloat16 act_t;
typedef __nv_bfloat162 act2_t;
MT_INLINE act2_t act2(float a, float b) { return __floats2bfloat162_rn(a, b); }
#else
typedef __half act_t;
typedef __half2 act2_t;
MT_INLINE act2_t act2(float a, float b) {
    return __floats2half2_rn(fminf(fmaxf(a, -65504.f), 65504.f), fminf(fmaxf(b, -65504.f), 65504.f));
}
#endif
// One value into an array of T: f32 as is; bf16 and f16 rounded to nearest, f16 saturating as act2.
MT_INLINE void st1(float* p, float v) { *p = v; }
MT_INLINE void st1(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
MT_INLINE void st1(__half* p, float v) { *p = __float2half_rn(fminf(fmaxf(v, -65504.f), 65504.f)); }

namespace mt {

// E consecutive cache elements as raw 32-bit words, fetched by one vector load (E * sizeof(kv_t)
// bytes, aligned to that when the offset is a multiple of E) and widened to f32 when used, so that
// a loop can hold the next positions' loads in flight at half the registers of f32 values.
template <int E> struct KvRaw {
    static constexpr int WORDS = E * (int)sizeof(kv_t) / 4;
    static_assert(WORDS * 4 == E * (int)sizeof(kv_t) && (WORDS == 1 || WORDS == 2 || WORDS == 4),
                  "a lane's cache elements must be 4, 8 or 16 bytes (fp8: head_dim 128 or more)");
    unsigned int w[WORDS];
#if defined(METRALE_KV_fp8)
    float s;  // the head vector's scale (kv_fetch_scaled)
#endif
};
#if defined(METRALE_KV_fp8)
// An fp8 cache's E elements and the scale of their head vector (at `scale`).
template <int E> MT_INLINE KvRaw<E> kv_fetch_scaled(const kv_t* p, const kv_t* scale) {
    KvRaw<E> r;
#pragma unroll
    for (int i = 0; i < KvRaw<E>::WORDS; ++i) r.w[i] = reinterpret_cast<const unsigned int*>(p)[i];
    r.s = *reinterpret_cast<const float*>(scale);
    return r;
}
#endif
template <int E> MT_INLINE KvRaw<E> kv_fetch(const kv_t* p) {
    KvRaw<E> r;
    if constexpr (KvRaw<E>::WORDS == 4) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        r.w[0] = u.x; r.w[1] = u.y; r.w[2] = u.z; r.w[3] = u.w;
    } else if constexpr (KvRaw<E>::WORDS == 2) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        r.w[0] = u.x; r.w[1] = u.y;
    } else {
        r.w[0] = *reinterpret_cast<const unsigned int*>(p);
    }
    return r;
}
template <int E> MT_INLINE KvRaw<E> kv_zero() {
    KvRaw<E> r;
#pragma unroll
    for (int i = 0; i < KvRaw<E>::WORDS; ++i) r.w[i] = 0u;
#if defined(METRALE_KV_fp8)
    r.s = 0.f;
#endif
    return r;
}
template <int E> MT_INLINE void kv_widen(const KvRaw<E>& r, float out[E]) {
#pragma unroll
    for (int i = 0; i < KvRaw<E>::WORDS; ++i) {
#if defined(METRALE_KV_bf16)
        // bf16 -> f32 is a 16-bit shift: exact (element 2i in the low half of word i)
        out[2 * i] = __uint_as_float(r.w[i] << 16);
        out[2 * i + 1] = __uint_as_float(r.w[i] & 0xffff0000u);
#elif defined(METRALE_KV_fp8)
        // e4m3 bytes 4i .. 4i+3 (element 4i in the low byte), each times the vector's scale, as the
        // CPU's KvStore::Fp8 reads them
        const unsigned int lo = e4m3x2_to_h2((unsigned short)(r.w[i] & 0xffffu));
        const unsigned int hi = e4m3x2_to_h2((unsigned short)(r.w[i] >> 16));
        const float2 a = __half22float2(*reinterpret_cast<const half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const half2*>(&hi));
        out[4 * i] = a.x * r.s; out[4 * i + 1] = a.y * r.s;
        out[4 * i + 2] = b.x * r.s; out[4 * i + 3] = b.y * r.s;
#else
        out[i] = __uint_as_float(r.w[i]);
#endif
    }
}

// Two adjacent elements (p even-aligned): a at p[0], b at p[1].
MT_INLINE void kv_st2(float* p, float a, float b) {
    p[0] = a;
    p[1] = b;
}
MT_INLINE void kv_st2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
// An fp8 cache is written a whole head vector at a time, with its scale (qkv_rope: targets with
// an fp8 cache leave their QKV products' rows raw); a pair alone has no scale to be written with.
MT_INLINE void kv_st2(unsigned char*, float, float) { __trap(); }

// What a store of x and a load give back: the value later steps read from the cache (f32 and bf16
// caches; an fp8 value depends on its whole head vector).
MT_INLINE float kv_round(float x) {
#if defined(METRALE_KV_bf16)
    return __bfloat162float(__float2bfloat16_rn(x));
#else
    return x;
#endif
}

// kv_t elements of one (block, layer, KV head) segment: its KV_BLOCK head vectors, and for an fp8
// cache their KV_BLOCK f32 scales after them.
template <int HEAD_DIM> MT_INLINE constexpr size_t kv_seg() {
#if defined(METRALE_KV_fp8)
    return (size_t)abi::KV_BLOCK * HEAD_DIM + abi::KV_BLOCK * sizeof(float);
#else
    return (size_t)abi::KV_BLOCK * HEAD_DIM;
#endif
}

// Element offset of (layer, KV head h, position p) in pool block b (the block holding p).
template <int LAYERS, int KV_HEADS, int HEAD_DIM>
MT_INLINE size_t kv_off_in(size_t b, int layer, int h, int p) {
    return ((b * LAYERS + layer) * KV_HEADS + h) * kv_seg<HEAD_DIM>() + (size_t)(p % abi::KV_BLOCK) * HEAD_DIM;
}

// Element offset of (layer, KV head h, position p) for the sequence whose table row is `row`.
template <int LAYERS, int KV_HEADS, int HEAD_DIM>
MT_INLINE size_t kv_off(const unsigned int* row, int layer, int h, int p) {
    return kv_off_in<LAYERS, KV_HEADS, HEAD_DIM>(row[p / abi::KV_BLOCK], layer, h, p);
}

#if defined(METRALE_KV_fp8)
// Offset (in kv_t, bytes) of the f32 scale of (layer, KV head h, position p)'s head vector.
template <int LAYERS, int KV_HEADS, int HEAD_DIM>
MT_INLINE size_t kv_scale_off(const unsigned int* row, int layer, int h, int p) {
    // the segment's start (its position 0), past its vectors, to the position's scale
    return kv_off_in<LAYERS, KV_HEADS, HEAD_DIM>(row[p / abi::KV_BLOCK], layer, h, 0) +
           (size_t)abi::KV_BLOCK * HEAD_DIM + (p % abi::KV_BLOCK) * sizeof(float);
}

#endif

}  // namespace mt
