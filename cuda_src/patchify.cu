// patchify.cu — the pixels' way in from the collection pipeline: the uint8 canvases of a batch
// ([H, W, 3] each, resized and zero-padded on the host; a video's frames [T, H, W, 3] on their
// canvas) -> BF16 pixel_values [P, 3 x T x p x p], block-major, the patch-embed GEMM's operand.
// The host sends 1 byte a value instead of 4. Each value goes through a table (float32 [3, 256]:
// preprocess.pixel_table for images, video.video_pixel_table for video frames, each its oracle's
// arithmetic tabulated) and rounds to BF16 as f32_to_bf16 does, so the GEMM sees the same bits
// as from the CPU path's float32 pixel_values (checked bit for bit by tests/test_gpu_pipeline.py
// and tests/test_gpu_video.py). One block a patch row: 3 x p x p loads from p rows of each of
// the T frames (an image's one frame T times: the image processor repeats it).
#include "common.cuh"

// images[i] = {first patch row, byte offset of its (first) frame, patches a canvas row (gw),
// bytes from one frame of a temporal group to the next}, sorted by first row: an image (stride
// 0, its one frame stands for all T, normalised by tables[0]) or one temporal group of a video
// (its T frames `stride` apart, normalised by tables[1]). tables: float32 [2, 3, 256].
// 2x2 merge blocks (GlmVitGeometry refuses any other merge).
extern "C" __global__ void patchify_u8(const unsigned char* __restrict__ canvases, const int4* __restrict__ images,
                                       int n_images, const float* __restrict__ tables, bf16* __restrict__ out,
                                       int rows, int patch, int temporal) {
    const int pp = patch * patch, row_len = 3 * temporal * pp;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        int lo = 0, hi = n_images - 1;  // the last image whose first row <= row
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (images[mid].x <= row) lo = mid; else hi = mid - 1;
        }
        const int4 img = images[lo];
        const int local = row - img.x, block = local >> 2, within = local & 3, half_w = img.z >> 1;
        const int ph = (block / half_w) * 2 + (within >> 1), pw = (block % half_w) * 2 + (within & 1);
        const long long width = (long long)img.z * patch;  // canvas pixels a row
        const unsigned char* src = canvases + img.y + ((long long)ph * patch * width + (long long)pw * patch) * 3;
        const float* table = tables + (img.w != 0 ? 3 * 256 : 0);
        bf16* dst = out + (long long)row * row_len;
        for (int j = threadIdx.x; j < 3 * pp; j += blockDim.x) {
            const int c = j / pp, py = (j % pp) / patch, px = j % patch;
            const long long at = (long long)(py * width + px) * 3 + c;
            for (int t = 0; t < temporal; ++t)
                dst[(c * temporal + t) * pp + py * patch + px] =
                    __float2bfloat16_rn(table[c * 256 + src[at + (long long)t * img.w]]);
        }
    }
}
