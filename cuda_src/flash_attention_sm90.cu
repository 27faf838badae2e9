// requires: sm_90a
// flash_attention_sm90.cu — the same fused varlen attention as flash_attention.cu, on Hopper's
// warpgroup MMA (wgmma): compiled for sm_90a (the line above tells the loader and CI), used
// when the device is sm_90.
//
// Why a second kernel: mma.sync cannot keep Hopper's tensor cores busy, and at long segments
// attention is most of the tower's FLOPs (benchmarks/NOTES.md has both figures). wgmma reads
// the B operands (K, V) straight from shared memory through descriptors, so a warp spends no
// issue slots or registers on ldmatrix fragments for them.
//
// Shape: a CTA is WGS warpgroups (1, 2 or 4: one kernel each) on one (64 x WGS-query tile,
// head); a warpgroup owns 64 query rows and each warp 16, with the same accumulator fragment
// layout as mma.sync (attention.cuh), so masking, the online softmax, the P re-pack and the
// store are shared with flash_attention.cu. Q is loaded once into registers (A fragments). Per
// 64-key tile j, in each warpgroup:
//   S_j = Q K_j^T         4 x wgmma m64n64k16, B = K from swizzled shared memory (K-major)
//   O += P_{j-1} V_{j-1}  4 x wgmma m64n64k16, A = P from registers, B = V from shared memory
//                         read N-major (the "transpose B" bit): V keeps its [key][dim] layout;
//                         and the row sums of P as 4 x m64n8k16 against a tile of ones
//   softmax of S_j        while P_{j-1} V_{j-1} is still running
// That software pipeline (FA3's intra-warpgroup overlap) is why the loop looks the way it
// does: issued back to back, QK^T, softmax and PV leave the tensor cores idle during the
// exponentials, which at head_dim 64 take as long as the MMAs. S_j, P_{j-1}, O, the row sums
// and Q are all live at once (100 of a thread's 126 registers); 16 warps share an SM.
// Why several warpgroups a CTA: they read each K/V tile from L2 once for all of them, and on a
// power-capped GPU, whose clock follows power, the L2 traffic saved is speed in the whole forward
// (benchmarks/NOTES.md). The engine takes the widest tile that still gives every SM a CTA
// (flash.choose_bm).
// K/V tiles go through 3 shared-memory stages: tile j is read by S_j, tile j-1 by the PV still
// in flight, and tile j+1 loads meanwhile. One thread loads them with TMA (cp.async.bulk.tensor,
// a 64 x 64 box per instruction, 128B-swizzled by the copy engine into the layout the
// descriptors declare, rows past the buffer's end zero-filled) and arms the stage's mbarrier
// with the bytes to expect; everyone waits on its phase. With several warpgroups, the last one
// done with a stage (a shared counter) refills it, so none waits for the others unless it runs
// a whole tile ahead (a CTA-wide barrier per tile would keep them in lockstep). TMA rather than
// cp.async because the kernel is bound by instruction issue, and cp.async spends a warp's
// instructions on load addresses and row guards.
// Reference: segment_attention in reference.py; cross-checks: flash_attention.cu, naive path.
#include "attention.cuh"
#include "wgmma.cuh"

namespace {

using namespace attn;
using namespace sm90;

constexpr int HD = 64;
constexpr int BN = 64;       // keys per pipeline stage (and query rows per warpgroup)
constexpr int STAGES = 3;    // K/V shared-memory stages (see the header)

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
__device__ __forceinline__ void issue_qk(float (&s)[BN / 8][4], const unsigned (&q)[HD / 16][4], unsigned long long k_desc) {
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) wgmma_rs<0>(s, q[ks], k_desc + 2 * ks, ks);
    wgmma_commit();
}

// A descriptor of the 256-byte all-ones B tile: two 8 x 8 core matrices, no swizzle (whatever
// the layout rules, every element it can address is 1).
__device__ __forceinline__ unsigned long long ones_descriptor(const bf16* ones) {
    return ((smem_addr(ones) & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}

// D (+)= A . ones, m64n8k16: every column of D is the row sum of A. The same P fragments as
// the PV MMA, so the softmax denominators come out of the tensor cores instead of 32 FADDs a
// thread and tile, and they sum exactly the BF16 weights that multiply V.
__device__ __forceinline__ void wgmma_rowsum(float (&d)[4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// O += P V and l += P . 1: 4 k16 steps over the keys; a V step is 16 rows = 2048 bytes.
// acc is O's 8 n8 column tiles followed by the row-sum tile.
__device__ __forceinline__ void issue_pv(float (&acc)[HD / 8 + 1][4], const unsigned (&a)[BN / 16][4],
                                         unsigned long long v_desc, unsigned long long ones) {
    float (&o)[HD / 8][4] = reinterpret_cast<float (&)[HD / 8][4]>(acc);
    #pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_rs<1>(o, a[kk], v_desc + (unsigned long long)(kk * 2048 >> 4), 1);
        wgmma_rowsum(acc[HD / 8], a[kk], ones);
    }
    wgmma_commit();
}

// Named barrier of one warpgroup (ids 1-4; constant ids, since a register id reserves all 16).
__device__ __forceinline__ void warpgroup_sync(int wg) {
    switch (wg) {
        case 0: asm volatile("bar.sync 1, 128;\n" ::: "memory"); break;
        case 1: asm volatile("bar.sync 2, 128;\n" ::: "memory"); break;
        case 2: asm volatile("bar.sync 3, 128;\n" ::: "memory"); break;
        default: asm volatile("bar.sync 4, 128;\n" ::: "memory"); break;
    }
}

// A piece's rows in `partial`, as store_partial leaves them and merge_pieces reads them: slot i
// holds [bm][HD] unnormalised O, then [bm] running maxima (raw scores), then [bm] row sums.
template <typename F>  // float; const float for reading
struct PartialSlot {
    F* base;
    int bm;
    __device__ PartialSlot(F* partial, long long i, int bm) : base(partial + i * bm * (HD + 2)), bm(bm) {}
    __device__ F* o(int row) const { return base + row * HD; }
    __device__ F& m(int row) const { return base[bm * HD + row]; }
    __device__ F& l(int row) const { return base[bm * HD + bm + row]; }
};

template <int NO>
__device__ __forceinline__ void store_partial(const float (&o)[NO][4], const float (&l_row)[2], const float (&m_run)[2],
                                              PartialSlot<float> slot, int row_first, int g, int t) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_first + g + 8 * r;
        #pragma unroll
        for (int n = 0; n < NO; ++n)
            *reinterpret_cast<float2*>(slot.o(row) + n * 8 + 2 * t) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
        if (t == 0) {
            slot.m(row) = m_run[r];
            slot.l(row) = l_row[r];
        }
    }
}

// Whether this CTA is the last of its query tile's pieces to finish; every piece's rows are then
// in `partial`. The CUDA guide's threadfence pattern: each thread fences its stores, one thread
// counts, and the last resets the counter for the next launch (a layer later, or a graph replay).
__device__ __forceinline__ bool last_piece(unsigned* counter, int pieces) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == pieces - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The rows of a query tile's pieces merged as one pass would have: rescaled to the largest of
// the maxima, O and the row sums added in piece order, so the bits do not depend on which piece
// finished last. This CTA's own piece comes from its registers, the others' through L2 (__ldcg:
// this SM's L1 never saw their stores). Each other piece's maximum is read twice, for the
// maximum and for its weight: 4-byte L2 hits in the last piece only, where keeping up to
// MAX_PIECES maxima a row would take 32 registers.
template <int NO>
__device__ __forceinline__ void merge_pieces(const float (&o)[NO][4], const float (&l_row)[2], const float (&m_run)[2],
                                             const float* partial, long long first_slot, int piece, int pieces, int bm,
                                             int row_first, int g, int t, float scale_log2, float (&acc)[NO][4],
                                             float (&den)[2]) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_first + g + 8 * r;
        float mx = m_run[r];
        for (int i = 0; i < pieces; ++i)
            if (i != piece) mx = fmaxf(mx, __ldcg(&PartialSlot<const float>(partial, first_slot + i, bm).m(row)));
        den[r] = 0.f;
        #pragma unroll
        for (int n = 0; n < NO; ++n) acc[n][2 * r] = acc[n][2 * r + 1] = 0.f;
        for (int i = 0; i < pieces; ++i) {
            const PartialSlot<const float> slot(partial, first_slot + i, bm);
            const bool own = i == piece;
            const float w = exp2f(((own ? m_run[r] : __ldcg(&slot.m(row))) - mx) * scale_log2);
            den[r] += w * (own ? l_row[r] : __ldcg(&slot.l(row)));
            #pragma unroll
            for (int n = 0; n < NO; ++n) {
                const float2 v = own ? make_float2(o[n][2 * r], o[n][2 * r + 1])
                                     : __ldcg(reinterpret_cast<const float2*>(slot.o(row) + n * 8 + 2 * t));
                acc[n][2 * r] += w * v.x;
                acc[n][2 * r + 1] += w * v.y;
            }
        }
    }
}

// WGS warpgroups a CTA, 64 query rows each, sharing every K/V stage.
template <int WGS>
__device__ __forceinline__ void flash_tile(const void* qkv_map, bf16* out, const int4* tiles, int heads,
                                           float scale_log2, float* partial, unsigned* counters, int first_piece) {
    constexpr int NS = BN / 8, NO = HD / 8, TILE = BN * HD;
    static_assert(BN == 64, "Q is staged in 64-row tiles");
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[STAGES + 1];  // per K/V stage, then Q's
    __shared__ unsigned released[STAGES];  // WGS > 1: warpgroups done with a stage (atomicInc wraps at WGS)
    __shared__ __align__(256) bf16 ones[128];
    bf16* sK = reinterpret_cast<bf16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));  // [STAGES][BN][HD]
    bf16* sV = sK + STAGES * TILE;  // [STAGES][BN][HD]
    bf16* sQ = WGS == 1 ? sK + 2 * TILE : sV + STAGES * TILE;  // one warpgroup: in K stage 2 until tile 2 loads

    const int4 entry = tiles[blockIdx.x];
    const int seg_start = entry.x, seg_len = entry.y, q0 = entry.z, head = entry.w & 0xFF, h = heads * HD;
    // A piece (pieces > 0) covers key tiles [kt0, kt0 + n_tiles) of the segment's and leaves
    // its unnormalised rows for merge_pieces; otherwise the CTA takes every key tile.
    const int pieces = entry.w >> 16, piece = (entry.w >> 8) & 0xFF, seg_tiles = (seg_len + BN - 1) / BN;
    const int kt0 = pieces ? seg_tiles * piece / pieces : 0;
    const int n_tiles = (pieces ? seg_tiles * (piece + 1) / pieces : seg_tiles) - kt0;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int t = lane & 3;
    const bool leader = threadIdx.x == 0, wg_leader = (threadIdx.x & 127) == 0;
    auto load_kv = [&](int j, int stage) {  // key tile j into stage j % STAGES (one thread)
        expect_bytes(&full[stage], 2 * TILE * 2);
        tma_load(sK + stage * TILE, qkv_map, h + head * HD, seg_start + (kt0 + j) * BN, &full[stage]);
        tma_load(sV + stage * TILE, qkv_map, 2 * h + head * HD, seg_start + (kt0 + j) * BN, &full[stage]);
    };

    if (threadIdx.x < 128) ones[threadIdx.x] = __float2bfloat16(1.f);
    if (WGS > 1 && threadIdx.x < STAGES) released[threadIdx.x] = 0;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma after the barrier
    const unsigned long long ones_desc = ones_descriptor(ones);
    // Stages are contiguous, so a stage's descriptor is the first one's plus its byte offset >> 4.
    const unsigned long long k_desc = descriptor(sK), v_desc = descriptor(sV);
    constexpr unsigned long long STAGE_STEP = TILE * 2 >> 4;
    if (wg_leader) tensormap_acquire(qkv_map);  // the threads that issue copies
    if (leader) {
        #pragma unroll
        for (int i = 0; i <= STAGES; ++i) mbar_init(&full[i], 1);
        mbar_fence_init();
        expect_bytes(&full[STAGES], WGS * TILE * 2);
        for (int w = 0; w < WGS; ++w) tma_load(sQ + w * TILE, qkv_map, head * HD, seg_start + q0 + 64 * w, &full[STAGES]);
        for (int j = 0; j < (WGS == 1 ? 2 : STAGES) && j < n_tiles; ++j) load_kv(j, j);
    }
    __syncthreads();  // the barriers are initialised before anyone waits on them

    unsigned q[HD / 16][4];  // this warp's 16 query rows as A fragments, loaded once
    float o[NO + 1][4], s[NS][4], corr[2];  // o: O, then the row sums (every column the same)
    unsigned a[BN / 16][4];  // P of the previous tile: the A operand of the PV in flight
    float m_run[2] = {neg_inf(), neg_inf()};
    #pragma unroll
    for (int n = 0; n <= NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    // Tile 0: nothing to overlap with yet.
    mbar_wait(&full[STAGES], 0);
    #pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks)
        ldmatrix_x4(q[ks], sQ + wg * TILE + swz<HD>(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)));
    mbar_wait(&full[0], 0);
    fence_regs(s);
    wgmma_fence();
    issue_qk(s, q, k_desc);
    wgmma_wait<0>();
    fence_regs(s);
    mask_tail(s, kt0 * BN, seg_len, t);
    exponentiate(s, m_run, corr, scale_log2);

    // The loop is rotated so that each iteration ENDS with the softmax of S_j while P_{j-1} V_{j-1}
    // runs, and the wait for that PV opens the next iteration. Written the other way round
    // (wait between softmax and rescale), ptxas hoists the wait above the exponentials and
    // the overlap is lost; a wait cannot move up across the loop's back edge. The stages and
    // the barrier parity are stepped, not computed from j (j % 3 costs several instructions).
    static_assert(STAGES == 3, "the free stage is the one neither tile j nor j - 1 occupies");
    int prev = 0, cur = 1, phase = 0;  // stages of tiles j - 1 and j, parity of tile j's barrier
    for (int j = 1; j <= n_tiles; ++j) {
        wgmma_wait<0>();  // P_{j-2} V_{j-2}
        fence_regs(o);
        rescale(o, corr);  // O, the row sums and P_{j-1} now share the running max
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) p_fragment(a[kk], s, kk);
        if (j == n_tiles) break;

        const int free = 3 - prev - cur;  // the stage of tile j - 2 (at j = 1: Q's, or tile 2's)
        if (WGS == 1) {
            __syncthreads();  // every warp is past P_{j-2} V_{j-2} (and, at j = 1, past reading Q)
            if (leader && j + 1 < n_tiles) load_kv(j + 1, free);
        } else if (j >= 2) {  // the last warpgroup done with tile j - 2 refills its stage
            warpgroup_sync(wg);
            if (wg_leader) {
                __threadfence_block();
                if (atomicInc(&released[free], WGS - 1) == WGS - 1 && j + 1 < n_tiles) load_kv(j + 1, free);
            }
        }
        mbar_wait(&full[cur], phase);  // tile j

        fence_regs(s);
        fence_regs(a);
        fence_regs(o);
        wgmma_fence();
        issue_qk(s, q, k_desc + cur * STAGE_STEP);
        issue_pv(o, a, v_desc + prev * STAGE_STEP, ones_desc);
        wgmma_wait<1>();  // S_j is done; P_{j-1} V_{j-1} may still run
        fence_regs(s);
        mask_tail(s, (kt0 + j) * BN, seg_len, t);
        exponentiate(s, m_run, corr, scale_log2);
        prev = cur;
        cur = cur == STAGES - 1 ? 0 : cur + 1;
        phase ^= cur == 0;
    }

    fence_regs(a);
    fence_regs(o);
    wgmma_fence();
    issue_pv(o, a, v_desc + prev * STAGE_STEP, ones_desc);  // the last tile
    wgmma_wait<0>();
    fence_regs(o);
    const float l_row[2] = {o[NO][0], o[NO][2]};
    const float (&o_rows)[NO][4] = reinterpret_cast<const float (&)[NO][4]>(o);
    const int g = lane >> 2, row_first = wg * 64 + warp * 16;
    if (pieces == 0) {
        store_rows(o_rows, l_row, out, seg_start, seg_len, q0 + row_first, h, head, g, t);
        return;
    }
    // A piece leaves its rows for the others; the last of its query tile to finish merges them all.
    const long long first_slot = blockIdx.x - first_piece - piece;  // piece 0 of this query tile
    store_partial(o_rows, l_row, m_run, PartialSlot<float>(partial, first_slot + piece, 64 * WGS), row_first, g, t);
    if (!last_piece(&counters[first_slot / pieces], pieces)) return;
    float merged[NO][4], den[2];
    merge_pieces(o_rows, l_row, m_run, partial, first_slot, piece, pieces, 64 * WGS, row_first, g, t, scale_log2,
                 merged, den);
    store_rows(merged, den, out, seg_start, seg_len, q0 + row_first, h, head, g, t);
}

}  // namespace

// Dynamic shared memory: 1 KiB of alignment slack + 3 K + 3 V tiles (48 KiB), and with more than
// one warpgroup their Q tiles (8 KiB each). `qkv_map` is the TMA descriptor of the QKV buffer
// (qkv_map in kernels.py): [P rows, 3 x heads x HD columns], boxes of 64 rows x 64 columns in
// the 128B swizzle, rows at or past P read as zeros. Grid: one CTA per work-list entry. Entries
// from first_piece on are pieces: their rows go to `partial` (slot blockIdx.x - first_piece) and
// counters[(blockIdx.x - first_piece) / pieces] (zero between launches) counts them. Why pieces:
// with 4 warpgroups a CTA one CTA fits an SM, and a tail of a few CTAs past the last whole
// round takes as long as a round; flash.flash_work_list cuts such a tail into pieces that fill
// whole rounds. The last piece merges them: a separate combine kernel costs more.
#define FLASH_SM90(NAME, WGS)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128 * WGS, 4 / WGS)                                             \
    NAME(const void* __restrict__ qkv_map, bf16* __restrict__ out, const int4* __restrict__ tiles, int heads,     \
         float scale_log2, float* partial, unsigned* counters, int first_piece) {                                 \
        flash_tile<WGS>(qkv_map, out, tiles, heads, scale_log2, partial, counters, first_piece);                 \
    }
FLASH_SM90(flash_attention_sm90_hd64, 1)
FLASH_SM90(flash_attention_sm90_hd64_wg2, 2)
FLASH_SM90(flash_attention_sm90_hd64_wg4, 4)
