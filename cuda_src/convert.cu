// convert.cu — float32 -> 16-bit conversions at the engine's edges. f32_to_bf16 is the way in of
// float32 pixel_values [P, patch_dim] (GlmVit.forward): BF16, the operand of the patch-embed
// GEMM; it runs outside the captured CUDA graph, because the caller's input array moves between
// calls. Pure bandwidth: four elements a thread, 16-byte loads, 8-byte stores.
#include "common.cuh"
#include <cuda_fp16.h>

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(src)[i];
        reinterpret_cast<uint2*>(dst)[i] = pack4_bf16(v.x, v.y, v.z, v.w);
    }
}

// The pipeline's float16 outputs: float32 [n4 x 4] -> float16 (round to nearest even), the same
// shape of loop as above. BF16 outputs use f32_to_bf16; float32 ones are a plain copy.
extern "C" __global__ void f32_to_f16(const float* __restrict__ src, __half* __restrict__ dst, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(src)[i];
        __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
        reinterpret_cast<uint2*>(dst)[i] = make_uint2(*reinterpret_cast<unsigned*>(&lo), *reinterpret_cast<unsigned*>(&hi));
    }
}
