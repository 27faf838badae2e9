// requires: sm_90a
// flash_attention_sm90.cu — the same fused varlen attention as flash_attention.cu, on Hopper's
// warpgroup MMA (wgmma): compiled for sm_90a (the line above tells the loader and CI), used
// when the device is sm_90.
//
// Why a second kernel: mma.sync reaches about two thirds of H100/H200 tensor throughput, and
// at 21k-token segments attention is 70% of the tower's FLOPs. wgmma reads the B operands
// (K, V) straight from shared memory through descriptors, so a warp no longer spends issue
// slots and registers on ldmatrix fragments for them.
//
// Shape: a CTA is one warpgroup (128 threads) on one (64-query tile, head); each warp owns 16
// query rows, with the same accumulator fragment layout as mma.sync (attention.cuh), so
// masking, the online softmax, the P re-pack and the store are shared with flash_attention.cu.
// Q is loaded once into registers (A fragments). Per 64-key tile j:
//   S_j = Q K_j^T         4 x wgmma m64n64k16, B = K from swizzled shared memory (K-major)
//   O += P_{j-1} V_{j-1}  4 x wgmma m64n64k16, A = P from registers, B = V from shared memory
//                         read N-major (the "transpose B" bit): V keeps its [key][dim] layout
//   softmax of S_j        while P_{j-1} V_{j-1} is still running
// That software pipeline (FA3's intra-warpgroup overlap) is why the loop looks the way it
// does: issued back to back, QK^T, softmax and PV leave the tensor cores idle during the
// exponentials, which at head_dim 64 take as long as the MMAs. S_j, P_{j-1}, O and Q are all
// live at once (96 of a thread's 128 registers); 4 CTAs share an SM. One warpgroup a CTA,
// not two sharing K/V tiles: a CTA-wide barrier per tile kept two warpgroups in lockstep, and
// 1024- to 5476-key segments ran 7-10% slower that way (21316: the same).
// K/V tiles go through 3 shared-memory stages with cp.async: tile j is read by S_j, tile j-1
// by the PV still in flight, and tile j+1 loads meanwhile. The tiles use the 128B swizzle the
// descriptors declare (attention.cuh), 1024-byte aligned. cp.async writes through the generic
// proxy and wgmma reads through the async proxy, hence the fence.proxy.async before the
// barrier that publishes a tile.
// Reference: segment_attention in reference.py; cross-checks: flash_attention.cu, naive path.
#include "attention.cuh"

namespace {

using namespace attn;

constexpr int HD = 64;
constexpr int BM = 64;       // queries per CTA (one warpgroup)
constexpr int BN = 64;       // keys per pipeline stage
constexpr int STAGES = 3;    // K/V shared-memory stages (see the header)
constexpr int THREADS = 128;

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

// D (+)= A B, m64n64k16, A from registers (an m16k16 fragment per warp: the mma.sync A layout),
// B from shared memory, K-major (TRANS_B 0: K tiles) or N-major (1: V tiles keep their
// [key][dim] layout). accumulate = 0 overwrites D.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : ACC32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TRANS_B));
}

// S = Q K^T: 4 k16 steps over the head dim; a step is 32 bytes along K's swizzled rows.
__device__ __forceinline__ void issue_qk(float (&s)[BN / 8][4], const unsigned (&q)[HD / 16][4], const bf16* k_tile) {
    const unsigned long long k_desc = descriptor(k_tile);
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) wgmma_rs<0>(s, q[ks], k_desc + 2 * ks, ks);
    wgmma_commit();
}

// O += P V: 4 k16 steps over the keys; a step is 16 rows of V = 2048 bytes.
__device__ __forceinline__ void issue_pv(float (&o)[HD / 8][4], const unsigned (&a)[BN / 16][4], const bf16* v_tile) {
    const unsigned long long v_desc = descriptor(v_tile);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<1>(o, a[kk], v_desc + (unsigned long long)(kk * 2048 >> 4), 1);
    wgmma_commit();
}

}  // namespace

// Dynamic shared memory: 1 KiB of alignment slack + 3 K + 3 V tiles (48 KiB); Q passes through
// the third K stage on its way into registers.
extern "C" __global__ void __launch_bounds__(THREADS, 4)
flash_attention_sm90_hd64(const bf16* __restrict__ qkv, bf16* __restrict__ out, const int4* __restrict__ tiles,
                          int heads, float scale_log2) {
    constexpr int NS = BN / 8, NO = HD / 8, TILE = BN * HD;
    static_assert(BM == BN, "Q is staged in a K tile");
    extern __shared__ unsigned char smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));  // [STAGES][BN][HD]
    bf16* sV = sK + STAGES * TILE;   // [STAGES][BN][HD]
    bf16* sQ = sK + 2 * TILE;        // until tile 2 loads

    const Work<HD> w(qkv, tiles, heads);
    const int n_tiles = (w.seg_len + BN - 1) / BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = lane & 3;
    auto load_kv = [&](int j) {  // key tile j into stage j % STAGES
        const int valid = min(BN, w.seg_len - j * BN), stage = j % STAGES;
        load_tile<BN, HD, THREADS>(sK + stage * TILE, w.k + j * BN * w.ld, w.ld, valid);
        load_tile<BN, HD, THREADS>(sV + stage * TILE, w.v + j * BN * w.ld, w.ld, valid);
    };
    auto publish = [&]() {  // every thread's cp.async data, visible to the warpgroup's wgmma and ldmatrix
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    };

    load_tile<BM, HD, THREADS>(sQ, w.q, w.ld, min(BM, w.seg_len - w.q0));
    load_kv(0);
    cp_async_commit();
    if (n_tiles > 1) load_kv(1);
    cp_async_commit();

    unsigned q[HD / 16][4];  // this warp's 16 query rows as A fragments, loaded once
    float o[NO][4], s[NS][4], corr[2];
    unsigned a[BN / 16][4];  // P of the previous tile: the A operand of the PV in flight
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    #pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    // Tile 0: nothing to overlap with yet.
    cp_async_wait<1>();
    publish();
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks)
        ldmatrix_x4(q[ks], sQ + swz<HD>(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)));
    fence_regs(s);
    wgmma_fence();
    issue_qk(s, q, sK);
    wgmma_wait<0>();
    fence_regs(s);
    mask_tail(s, 0, w.seg_len, t);
    softmax_step(s, m_run, l_run, corr, scale_log2);

    // The loop is rotated so that each iteration ENDS with the softmax of S_j while P_{j-1} V_{j-1}
    // runs, and the wait for that PV opens the next iteration. Written the other way round
    // (wait between softmax and rescale), ptxas hoists the wait above the exponentials and
    // the overlap is lost; a wait cannot move up across the loop's back edge.
    for (int j = 1; j <= n_tiles; ++j) {
        wgmma_wait<0>();  // P_{j-2} V_{j-2}
        fence_regs(o);
        rescale(o, corr);  // O and P_{j-1} now share the running max
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment(a[kk], s, kk);
        if (j == n_tiles) break;

        cp_async_wait<0>();  // tile j (committed one iteration ago)
        publish();           // ... and every warp is past P_{j-2} V_{j-2}
        if (j + 1 < n_tiles) load_kv(j + 1);  // into the stage of tile j - 2, no longer read
        cp_async_commit();

        fence_regs(s);
        fence_regs(a);
        fence_regs(o);
        wgmma_fence();
        issue_qk(s, q, sK + (j % STAGES) * TILE);
        issue_pv(o, a, sV + ((j - 1) % STAGES) * TILE);
        wgmma_wait<1>();  // S_j is done; P_{j-1} V_{j-1} may still run
        fence_regs(s);
        mask_tail(s, j * BN, w.seg_len, t);
        softmax_step(s, m_run, l_run, corr, scale_log2);
    }

    fence_regs(a);
    fence_regs(o);
    wgmma_fence();
    issue_pv(o, a, sV + ((n_tiles - 1) % STAGES) * TILE);
    wgmma_wait<0>();
    fence_regs(o);
    store_rows(o, l_run, out, w.seg_start, w.seg_len, w.q0 + warp * 16, w.h, w.head, lane >> 2, t);
}
