// requires: sm_90a
// gemm_sm90.cu — on Hopper, the two GEMMs whose product only feeds an elementwise pass get that
// pass as their epilogue, so the product never makes a round trip through memory:
//   gemm_swiglu_sm90    the MLP's gate|up GEMM + clamped SwiGLU (mlp.cu's swiglu_clamp):
//                       act = silu(min(x.Wg^T + bg, L)) * clamp(x.Wu^T + bu, -L, L); the
//                       [rows, 2 x inter] product and a pass over it disappear.
//   gemm_qkv_rope_sm90  the QKV GEMM + q/k bias, per-head RMSNorm and axial 2D RoPE (rope.cu's
//                       qknorm_rope), v stored as it comes (its bias rides in the residual
//                       stream, engine.bias_sums).
// On other GPUs, or for dims off these tiles, the engine runs cuBLAS and the separate kernels.
//
// Shape (shared): a persistent CTA (one per SM) of 4 warpgroups, each with one job, walks output
// tiles of 128 rows x two 128-column halves (the gate and the up columns of 128 act columns; or
// 256 consecutive QKV columns, 4 heads):
//   WG0 producer: one thread issues, per 64-wide k step, TMA loads of the X box [128 rows x 64]
//       and the two W boxes [128 rows x 64] (48 KiB, one of 3 stages).
//   WG1, WG2 MMA: each owns 64 of the rows and accumulates both halves (m64n128, 2 x 64 f32 a
//       thread) with SS wgmma, both operands in shared memory. At the end of a tile they round
//       the product to BF16 (as cuBLAS's output is on the unfused path) into a staging tile in
//       shared memory and go straight on to the next tile.
//   WG3 epilogue: turns the staging tile into output rows (16-byte loads and stores, a warp on
//       32 rows) while the tensor cores work on the next tile.
// The first version ran the epilogue in the MMA warpgroups' registers: the tensor cores waited
// for every epilogue. It was 12-14% slower for the gate|up GEMM (21316 rows: 0.58 vs 0.51 ms;
// cuBLAS's GEMM alone 0.52, with the swiglu pass 0.70), and the QKV one lost to cuBLAS +
// qknorm_rope outright. Registers follow the jobs (setmaxnreg): producer 40, epilogue 96, MMA
// 184 (128 accumulators).
// Tiles go n-fastest, so the CTAs in flight share their X rows in L2; W (at most 16 MiB) stays
// in L2 as well. Measured and not kept (benchmarks/NOTES.md): clusters of 2 CTAs multicasting
// the W tiles (slower); a non-persistent grid (-4%); IEEE division in silu.
// Barriers: per stage full[s] (its TMA bytes) and empty[s] (one arrival per MMA warpgroup once
// the wgmma group that read it has completed); per tile staged (256 MMA threads have written the
// staging tile) and drained (the 128 epilogue threads have read it).
// References: linear + swiglu_clamp / qknorm_rope in reference.py; cross-checks: cuBLAS +
// mlp.cu / rope.cu (tests/test_gpu.py).
#include "wgmma.cuh"

namespace {

using namespace sm90;

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3;  // BN: columns of each half
constexpr int TILE_X = BM * BK, TILE_W = BN * BK;       // elements
constexpr int STAGE_ELEMS = TILE_X + 2 * TILE_W;
constexpr int SROW = 2 * BN + 8;  // staging row: both halves, and 16 bytes that make the fragment stores conflict-free
constexpr int THREADS = 512;

#define R4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define ACC64(d) R4(d, 0), R4(d, 1), R4(d, 2), R4(d, 3), R4(d, 4), R4(d, 5), R4(d, 6), R4(d, 7), \
                 R4(d, 8), R4(d, 9), R4(d, 10), R4(d, 11), R4(d, 12), R4(d, 13), R4(d, 14), R4(d, 15)

// D += A B^T, m64n128k16, both operands K-major in swizzled shared memory.
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], unsigned long long a, unsigned long long b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, 1, 1, 1, 0, 0;\n"
                 : ACC64(d) : "l"(a), "l"(b));
}

// The kernel both entry points run. Epi supplies n_blocks, w_rows(nb) (the first W row of each
// half of column block nb) and tile(buf, m0, nb, warp, lane): the epilogue warpgroup's work on
// a staged tile whose first row is m0 (relative to row0).
template <class Epi>
__device__ __forceinline__ void gemm_tiles(const void* x_map, const void* w_map, int row0, int rows, int K,
                                           const Epi& epi) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES], staged, drained;
    bf16* smem = reinterpret_cast<bf16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    bf16* buf = smem + STAGES * STAGE_ELEMS;  // [BM][SROW]
    const int wg = threadIdx.x >> 7, k_steps = K / BK, n_blocks = epi.n_blocks;
    const int tiles = n_blocks * ((rows + BM - 1) / BM);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 2);
        }
        mbar_init(&staged, 256);
        mbar_init(&drained, 128);
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            tensormap_acquire(x_map);
            tensormap_acquire(w_map);
            int it = 0;  // k steps issued over all of this CTA's tiles: stage it % STAGES
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const int2 w_rows = epi.w_rows(t % n_blocks);
                const int m0 = row0 + (t / n_blocks) * BM;
                for (int kt = 0; kt < k_steps; ++kt, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
                    bf16* stage = smem + s * STAGE_ELEMS;
                    expect_bytes(&full[s], STAGE_ELEMS * 2);
                    tma_load(stage, x_map, kt * BK, m0, &full[s]);
                    tma_load(stage + TILE_X, w_map, kt * BK, w_rows.x, &full[s]);
                    tma_load(stage + TILE_X + TILE_W, w_map, kt * BK, w_rows.y, &full[s]);
                }
            }
        }
        return;
    }
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    if (wg == 3) {  // epilogue
        asm volatile("setmaxnreg.dec.sync.aligned.u32 96;\n");
        int n = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
            mbar_wait(&staged, n & 1);
            epi.tile(buf, (t / n_blocks) * BM, t % n_blocks, warp, lane);
            mbar_arrive(&drained);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 184;\n");  // MMA warpgroups

    const int leader = (threadIdx.x & 127) == 0;
    int it = 0, n = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
        float a[BN / 8][4], b[BN / 8][4];  // the two halves
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j)
            a[j][0] = a[j][1] = a[j][2] = a[j][3] = b[j][0] = b[j][1] = b[j][2] = b[j][3] = 0.f;
        for (int kt = 0; kt < k_steps; ++kt, ++it) {
            const int s = it % STAGES;
            mbar_wait(&full[s], (it / STAGES) & 1);
            const bf16* stage = smem + s * STAGE_ELEMS;
            const unsigned long long x = descriptor(stage + (wg - 1) * 64 * BK), wa = descriptor(stage + TILE_X),
                                     wb = descriptor(stage + TILE_X + TILE_W);
            fence_regs(a);
            fence_regs(b);
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {  // a k16 step is 32 bytes along the swizzled rows
                wgmma_ss(a, x + 2 * ks, wa + 2 * ks);
                wgmma_ss(b, x + 2 * ks, wb + 2 * ks);
            }
            wgmma_commit();
            wgmma_wait<1>();  // the group of step it - 1 is done: its stage can be refilled
            fence_regs(a);
            fence_regs(b);
            if (kt > 0 && leader) mbar_arrive(&empty[(it - 1) % STAGES]);
        }
        wgmma_wait<0>();
        fence_regs(a);
        fence_regs(b);
        if (leader) mbar_arrive(&empty[(it - 1) % STAGES]);
        if (n > 0) mbar_wait(&drained, (n - 1) & 1);  // the epilogue has read the previous tile
        // Fragment of warp w, lane 4r + c: rows 16w + r (+ 8), columns 8j + 2c (+ 1) of each half.
        const int r0 = (wg - 1) * 64 + warp * 16 + (lane >> 2);
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = 8 * j + 2 * (lane & 3);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                *reinterpret_cast<__nv_bfloat162*>(buf + (r0 + 8 * h) * SROW + col) = __floats2bfloat162_rn(a[j][2 * h], a[j][2 * h + 1]);
                *reinterpret_cast<__nv_bfloat162*>(buf + (r0 + 8 * h) * SROW + BN + col) = __floats2bfloat162_rn(b[j][2 * h], b[j][2 * h + 1]);
            }
        }
        mbar_arrive(&staged);
    }
}

// ex2.approx and rcp.approx (IEEE division was 20% of the first version's time); for v -> -inf
// the quotient goes to -0, as silu does.
__device__ __forceinline__ float fast_silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

struct SwigluEpilogue {
    const bf16* bias;  // [2 x inter] or null
    bf16* act;
    long long ld_act;
    int rows, inter, n_blocks;
    float limit;

    __device__ int2 w_rows(int nb) const { return make_int2(nb * BN, inter + nb * BN); }

    // A warp takes 32 rows, two at a time: a lane reads 8 gate and the matching 8 up values.
    __device__ void tile(const bf16* buf, int m0, int nb, int warp, int lane) const {
        const int half = lane >> 4, cl = (lane & 15) * 8, n0 = nb * BN;
        float bg[8] = {}, bu[8] = {};
        if (bias != nullptr) {
            unpack8_bf16(*reinterpret_cast<const uint4*>(bias + n0 + cl), bg);
            unpack8_bf16(*reinterpret_cast<const uint4*>(bias + inter + n0 + cl), bu);
        }
        #pragma unroll 4
        for (int i = 0; i < BM / 8; ++i) {
            const int r = warp * (BM / 4) + 2 * i + half;
            float g[8], u[8], a[8];
            unpack8_bf16(*reinterpret_cast<const uint4*>(buf + r * SROW + cl), g);
            unpack8_bf16(*reinterpret_cast<const uint4*>(buf + r * SROW + BN + cl), u);
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                a[e] = fast_silu(fminf(g[e] + bg[e], limit)) * fminf(fmaxf(u[e] + bu[e], -limit), limit);
            if (m0 + r < rows) {
                const uint2 lo = pack4_bf16(a[0], a[1], a[2], a[3]), hi = pack4_bf16(a[4], a[5], a[6], a[7]);
                *reinterpret_cast<uint4*>(act + (long long)(m0 + r) * ld_act + n0 + cl) = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
        }
    }
};

// qknorm_rope's layout on a staged row of 256 columns: a lane holds 8 consecutive values, so a
// 64-wide head is 8 lanes: its RMS is a 3-step shuffle, and the rotate-half partner (32 columns
// away) is lane ^ 4. Every lane shuffles (a tile can hold q and k heads, or end past 3h); v
// lanes and columns past 3h just keep or drop their values.
struct QkvRopeEpilogue {
    const bf16 *bias, *q_w, *k_w;  // [3h], [64], [64]
    const float *cos_t, *sin_t;    // [P, 32], row row0 + r
    bf16* qkv;                     // [rows, 3h]
    int row0, rows, h, n_blocks;
    float eps;

    __device__ int2 w_rows(int nb) const { return make_int2(2 * BN * nb, 2 * BN * nb + BN); }

    __device__ void tile(const bf16* buf, int m0, int nb, int warp, int lane) const {
        const int col = 2 * BN * nb + lane * 8, e0 = (lane & 7) * 8, k0 = e0 & 31;
        const bool live = col < 3 * h, qk = col < 2 * h;
        float b[8] = {}, w[8] = {};
        if (qk) {
            unpack8_bf16(*reinterpret_cast<const uint4*>(bias + col), b);
            unpack8_bf16(*reinterpret_cast<const uint4*>((col < h ? q_w : k_w) + e0), w);
        }
        #pragma unroll 2
        for (int i = 0; i < BM / 4; ++i) {
            const int r = warp * (BM / 4) + i;
            float v[8];
            unpack8_bf16(*reinterpret_cast<const uint4*>(buf + r * SROW + lane * 8), v);
            float ss = 0.f;
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                v[e] += b[e];
                ss += v[e] * v[e];
            }
            ss += __shfl_xor_sync(0xffffffffu, ss, 4);
            ss += __shfl_xor_sync(0xffffffffu, ss, 2);
            ss += __shfl_xor_sync(0xffffffffu, ss, 1);
            const float rr = rsqrtf(ss / 64 + eps);
            const long long p = row0 + m0 + (m0 + r < rows ? r : 0);  // dead rows read a live row's angles
            const float4* c4 = reinterpret_cast<const float4*>(cos_t + p * 32 + k0);
            const float4* s4 = reinterpret_cast<const float4*>(sin_t + p * 32 + k0);
            const float4 ca = c4[0], cb = c4[1], sa = s4[0], sb = s4[1];
            const float c[8] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
            const float s[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
            float out[8];
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float y = v[e] * rr * w[e];  // RMSNorm before the rotary, as the reference orders it
                const float partner = __shfl_xor_sync(0xffffffffu, y, 4);
                out[e] = qk ? y * c[e] + (e0 < 32 ? -partner : partner) * s[e] : v[e];
            }
            if (live && m0 + r < rows) {
                const uint2 lo = pack4_bf16(out[0], out[1], out[2], out[3]), hi = pack4_bf16(out[4], out[5], out[6], out[7]);
                *reinterpret_cast<uint4*>(qkv + (long long)(m0 + r) * 3 * h + col) = make_uint4(lo.x, lo.y, hi.x, hi.y);
            }
        }
    }
};

}  // namespace

// x_map: TMA map of the GEMM input X (boxes 128 rows x 64), read from row row0; w_map: of the
// gate|up weight [2 x inter, K] (same boxes). act[r, c] for r < rows lands at act + r * ld_act
// + c (16-byte aligned rows). bias: [2 x inter] or null. K % 64 == 0, inter % 128 == 0 (the
// engine checks). Grid: min(tiles, SMs); 512 threads; dynamic smem 3 x 48 KiB stages + the
// 66 KiB staging tile + 1 KiB of alignment slack (kernels.py); the same for both kernels.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_swiglu_sm90(const void* __restrict__ x_map, const void* __restrict__ w_map, const bf16* __restrict__ bias,
                 bf16* __restrict__ act, int row0, int rows, int K, int inter, long long ld_act, float limit) {
    gemm_tiles(x_map, w_map, row0, rows, K, SwigluEpilogue{bias, act, ld_act, rows, inter, inter / BN, limit});
}

// x_map as above; w_map: of the QKV weight [3h, K]. qkv[r] for r < rows is X row row0 + r's q, k
// and v (row stride 3h); the RoPE tables are read at row row0 + r. head_dim 64, K % 64 == 0.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_qkv_rope_sm90(const void* __restrict__ x_map, const void* __restrict__ w_map, const bf16* __restrict__ bias,
                   const bf16* __restrict__ q_w, const bf16* __restrict__ k_w, const float* __restrict__ cos_t,
                   const float* __restrict__ sin_t, bf16* __restrict__ qkv, int row0, int rows, int K, int h,
                   float eps) {
    gemm_tiles(x_map, w_map, row0, rows, K,
               QkvRopeEpilogue{bias, q_w, k_w, cos_t, sin_t, qkv, row0, rows, h, (3 * h + 2 * BN - 1) / (2 * BN), eps});
}
