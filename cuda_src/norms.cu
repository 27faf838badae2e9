// norms.cu — the tower's two normalisations, one row per block, statistics in float32.
//
// rmsnorm_bias: weight-only RMSNorm, w * x / sqrt(mean(x^2) + eps), over the float32
//   residual stream. It first adds a PENDING bias to the residual in place: the GEMM that
//   wrote the residual (patch embed, attention proj, MLP down; cuBLAS accumulates straight
//   into the float32 stream with beta = 1) cannot add a bias itself, and this kernel reads
//   the row anyway. bias == nullptr skips that. Output: BF16, the next GEMM's operand.
// layernorm_gelu: the merger's mean-subtracting, biased LayerNorm followed by exact (erf)
//   GELU, float32 in, BF16 out.
// Rows are re-read from L1/L2 between passes rather than cached in registers, so one kernel
// serves any width (n % 4 == 0). Reference: rmsnorm / layernorm / gelu_erf in reference.py.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
rmsnorm_bias(float* __restrict__ x, const bf16* __restrict__ bias, const bf16* __restrict__ w,
             bf16* __restrict__ out, int n, float eps) {
    __shared__ float red[8];
    float* row = x + (long long)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<float4*>(row + i);
        if (bias != nullptr) {
            float4 b = load4_bf16(bias + i);
            v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
            *reinterpret_cast<float4*>(row + i) = v;
        }
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float r = rsqrtf(block_reduce<false>(ss, red) / n + eps);
    bf16* o = out + (long long)blockIdx.x * n;
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<float4*>(row + i);
        float4 g = load4_bf16(w + i);
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
