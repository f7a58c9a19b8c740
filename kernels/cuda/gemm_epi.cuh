// The epilogues of the four layer products on the GEMM paths (gemm.cu.hbs on mma.sync,
// gemm_hopper.cu.hbs on wgmma): what happens to a finished pair of adjacent output columns (n, n+1)
// of token t, the same layouts and arithmetic as the matrix-vector kernels attn_in, attn_out, ffn_in
// and ffn_out. A template includes this after defining its shape constants (HIDDEN, FFN, QD, KD,
// HEAD_DIM, KV_HEADS, LAYERS).
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
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        const int p = pos[t];
        if (n < QD + KD) {  // (cos, sin) rotation of the adjacent pair
            const float2 cs = rope[(size_t)p * (HEAD_DIM / 2) + (n % HEAD_DIM) / 2];
            const float a2 = a * cs.x - b * cs.y, b2 = a * cs.y + b * cs.x;
            a = a2;
            b = b2;
        }
        if (n < QD) {
            *reinterpret_cast<float2*>(q + (size_t)t * QD + n) = make_float2(a, b);
        } else {
            const bool is_k = n < QD + KD;
            const int rr = is_k ? n - QD : n - QD - KD;
            const int h = rr / HEAD_DIM, d = rr % HEAD_DIM;
            kv_t* cache = is_k ? kc : vc;
            const unsigned int* row = tables + (size_t)slot[t] * max_blocks;
            mt::kv_st2(cache + mt::kv_off<LAYERS, KV_HEADS, HEAD_DIM>(row, layer, h, p) + d, a, b);
        }
    }
};

// Output and down projections: x[t][n..n+1] += (a, b), the residual stream.
struct Residual {
    float* x;
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        float2* p = reinterpret_cast<float2*>(x + (size_t)t * HIDDEN + n);
        const float2 o = *p;
        *p = make_float2(o.x + a, o.y + b);
    }
};

// Gate/up (rows interleaved: n even is gate row n/2, n + 1 its up row): h = SiLU(gate) * up.
struct SiluUp {
    float* h;
    MT_INLINE void operator()(int t, int n, float g, float u) const {
        h[(size_t)t * FFN + n / 2] = g / (1.f + expf(-g)) * u;
    }
};

// LM head of a vocabulary of V rows (Hopper path): logits[t][n..n+1] = (a, b).
template <int V> struct Logits {
    float* logits;
    MT_INLINE void operator()(int t, int n, float a, float b) const {
        *reinterpret_cast<float2*>(logits + (size_t)t * V + n) = make_float2(a, b);
    }
};

}  // namespace epi
