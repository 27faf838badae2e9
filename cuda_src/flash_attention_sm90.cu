// requires: sm_90a
// flash_attention_sm90.cu — the same fused varlen attention as flash_attention.cu, on Hopper's
// warpgroup MMA (wgmma): compiled for sm_90a (the line above tells the loader and CI), used
// when the device is sm_90.
//
// Why a second kernel: mma.sync reaches about two thirds of H100/H200 tensor throughput, and
// at 21k-token segments attention is 70% of the tower's FLOPs. wgmma reads both B operands
// (K, V) straight from shared memory through descriptors, and A (Q) too for S = Q K^T, so a
// warp no longer spends issue slots and registers on ldmatrix fragments.
//
// Shape: a CTA is two warpgroups (256 threads) on one (128-query tile, head); warpgroup w owns
// query rows 64w..64w+63 and each of its warps 16 of them, with the same accumulator fragment
// layout as mma.sync (attention.cuh), so masking, the online softmax, the P re-pack and the
// store are shared with flash_attention.cu. Per 64-key tile and warpgroup:
//   S = Q K^T   4 x wgmma m64n64k16, A = Q and B = K from swizzled shared memory (K-major)
//   softmax     on the 32 S registers a thread holds
//   O += P V    4 x wgmma m64n64k16, A = P from registers, B = V from shared memory read
//               N-major (the "transpose B" bit): V keeps its [key][dim] layout
// K/V tiles are double-buffered with cp.async as in flash_attention.cu. The tiles use the
// 128B swizzle the descriptors declare (attention.cuh), 1024-byte aligned. cp.async writes
// through the generic proxy and wgmma reads through the async proxy, hence the
// fence.proxy.async before each barrier that publishes a tile.
// Reference: segment_attention in reference.py; cross-checks: flash_attention.cu, naive path.
#include "attention.cuh"

namespace {

using namespace attn;

constexpr int HD = 64;
constexpr int BM = 128;      // queries per CTA (two warpgroups of 64)
constexpr int BN = 64;       // keys per pipeline stage
constexpr int THREADS = 256;

// Shared-memory matrix descriptor: start address, leading and stride byte offsets (both the
// 1024-byte distance between 8-row swizzle atoms; the leading one is unused for K-major and
// for an N-major operand one atom wide), 128B swizzle. Fields hold byte values >> 4.
__device__ __forceinline__ unsigned long long descriptor(const void* tile) {
    const unsigned long long addr = smem_addr(tile);
    return ((addr & 0x3FFFF) >> 4) | (64ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Keep the compiler from moving register reads/writes across the asynchronous MMAs: operands
// are pinned here, before wgmma.fence, and accumulators again after the wait.
__device__ __forceinline__ void fence_regs(float (&d)[8][4]) {
    #pragma unroll
    for (int n = 0; n < 8; ++n)
        asm volatile("" : "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3]) :: "memory");
}
__device__ __forceinline__ void fence_regs(unsigned (&a)[4][4]) {
    #pragma unroll
    for (int n = 0; n < 4; ++n)
        asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1]), "+r"(a[n][2]), "+r"(a[n][3]) :: "memory");
}

#define ACC32(d)                                                                                  \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),     \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),     \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),     \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),     \
    "+f"(d[7][2]), "+f"(d[7][3])
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// D (+)= A B, m64n64k16, A and B from shared memory, both K-major. accumulate = 0 overwrites.
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : ACC32(d) : "l"(a), "l"(b), "r"(accumulate));
}

// D += A B, m64n64k16, A from registers (an m16k16 fragment per warp), B from shared memory
// read N-major.
__device__ __forceinline__ void wgmma_rs_bt(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : ACC32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

}  // namespace

// Dynamic shared memory: 1 KiB of alignment slack + Q (16 KiB) + 2 K + 2 V tiles (32 KiB).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attention_sm90_hd64(const bf16* __restrict__ qkv, bf16* __restrict__ out, const int4* __restrict__ tiles,
                          int heads, float scale_log2) {
    constexpr int NS = BN / 8, NO = HD / 8;
    extern __shared__ unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    bf16* sK = sQ + BM * HD;      // [2][BN][HD]
    bf16* sV = sK + 2 * BN * HD;  // [2][BN][HD]

    const Work<HD> w(qkv, tiles, heads);
    const int n_tiles = (w.seg_len + BN - 1) / BN;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;

    load_tile<BM, HD, THREADS>(sQ, w.q, w.ld, min(BM, w.seg_len - w.q0));
    load_tile<BN, HD, THREADS>(sK, w.k, w.ld, min(BN, w.seg_len));
    load_tile<BN, HD, THREADS>(sV, w.v, w.ld, min(BN, w.seg_len));
    cp_async_commit();

    const unsigned long long q_desc = descriptor(sQ + wg * 64 * HD);
    float o[NO][4], s[NS][4];
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    #pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < n_tiles) {
            const int valid = min(BN, w.seg_len - (kt + 1) * BN);
            load_tile<BN, HD, THREADS>(sK + (buf ^ 1) * BN * HD, w.k + (kt + 1) * BN * w.ld, w.ld, valid);
            load_tile<BN, HD, THREADS>(sV + (buf ^ 1) * BN * HD, w.v + (kt + 1) * BN * w.ld, w.ld, valid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async data -> wgmma
        __syncthreads();

        // S = Q K^T: 4 k16 steps over the head dim; a step is 32 bytes along the swizzled rows.
        const unsigned long long k_desc = descriptor(sK + buf * BN * HD);
        fence_regs(s);
        wgmma_fence();
        #pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) wgmma_ss(s, q_desc + 2 * ks, k_desc + 2 * ks, ks);
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(s);

        mask_tail(s, kt * BN, w.seg_len, t);
        online_softmax(s, o, m_run, l_run, scale_log2);

        // O += P V: 4 k16 steps over the keys; a step is 16 rows of V = 2048 bytes.
        const unsigned long long v_desc = descriptor(sV + buf * BN * HD);
        unsigned a[BN / 16][4];
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment(a[kk], s, kk);
        fence_regs(a);
        fence_regs(o);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_bt(o, a[kk], v_desc + (unsigned long long)(kk * 2048 >> 4));
        wgmma_commit();
        wgmma_wait_all();
        fence_regs(o);
        __syncthreads();  // both warpgroups are done with this buffer before it is refilled
    }
    store_rows(o, l_run, out, w.seg_start, w.seg_len, w.q0 + wg * 64 + warp * 16, w.h, w.head, g, t);
}
