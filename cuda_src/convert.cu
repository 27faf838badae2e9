// convert.cu — the pixels' way in: float32 pixel_values [P, patch_dim] -> BF16, the operand of
// the patch-embed GEMM. Pure bandwidth: four elements a thread, 16-byte loads, 8-byte stores.
// It runs outside the captured CUDA graph, because the caller's input array moves between calls.
#include "common.cuh"

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(src)[i];
        reinterpret_cast<uint2*>(dst)[i] = pack4_bf16(v.x, v.y, v.z, v.w);
    }
}
