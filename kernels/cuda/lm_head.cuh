// lm_head.cuh: the one-output LM head shared by lm_head_1 (lm_head.cu.hbs) and the persistent decode
// kernel (decode.cu.hbs): streaming whole rows of the embedding-format head in 16-byte chunks, the
// running greedy reduction (max, sum exp, first arg-max) and the cross-block merge by ticket.
// Include after common.cuh (it needs mt::WEmbed).
#pragma once

namespace mt {

__host__ __device__ constexpr int cgcd(int a, int b) { return b == 0 ? a : cgcd(b, a % b); }

// Each warp takes batches of R1 consecutive rows: R1 * C1 16-byte chunks (C1 = HIDDEN / CHUNK per
// row), J1 per lane, all loaded at once (full 512-byte warp loads, every lane busy). A lane's chunks
// belong to at most R1 rows; the row sums come out of one transpose-reduce (R1 - 1 + log2(32 / R1)
// shuffles). The lanes holding row sums keep running (max, sum exp, arg-max) over the warp's batches.
template <int HIDDEN, int VOCAB> struct Lm1 {
    static constexpr int CH = WEmbed::CHUNK;
    static constexpr int C1 = HIDDEN / CH;
    static_assert(HIDDEN % CH == 0, "row length must be a multiple of the chunk");
    static constexpr int R0 = 32 / cgcd(C1, 32);
    static constexpr int J0 = R0 * C1 / 32;
    static constexpr int R1 = R0 * (J0 >= 8 ? 1 : 8 / J0);  // rows per warp batch (8 for 576-wide Q8_0)
    static constexpr int J1 = R1 * C1 / 32;                  // chunks per lane per batch (9 for 576-wide Q8_0)
    static_assert(R1 <= 32 && VOCAB % R1 == 0, "vocab must split into whole batches");
    static_assert((R1 & (R1 - 1)) == 0, "rows per batch must be a power of two");
    static constexpr int NBATCH = VOCAB / R1;
    typedef typename WEmbed::CRaw CRaw;

    // Load batch bt's chunks of this lane.
    static MT_INLINE void fetch(const WEmbed& w, CRaw (&dst)[J1], int bt) {
        const unsigned int base = (unsigned int)bt * (R1 * C1) + (threadIdx.x & 31);
#pragma unroll
        for (int j = 0; j < J1; ++j) dst[j] = w.template cfetch<HIDDEN>(base + 32 * j);
    }

    // One batch bt (its chunks in raw) against the padded row xs (normalised but for the factor
    // `scale`): logits written, `best` updated on the lanes that report rows.
    static MT_INLINE void batch(const CRaw (&raw)[J1], int bt, const float* xs, float scale, float* __restrict__ logits, Acc& best) {
        const int lane = threadIdx.x & 31;
        float d[J1];
#pragma unroll
        for (int j = 0; j < J1; ++j) d[j] = WEmbed::cdot(raw[j], xs + pad_idx(((lane + 32 * j) % C1) * CH));
        // this lane's part of each row, then a transpose-reduce: at offset o the lanes with bit o set
        // keep the upper half of their rows and hand the lower half over (R1 - 1 shuffles in all),
        // then a butterfly over the remaining lanes; lane L ends with row L / (32 / R1).
        float v[R1];
#pragma unroll
        for (int r = 0; r < R1; ++r) {
            v[r] = 0.f;
#pragma unroll
            for (int j = 0; j < J1; ++j)
                if ((32 * j) / C1 <= r && r <= (32 * j + 31) / C1)  // chunk slot j can hold row r (constant)
                    v[r] += (lane + 32 * j) / C1 == r ? d[j] : 0.f;
        }
#pragma unroll
        for (int n = R1, o = 16; n > 1; n >>= 1, o >>= 1) {
            const bool up = (lane & o) != 0;
#pragma unroll
            for (int i = 0; i < n / 2; ++i) {
                const float send = up ? v[i] : v[i + n / 2];
                const float keep = up ? v[i + n / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
#pragma unroll
        for (int o = 16 / R1; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        if ((lane & (32 / R1 - 1)) == 0) {
            const int row = bt * R1 + lane / (32 / R1);
            const float lg = v[0] * scale;
            logits[row] = lg;
            acc_push(best, lg, row);
        }
    }

    // The rows of batches gw, gw + nwarps, ... : `raw` holds batch gw's chunks (fetched by the
    // caller); the next batch is loaded while the current one computes.
    static MT_INLINE void rows(const WEmbed& w, CRaw (&raw)[J1], int gw, int nwarps, const float* xs, float scale,
                               float* __restrict__ logits, Acc& best) {
        for (int bt = gw; bt < NBATCH; bt += nwarps) {
            CRaw nxt[J1];
            if (bt + nwarps < NBATCH) fetch(w, nxt, bt + nwarps);  // in flight while this batch computes
            batch(raw, bt, xs, scale, logits, best);
#pragma unroll
            for (int j = 0; j < J1; ++j) raw[j] = nxt[j];
        }
    }

};

// The last block's merge of one token's n block partials (L2 reads: other SMs wrote them) into its
// arg-max and logprob: every thread merges a stride of partials, then the warps, then the block
// (scratch: one entry per warp, `stride` apart); thread 0 writes the answer.
MT_INLINE void merge_parts(const Acc* pt, int n, Acc* scratch, int stride, int* out_tok, float* out_logprob) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    Acc a{-INFINITY, 0.f, -1};
#pragma unroll 4
    for (int b = threadIdx.x; b < n; b += blockDim.x) {
        Acc o;
        o.m = __ldcg(&pt[b].m);
        o.s = __ldcg(&pt[b].s);
        o.i = __ldcg(&pt[b].i);
        a = acc_merge(a, o);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = acc_merge(a, acc_shfl(a, o));
    if (lane == 0) scratch[warp * stride] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        Acc r = scratch[0];
        for (int w2 = 1; w2 < nw; ++w2) r = acc_merge(r, scratch[w2 * stride]);
        *out_tok = r.i < 0 ? 0 : r.i;
        *out_logprob = (r.i < 0 || !isfinite(r.m)) ? 0.f : -logf(r.s);
    }
}

// One output's greedy reduction across the grid: every block reduces its lanes' `best` to one
// partial (part[blockIdx.x]); the last block to take a ticket merges all gridDim.x partials into the
// arg-max and its logprob, then re-arms the counter. `sa` holds one Acc per warp.
MT_INLINE void finish_greedy(Acc best, Acc* sa, Acc* __restrict__ part, unsigned int* __restrict__ counter,
                             int* __restrict__ out_tok, float* __restrict__ out_logprob) {
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = acc_merge(best, acc_shfl(best, o));
    if (lane == 0) sa[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        Acc a = sa[0];
        for (int w2 = 1; w2 < nw; ++w2) a = acc_merge(a, sa[w2]);
        part[blockIdx.x] = a;
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        merge_parts(part, gridDim.x, sa, 1, out_tok, out_logprob);
        if (threadIdx.x == 0) *counter = 0;  // re-armed for the next launch
    }
}

}  // namespace mt
