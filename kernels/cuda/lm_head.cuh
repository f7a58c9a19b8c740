// lm_head.cuh: the one-output LM head shared by lm_head_1 (lm_head.cu.hbs) and the persistent decode
// kernel (decode.cu.hbs): streaming whole rows of the embedding-format head in 16-byte chunks, the
// running greedy reduction (max, sum exp, first arg-max) and the cross-block merge by ticket.
// Include after common.cuh (it needs mt::WEmbed).
#pragma once

namespace mt {

__host__ __device__ constexpr int cgcd(int a, int b) { return b == 0 ? a : cgcd(b, a % b); }

// Each warp takes batches of R1 consecutive rows: R1 * C1 16-byte chunks (C1 = HIDDEN / CHUNK per
// row), JB per lane (full 512-byte warp loads, every lane busy), loaded in SEG segments of J1 (one
// where JB <= 4 or R1 > 1), each segment in flight while the one before computes. A lane's chunks
// belong to at most R1 rows; the row sums come out of one transpose-reduce (R1 - 1 + log2(32 / R1)
// shuffles). The lanes holding row sums keep running (max, sum exp, arg-max) over the warp's batches.
// Segments: a 4096-wide bf16 row whole (16 chunks a lane, and the next row's 16) took lm_head_1 128
// registers and two blocks an SM, 431 us for the 8B head's 1.05 GB on an H100 (81% of the copy
// rate); in 4 segments, 80 registers and three blocks, 368 us (94%) (bench/floor/README.md).
template <int HIDDEN, int VOCAB> struct Lm1 {
    static constexpr int CH = WEmbed::CHUNK;
    static constexpr int C1 = HIDDEN / CH;
    static_assert(HIDDEN % CH == 0, "row length must be a multiple of the chunk");
    static constexpr int R0 = 32 / cgcd(C1, 32);
    static constexpr int J0 = R0 * C1 / 32;
    static constexpr int R1 = R0 * (J0 >= 8 ? 1 : 8 / J0);  // rows per warp batch (8 for 576-wide Q8_0)
    static constexpr int JB = R1 * C1 / 32;                  // chunks per lane per batch (9 for 576-wide Q8_0)
    // A one-row batch of more than 4 chunks a lane (bf16 rows of 4096: 16) is read in SEG segments of
    // 4, each loaded while the one before computes, so that a lane holds 8 chunks rather than 32 and
    // three blocks fit an SM where two did.
    static constexpr int SEG = (R1 == 1 && JB > 4 && JB % 4 == 0) ? JB / 4 : 1;
    static constexpr int J1 = JB / SEG;                      // chunks per lane loaded at once
    static constexpr int MIN_BLOCKS = SEG > 1 ? 3 : 2;       // lm_head_1's blocks an SM
    static_assert(R1 <= 32 && VOCAB % R1 == 0, "vocab must split into whole batches");
    static_assert((R1 & (R1 - 1)) == 0, "rows per batch must be a power of two");
    static constexpr int NBATCH = VOCAB / R1;
    typedef typename WEmbed::CRaw CRaw;

    // Load segment sg of batch bt: this lane's chunks.
    static MT_INLINE void fetch(const WEmbed& w, CRaw (&dst)[J1], int bt, int sg = 0) {
        const unsigned int base = (unsigned int)bt * (R1 * C1) + (unsigned int)sg * (32 * J1) + (threadIdx.x & 31);
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
        if constexpr (SEG > 1) {
            rows_seg(w, raw, gw, nwarps, xs, scale, logits, best);
            return;
        }
        for (int bt = gw; bt < NBATCH; bt += nwarps) {
            CRaw nxt[J1];
            if (bt + nwarps < NBATCH) fetch(w, nxt, bt + nwarps);  // in flight while this batch computes
            batch(raw, bt, xs, scale, logits, best);
#pragma unroll
            for (int j = 0; j < J1; ++j) raw[j] = nxt[j];
        }
    }

    // rows for one-row batches read in SEG segments (R1 == 1): the lane's products added in the
    // order `batch` adds them, one butterfly a row.
    static MT_INLINE void rows_seg(const WEmbed& w, CRaw (&raw)[J1], int gw, int nwarps, const float* xs, float scale,
                                   float* __restrict__ logits, Acc& best) {
        const int lane = threadIdx.x & 31;
        for (int bt = gw; bt < NBATCH; bt += nwarps) {
            float v = 0.f;
#pragma unroll
            for (int sg = 0; sg < SEG; ++sg) {
                CRaw nxt[J1];
                if (sg + 1 < SEG) fetch(w, nxt, bt, sg + 1);  // in flight while this segment computes
                else if (bt + nwarps < NBATCH) fetch(w, nxt, bt + nwarps, 0);
                float d[J1];
#pragma unroll
                for (int j = 0; j < J1; ++j) d[j] = WEmbed::cdot(raw[j], xs + pad_idx((sg * 32 * J1 + lane + 32 * j) * CH));
#pragma unroll
                for (int j = 0; j < J1; ++j) v += d[j];
#pragma unroll
                for (int j = 0; j < J1; ++j) raw[j] = nxt[j];
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) {
                const float lg = v * scale;
                logits[bt] = lg;
                acc_push(best, lg, bt);
            }
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
