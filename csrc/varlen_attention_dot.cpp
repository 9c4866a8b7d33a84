// Varlen (vision-tower) attention in bfloat16 on vdpbf16ps, for AVX512-BF16 builds
// (MMSERVE_BF16_DOT): bidirectional within each packed segment, online softmax in float32.
//
// Both products are the K-pair panel product of linear.cpp: a broadcast pair of bfloat16 from a
// row times 16 columns of a panel holding, per 32-bit word, the same pair for one column.
// - Scores: q · kᵀ with the pair along head_dim. Each (segment, head)'s keys are packed once into
//   panels of 16 keys (panel b, pair p: words c = (k[16b + c][2p], k[16b + c][2p + 1])), so one
//   zmm of scores is D / 2 instructions.
// - Output: p · v with the pair along the keys. Values are packed once into, per key pair j and
//   column panel c of head_dim: words (v[2j][16c + t], v[2j + 1][16c + t]). The probabilities
//   are rounded to bfloat16 for this product (as torch's flash kernel does for reduced
//   precision), the sums, the running max and the normaliser stay float32.
// A tile of kTileRows query rows runs over blocks of kBlockKeys keys: its 6 × 4 score vectors
// stay in registers; keys past the segment's end are padding (zero in both packs, masked to
// −inf). Work: one task per kTaskRows query rows of a (segment, head), after a parallel pass
// that packs every (segment, head)'s keys and values.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
#include <immintrin.h>

namespace mmserve {
namespace {

using BFloat16 = c10::BFloat16;
constexpr int kLanes = 16;                      // float32 lanes of a zmm: keys per score vector
constexpr int kScoreVecs = 4;                   // score vectors per row and block
constexpr int kBlockKeys = kLanes * kScoreVecs;  // keys per online-softmax step
constexpr int kTileRows = 6;                    // 24 score accumulators of the 32 registers
constexpr int kMaxOutputPanels = 4;             // output column panels accumulated at once
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kTaskRows = 48;
constexpr float kLog2E = 1.4426950408889634f;

inline int32_t load_pair(const BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

inline __m512bh as_pairs(__m512i bits) { return (__m512bh)bits; }

// One (segment, head)'s packed keys and values, and where its rows are.
struct Packed {
  const BFloat16* keys;    // [padded_keys / 16][head_dim / 2][16][2]
  const BFloat16* values;  // [padded_keys / 2][column_panels][16][2]
};

struct Shape {
  int64_t head_dim, pairs, column_panels, padded_keys;
};

void pack_keys_values(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                      const Shape& shape, BFloat16* keys, BFloat16* values) {
  const BFloat16* key = static_cast<const BFloat16*>(args.key.data) + head * args.key.head_stride;
  const BFloat16* value = static_cast<const BFloat16*>(args.value.data) + head * args.value.head_stride;
  const int64_t num_keys = segment.num_queries;
  // Keys as 32-bit words (one pair each): word p of key n goes to panel n / 16, row p, slot n % 16.
  int32_t* key_words = reinterpret_cast<int32_t*>(keys);
  for (int64_t n = 0; n < shape.padded_keys; ++n) {
    int32_t* slot = key_words + (n / kLanes) * shape.pairs * kLanes + n % kLanes;
    if (n >= num_keys) {
      for (int64_t p = 0; p < shape.pairs; ++p) slot[p * kLanes] = 0;
      continue;
    }
    const BFloat16* row = key + (segment.query_begin + n) * args.key.token_stride;
    for (int64_t p = 0; p < shape.pairs; ++p) slot[p * kLanes] = load_pair(row + 2 * p);
  }
  // Values: column d of keys 2j and 2j + 1 side by side at 2d of pair j's run (panel d / 16 of 16
  // words is exactly that); columns past head_dim and keys past the segment are zero.
  const int64_t width = shape.column_panels * kLanes;
  for (int64_t j = 0; j < shape.padded_keys / 2; ++j) {
    BFloat16* run = values + j * 2 * width;
    std::memset(static_cast<void*>(run), 0, 2 * width * sizeof(BFloat16));
    for (int64_t e = 0; e < 2 && 2 * j + e < num_keys; ++e) {
      const BFloat16* row = value + (segment.query_begin + 2 * j + e) * args.value.token_stride;
      for (int64_t d = 0; d < shape.head_dim; ++d) run[2 * d + e] = row[d];
    }
  }
}

// Running state of a tile's rows: output sums [R][column_panels · 16], max, and the normaliser
// as 16 lane sums per row (added up once, at the end).
struct TileState {
  float* out;
  float* max;
  __m512* sum;
  int64_t out_stride;
};

// 2^x for x ≤ 0, and 0 below 2^−126 (so −inf and NaN give 0): 2^n · 2^f with n = round(x) and
// f = x − n in [−½, ½], 2^f by its Taylor polynomial of degree 6 (relative error under 1.2e-7 before
// rounding), 2^n applied by vscalefps. 11 instructions where ATen's exp_u20 and the subtraction and
// scaling before it take 21; the probabilities are rounded to bfloat16 afterwards anyway.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln(2)^k / k!, k = 6 .. 0
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __mmask16 representable = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(representable, p, n);
}

// scores[r][·] of R query rows against keys [block, block + 64), in base-2 units (scaled by
// scale · log2 e, so that e^(s − max) is 2^(s₂ − max₂)), padding at −inf.
template <int R>
inline void block_scores(const BFloat16* const* q, const Packed& packed, const Shape& shape, int64_t block,
                         int64_t num_keys, float scale, __m512 (&scores)[R][kScoreVecs]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < kScoreVecs; ++t) scores[r][t] = _mm512_setzero_ps();
  const BFloat16* panels = packed.keys + (block / kLanes) * shape.pairs * 2 * kLanes;
  const int64_t panel_stride = shape.pairs * 2 * kLanes;
  for (int64_t p = 0; p < shape.pairs; ++p) {
    __m512bh k[kScoreVecs];
    for (int t = 0; t < kScoreVecs; ++t)
      k[t] = as_pairs(_mm512_loadu_si512(panels + t * panel_stride + p * 2 * kLanes));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = as_pairs(_mm512_set1_epi32(load_pair(q[r] + 2 * p)));
      for (int t = 0; t < kScoreVecs; ++t) scores[r][t] = _mm512_dpbf16_ps(scores[r][t], pair, k[t]);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale * kLog2E);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int t = 0; t < kScoreVecs; ++t) {
    const int64_t first = block + t * kLanes;
    const int64_t valid = std::clamp<int64_t>(num_keys - first, 0, kLanes);
    const __mmask16 keep = valid == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int r = 0; r < R; ++r)
      scores[r][t] = _mm512_mask_mul_ps(minus_inf, keep, scores[r][t], factor);
  }
}

// Scores (base 2) into bfloat16 probabilities (probs[r][0..63], key order), updating max and the
// lane-wise normaliser sums; alpha[r] is the factor 2^(old max − new max) the row's output sums are
// rescaled by: exactly 1 while the max stands (most blocks after the first few), so neither the
// max's horizontal reduction nor an exponential is computed then.
template <int R>
inline void block_softmax(__m512 (&scores)[R][kScoreVecs], const TileState& state, BFloat16* probs,
                          float* alpha) {
  for (int r = 0; r < R; ++r) {
    __m512 m = _mm512_max_ps(_mm512_max_ps(scores[r][0], scores[r][1]), _mm512_max_ps(scores[r][2], scores[r][3]));
    const float old_max = state.max[r];
    const bool max_rises = _mm512_cmp_ps_mask(m, _mm512_set1_ps(old_max), _CMP_GT_OQ) != 0;
    const float new_max = max_rises ? _mm512_reduce_max_ps(m) : old_max;
    alpha[r] = max_rises ? std::exp2(old_max - new_max) : 1.f;  // 0 on the first block
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 p[kScoreVecs];
    __m512 total = _mm512_setzero_ps();
    for (int t = 0; t < kScoreVecs; ++t) {
      p[t] = exp2_nonpositive(_mm512_sub_ps(scores[r][t], shift));
      total = _mm512_add_ps(total, p[t]);
    }
    state.sum[r] = !max_rises ? _mm512_add_ps(state.sum[r], total)
                                   : _mm512_fmadd_ps(state.sum[r], _mm512_set1_ps(alpha[r]), total);
    state.max[r] = new_max;
    BFloat16* row = probs + r * kBlockKeys;
    for (int t = 0; t < kScoreVecs; t += 2)  // 32 probabilities, in order, per instruction
      _mm512_storeu_si512(row + t * kLanes, (__m512i)_mm512_cvtne2ps_pbh(p[t + 1], p[t]));
  }
}

// out[r][panels [c0, c0 + C)] ← alpha[r] · out + Σ_n probs[r][n] · v[n] over the block's keys.
template <int R, int C>
inline void block_values(const BFloat16* probs, const float* alpha, const Packed& packed, const Shape& shape,
                         int64_t block, int64_t c0, const TileState& state) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 factor = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(state.out + r * state.out_stride + (c0 + c) * kLanes), factor);
  }
  const int64_t pair_stride = shape.column_panels * 2 * kLanes;
  const BFloat16* pairs = packed.values + (block / 2) * pair_stride + c0 * 2 * kLanes;
  for (int j = 0; j < kBlockKeys / 2; ++j) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = as_pairs(_mm512_loadu_si512(pairs + j * pair_stride + c * 2 * kLanes));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh p = as_pairs(_mm512_set1_epi32(load_pair(probs + r * kBlockKeys + 2 * j)));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(state.out + r * state.out_stride + (c0 + c) * kLanes, acc[r][c]);
}

template <int R>
inline void all_block_values(const BFloat16* probs, const float* alpha, const Packed& packed, const Shape& shape,
                             int64_t block, const TileState& state) {
  for (int64_t c0 = 0; c0 < shape.column_panels;) {
    switch (std::min<int64_t>(kMaxOutputPanels, shape.column_panels - c0)) {
      case 1: block_values<R, 1>(probs, alpha, packed, shape, block, c0, state); c0 += 1; break;
      case 2: block_values<R, 2>(probs, alpha, packed, shape, block, c0, state); c0 += 2; break;
      case 3: block_values<R, 3>(probs, alpha, packed, shape, block, c0, state); c0 += 3; break;
      default: block_values<R, 4>(probs, alpha, packed, shape, block, c0, state); c0 += 4; break;
    }
  }
}

// R query rows (first..first + R of the segment) over all its keys, written to out.
template <int R>
void attend_tile(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                 const Packed& packed, const Shape& shape, int64_t first) {
  const BFloat16* q[R];
  for (int r = 0; r < R; ++r)
    q[r] = static_cast<const BFloat16*>(args.query.data) + (segment.query_begin + first + r) * args.query.token_stride +
           head * args.query.head_stride;
  const int64_t width = shape.column_panels * kLanes;
  alignas(64) float out_sums[R * kMaxHeadDim];
  std::fill(out_sums, out_sums + R * width, 0.f);
  float max[R], alpha[R];
  __m512 sum[R];
  std::fill(max, max + R, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + R, _mm512_setzero_ps());
  const TileState state{out_sums, max, sum, width};
  alignas(64) BFloat16 probs[R * kBlockKeys];
  __m512 scores[R][kScoreVecs];
  for (int64_t block = 0; block < shape.padded_keys; block += kBlockKeys) {
    block_scores<R>(q, packed, shape, block, segment.num_queries, args.scale, scores);
    block_softmax<R>(scores, state, probs, alpha);
    all_block_values<R>(probs, alpha, packed, shape, block, state);
  }
  for (int r = 0; r < R; ++r) {
    BFloat16* out = static_cast<BFloat16*>(args.out.data) + (segment.query_begin + first + r) * args.out.token_stride +
                    head * args.out.head_stride;
    const float inverse = 1.f / _mm512_reduce_add_ps(sum[r]);
    for (int64_t d = 0; d < shape.head_dim; ++d) out[d] = BFloat16(out_sums[r * width + d] * inverse);
  }
}

void attend_rows(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                 const Packed& packed, const Shape& shape, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end;) {
    switch (std::min<int64_t>(kTileRows, end - row)) {
      case 1: attend_tile<1>(args, segment, head, packed, shape, row); row += 1; break;
      case 2: attend_tile<2>(args, segment, head, packed, shape, row); row += 2; break;
      case 3: attend_tile<3>(args, segment, head, packed, shape, row); row += 3; break;
      case 4: attend_tile<4>(args, segment, head, packed, shape, row); row += 4; break;
      case 5: attend_tile<5>(args, segment, head, packed, shape, row); row += 5; break;
      default: attend_tile<6>(args, segment, head, packed, shape, row); row += 6; break;
    }
  }
}

}  // namespace

bool varlen_attention_dot(const VarlenAttentionArgs& args) {
  if (args.query.dtype != Dtype::kBFloat16 || args.head_dim % 2 != 0 || args.head_dim > kMaxHeadDim) return false;
  const int64_t num_heads = args.num_heads;
  const int64_t column_panels = (args.head_dim + kLanes - 1) / kLanes;
  std::vector<Shape> shapes;
  std::vector<int64_t> offsets{0};  // of each (segment, head)'s packs, in elements
  for (const attention::Sequence& segment : args.sequences) {
    const int64_t padded = (segment.num_queries + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
    shapes.push_back({args.head_dim, args.head_dim / 2, column_panels, padded});
    for (int64_t h = 0; h < num_heads; ++h) offsets.push_back(offsets.back() + padded * column_panels * kLanes);
  }
  const int64_t units = static_cast<int64_t>(args.sequences.size()) * num_heads;
  // Keys need padded · head_dim elements, values padded · column_panels · 16: both fit the stride.
  std::vector<BFloat16> keys(offsets.back()), values(offsets.back());
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit)
      pack_keys_values(args, args.sequences[unit / num_heads], unit % num_heads, shapes[unit / num_heads],
                       keys.data() + offsets[unit], values.data() + offsets[unit]);
  });
  struct Task {
    int64_t unit, begin, end;
  };
  std::vector<Task> tasks;
  for (int64_t unit = 0; unit < units; ++unit) {
    const int64_t rows = args.sequences[unit / num_heads].num_queries;
    for (int64_t begin = 0; begin < rows; begin += kTaskRows) tasks.push_back({unit, begin, std::min(rows, begin + kTaskRows)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t s = task.unit / num_heads;
      const Packed packed{keys.data() + offsets[task.unit], values.data() + offsets[task.unit]};
      attend_rows(args, args.sequences[s], task.unit % num_heads, packed, shapes[s], task.begin, task.end);
    }
  });
  return true;
}

}  // namespace mmserve

#else

namespace mmserve {
bool varlen_attention_dot(const VarlenAttentionArgs&) { return false; }
}  // namespace mmserve

#endif
