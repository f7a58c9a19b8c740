// The epilogues of the four layer products and the LM head on the GEMM paths (gemm.cu.hbs on
// mma.sync, gemm_hopper.cu.hbs and gemm_tma.cu.hbs on wgmma): what happens to a finished pair of
// adjacent output columns (n, n+1) of token t, the same layouts and arithmetic as the
// matrix-vector kernels attn_in, attn_out, ffn_in and ffn_out. A template includes this after
// defining its shape constants (HIDDEN, FFN, QD, KD, HEAD_DIM, KV_HEADS, LAYERS) and RAW_QKV (the
// family's features.qkv_rope).
//
// Each epilogue comes in three steps so that a kernel holding many pairs of one token can issue
// every load before any store (a store through a pointer the compiler cannot tell apart from the
// next load's would otherwise wait for it: one memory round trip per pair):
//   row(t)                  what depends on the token alone (its position, cache block, row start)
//   pre(row, n)             the loads of the pair (the residual's old values, the rotation)
//   post(row, n, pre, a, b) the arithmetic and the stores; it returns the new residual pair where
//                           the epilogue writes the next product's input (Residual), else zeros
// and operator()(t, n, a, b) runs the three for one pair. `Pre` is what pre returns.
//
// The QKV and gate/up products' inputs on the Hopper paths are RMSNorms of the residual taken
// unscaled (abi::SS_COLS): a = act_t(x * norm_w), with the squares of x summed per SS_COLS
// columns into ss. Those kernels scale each token's outputs by norm_scale before the epilogue;
// the O and down products' Residual epilogue writes a and the squares of the product after it.
#pragma once
#if defined(METRALE_KV_fp8)
static_assert(RAW_QKV, "an fp8 KV cache is written by qkv_rope, a head vector at a time");
#endif

namespace epi {

// The RMSNorm factor rsqrt(mean(x^2) + eps) of token t whose squares' partials are
// ss[t][HIDDEN / abi::SS_COLS]. The L consecutive lanes of an aligned group share the token: lane i
// sums partials (float4s where they divide evenly) i, i + L, ... in order, and the group's sums meet
// by a fixed butterfly of shuffles, so every launch gets the same bits. Every lane of the warp
// calls it.
template <int L> MT_INLINE float norm_scale(const float* ss, int t) {
    static_assert(HIDDEN % abi::SS_COLS == 0 && L >= 1 && L <= 32 && (L & (L - 1)) == 0, "partials");
    constexpr int C = HIDDEN / abi::SS_COLS;
    const float* p = ss + (size_t)t * C;
    float s = 0.f;
    if constexpr (C % (4 * L) == 0) {
        // every load in flight at once: one round trip (8 float4s a lane at the 8B shape)
        constexpr int PER = C / (4 * L);
        const float4* p4 = reinterpret_cast<const float4*>(p);
        float4 v[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) v[k] = __ldcg(p4 + threadIdx.x % L + k * L);
#pragma unroll
        for (int k = 0; k < PER; ++k) s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    } else {
#pragma unroll
        for (int i = 0; i < C; i += L)
            if (i + (int)(threadIdx.x % L) < C) s += __ldcg(p + i + threadIdx.x % L);
    }
#pragma unroll
    for (int o = 1; o < L; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return rsqrtf(s / (float)HIDDEN + NORM_EPS);
}

// The sum of `v` over the L consecutive lanes of an aligned group (a fixed butterfly: the same
// bits on every launch); lane 0 of the group writes it to ss[t][c] when `put`. Every lane of the
// warp calls it.
template <int L> MT_INLINE void norm_partial(float* ss, int t, int c, float v, bool put) {
#pragma unroll
    for (int o = 1; o < L; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (put && threadIdx.x % L == 0) ss[(size_t)t * (HIDDEN / abi::SS_COLS) + c] = v;
}

// QKV: RoPE on q and k (GGUF adjacent pairs, host cos/sin table), q to q[ntok][QD], k and v into the
// paged KV cache at the token's position. Where the family adds Q/K/V biases or norms each Q/K
// head (RAW_QKV: features.qkv_rope) the pair is stored raw into q[ntok][QD + 2 KD] instead, for
// qkv_rope (the norm needs the whole head).
struct Qkv {
    using Pre = float2;
    const float2* rope;
    float* q;
    kv_t* kc;
    kv_t* vc;
    const int* pos;
    const int* slot;
    const unsigned int* tables;
    int layer, max_blocks;
    struct Row {
        int p;
        unsigned int blk;  // the pool block holding position p
        int t;
    };
    MT_INLINE Row row(int t) const {
        const int p = pos[t];
        return Row{p, tables[(size_t)slot[t] * max_blocks + p / abi::KV_BLOCK], t};
    }
    MT_INLINE float2 pre(const Row& r, int n) const {
        if constexpr (RAW_QKV) return make_float2(1.f, 0.f);
        // the (cos, sin) of the pair's rotation (v is not rotated)
        return n < QD + KD ? rope[(size_t)r.p * (HEAD_DIM / 2) + (n % HEAD_DIM) / 2] : make_float2(1.f, 0.f);
    }
    MT_INLINE float2 post(const Row& r, int n, float2 cs, float a, float b) const {
        if constexpr (RAW_QKV) {
            *reinterpret_cast<float2*>(q + (size_t)r.t * (QD + 2 * KD) + n) = make_float2(a, b);
            return make_float2(0.f, 0.f);
        }
        const float a2 = a * cs.x - b * cs.y, b2 = a * cs.y + b * cs.x;
        if (n < QD) {
            *reinterpret_cast<float2*>(q + (size_t)r.t * QD + n) = make_float2(a2, b2);
        } else {
            const bool is_k = n < QD + KD;
            const int rr = is_k ? n - QD : n - QD - KD;
            kv_t* cache = is_k ? kc : vc;
            mt::kv_st2(cache + mt::kv_off_in<LAYERS, KV_HEADS, HEAD_DIM>(r.blk, layer, rr / HEAD_DIM, r.p) + rr % HEAD_DIM,
                       is_k ? a2 : a, is_k ? b2 : b);
        }
        return make_float2(0.f, 0.f);
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        const Row r = row(t);
        post(r, n, pre(r, n), a, b);
    }
};

// Output and down projections: x[t][n..n+1] += (a, b), the residual stream. Where `an` is not
// null, also the next product's input from the new residual, an[t][n..n+1] = act_t(x * g[n..n+1]),
// post returning the new pair for the kernel to sum its squares per abi::SS_COLS columns into ss;
// else post returns zeros.
struct Residual {
    using Pre = float4;  // the residual's two old values, then the norm weight's two
    float* x;
    act_t* an = nullptr;
    const float* g = nullptr;
    float* ss = nullptr;
    struct Row {
        float* p;
        act_t* q;
    };
    MT_INLINE bool normed() const { return an != nullptr; }
    MT_INLINE Row row(int t) const { return Row{x + (size_t)t * HIDDEN, an ? an + (size_t)t * HIDDEN : nullptr}; }
    MT_INLINE float4 pre(const Row& r, int n) const {
        const float2 o = *reinterpret_cast<const float2*>(r.p + n);
        const float2 w = r.q ? *reinterpret_cast<const float2*>(g + n) : make_float2(0.f, 0.f);
        return make_float4(o.x, o.y, w.x, w.y);
    }
    MT_INLINE float2 post(const Row& r, int n, float4 o, float a, float b) const {
        const float y0 = o.x + a, y1 = o.y + b;
        *reinterpret_cast<float2*>(r.p + n) = make_float2(y0, y1);
        if (!r.q) return make_float2(0.f, 0.f);
        *reinterpret_cast<act2_t*>(r.q + n) = act2(y0 * o.z, y1 * o.w);
        return make_float2(y0, y1);
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        const Row r = row(t);
        post(r, n, pre(r, n), a, b);
    }
};

// Whether an epilogue writes the next product's input (and so sums squares), and where their
// partials go: epi::Residual with `an` alone.
template <class E> MT_INLINE bool writes_norm(const E&) { return false; }
// ... and whether it ever can (a tile must then give each warpgroup whole 32-column groups)
template <class E> struct CanWriteNorm {
    static constexpr bool value = false;
};
template <> struct CanWriteNorm<Residual> {
    static constexpr bool value = true;
};
MT_INLINE bool writes_norm(const Residual& e) { return e.normed(); }
template <class E> MT_INLINE float* ss_out(const E&) { return nullptr; }
MT_INLINE float* ss_out(const Residual& e) { return e.ss; }

// Gate/up (rows interleaved: n even is gate row n/2, n + 1 its up row): h = SiLU(gate) * up, into
// h[ntok][FFN] of T: f32 on the mma.sync path; the down product's 16-bit activations on the Hopper
// paths (the value they converted h to before, so down reads it as written).
template <class T> struct SiluUp {
    using Pre = float2;
    T* h;
    struct Row {
        T* p;
    };
    MT_INLINE Row row(int t) const { return Row{h + (size_t)t * FFN}; }
    MT_INLINE float2 pre(const Row&, int) const { return make_float2(0.f, 0.f); }
    MT_INLINE float2 post(const Row& r, int n, float2, float g, float u) const {
        st1(r.p + n / 2, g / (1.f + expf(-g)) * u);
        return make_float2(0.f, 0.f);
    }
    MT_INLINE void operator()(int t, int n, float g, float u) const { post(row(t), n, make_float2(0.f, 0.f), g, u); }
};

// LM head of a vocabulary of V rows (Hopper paths): logits[t][n..n+1] = (a, b).
template <int V> struct Logits {
    using Pre = float2;
    float* logits;
    struct Row {
        float* p;
    };
    MT_INLINE Row row(int t) const { return Row{logits + (size_t)t * V}; }
    MT_INLINE float2 pre(const Row&, int) const { return make_float2(0.f, 0.f); }
    MT_INLINE float2 post(const Row& r, int n, float2, float a, float b) const {
        *reinterpret_cast<float2*>(r.p + n) = make_float2(a, b);
        return make_float2(0.f, 0.f);
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const { post(row(t), n, make_float2(0.f, 0.f), a, b); }
};

}  // namespace epi
