// requires: sm_90a
// gemm_swiglu_sm90.cu — the MLP's gate|up GEMM with the clamped SwiGLU as its epilogue, on
// Hopper's wgmma: act = silu(min(x.Wg^T + bg, L)) * clamp(x.Wu^T + bu, -L, L), so the
// [rows, 2 x inter] product never reaches memory and mlp.cu's swiglu pass (a read of 2 x inter
// and a write of inter per row) disappears. On other GPUs the engine runs cuBLAS + swiglu_clamp.
//
// Why it can beat cuBLAS + swiglu: for the gate|up GEMM (K = 1024, N = 8192) cuBLAS reaches
// ~720 TFLOP/s alone on the H200, and the swiglu pass adds 30% to it at 21316 rows. This kernel
// runs at ~640 including the epilogue: 14% less time than the pair at 21316 rows, 23% at 32768.
//
// Shape: a persistent CTA (one per SM) of 3 warpgroups walks output tiles of 128 rows x 128
// act columns. WG0 is the producer: one thread issues, per 64-wide k step, TMA loads of the X
// box [128 rows x 64] and the W boxes of the tile's 128 gate rows and 128 up rows (48 KiB, one
// of 4 stages). WG1 and WG2 each own 64 of the rows and accumulate a gate and an up tile
// (m64n128, 2 x 64 f32 a thread) with SS wgmma, so both operands stay in shared memory. The
// producer runs ahead across tiles: it fills the next tile's stages while the consumers run
// the epilogue, which is then the only time the tensor cores wait. setmaxnreg hands the
// producer's registers to the consumers (40 / 232).
// Tiles go n-fastest (t % n_blocks), so the CTAs in flight share their X rows in L2; W (16 MiB
// for a block) stays in L2 as well.
// Measured and not kept (benchmarks/NOTES.md): clusters of 2 CTAs multicasting the W tiles
// (slower: L2 bandwidth is not the limit here); a non-persistent grid (-4%). The epilogue's
// IEEE division was 20% of the kernel's time: silu uses the approximate reciprocal.
// Barriers per stage: full[s] (the stage's TMA bytes) and empty[s] (one arrival from each
// consumer warpgroup once the wgmma group that read stage s has completed).
// Reference: linear + swiglu_clamp in reference.py; cross-check: cuBLAS + mlp.cu's swiglu_clamp.
#include "wgmma.cuh"

namespace {

using namespace sm90;

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4;  // BN: act columns (gate and up rows each)
constexpr int TILE_X = BM * BK, TILE_W = BN * BK;       // elements
constexpr int STAGE_ELEMS = TILE_X + 2 * TILE_W;
constexpr int THREADS = 384;

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

// ex2.approx and rcp.approx; for v -> -inf the quotient goes to -0, as silu does.
__device__ __forceinline__ float fast_silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

}  // namespace

// x_map: TMA map of the GEMM input X [rows, K] (boxes 128 rows x 64), read from row row0;
// w_map: of the gate|up weight [2 x inter, K] (same boxes). act[r, c] for r < rows lands at
// act + r * ld_act + c. bias: [2 x inter] or null. K % 64 == 0, inter % 128 == 0 (the engine
// checks). Grid: min(tiles, SMs); 384 threads; dynamic smem STAGES * 48 KiB + 1 KiB.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
gemm_swiglu_sm90(const void* __restrict__ x_map, const void* __restrict__ w_map, const bf16* __restrict__ bias,
                 bf16* __restrict__ act, int row0, int rows, int K, int inter, long long ld_act, float limit) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    bf16* smem = reinterpret_cast<bf16*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    const int wg = threadIdx.x >> 7, k_steps = K / BK, n_blocks = inter / BN;
    const int tiles = n_blocks * ((rows + BM - 1) / BM);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 2);
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
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
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");

    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, leader = (threadIdx.x & 127) == 0;
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int n0 = (t % n_blocks) * BN, m0 = (t / n_blocks) * BM;
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

        // Accumulator fragment of warp w, lane 4r + c: rows 16w + r (+ 8), columns 8j + 2c (+ 1).
        const int row = m0 + (wg - 1) * 64 + warp * 16 + (lane >> 2);
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = n0 + 8 * j + 2 * (lane & 3);
            float2 bg = make_float2(0.f, 0.f), bu = bg;
            if (bias != nullptr) {
                bg = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
                bu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + inter + col));
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (row + 8 * h < rows) {
                    const float a0 = fast_silu(fminf(g[j][2 * h] + bg.x, limit)) *
                                     fminf(fmaxf(u[j][2 * h] + bu.x, -limit), limit);
                    const float a1 = fast_silu(fminf(g[j][2 * h + 1] + bg.y, limit)) *
                                     fminf(fmaxf(u[j][2 * h + 1] + bu.y, -limit), limit);
                    *reinterpret_cast<__nv_bfloat162*>(act + (long long)(row + 8 * h) * ld_act + col) =
                        __floats2bfloat162_rn(a0, a1);
                }
            }
        }
    }
}
