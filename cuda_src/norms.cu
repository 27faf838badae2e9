// norms.cu — the tower's two normalisations, statistics in float32.
//
// rmsnorm_bias: weight-only RMSNorm, w * v / sqrt(mean(v^2) + eps), of v = x + deferred_bias:
//   x is the float32 residual stream WITHOUT the biases of the GEMMs that accumulate into it
//   (patch embed, attention proj, MLP down: cuBLAS adds into the stream with beta = 1 and cannot
//   add a bias), deferred_bias the float32 running sum of those biases, precomputed at load
//   (weights.deferred_bias). So no kernel ever rewrites the stream to add a bias: this one reads
//   the row and deferred_bias, and writes only its BF16 output, the next GEMM's operand.
// layernorm_gelu: the merger's mean-subtracting, biased LayerNorm followed by exact (erf)
//   GELU, float32 in, BF16 out; one row per block (it runs once, on M = P / 4 rows).
// Rows are re-read from L1/L2 between passes rather than cached in registers, so one kernel
// serves any width (n % 4 == 0). Reference: rmsnorm / layernorm / gelu_erf in reference.py.
#include "common.cuh"

// A warp per row, ROWS rows a block: the sum of squares is a warp shuffle, with no block barrier.
// A lane reads its columns in sweeps of SWEEP float4 whose loads are all issued before the first
// is used: with one load in flight at a time, a short grid (448x448: 1024 rows) would leave the
// warps waiting on latency.
constexpr int SWEEP = 8;  // float4 per lane and sweep: a 1024-wide row is one sweep
constexpr int ROWS = 8;   // rows (warps) a block of rmsnorm_bias; the launcher reads it from here

__device__ __forceinline__ float4 add4(float4 v, float4 b) {
    return make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
}

__device__ __forceinline__ float4 biased(const float* row, const float* deferred_bias, int i) {
    return add4(*reinterpret_cast<const float4*>(row + i), *reinterpret_cast<const float4*>(deferred_bias + i));
}

extern "C" __global__ void __launch_bounds__(32 * ROWS)
rmsnorm_bias(const float* __restrict__ x, const float* __restrict__ deferred_bias, const bf16* __restrict__ w,
             bf16* __restrict__ out, int rows, int n, float eps) {
    const int row_id = blockIdx.x * ROWS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row_id >= rows) return;  // whole warps leave: the shuffles below see all 32 lanes
    const float* row = x + (long long)row_id * n;
    float ss = 0.f;
    for (int base = lane * 4; base < n; base += 128 * SWEEP) {
        float4 v[SWEEP], b[SWEEP];
        #pragma unroll
        for (int c = 0; c < SWEEP; ++c) {
            if (base + 128 * c < n) {
                v[c] = *reinterpret_cast<const float4*>(row + base + 128 * c);
                b[c] = *reinterpret_cast<const float4*>(deferred_bias + base + 128 * c);
            }
        }
        #pragma unroll
        for (int c = 0; c < SWEEP; ++c) {
            if (base + 128 * c < n) {
                const float4 u = add4(v[c], b[c]);
                ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
            }
        }
    }
    const float r = rsqrtf(warp_sum(ss) / n + eps);
    bf16* o = out + (long long)row_id * n;
    for (int i = lane * 4; i < n; i += 128) {  // the row again, from L1
        const float4 v = biased(row, deferred_bias, i), g = load4_bf16(w + i);
        *reinterpret_cast<uint2*>(o + i) = pack4_bf16(v.x * r * g.x, v.y * r * g.y, v.z * r * g.z, v.w * r * g.w);
    }
}

__device__ __forceinline__ float gelu_erf(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

extern "C" __global__ void __launch_bounds__(256)
layernorm_gelu(const float* __restrict__ x, const bf16* __restrict__ w, const bf16* __restrict__ b,
               bf16* __restrict__ out, int n, float eps) {
    __shared__ float red[8];
    const float* row = x + (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(row + i);
        s += v.x + v.y + v.z + v.w;
    }
    const float mean = block_reduce<false>(s, red) / n;
    float ss = 0.f;  // two-pass variance: no cancellation for rows with a large mean
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(row + i);
        v.x -= mean; v.y -= mean; v.z -= mean; v.w -= mean;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float r = rsqrtf(block_reduce<false>(ss, red) / n + eps);
    bf16* o = out + (long long)blockIdx.x * n;
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(row + i);
        float4 g = load4_bf16(w + i), c = load4_bf16(b + i);
        *reinterpret_cast<uint2*>(o + i) = pack4_bf16(
            gelu_erf((v.x - mean) * r * g.x + c.x), gelu_erf((v.y - mean) * r * g.y + c.y),
            gelu_erf((v.z - mean) * r * g.z + c.z), gelu_erf((v.w - mean) * r * g.w + c.w));
    }
}
