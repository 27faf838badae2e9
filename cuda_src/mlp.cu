// mlp.cu — the clamped SwiGLU between the gate|up GEMM and the down GEMM (blocks and merger).
//
// swiglu_clamp: over a [rows, 2 * inter] BF16 gate|up product (one GEMM against the gate and
//   up weights stored back to back), act = silu(min(gate + bg, L)) * clamp(up + bu, -L, L),
//   written IN PLACE over the gate half, which the down GEMM then reads with ld = 2 * inter.
//   Biases are optional (the merger has none). Eight elements a thread, 16-byte accesses.
// Reference: swiglu_clamp in reference.py.
#include "common.cuh"

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// Grid: x over 8-column chunks of a row, y over rows (grid-stride past 65535), so no thread
// divides a flat index by the row width, and biases are read 16 bytes at a time.
extern "C" __global__ void __launch_bounds__(256)
swiglu_clamp(bf16* __restrict__ gu, const bf16* __restrict__ bias, int rows, int inter, float limit) {
    const int col = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (col >= inter) return;
    float gb[8] = {}, ub[8] = {};
    if (bias != nullptr) {
        const uint4 g4 = *reinterpret_cast<const uint4*>(bias + col), u4 = *reinterpret_cast<const uint4*>(bias + inter + col);
        unpack8_bf16(g4, gb);
        unpack8_bf16(u4, ub);
    }
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        bf16* g = gu + (long long)r * 2 * inter + col;
        float gate[8], up[8];
        unpack8_bf16(*reinterpret_cast<const uint4*>(g), gate);
        unpack8_bf16(*reinterpret_cast<const uint4*>(g + inter), up);
        float a[8];
        #pragma unroll
        for (int e = 0; e < 8; ++e)
            a[e] = silu(fminf(gate[e] + gb[e], limit)) * fminf(fmaxf(up[e] + ub[e], -limit), limit);
        store8_bf16(g, a);
    }
}
