// Varlen (vision-tower) attention in bfloat16 on vdpbf16ps, for AVX512-BF16 builds
// (MMSERVE_BF16_DOT): bidirectional within each packed segment, online softmax in float32.
//
// Both products are the K-pair panel product of linear.cpp: a broadcast pair of bfloat16 from a
// row times 16 columns of a panel holding, per 32-bit word, the same pair for one column
// (varlen_attention_pack.h packs the keys and values so).
// - Scores: q · kᵀ with the pair along head_dim: one zmm of scores is D / 2 instructions.
// - Output: p · v with the pair along the keys. The probabilities are rounded to bfloat16 for
//   this product (as torch's flash kernel does for reduced precision), the sums, the running
//   max and the normaliser stay float32.
// A tile of kTileRows query rows runs over blocks of kBlockKeys keys: its 6 × 4 score vectors
// stay in registers. Work: one task per kTaskRows query rows of a (segment, head), after a
// parallel pass that packs every (segment, head)'s keys and values.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
#include "exp2_avx512.h"
#include "varlen_attention_pack.h"

namespace mmserve {
namespace {

using namespace varlen;
constexpr int kTileRows = 6;                    // 24 score accumulators of the 32 registers
constexpr int kMaxOutputPanels = 4;             // output column panels accumulated at once
constexpr int64_t kTaskRows = 48;

inline __m512bh as_pairs(__m512i bits) { return (__m512bh)bits; }

// Running state of a tile's rows: output sums [R][column_panels · 16], max, and the normaliser
// as 16 lane sums per row (added up once, at the end).
struct TileState {
  float* out;
  float* max;
  __m512* sum;
  int64_t out_stride;
};

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
  if (!takes(args)) return false;
  attend_tasks(args, 1, kTaskRows, attend_rows);
  return true;
}

}  // namespace mmserve

#else

namespace mmserve {
bool varlen_attention_dot(const VarlenAttentionArgs&) { return false; }
}  // namespace mmserve

#endif
