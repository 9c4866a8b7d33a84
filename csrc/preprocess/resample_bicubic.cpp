// Bicubic resize of packed RGB uint8 images, bit-identical to Pillow's `Image.resize(size,
// Image.Resampling.BICUBIC)` (libImaging/Resample.c, 8 bits per channel).
//
// Pillow's algorithm, kept to the bit: per axis, a table of double weights (Keys' cubic with
// a = -0.5, support widened by the downscale factor, each output's weights normalised to sum 1)
// rounded to signed 22-bit fixed point; two passes, each rounded and clamped to uint8: horizontal
// (over the input rows the vertical pass will read) then vertical, or the other way round where
// the Pillow in use does that (`vertical_first`). Integer sums are exact whatever
// their order, so vectorising them changes nothing; the double weights are computed in Pillow's
// order of operations, and the build uses -ffp-contract=off so that no FMA rounds differently.
//
// What differs is speed: the horizontal pass takes 5 RGB pixels (15 bytes) or 4 RGBX pixels per
// 16-lane vector where Pillow takes one channel of one pixel per multiply. The source may be
// packed RGB or Pillow's own RGBX rows (4 bytes per pixel, the 4th ignored), which saves copying
// the decoded image out of Pillow; the result is packed RGB. Plain C ABI, no Python or torch: it
// is loaded with ctypes by preprocess/resample.py in the preprocessing workers.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr int32_t kHalf = 1 << (kPrecisionBits - 1);
constexpr int kChannels = 3;  // of the result, and the ones computed
constexpr int kLanes = 16;

// Source pixels per 16-lane vector: 5 of 3 bytes (15 lanes), or 4 of 4.
constexpr int taps_per_vector(int pixel_bytes) { return kLanes / pixel_bytes; }

typedef int32_t Lanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

double bicubic_filter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// One axis: output i reads inputs [first[i], first[i] + count[i]) with weights[i * ksize + t].
struct Taps {
  int ksize = 0;
  std::vector<int> first;
  std::vector<int> count;
  std::vector<int32_t> weights;
};

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for a box of the whole input.
Taps precompute(int in_size, int out_size) {
  const float in0 = 0.0f;
  const float in1 = static_cast<float>(in_size);
  const double scale = static_cast<double>(in1 - in0) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = 2.0 * filterscale;  // bicubic support 2, widened when downscaling
  Taps taps;
  taps.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  taps.first.resize(out_size);
  taps.count.resize(out_size);
  taps.weights.assign(static_cast<size_t>(out_size) * taps.ksize, 0);
  std::vector<double> k(taps.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double w = bicubic_filter((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    int32_t* out = &taps.weights[static_cast<size_t>(xx) * taps.ksize];
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[x] / ww : k[x];
      out[x] = w < 0 ? static_cast<int>(-0.5 + w * (1 << kPrecisionBits))
                     : static_cast<int>(0.5 + w * (1 << kPrecisionBits));
    }
    taps.first[xx] = xmin;
    taps.count[xx] = xmax;
  }
  return taps;
}

inline uint8_t clip8(int32_t sum) {
  return static_cast<uint8_t>(std::clamp(sum >> kPrecisionBits, 0, 255));
}

// Horizontal weights laid out per vector: output x, vector j, lane P·t + c = weight of tap
// T·j + t for the 3 colour channels c (T = taps per vector, P = source pixel bytes); the other
// lanes and taps past count[x] are 0, so the bytes they meet do not matter.
template <int P>
std::vector<Lanes> spread_weights(const Taps& taps, int* vectors_per_output) {
  constexpr int T = taps_per_vector(P);
  const int out_size = static_cast<int>(taps.first.size());
  const int per_output = (taps.ksize + T - 1) / T;
  std::vector<Lanes> spread(static_cast<size_t>(out_size) * per_output);
  for (int x = 0; x < out_size; ++x) {
    const int32_t* w = &taps.weights[static_cast<size_t>(x) * taps.ksize];
    for (int j = 0; j < per_output; ++j) {
      Lanes lanes = {};
      for (int t = 0; t < T; ++t) {
        const int tap = j * T + t;
        if (tap >= taps.count[x]) break;
        for (int c = 0; c < kChannels; ++c) lanes[t * P + c] = w[tap];
      }
      spread[static_cast<size_t>(x) * per_output + j] = lanes;
    }
  }
  *vectors_per_output = per_output;
  return spread;
}

// One output pixel of the horizontal pass into `dst` (3 bytes): `vectors` groups of T pixels of
// P bytes from `src`, weighted by `w`. Reads whole 16-byte groups unless `bytes_left` (to the end
// of the source) is shorter; the bytes past the taps meet zero weights.
template <int P>
inline void resample_pixel(const uint8_t* src, const Lanes* w, int vectors, ptrdiff_t bytes_left,
                           uint8_t* dst) {
  constexpr int step = taps_per_vector(P) * P;  // bytes per group: 15 or 16
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
  for (int j = 0; j < vectors; ++j, src += step) {
    const ptrdiff_t left = bytes_left - static_cast<ptrdiff_t>(j) * step;
    const __m128i bytes = left >= kLanes
                              ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src))
                              : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << left) - 1), src);
    const __m512i weights = _mm512_loadu_si512(&w[j]);
    acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(bytes), weights));
  }
  // lanes P·t + c -> lane c, then round and clamp as clip8.
  const __m512i zero = _mm512_setzero_si512();
  __m512i total;
  if constexpr (P == 3) {
    total = _mm512_add_epi32(acc, _mm512_alignr_epi32(zero, acc, 3));     // t0+t1, t2+t3, ...
    total = _mm512_add_epi32(total, _mm512_alignr_epi32(zero, total, 6));  // t0+..+t3
    total = _mm512_add_epi32(total, _mm512_alignr_epi32(zero, acc, 12));   // + t4
  } else {
    total = _mm512_add_epi32(acc, _mm512_alignr_epi32(zero, acc, 8));      // t0+t2, t1+t3
    total = _mm512_add_epi32(total, _mm512_alignr_epi32(zero, total, 4));  // t0+..+t3
  }
  total = _mm512_srai_epi32(_mm512_add_epi32(total, _mm512_set1_epi32(kHalf)), kPrecisionBits);
  const __m128i levels = _mm512_cvtusepi32_epi8(_mm512_max_epi32(total, zero));  // min 255 too
  const uint32_t rgb = static_cast<uint32_t>(_mm_cvtsi128_si32(levels));
  std::memcpy(dst, &rgb, kChannels);
#else
  Lanes acc = {};
  for (int j = 0; j < vectors; ++j, src += step) {
    const ptrdiff_t left = bytes_left - static_cast<ptrdiff_t>(j) * step;
    alignas(16) uint8_t bytes[kLanes] = {};
    std::memcpy(bytes, src, static_cast<size_t>(std::min<ptrdiff_t>(kLanes, left)));
    Lanes values;
    for (int i = 0; i < kLanes; ++i) values[i] = bytes[i];
    acc += values * w[j];
  }
  for (int c = 0; c < kChannels; ++c) {
    int32_t sum = kHalf;
    for (int t = 0; t < taps_per_vector(P); ++t) sum += acc[t * P + c];
    dst[c] = clip8(sum);
  }
#endif
}

// rows [row0, row0 + num_rows) of `in` [.., in_w, P] -> `out` [num_rows, out_w, 3].
template <int P>
void horizontal_pass(const uint8_t* in, int in_w, int row0, int num_rows, const Taps& taps,
                     const uint8_t* in_end, uint8_t* out) {
  const int out_w = static_cast<int>(taps.first.size());
  int per_output = 0;
  const std::vector<Lanes> spread = spread_weights<P>(taps, &per_output);
  constexpr int T = taps_per_vector(P);
  const size_t in_stride = static_cast<size_t>(in_w) * P;
  for (int r = 0; r < num_rows; ++r) {
    const uint8_t* row = in + (static_cast<size_t>(row0) + r) * in_stride;
    uint8_t* dst = out + static_cast<size_t>(r) * out_w * kChannels;
    for (int x = 0; x < out_w; ++x) {
      const uint8_t* src = row + static_cast<size_t>(taps.first[x]) * P;
      const int vectors = (taps.count[x] + T - 1) / T;
      resample_pixel<P>(src, &spread[static_cast<size_t>(x) * per_output], vectors, in_end - src,
                        dst + x * kChannels);
    }
  }
}

// `in` [in_h, width, P] -> `out` [taps.first.size(), width, P], rows relative to `in`: every byte
// goes through (an X byte of RGBX too, harmlessly).
void vertical_pass(const uint8_t* in, int width, int pixel_bytes, const Taps& taps, uint8_t* out) {
  const int out_h = static_cast<int>(taps.first.size());
  const int n = width * pixel_bytes;
  std::vector<int32_t> acc(n);
  for (int yy = 0; yy < out_h; ++yy) {
    const int32_t* w = &taps.weights[static_cast<size_t>(yy) * taps.ksize];
    std::fill(acc.begin(), acc.end(), kHalf);
    for (int y = 0; y < taps.count[yy]; ++y) {
      const uint8_t* row = in + (static_cast<size_t>(taps.first[yy]) + y) * n;
      const int32_t weight = w[y];
      for (int i = 0; i < n; ++i) acc[i] += row[i] * weight;
    }
    uint8_t* dst = out + static_cast<size_t>(yy) * n;
    for (int i = 0; i < n; ++i) dst[i] = clip8(acc[i]);
  }
}

// Packed RGB from P-byte pixels (the copy when there is nothing to resample).
void pack_rgb(const uint8_t* in, size_t num_pixels, int pixel_bytes, uint8_t* out) {
  if (pixel_bytes == kChannels) {
    std::memcpy(out, in, num_pixels * kChannels);
    return;
  }
  for (size_t i = 0; i < num_pixels; ++i) std::memcpy(out + i * kChannels, in + i * pixel_bytes, kChannels);
}

template <int P>
void resize(const uint8_t* in, int in_h, int in_w, uint8_t* out, int out_h, int out_w, bool vertical_first) {
  const bool need_horizontal = out_w != in_w;
  const bool need_vertical = out_h != in_h;
  const uint8_t* in_end = in + static_cast<size_t>(in_h) * in_w * P;
  if (!need_horizontal && !need_vertical) {
    pack_rgb(in, static_cast<size_t>(in_h) * in_w, P, out);
    return;
  }
  if (!need_horizontal) {
    if (P == kChannels) {
      vertical_pass(in, in_w, P, precompute(in_h, out_h), out);
    } else {
      std::vector<uint8_t> temp(static_cast<size_t>(out_h) * in_w * P);
      vertical_pass(in, in_w, P, precompute(in_h, out_h), temp.data());
      pack_rgb(temp.data(), static_cast<size_t>(out_h) * in_w, P, out);
    }
    return;
  }
  const Taps cols = precompute(in_w, out_w);
  if (!need_vertical) {
    horizontal_pass<P>(in, in_w, 0, in_h, cols, in_end, out);
    return;
  }
  Taps rows = precompute(in_h, out_h);
  if (vertical_first) {
    std::vector<uint8_t> temp(static_cast<size_t>(out_h) * in_w * P);
    vertical_pass(in, in_w, P, rows, temp.data());
    horizontal_pass<P>(temp.data(), in_w, 0, out_h, cols, temp.data() + temp.size(), out);
    return;
  }
  // Only the input rows some output row reads go through the horizontal pass.
  const int first_row = rows.first.front();
  const int last_row = rows.first.back() + rows.count.back();
  std::vector<uint8_t> temp(static_cast<size_t>(last_row - first_row) * out_w * kChannels);
  horizontal_pass<P>(in, in_w, first_row, last_row - first_row, cols, in_end, temp.data());
  for (int& first : rows.first) first -= first_row;
  vertical_pass(temp.data(), out_w, kChannels, rows, out);
}

}  // namespace

// `in` [in_h, in_w, pixel_bytes] (3: packed RGB; 4: RGBX, X ignored) -> `out` [out_h, out_w, 3],
// both C-contiguous uint8, all sides >= 1. `vertical_first` picks the order of the two passes when
// both are needed; the rounding between them makes the order visible in the result, so it must be
// the one the Pillow in use takes (preprocess/resample.py decides). Returns 0; -1 when memory
// could not be had, -2 for a pixel size other than 3 or 4.
extern "C" int mmserve_resize_bicubic_rgb(const uint8_t* in, int in_h, int in_w, int pixel_bytes,
                                          uint8_t* out, int out_h, int out_w, int vertical_first) {
  try {
    if (pixel_bytes == 3) {
      resize<3>(in, in_h, in_w, out, out_h, out_w, vertical_first != 0);
    } else if (pixel_bytes == 4) {
      resize<4>(in, in_h, in_w, out, out_h, out_w, vertical_first != 0);
    } else {
      return -2;
    }
    return 0;
  } catch (const std::bad_alloc&) {
    return -1;
  }
}
