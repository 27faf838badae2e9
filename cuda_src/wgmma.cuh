// wgmma.cuh — Hopper's asynchronous primitives, shared by the sm_90a kernels (the wgmma flash
// attention and the fused gate|up GEMM): shared-memory matrix descriptors for 128B-swizzled
// tiles, the wgmma fence/commit/wait protocol, mbarriers, and TMA loads through a CUtensorMap
// the host encodes (kernels.TensorMaps). Compiles only for sm_90a.
#pragma once
#include "common.cuh"

namespace sm90 {

// Shared-memory matrix descriptor: start address, leading and stride byte offsets (both the
// 1024-byte distance between 8-row swizzle atoms; the leading one is unused for K-major and
// for an N-major operand one atom wide), 128B swizzle. Fields hold byte values >> 4.
__device__ __forceinline__ unsigned long long descriptor(const void* tile) {
    const unsigned long long addr = smem_addr(tile);
    return ((addr & 0x3FFFF) >> 4) | (64ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // wait until at most N committed wgmma groups are still pending
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// mbarriers and TMA (cp.async.bulk.tensor). The leader thread arms a stage's barrier with the
// bytes it expects and issues the copies; the tensor core's async proxy writes the tile, and
// the barrier's phase flips when all bytes have landed, which is what every thread waits on.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void expect_bytes(unsigned long long* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, int parity) {
    asm volatile("{\n.reg .pred p;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// The descriptor lives in global memory, written by the host before the launch.
__device__ __forceinline__ void tensormap_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" :: "l"(map) : "memory");
}
// One box at (column, row) of the tensor `map` into a 1024-byte aligned tile.
__device__ __forceinline__ void tma_load(bf16* tile, const void* map, int col, int row, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_addr(tile)), "l"(map), "r"(col), "r"(row), "r"(smem_addr(bar)) : "memory");
}

// Keep the compiler from moving register reads/writes across the asynchronous MMAs: operands
// (A fragments) are pinned here, before wgmma.fence, and accumulators again after the wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
    #pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3]) :: "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(unsigned (&a)[N][4]) {
    #pragma unroll
    for (int n = 0; n < N; ++n)
        asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1]), "+r"(a[n][2]), "+r"(a[n][3]) :: "memory");
}

}  // namespace sm90
