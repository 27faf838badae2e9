// rope.cu — axial 2D RoPE: the angle tables, and the per-head QK-RMSNorm + rotation that
// consumes them in place on the QKV GEMM's output.
//
// rope_tables: cos/sin float32 [P, hd/2] of [h_id * inv_freq, w_id * inv_freq] (hd/4 each).
//   The full-width table is these hd/2 angles twice, so only half is stored. Built once per
//   forward from the positions the host uploads (layout.block_major_positions).
// qknorm_rope: in place on q and k of the QKV row [3, heads, hd] (the de-interleave is only
//   pointer arithmetic): add the bias, RMSNorm over hd with the q_norm / k_norm weight, then
//   rotate-half over the whole hd. All in float32, rounded to BF16 once.
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

// One thread per 8 consecutive elements of a q or k head vector, G = hd / 8 threads a vector
// (hd a power of two from 16 to 256, so a group never straddles a warp): 16-byte loads and
// stores, the RMS a G-lane shuffle sum, and the rotate-half partner (hd / 2 elements away) is
// lane ^ G/2, exchanged by shuffle. q and k of all heads are the first 2 * heads vectors of a
// QKV row, so thread t's vector is simply t / G. v is not touched (its bias is folded into the
// residual stream, see weights.deferred_bias). 16-byte accesses because the kernel is bound by
// memory bandwidth.
extern "C" __global__ void __launch_bounds__(256)
qknorm_rope(bf16* __restrict__ qkv, const bf16* __restrict__ bias, const bf16* __restrict__ q_w,
            const bf16* __restrict__ k_w, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
            int P, int heads, int hd, float eps) {
    const int G = hd / 8, half = hd / 2, vectors = P * 2 * heads;  // < 2^31 (p_max)
    const int tid = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = tid / G < vectors;  // dead lanes still shuffle, so they compute on row 0
    const int vec = live ? tid / G : 0, e0 = (tid % G) * 8;
    const int p = vec / (2 * heads), r = vec % (2 * heads);  // r < heads: q of head r, else k
    bf16* x = qkv + (long long)p * 3 * heads * hd + r * hd + e0;
    float v[8], b[8], w[8];
    unpack8_bf16(*reinterpret_cast<const uint4*>(x), v);
    unpack8_bf16(*reinterpret_cast<const uint4*>(bias + r * hd + e0), b);
    unpack8_bf16(*reinterpret_cast<const uint4*>((r < heads ? q_w : k_w) + e0), w);
    float ss = 0.f;
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        v[e] += b[e];
        ss += v[e] * v[e];
    }
    for (int o = G / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float rr = rsqrtf(ss / hd + eps);
    #pragma unroll
    for (int e = 0; e < 8; ++e) v[e] *= rr * w[e];  // RMSNorm BEFORE the rotary, as the reference orders it
    const bool lower = e0 < half;
    const int k0 = lower ? e0 : e0 - half;
    const float4* c4 = reinterpret_cast<const float4*>(cos_t + (long long)p * half + k0);
    const float4* s4 = reinterpret_cast<const float4*>(sin_t + (long long)p * half + k0);
    const float4 ca = c4[0], cb = c4[1], sa = s4[0], sb = s4[1];
    const float c[8] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
    const float s[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
    float out[8];
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float partner = __shfl_xor_sync(0xffffffffu, v[e], G / 2);
        out[e] = v[e] * c[e] + (lower ? -partner : partner) * s[e];
    }
    if (live) store8_bf16(x, out);
}
