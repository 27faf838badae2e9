// flash_attention.cu — fused varlen attention for any GPU from sm_80 (mma.sync; Hopper runs
// flash_attention_sm90.cu instead): softmax(q k^T * hd^-0.5) v within each segment
// (one per image frame), in one launch for a whole batch, never materialising the scores.
//
// Shape: one CTA of 4 warps per (128-query tile, head); each warp owns 32 query rows (two m16
// tiles), so every K/V fragment read from shared memory feeds two MMAs: with 16 rows a warp
// the loop is bound by shared-memory bandwidth, not the tensor cores (FA2's choice for hd 64).
// K and V stream through shared memory in 64-key tiles, double-buffered with cp.async so the
// next tile loads while this one is multiplied. Per tile and warp:
//   S = Q K^T         mma.sync m16n8k16 (BF16 in, FP32 accumulate); Q stays in registers
//   online softmax    running row max / sum in FP32, exp2 with the scale folded into log2(e)
//   O += P V          P re-packed from the S accumulators straight into A fragments (the
//                     m16n8 C layout pairs up into the m16k16 A layout), V via ldmatrix.trans
// Shared tiles are stored with 16-byte chunks XOR-swizzled by row (chunk ^ (row & 7)): the 8
// rows one ldmatrix reads would otherwise all sit in the same 4 banks (rows are 128 bytes).
// Keys past the segment end are zero-filled by cp.async and masked to -inf; query rows past
// it are computed on zeros and not stored.
//
// Work list (`tiles`, one int4 per CTA; attention.cuh's Work), built on the host from the
// segments (flash.py's flash_work_list). Segments of one batch may differ in length; each CTA walks only its
// own segment's keys, in a fixed order, so results do not depend on where an image sits in a
// batch.
// Input: the QKV buffer [P, 3, heads, HD] after qknorm_rope (row stride 3 * heads * HD).
// Output: [P, heads * HD]. Reference: segment_attention in reference.py; cross-check: the
// naive path (cuBLAS score GEMM + softmax.cu + cuBLAS PV GEMM).
#include "attention.cuh"

namespace {

using namespace attn;

constexpr int BM = 128;   // queries per CTA
constexpr int BN = 64;    // keys per pipeline stage
constexpr int THREADS = 128;
// Q's fragments stay in registers for the whole key loop where they fit: sm_100 and sm_120
// allocate more registers to the same loop (255, the per-thread cap, and spills), so there
// they are read again from shared memory at each k16 step (sQ is never overwritten).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool Q_IN_REGISTERS = false;
#else
constexpr bool Q_IN_REGISTERS = true;
#endif

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// D += A B for one m16n8k16 tile. A: 4 regs (row-major 16x16), B: 2 regs (16x8, "col").
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int HD>
__device__ __forceinline__ void flash_attention(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                                                const int4* __restrict__ tiles, int heads, float scale_log2) {
    constexpr int MT = 2;         // m16 tiles per warp (32 query rows)
    constexpr int KQ = HD / 16;   // k16 steps over the head dim (S = Q K^T)
    constexpr int NS = BN / 8;    // n8 tiles of S per key tile
    constexpr int NO = HD / 8;    // n8 tiles of O

    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sK = sQ + BM * HD;      // [2][BN][HD]
    bf16* sV = sK + 2 * BN * HD;  // [2][BN][HD]

    const Work<HD> w(qkv, tiles, heads);
    const int n_tiles = (w.seg_len + BN - 1) / BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // the mma fragment's row group and column pair

    load_tile<BM, HD, THREADS>(sQ, w.q, w.ld, min(BM, w.seg_len - w.q0));
    load_tile<BN, HD, THREADS>(sK, w.k, w.ld, min(BN, w.seg_len));
    load_tile<BN, HD, THREADS>(sV, w.v, w.ld, min(BN, w.seg_len));
    cp_async_commit();

    unsigned qf[MT][Q_IN_REGISTERS ? KQ : 1][4];
    float o[MT][NO][4];
    float m_run[MT][2], l_run[MT][2];  // per m-tile: rows g and g + 8
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int n = 0; n < NO; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = neg_inf();
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < n_tiles) {  // prefetch the next key tile into the other buffer
            const int valid = min(BN, w.seg_len - (kt + 1) * BN);
            load_tile<BN, HD, THREADS>(sK + (buf ^ 1) * BN * HD, w.k + (kt + 1) * BN * w.ld, w.ld, valid);
            load_tile<BN, HD, THREADS>(sV + (buf ^ 1) * BN * HD, w.v + (kt + 1) * BN * w.ld, w.ld, valid);
        }
        cp_async_commit();
        cp_async_wait<1>();  // everything but the prefetch just issued has landed
        __syncthreads();

        if (Q_IN_REGISTERS && kt == 0) {  // Q fragments, once: rows warp*32 + mt*16 + (lane & 15), chunk 2*ks + lane/16
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int ks = 0; ks < KQ; ++ks)
                    ldmatrix_x4(qf[mt][ks], sQ + swz<HD>(warp * 32 + mt * 16 + (lane & 15), 2 * ks + (lane >> 4)));
        }

        // S = Q K^T. One ldmatrix.x4 gives B fragments for two n8 key tiles at one k16 step:
        // matrices (keys +0..7, dims lo), (keys +0..7, dims hi), (keys +8..15, lo), (+8..15, hi).
        const bf16* k_tile = sK + buf * BN * HD;
        float s[MT][NS][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int n = 0; n < NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        #pragma unroll
        for (int ks = 0; ks < KQ; ++ks) {
            const int qs = Q_IN_REGISTERS ? ks : 0;
            if (!Q_IN_REGISTERS) {
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(qf[mt][0], sQ + swz<HD>(warp * 32 + mt * 16 + (lane & 15), 2 * ks + (lane >> 4)));
            }
            #pragma unroll
            for (int n = 0; n < NS; n += 2) {
                unsigned b[4];
                ldmatrix_x4(b, k_tile + swz<HD>(n * 8 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1)));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][n], qf[mt][qs], b[0], b[1]);
                    mma_bf16(s[mt][n + 1], qf[mt][qs], b[2], b[3]);
                }
            }
        }

        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mask_tail(s[mt], kt * BN, w.seg_len, t);
            online_softmax(s[mt], o[mt], m_run[mt], l_run[mt], scale_log2);
        }

        // O += P V. One ldmatrix.x4.trans gives B fragments for two n8 tiles of the head dim:
        // (keys +0..7, dims lo), (+8..15, lo), (+0..7, dims hi), (+8..15, hi).
        const bf16* v_tile = sV + buf * BN * HD;
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) p_fragment(a[mt], s[mt], kk);
            #pragma unroll
            for (int n = 0; n < NO; n += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, v_tile + swz<HD>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), n + (lane >> 4)));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][n], a[mt], b[0], b[1]);
                    mma_bf16(o[mt][n + 1], a[mt], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // this buffer is the target of the prefetch two iterations on
    }

    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        quad_sums(l_run[mt]);
        store_rows(o[mt], l_run[mt], out, w.seg_start, w.seg_len, w.q0 + warp * 32 + mt * 16, w.h, w.head, g, t);
    }
}

}  // namespace

// Dynamic shared memory: (BM + 4 * BN) * HD * 2 bytes = 48 KiB for HD 64.
extern "C" __global__ void __launch_bounds__(THREADS, 2)
flash_attention_hd64(const bf16* __restrict__ qkv, bf16* __restrict__ out, const int4* __restrict__ tiles,
                     int heads, float scale_log2) {
    flash_attention<64>(qkv, out, tiles, heads, scale_log2);
}
