// mlp.cu — the clamped SwiGLU between the gate|up GEMM and the down GEMM (blocks and merger).
//
// swiglu_clamp: over a [rows, 2 * inter] BF16 gate|up product (one GEMM against the gate and
//   up weights stored back to back), act = silu(min(gate + bg, L)) * clamp(up + bu, -L, L),
//   written IN PLACE over the gate half, which the down GEMM then reads with ld = 2 * inter.
//   Biases are optional (the merger has none). Eight elements a thread, 16-byte accesses.
// Reference: swiglu_clamp in reference.py.
#include "common.cuh"

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

extern "C" __global__ void swiglu_clamp(bf16* __restrict__ gu, const bf16* __restrict__ bias,
                                        long long rows, int inter, float limit) {
    const int per_row = inter / 8;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * per_row;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / per_row;
        const int col = (int)(i % per_row) * 8;
        bf16* g = gu + r * 2 * inter + col;
        uint4 gv = *reinterpret_cast<const uint4*>(g), uv = *reinterpret_cast<const uint4*>(g + inter);
        const bf16* gb = reinterpret_cast<const bf16*>(&gv);
        const bf16* ub = reinterpret_cast<const bf16*>(&uv);
        float a[8];
        #pragma unroll
        for (int e = 0; e < 8; ++e) {
            float gate = __bfloat162float(gb[e]), up = __bfloat162float(ub[e]);
            if (bias != nullptr) {
                gate += __bfloat162float(bias[col + e]);
                up += __bfloat162float(bias[inter + col + e]);
            }
            a[e] = silu(fminf(gate, limit)) * fminf(fmaxf(up, -limit), limit);
        }
        uint2 lo = pack4_bf16(a[0], a[1], a[2], a[3]), hi = pack4_bf16(a[4], a[5], a[6], a[7]);
        *reinterpret_cast<uint4*>(g) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
}
