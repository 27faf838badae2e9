// softmax.cu — the naive (materialised-score) attention path's softmax, kept as the
// cross-check for flash_attention.cu (`attention="naive"`).
//
// softmax_rows: one block per query row of a float32 score matrix [rows, n] that a cuBLAS
//   GEMM wrote (q . k^T, unscaled); probs = softmax(scale * scores) rounded to BF16, the
//   operand of the P.V GEMM. Three passes over the row (max, sum, write), all from L2.
// Reference: segment_attention in reference.py.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
softmax_rows(const float* __restrict__ scores, bf16* __restrict__ probs, int n, float scale) {
    __shared__ float red[8];
    const float* row = scores + (long long)blockIdx.x * n;
    float m = neg_inf();
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_reduce<true>(m, red);
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += expf((row[i] - m) * scale);
    const float inv = 1.f / block_reduce<false>(s, red);
    bf16* out = probs + (long long)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __float2bfloat16_rn(expf((row[i] - m) * scale) * inv);
}
