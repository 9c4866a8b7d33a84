// Normalise and patchify a resized RGB uint8 image into Qwen-VL's `pixel_values` layout in one
// pass: what preprocess/patchify.py's numpy reference does with a strided transpose, a float
// conversion, two divisions and a subtraction over the whole image.
//
// The normalisation is a lookup: the result depends only on (channel, level), so the caller
// passes the 768 float32 values transformers' arithmetic gives (preprocess/normalise.py), and
// every value written is one of them, bit for bit. Plain C ABI, loaded with ctypes.

#include <cstddef>
#include <cstdint>

namespace {

constexpr int kChannels = 3;
constexpr int kLevels = 256;

}  // namespace

// `rgb` [height, width, 3] uint8 -> `out` [N, 3, patch·patch] float32, N = (height / patch)·
// (width / patch) rows in (block_h, block_w, merge_h, merge_w) order: transformers' layout with
// the frame once (it repeats a still image's frame over T). `table` [3, 256] float32 is the
// normalised value of each (channel, level). Both sides must be multiples of patch·merge.
// Returns 0, or -2 for a geometry that does not tile.
extern "C" int mmserve_patchify_rgb(const uint8_t* rgb, int height, int width, const float* table,
                                    int patch, int merge, float* out) {
  const int block = patch * merge;
  if (patch < 1 || merge < 1 || height < block || width < block || height % block != 0 ||
      width % block != 0) {
    return -2;
  }
  const size_t row_stride = static_cast<size_t>(width) * kChannels;
  float* dst = out;
  for (int bh = 0; bh < height / block; ++bh) {
    for (int bw = 0; bw < width / block; ++bw) {
      for (int mh = 0; mh < merge; ++mh) {
        for (int mw = 0; mw < merge; ++mw) {
          const size_t y0 = static_cast<size_t>(bh * merge + mh) * patch;
          const size_t x0 = static_cast<size_t>(bw * merge + mw) * patch;
          for (int c = 0; c < kChannels; ++c) {
            const float* lut = table + c * kLevels;
            for (int ph = 0; ph < patch; ++ph) {
              const uint8_t* src = rgb + (y0 + ph) * row_stride + x0 * kChannels + c;
              for (int pw = 0; pw < patch; ++pw) dst[pw] = lut[src[pw * kChannels]];
              dst += patch;
            }
          }
        }
      }
    }
  }
  return 0;
}
