// The epilogues of the four layer products and the LM head on the GEMM paths (gemm.cu.hbs on
// mma.sync, gemm_hopper.cu.hbs and gemm_tma.cu.hbs on wgmma): what happens to a finished pair of
// adjacent output columns (n, n+1) of token t, the same layouts and arithmetic as the
// matrix-vector kernels attn_in, attn_out, ffn_in and ffn_out. A template includes this after
// defining its shape constants (HIDDEN, FFN, QD, KD, HEAD_DIM, KV_HEADS, LAYERS).
//
// Each epilogue comes in three steps so that a kernel holding many pairs of one token can issue
// every load before any store (a store through a pointer the compiler cannot tell apart from the
// next load's would otherwise wait for it: one memory round trip per pair):
//   row(t)                  what depends on the token alone (its position, cache block, row start)
//   pre(row, n)             the loads of the pair (the residual's old values, the rotation)
//   post(row, n, pre, a, b) the arithmetic and the stores
// and operator()(t, n, a, b) runs the three for one pair.
#pragma once

namespace epi {

// QKV: RoPE on q and k (GGUF adjacent pairs, host cos/sin table), q to q[ntok][QD], k and v into the
// paged KV cache at the token's position.
struct Qkv {
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
        // the (cos, sin) of the pair's rotation (v is not rotated)
        return n < QD + KD ? rope[(size_t)r.p * (HEAD_DIM / 2) + (n % HEAD_DIM) / 2] : make_float2(1.f, 0.f);
    }
    MT_INLINE void post(const Row& r, int n, float2 cs, float a, float b) const {
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
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        const Row r = row(t);
        post(r, n, pre(r, n), a, b);
    }
};

// Output and down projections: x[t][n..n+1] += (a, b), the residual stream.
struct Residual {
    float* x;
    struct Row {
        float* p;
    };
    MT_INLINE Row row(int t) const { return Row{x + (size_t)t * HIDDEN}; }
    MT_INLINE float2 pre(const Row& r, int n) const { return *reinterpret_cast<const float2*>(r.p + n); }
    MT_INLINE void post(const Row& r, int n, float2 o, float a, float b) const {
        *reinterpret_cast<float2*>(r.p + n) = make_float2(o.x + a, o.y + b);
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        const Row r = row(t);
        post(r, n, pre(r, n), a, b);
    }
};

// Gate/up (rows interleaved: n even is gate row n/2, n + 1 its up row): h = SiLU(gate) * up, into
// h[ntok][FFN] of T: f32 on the mma.sync path; the down product's 16-bit activations on the Hopper
// paths (the value they converted h to before, so down reads it as written).
template <class T> struct SiluUp {
    T* h;
    struct Row {
        T* p;
    };
    MT_INLINE Row row(int t) const { return Row{h + (size_t)t * FFN}; }
    MT_INLINE float2 pre(const Row&, int) const { return make_float2(0.f, 0.f); }
    MT_INLINE void post(const Row& r, int n, float2, float g, float u) const { st1(r.p + n / 2, g / (1.f + expf(-g)) * u); }
    MT_INLINE void operator()(int t, int n, float g, float u) const { post(row(t), n, make_float2(0.f, 0.f), g, u); }
};

// LM head of a vocabulary of V rows (Hopper paths): logits[t][n..n+1] = (a, b).
template <int V> struct Logits {
    float* logits;
    struct Row {
        float* p;
    };
    MT_INLINE Row row(int t) const { return Row{logits + (size_t)t * V}; }
    MT_INLINE float2 pre(const Row&, int) const { return make_float2(0.f, 0.f); }
    MT_INLINE void post(const Row& r, int n, float2, float a, float b) const {
        *reinterpret_cast<float2*>(r.p + n) = make_float2(a, b);
    }
    MT_INLINE void operator()(int t, int n, float a, float b) const { post(row(t), n, make_float2(0.f, 0.f), a, b); }
};

}  // namespace epi
