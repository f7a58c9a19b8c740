// mbarriers in shared memory (by 32-bit shared address), for the warp-specialised GEMMs
// (gemm_tma.cu.hbs, gemm_hopper.cu.hbs): a stage's "full" barrier completes when its bytes have
// landed, its "empty" barrier when the MMAs that read it are done. sm_90 only.
#pragma once

namespace mbar {

MT_INLINE void init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make the initialisations visible to the other threads (and the copy engines) before any use.
MT_INLINE void init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Arrive, and expect `bytes` more bytes of bulk copies to complete before the phase can.
MT_INLINE void expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
MT_INLINE void arrive(unsigned bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
// One arrival once every cp.async this thread issued so far has landed (counted against the
// barrier's arrivals: `noinc`).
MT_INLINE void arrive_cp_async(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Wait for the phase of parity `parity` to complete (a fresh barrier counts the phase before its
// first, parity 1, as complete).
MT_INLINE void wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

}  // namespace mbar
