// step_probe.cu: what one persistent launch a decode step could reach. The 32 layers' q4_1
// matrices of the 8B shape (qkv, o, gate/up, down: 4.36 GB, the LM head left out) are
// read product after product, the way a batch-1 step must: a warp a row pair with a register ring
// of 4 loads a lane (mv_probe.cu's `reg 4`, with the dot product's dp2a work), and between two
// products a dependency every block must see, in one of three ways:
//   stream:   none (the products back to back, no wait): the rate of the bytes alone;
//   barrier:  one cooperative launch; a grid-wide barrier between products, each warp's first
//             loads of the next product issued before it arrives (weights never wait for inputs),
//             then every block reads the product's input vector (K floats, an L2 round trip) as a
//             real stage would stage its activations;
//   launches: one launch a product (the 128 products as kernels in a CUDA graph, each with
//             programmatic dependent launch: its first loads before griddepcontrol.wait, the
//             trigger right after it), then the same input read: the per-stage kernels' shape.
// Each way: median of 7 steps, against the bytes at the device-to-device copy rate (read +
// written a second, cuda_bench's floor).
//
// Build and run on the GPU machine: nvcc -O3 -std=c++17 -arch=sm_90a -o step_probe step_probe.cu && ./step_probe
#include "probe.cuh"

constexpr int WARPS = 8, THREADS = 32 * WARPS, G = 4, LAYERS = 32, NPROD = 4 * LAYERS;
constexpr int HIDDEN = 4096, QKV = 6144, FFN = 14336;

struct Prod { const uint4* qs; const uint32_t* sc; int rows, nb; };
struct Step { Prod p[NPROD]; const float* vec; };

// the panel address of load i of a lane (probe.cuh)
__device__ __forceinline__ size_t at(const Prod& m, int rp, int i, int lane) { return panel_at(m.rows, rp, i, lane); }

struct Ring { uint4 q[G]; uint32_t s[G]; };

__device__ __forceinline__ void first_loads(const Prod& m, int rp, Ring& r) {
    const int lane = threadIdx.x & 31;
    if (rp < m.rows / 2) {
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const size_t a = at(m, rp, j, lane);
            r.q[j] = __ldg(m.qs + a);
            r.s[j] = __ldg(m.sc + a);
        }
    }
}

// This warp's row pairs of m (the ring holds the first one's first loads); the ring is left
// holding the first loads of `next` (nullptr: none).
__device__ __forceinline__ void product(const Prod& m, const Prod* next, Ring& r, float& f) {
    const int lane = threadIdx.x & 31, L = m.nb / 16;
    const int nrp = m.rows / 2, stride = gridDim.x * WARPS, rp0 = blockIdx.x * WARPS + (threadIdx.x >> 5);
    for (int rp = rp0; rp < nrp; rp += stride) {
        const int nx = rp + stride;
        for (int c0 = 0; c0 < L; c0 += G) {
#pragma unroll
            for (int j = 0; j < G; ++j) {
                f += dp2a_block(r.q[j], r.s[j]);
                const int i = c0 + G + j;
                if (i < L) {
                    const size_t a = at(m, rp, i, lane);
                    r.q[j] = __ldg(m.qs + a);
                    r.s[j] = __ldg(m.sc + a);
                } else if (nx < nrp) {
                    const size_t a = at(m, nx, i - L, lane);
                    r.q[j] = __ldg(m.qs + a);
                    r.s[j] = __ldg(m.sc + a);
                }
            }
        }
    }
    if (next) first_loads(*next, rp0, r);
}

// every block reads the product's input (K floats) before its first dot, as a stage does
__device__ __forceinline__ void stage_input(const float* vec, int k, float& f) {
    __shared__ float red[WARPS];
    float s = 0.f;
    for (int i = threadIdx.x; i < k; i += THREADS) s += __ldcg(vec + i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    f += red[0] * 1e-30f;
    __syncthreads();
}

__device__ unsigned int bar_count, bar_gen;

__device__ __forceinline__ void grid_sync() {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int g;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(&bar_gen));
        if (atomicAdd(&bar_count, 1u) == gridDim.x - 1) {
            bar_count = 0;
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(&bar_gen), "r"(g + 1));
        } else {
            unsigned int h;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(h) : "l"(&bar_gen));
            } while (h == g);
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(THREADS) step_stream(Step s, float* out) {
    Ring r;
    float f = 0.f;
    first_loads(s.p[0], blockIdx.x * WARPS + (threadIdx.x >> 5), r);
    for (int i = 0; i < NPROD; ++i) product(s.p[i], i + 1 < NPROD ? &s.p[i + 1] : nullptr, r, f);
    if (f == 1.2345f) out[0] = f;
}

__global__ void __launch_bounds__(THREADS) step_barrier(Step s, float* out) {
    Ring r;
    float f = 0.f;
    first_loads(s.p[0], blockIdx.x * WARPS + (threadIdx.x >> 5), r);
    for (int i = 0; i < NPROD; ++i) {
        stage_input(s.vec, s.p[i].nb * 32, f);
        product(s.p[i], i + 1 < NPROD ? &s.p[i + 1] : nullptr, r, f);
        grid_sync();
    }
    if (f == 1.2345f) out[0] = f;
}

__global__ void __launch_bounds__(THREADS) one_product(Prod m, const float* vec, float* out) {
    Ring r;
    float f = 0.f;
    first_loads(m, blockIdx.x * WARPS + (threadIdx.x >> 5), r);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stage_input(vec, m.nb * 32, f);
    product(m, nullptr, r, f);
    if (f == 1.2345f) out[0] = f;
}

int main() {
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, 0));
    const int sms = pr.multiProcessorCount;
    printf("%s, %d SMs\n", pr.name, sms);
    const int shapes[4][2] = {{QKV, HIDDEN}, {HIDDEN, HIDDEN}, {2 * FFN, HIDDEN}, {HIDDEN, FFN}};
    size_t layer_bytes = 0;
    for (auto& sh : shapes) layer_bytes += (size_t)sh[0] * (sh[1] / 32) * 20;
    const size_t total = layer_bytes * LAYERS;
    char* pool;
    CK(cudaMalloc(&pool, total + 4096));
    CK(cudaMemset(pool, 0x5a, total + 4096));
    float *vec, *out;
    CK(cudaMalloc(&vec, FFN * 4));
    CK(cudaMemset(vec, 0, FFN * 4));
    CK(cudaMalloc(&out, 16));
    Step s;
    size_t off = 0;
    for (int l = 0; l < LAYERS; ++l)
        for (int k = 0; k < 4; ++k) {
            const int rows = shapes[k][0], nb = shapes[k][1] / 32;
            const size_t qb = (size_t)rows * nb * 16, sb = (size_t)rows * nb * 4;
            s.p[4 * l + k] = Prod{reinterpret_cast<const uint4*>(pool + off), reinterpret_cast<const uint32_t*>(pool + off + qb), rows, nb};
            off += qb + sb;
        }
    s.vec = vec;
    const double copy_gbs = copy_rate_gbs(pool, (size_t)1 << 30);  // 1 GiB within the pool
    const double floor_us = total / copy_gbs / 1e3;
    printf("copy rate %.1f GB/s; the step's %zu q4_1 bytes (32 layers, head left out) at it: %.1f us\n", copy_gbs, total, floor_us);
    // a step run 9 times on `st`, the median of the last 7
    auto timed = [&](const char* name, cudaStream_t st, auto run) {
        const double us = 1000.0 * median_ms(st, 9, 2, run);
        printf("%-44s %8.1f us  %5.1f%% of the floor  (%.1f us a product above the floor's share)\n", name, us,
               100.0 * floor_us / us, (us - floor_us) / NPROD);
    };
    for (int per : {2, 3}) {
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, step_barrier, THREADS, 0));
        const int grid = std::min(per, occ) * sms;
        char name[96];
        snprintf(name, sizeof name, "stream, %d blocks an SM (grid %d)", std::min(per, occ), grid);
        timed(name, 0, [&] { step_stream<<<grid, THREADS>>>(s, out); });
        snprintf(name, sizeof name, "barrier, %d blocks an SM (cooperative)", std::min(per, occ));
        timed(name, 0, [&] {
            void* args[] = {&s, &out};
            CK(cudaLaunchCooperativeKernel((void*)step_barrier, grid, THREADS, args, 0, 0));
        });
    }
    // launches: the 128 products as kernels in a graph, each with programmatic dependent launch
    {
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, one_product, THREADS, 0));
        for (int per : {2, 3}) {
            const int grid0 = std::min(per, occ) * sms;
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < NPROD; ++i) {
                cudaLaunchConfig_t cfg = {};
                cudaLaunchAttribute attr[1];
                attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                attr[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.gridDim = dim3(std::min(grid0, (s.p[i].rows / 2 + WARPS - 1) / WARPS));
                cfg.blockDim = dim3(THREADS);
                cfg.stream = st;
                cfg.attrs = attr;
                cfg.numAttrs = 1;
                CK(cudaLaunchKernelEx(&cfg, one_product, s.p[i], (const float*)vec, out));
            }
            CK(cudaStreamEndCapture(st, &g));
            cudaGraphExec_t ge;
            CK(cudaGraphInstantiate(&ge, g, 0));
            char name[96];
            snprintf(name, sizeof name, "launches, %d blocks an SM (graph + PDL)", std::min(per, occ));
            timed(name, st, [&] { CK(cudaGraphLaunch(ge, st)); });
        }
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
