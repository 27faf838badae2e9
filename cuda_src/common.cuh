// common.cuh — helpers every glmvit-cupy kernel file uses: BF16 conversion, warp and block
// reductions. The loader (glmvit_cupy/gpu/kernels.py) pastes this file in place of its
// #include, so CuPy's on-disk compile cache sees any change to it.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// -infinity without <math.h> (NVRTC compiles without the host headers that define INFINITY).
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// The 32-bit shared-window address that PTX's shared-memory operands (ldmatrix, cp.async,
// mbarrier, TMA) take.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds one float per
// warp. All threads add the partials in the same order, so the result is deterministic.
// Ends with a barrier so the caller may reuse `scratch` straight away.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    v = MAX ? warp_max(v) : warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = scratch[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) r = MAX ? fmaxf(r, scratch[i]) : r + scratch[i];
    __syncthreads();
    return r;
}

// Four floats -> four BF16 (round to nearest even) packed in 8 bytes, for one 8-byte store.
__device__ __forceinline__ uint2 pack4_bf16(float a, float b, float c, float d) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    return make_uint2(*reinterpret_cast<unsigned*>(&lo), *reinterpret_cast<unsigned*>(&hi));
}

__device__ __forceinline__ float4 load4_bf16(const bf16* p) {  // p 8-byte aligned
    uint2 u = *reinterpret_cast<const uint2*>(p);
    __nv_bfloat162 lo = *reinterpret_cast<__nv_bfloat162*>(&u.x), hi = *reinterpret_cast<__nv_bfloat162*>(&u.y);
    float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
    return make_float4(a.x, a.y, b.x, b.y);
}

// Eight floats -> BF16 (round to nearest even), one 16-byte store; p 16-byte aligned.
__device__ __forceinline__ void store8_bf16(bf16* p, const float (&f)[8]) {
    const uint2 lo = pack4_bf16(f[0], f[1], f[2], f[3]), hi = pack4_bf16(f[4], f[5], f[6], f[7]);
    *reinterpret_cast<uint4*>(p) = make_uint4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ void unpack8_bf16(uint4 u, float (&f)[8]) {  // 16 bytes -> 8 floats
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}
