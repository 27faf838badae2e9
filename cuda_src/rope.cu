// rope.cu — axial 2D RoPE: the angle tables, and the per-head QK-RMSNorm + rotation that
// consumes them in place on the QKV GEMM's output.
//
// rope_tables: cos/sin float32 [P, hd/2] of [h_id * inv_freq, w_id * inv_freq] (hd/4 each).
//   The full-width table is these hd/2 angles twice, so only half is stored. Built once per
//   forward from the positions the host uploads (layout.block_major_positions).
// qknorm_rope: one warp per (token, head). The QKV row is [3, heads, hd] (the de-interleave is
//   only pointer arithmetic). For q and k: add the bias, RMSNorm over hd with the q_norm /
//   k_norm weight (BEFORE the rotary, as the reference orders it), then rotate-half over the
//   whole hd; v only gets its bias. The normalised vector is staged in shared memory so a lane
//   can read its rotate-half partner whatever hd is. All in float32, rounded to BF16 once.
// Reference: rope_tables / qknorm_rope in reference.py.
#include "common.cuh"

extern "C" __global__ void rope_tables(const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                       float* __restrict__ cos_t, float* __restrict__ sin_t,
                                       int P, int quarter) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over P * quarter
    if (i >= P * quarter) return;
    const int p = i / quarter, k = i % quarter;
    const float f = inv_freq[k];
    float s, c;
    sincosf((float)pos[2 * p] * f, &s, &c);
    cos_t[p * 2 * quarter + k] = c;
    sin_t[p * 2 * quarter + k] = s;
    sincosf((float)pos[2 * p + 1] * f, &s, &c);
    cos_t[p * 2 * quarter + quarter + k] = c;
    sin_t[p * 2 * quarter + quarter + k] = s;
}

// blockDim.x = 256 (8 warps); dynamic shared memory: 8 * hd floats.
extern "C" __global__ void __launch_bounds__(256)
qknorm_rope(bf16* __restrict__ qkv, const bf16* __restrict__ bias, const bf16* __restrict__ q_w,
            const bf16* __restrict__ k_w, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
            int P, int heads, int hd, float eps) {
    extern __shared__ float stage[];
    const int lane = threadIdx.x & 31;
    const long long item = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    if (item >= (long long)P * heads) return;  // whole warps exit together
    float* v = stage + (threadIdx.x >> 5) * hd;
    const int p = (int)(item / heads), head = (int)(item % heads), h = heads * hd, half = hd / 2;
    bf16* row = qkv + (long long)p * 3 * h;
    const float* c = cos_t + (long long)p * half;
    const float* s = sin_t + (long long)p * half;

    for (int which = 0; which < 2; ++which) {  // 0: q, 1: k
        bf16* x = row + which * h + head * hd;
        const bf16* b = bias + which * h + head * hd;
        const bf16* w = which ? k_w : q_w;
        float ss = 0.f;
        for (int i = lane; i < hd; i += 32) {
            const float t = __bfloat162float(x[i]) + __bfloat162float(b[i]);
            v[i] = t;
            ss += t * t;
        }
        const float r = rsqrtf(warp_sum(ss) / hd + eps);
        __syncwarp();
        for (int i = lane; i < hd; i += 32) {
            const int j = i < half ? i + half : i - half;  // rotate-half partner
            const float xi = v[i] * r * __bfloat162float(w[i]);
            const float xj = v[j] * r * __bfloat162float(w[j]);
            const int k = i < half ? i : i - half;
            x[i] = __float2bfloat16_rn(xi * c[k] + (i < half ? -xj : xj) * s[k]);
        }
        __syncwarp();  // v is overwritten by the next pass
    }
    bf16* x = row + 2 * h + head * hd;
    const bf16* b = bias + 2 * h + head * hd;
    for (int i = lane; i < hd; i += 32) x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) + __bfloat162float(b[i]));
}
