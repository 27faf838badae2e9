// base64.cu — the server's base64 answers (glmvit_cupy/gpu/device_base64.py), encoded on the GPU where the
// embeddings already are: Python's encoder runs at a few hundred MB/s on a host core and holds the GIL.
// One thread a 3-byte group, 4 characters out (RFC 4648's alphabet, '=' padding for a short last
// group); a grid-stride loop. Byte loads, 4-byte stores: megabytes, so bandwidth is not the limit.
// Checked against Python's base64.b64encode (tests/test_gpu_service.py).

__constant__ char ALPHABET[65] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

extern "C" __global__ void base64_encode(const unsigned char* __restrict__ src, long long n, char4* __restrict__ dst) {
    long long groups = (n + 2) / 3;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
        long long i = 3 * g;
        unsigned b1 = i + 1 < n ? src[i + 1] : 0u, b2 = i + 2 < n ? src[i + 2] : 0u;
        unsigned w = (unsigned)src[i] << 16 | b1 << 8 | b2;
        dst[g] = make_char4(ALPHABET[w >> 18], ALPHABET[(w >> 12) & 63],
                            i + 1 < n ? ALPHABET[(w >> 6) & 63] : '=', i + 2 < n ? ALPHABET[w & 63] : '=');
    }
}
