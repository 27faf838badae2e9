// merge.cu — the 2x2 conv downsample's two helpers around its GEMM.
//
// im2col_2x2: tokens are block-major, so each run of 4 consecutive rows is one 2x2 block;
//   merged row m is [channel c][kh, kw] = x[4m + 2kh + kw][c], which is the conv weight's own
//   (channel, kh, kw) flattening: the conv becomes one GEMM. Reads coalesced along channels,
//   one 8-byte store of the 4 taps per thread.
// bias_to_bf16: the GEMM's float32 output [M, out] gets the conv bias in place (that array IS
//   last_hidden_state) plus a BF16 copy, the operand of the merger's first GEMM.
// Reference: im2col_2x2 and the downsample line of NumpyTower.merger in reference.py.
#include "common.cuh"

extern "C" __global__ void im2col_2x2(const bf16* __restrict__ x, bf16* __restrict__ out, long long merged, int n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < merged * n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long m = i / n;
        const int c = (int)(i % n);
        const bf16* src = x + 4 * m * n + c;
        __nv_bfloat162 lo = __halves2bfloat162(src[0], src[n]), hi = __halves2bfloat162(src[2 * n], src[3 * n]);
        *reinterpret_cast<uint2*>(out + m * 4 * n + 4 * c) =
            make_uint2(*reinterpret_cast<unsigned*>(&lo), *reinterpret_cast<unsigned*>(&hi));
    }
}

extern "C" __global__ void bias_to_bf16(float* __restrict__ x, const bf16* __restrict__ bias,
                                        bf16* __restrict__ dst, long long n4, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = reinterpret_cast<float4*>(x)[i];
        float4 b = load4_bf16(bias + (int)((i * 4) % cols));
        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
        reinterpret_cast<float4*>(x)[i] = v;
        reinterpret_cast<uint2*>(dst)[i] = pack4_bf16(v.x, v.y, v.z, v.w);
    }
}
