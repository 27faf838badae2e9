// attention.cuh — the pieces both flash-attention kernels share (flash_attention.cu: mma.sync,
// any GPU from sm_80; flash_attention_sm90.cu: wgmma, Hopper): the work list, the swizzled
// shared-memory tiles and their cp.async loads, and the online softmax on the accumulator
// fragment layout, which is the same for mma.sync m16n8 and for each warp of a wgmma m64nN.
//
// Fragment layout (per warp, 16 query rows): lane = 4g + t holds, for every n8 column tile
// j, c[j][0..1] = (row g, cols 8j + 2t, +1) and c[j][2..3] = (row g + 8, same cols).
//
// Tiles are [rows][HD] BF16 with 128-byte rows (HD = 64) whose 16-byte chunks are XOR-
// swizzled by row: chunk c of row r lives at chunk c ^ (r & 7). That is the hardware's 128B
// swizzle (address bits [4:6] ^= bits [7:9]) when the tile starts 1024-byte aligned, so the
// same layout serves ldmatrix without bank conflicts and wgmma's swizzled descriptors.
#pragma once
#include "common.cuh"

namespace attn {

// One CTA's share of the work: a query tile of one segment for one head (128 queries for the
// mma.sync kernel, 64 a warpgroup for the wgmma one; flash.BMS) (entry blockIdx.x
// of the host's work list, flash.flash_work_list: {segment start row, length, first query row
// in the segment, head | piece << 8 | pieces << 16}; the wgmma kernel alone gets pieces), and
// where that head's Q, K and V columns start in the QKV buffer [P, 3, heads, HD] (row stride
// `ld`).
template <int HD>
struct Work {
    int seg_start, seg_len, q0, head, h;
    long long ld;
    const bf16 *q, *k, *v;

    __device__ __forceinline__ Work(const bf16* qkv, const int4* tiles, int heads) {
        const int4 entry = tiles[blockIdx.x];
        seg_start = entry.x;
        seg_len = entry.y;
        q0 = entry.z;
        head = entry.w & 0xFF;
        h = heads * HD;
        ld = 3LL * h;
        q = qkv + (long long)(seg_start + q0) * ld + head * HD;
        k = qkv + (long long)seg_start * ld + h + head * HD;
        v = k + h;
    }
};

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// 2^x with denormal results flushed to zero: one MUFU op (exp2f adds denormal handling).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four 8x8 b16 matrices from shared memory, one row address per lane (lanes 8i..8i+7: matrix i).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][HD] tile.
template <int HD>
__device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(HD == 64, "the 128B swizzle is written for 128-byte rows");
    return row * HD + ((chunk ^ (row & 7)) << 3);
}

// Copy ROWS rows of HD values (global row stride `ld`) into a swizzled tile with cp.async;
// rows at or past `valid` are zero-filled (src-size 0 reads nothing). A thread copies the same
// 16-byte chunk of every STEP-th row, so its swizzle and address arithmetic are computed once
// and the loop unrolls to ROWS / STEP cp.async (a loop over a flat index costs more instructions
// than the softmax, and the wgmma kernel is bound by instruction issue).
template <int ROWS, int HD, int THREADS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, long long ld, int valid) {
    constexpr int CHUNKS = HD / 8, STEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && ROWS % STEP == 0 && STEP % 8 == 0,
                  "each thread keeps one chunk column, and rows STEP apart share a swizzle");
    const int row0 = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
    bf16* dst = tile + swz<HD>(row0, chunk);
    const bf16* from = src + row0 * ld + chunk * 8;
    #pragma unroll
    for (int r = 0; r < ROWS / STEP; ++r) {
        const bool ok = row0 + r * STEP < valid;
        cp_async_16(dst + r * STEP * HD, ok ? from + r * STEP * ld : src, ok ? 16 : 0);
    }
}

// Keys at or past the segment end take no weight (only the last key tile has any).
template <int NS>
__device__ __forceinline__ void mask_tail(float (&s)[NS][4], int key0, int seg_len, int t) {
    if (key0 + NS * 8 <= seg_len) return;
    #pragma unroll
    for (int n = 0; n < NS; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            if (key0 + n * 8 + 2 * t + (e & 1) >= seg_len) s[n][e] = neg_inf();
}

// One key tile of the online softmax for a warp's 16 rows: update the running max (reduced
// over the quad of lanes sharing a row) and turn s into p = 2^(s*c - max*c) in place (c is the
// softmax scale times log2 e). corr is the factor by which everything accumulated so far (the
// output and the row sums, see rescale) shrinks under the new max. Split from the rescale so
// the wgmma kernel can run it while P V is still in flight; it also sums P on the tensor cores,
// so the row sums are the mma.sync kernel's business (online_softmax).
template <int NS>
__device__ __forceinline__ void exponentiate(float (&s)[NS][4], float (&m_run)[2], float (&corr)[2], float scale_log2) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m_run[r];
        #pragma unroll
        for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        corr[r] = exp2_ftz((m_run[r] - mx) * scale_log2);  // 0 on the first tile
        const float base = mx * scale_log2;
        m_run[r] = mx;
        #pragma unroll
        for (int n = 0; n < NS; ++n) {
            s[n][2 * r] = exp2_ftz(fmaf(s[n][2 * r], scale_log2, -base));
            s[n][2 * r + 1] = exp2_ftz(fmaf(s[n][2 * r + 1], scale_log2, -base));
        }
    }
}

// O *= corr per row. Once the running max has settled, corr is exactly 1 for every row of most
// tiles: the warp then skips the 4 x NO multiplies (bit-identical, a vote instead).
template <int NO>
__device__ __forceinline__ void rescale(float (&o)[NO][4], const float (&corr)[2]) {
    if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
    #pragma unroll
    for (int n = 0; n < NO; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
}

// The whole step for the mma.sync kernel, row sums kept per lane in l_run (see quad_sums).
template <int NS, int NO>
__device__ __forceinline__ void online_softmax(float (&s)[NS][4], float (&o)[NO][4], float (&m_run)[2],
                                               float (&l_run)[2], float scale_log2) {
    float corr[2];
    exponentiate(s, m_run, corr, scale_log2);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = 0.f;
        #pragma unroll
        for (int n = 0; n < NS; ++n) sum += s[n][2 * r] + s[n][2 * r + 1];
        l_run[r] = l_run[r] * corr[r] + sum;
    }
    rescale(o, corr);
}

// Per-lane partial row sums -> whole rows (the four lanes of a quad share a row).
__device__ __forceinline__ void quad_sums(float (&l)[2]) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
}

// P for key step kk (keys 16kk..16kk+15) as an m16k16 A fragment: the C fragments of S
// n-tiles 2kk and 2kk+1 are exactly its rows g / g+8, cols 2t.. / 8+2t.., rounded to BF16.
template <int NS>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const float (&s)[NS][4], int kk) {
    a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Divide by the row sums and store the warp's rows q_first + g (+8) that lie in the segment.
template <int NO>
__device__ __forceinline__ void store_rows(const float (&o)[NO][4], const float (&l_row)[2], bf16* out,
                                           int seg_start, int seg_len, int q_first, int h, int head, int g, int t) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float inv = 1.f / l_row[r];
        const int q = q_first + g + 8 * r;
        if (q < seg_len) {
            bf16* dst = out + (long long)(seg_start + q) * h + head * NO * 8 + 2 * t;
            #pragma unroll
            for (int n = 0; n < NO; ++n)
                *reinterpret_cast<unsigned*>(dst + n * 8) = pack_bf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
    }
}

}  // namespace attn
