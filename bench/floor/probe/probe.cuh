// probe.cuh: what mv_probe.cu and step_probe.cu share: the error check, where a lane's block of a
// q4_1 panel sits, the dot product's dp2a work on one block, the copy rate, and event timing.
#pragma once
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// q4_1 panels (what the 8B q4_1 targets upload): qs uint4 [NB/4][ROWS][4]. Load i of lane l for
// row pair rp: row 2rp + ((l >> 2) & 1), block 16i + 4(l >> 3) + (l & 3), so 8 lanes read the
// pair's 128 contiguous bytes of one panel (mt::PanelLanes).
__device__ __forceinline__ size_t panel_at(int rows, int rp, int i, int lane) {
    const int row = 2 * rp + ((lane >> 2) & 1), b = 16 * i + 4 * (lane >> 3) + (lane & 3);
    return (size_t)(b >> 2) * rows * 4 + (size_t)row * 4 + (b & 3);
}

// the work a real kernel does on a block: 16 dp2a against activation words, a scale FMA
__device__ __forceinline__ float dp2a_block(uint4 q, uint32_t s) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    int is = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int lo = (int)(w[j] & 0x0f0f0f0fu), hi = (int)((w[j] >> 4) & 0x0f0f0f0fu);
        is = __dp2a_lo(0x00030001 + j, lo, is);
        is = __dp2a_hi(0x00050007 + j, lo, is);
        is = __dp2a_lo(0x00020009 + j, hi, is);
        is = __dp2a_hi(0x00040006 + j, hi, is);
    }
    return __uint_as_float(s & 0x3f7fffffu) * (float)is;
}

// Median of `reps` runs of `run` (events recorded on `stream` around each), the first `skip`
// left out, in ms.
template <class F> double median_ms(cudaStream_t stream, int reps, int skip, F run) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a, stream));
        run();
        CK(cudaEventRecord(b, stream));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r >= skip) t.push_back(ms);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// The device-to-device copy rate as cuda_bench measures the floor's: bytes read + written a
// second, `half` bytes copied from `pool` to `pool + half`, median of 7 after one warm-up.
inline double copy_rate_gbs(char* pool, size_t half) {
    const double ms = median_ms(0, 8, 1, [&] { CK(cudaMemcpy(pool + half, pool, half, cudaMemcpyDeviceToDevice)); });
    return 2.0 * half / (ms * 1e-3) / 1e9;
}
