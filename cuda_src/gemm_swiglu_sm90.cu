// requires: sm_90a
// gemm_swiglu_sm90.cu — the MLP's gate|up GEMM with the clamped SwiGLU as its epilogue, on
// Hopper's wgmma: act = silu(min(x.Wg^T + bg, L)) * clamp(x.Wu^T + bu, -L, L), so the
// [rows, 2 x inter] product never reaches memory and mlp.cu's swiglu pass (a read of 2 x inter
// and a write of inter per row) disappears. On other GPUs the engine runs cuBLAS + swiglu_clamp.
//
// Shape: a persistent CTA (one per SM) of 4 warpgroups, each with one job, walks output tiles of
// 128 rows x 128 act columns:
//   WG0 producer: one thread issues, per 64-wide k step, TMA loads of the X box [128 rows x 64]
//       and the W boxes of the tile's 128 gate rows and 128 up rows (48 KiB, one of 3 stages).
//   WG1, WG2 MMA: each owns 64 of the rows and accumulates a gate and an up tile (m64n128, 2 x
//       64 f32 a thread) with SS wgmma, both operands in shared memory. At the end of a tile
//       they round gate and up to BF16 (as the cuBLAS path's product is) into a staging tile
//       in shared memory and go straight on to the next tile.
//   WG3 epilogue: reads the staging tile, applies bias and the clamped SwiGLU, and writes act
//       rows with 16-byte stores, while the tensor cores work on the next tile.
// The epilogue has a warpgroup of its own because, run in the MMA warpgroups' registers, it
// keeps the tensor cores waiting. Registers follow the jobs (setmaxnreg): producer 40,
// epilogue 96, MMA 184 (128 accumulators).
// Tiles go n-fastest, so the CTAs in flight share their X rows in L2; W (16 MiB for a block)
// stays in L2 as well.
// Barriers: per stage full[s] (its TMA bytes) and empty[s] (one arrival per MMA warpgroup once
// the wgmma group that read it has completed); per tile staged (256 MMA threads have written the
// staging tile) and drained (the 128 epilogue threads have read it).
// Reference: linear + swiglu_clamp in reference.py; cross-check: cuBLAS + mlp.cu's swiglu_clamp.
#include "wgmma.cuh"

namespace {

using namespace sm90;

// The literals here are read by the host (gemm_swiglu.py sizes the launch and shared memory from them).
constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3;  // BN: act columns (gate and up rows each)
constexpr int SROW_PAD = 8;  // BF16 past a staging row's gate and up: 16 bytes make the fragment stores conflict-free
constexpr int ALIGN = 1024;  // the tiles start at the 128-byte swizzle's 1024-byte atom
constexpr int THREADS = 512;
constexpr int TILE_X = BM * BK, TILE_W = BN * BK;       // elements
constexpr int STAGE_ELEMS = TILE_X + 2 * TILE_W;
constexpr int SROW = 2 * BN + SROW_PAD;

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

// ex2.approx and rcp.approx (IEEE division is a large share of the epilogue); for v -> -inf
// the quotient goes to -0, as silu does.
__device__ __forceinline__ float fast_silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

}  // namespace

// x_map: TMA map of the GEMM input X (boxes 128 rows x 64), read from row row0; w_map: of the
// gate|up weight [2 x inter, K] (same boxes). act[r, c] for r < rows lands at act + r * ld_act
// + c (16-byte aligned rows). bias: [2 x inter] or null. K % 64 == 0, inter % 128 == 0 (the
// engine checks). Grid: min(tiles, SMs); 512 threads; dynamic smem 3 x 48 KiB stages + the
// Dynamic shared memory: STAGES stages, the staging tile [BM][SROW], ALIGN bytes of alignment slack.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_swiglu_sm90(const void* __restrict__ x_map, const void* __restrict__ w_map, const bf16* __restrict__ bias,
                 bf16* __restrict__ act, int row0, int rows, int K, int inter, long long ld_act, float limit) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES], staged, drained;
    bf16* smem = reinterpret_cast<bf16*>(smem_raw + ((ALIGN - (smem_addr(smem_raw) & (ALIGN - 1))) & (ALIGN - 1)));
    bf16* buf = smem + STAGES * STAGE_ELEMS;  // [BM][SROW]
    const int wg = threadIdx.x >> 7, k_steps = K / BK, n_blocks = inter / BN;
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
                const int n0 = (t % n_blocks) * BN, m0 = row0 + (t / n_blocks) * BM;
                for (int kt = 0; kt < k_steps; ++kt, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
                    bf16* stage = smem + s * STAGE_ELEMS;
                    expect_bytes(&full[s], STAGE_ELEMS * 2);
                    tma_load(stage, x_map, kt * BK, m0, &full[s]);
                    tma_load(stage + TILE_X, w_map, kt * BK, n0, &full[s]);
                    tma_load(stage + TILE_X + TILE_W, w_map, kt * BK, inter + n0, &full[s]);
                }
            }
        }
        return;
    }
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    if (wg == 3) {  // epilogue: a warp takes 32 rows, two at a time, 8 columns a lane
        asm volatile("setmaxnreg.dec.sync.aligned.u32 96;\n");
        const int half = lane >> 4, cl = (lane & 15) * 8;
        int n = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
            const int n0 = (t % n_blocks) * BN, m0 = (t / n_blocks) * BM;
            float bg[8] = {}, bu[8] = {};
            if (bias != nullptr) {
                unpack8_bf16(*reinterpret_cast<const uint4*>(bias + n0 + cl), bg);
                unpack8_bf16(*reinterpret_cast<const uint4*>(bias + inter + n0 + cl), bu);
            }
            mbar_wait(&staged, n & 1);
            #pragma unroll 4
            for (int i = 0; i < BM / 8; ++i) {
                const int r = warp * (BM / 4) + 2 * i + half;
                float g[8], u[8], a[8];
                unpack8_bf16(*reinterpret_cast<const uint4*>(buf + r * SROW + cl), g);
                unpack8_bf16(*reinterpret_cast<const uint4*>(buf + r * SROW + BN + cl), u);
                #pragma unroll
                for (int e = 0; e < 8; ++e)
                    a[e] = fast_silu(fminf(g[e] + bg[e], limit)) * fminf(fmaxf(u[e] + bu[e], -limit), limit);
                if (m0 + r < rows) store8_bf16(act + (long long)(m0 + r) * ld_act + n0 + cl, a);
            }
            mbar_arrive(&drained);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 184;\n");  // MMA warpgroups

    const int leader = (threadIdx.x & 127) == 0;
    int it = 0, n = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, ++n) {
        float g[BN / 8][4], u[BN / 8][4];
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j)
            g[j][0] = g[j][1] = g[j][2] = g[j][3] = u[j][0] = u[j][1] = u[j][2] = u[j][3] = 0.f;
        for (int kt = 0; kt < k_steps; ++kt, ++it) {
            const int s = it % STAGES;
            mbar_wait(&full[s], (it / STAGES) & 1);
            const bf16* stage = smem + s * STAGE_ELEMS;
            const unsigned long long a = descriptor(stage + (wg - 1) * 64 * BK), bg = descriptor(stage + TILE_X),
                                     bu = descriptor(stage + TILE_X + TILE_W);
            fence_regs(g);
            fence_regs(u);
            wgmma_fence();
            #pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {  // a k16 step is 32 bytes along the swizzled rows
                wgmma_ss(g, a + 2 * ks, bg + 2 * ks);
                wgmma_ss(u, a + 2 * ks, bu + 2 * ks);
            }
            wgmma_commit();
            wgmma_wait<1>();  // the group of step it - 1 is done: its stage can be refilled
            fence_regs(g);
            fence_regs(u);
            if (kt > 0 && leader) mbar_arrive(&empty[(it - 1) % STAGES]);
        }
        wgmma_wait<0>();
        fence_regs(g);
        fence_regs(u);
        if (leader) mbar_arrive(&empty[(it - 1) % STAGES]);
        if (n > 0) mbar_wait(&drained, (n - 1) & 1);  // the epilogue has read the previous tile
        // Fragment of warp w, lane 4r + c: rows 16w + r (+ 8), columns 8j + 2c (+ 1) of each half.
        const int r0 = (wg - 1) * 64 + warp * 16 + (lane >> 2);
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = 8 * j + 2 * (lane & 3);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                *reinterpret_cast<__nv_bfloat162*>(buf + (r0 + 8 * h) * SROW + col) = __floats2bfloat162_rn(g[j][2 * h], g[j][2 * h + 1]);
                *reinterpret_cast<__nv_bfloat162*>(buf + (r0 + 8 * h) * SROW + BN + col) = __floats2bfloat162_rn(u[j][2 * h], u[j][2 * h + 1]);
            }
        }
        mbar_arrive(&staged);
    }
}
