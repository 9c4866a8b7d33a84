// The inner loop of decode items (one query token per sequence): the query heads that share a
// kv head attend a run of keys, kDecodeKeys keys at a time, with an online softmax.
//
// A decode row is memory-bound only if the core spends a few instructions per byte of K/V, so
// this path differs from the tile engine (attention_tile.h) where a tile of 1–8 query rows made
// it compute-bound: K/V rows are read where they lie and bfloat16 is widened in registers (no
// copy into a buffer), or, for a bfloat16 query on AVX512-BF16, multiplied in pairs on
// vdpbf16ps as it lies: the scores along head_dim (decode_scores_dot), P·V along the keys with
// the probabilities rounded to bfloat16 (decode_accumulate_dot); each K/V vector, once in a
// register, serves up to kDecodeHeads query heads;
// the scores of a key block are reduced across lanes together (hadd trees); the softmax runs on
// vectors of kDecodeKeys scores; the accumulator's rescale is folded into the P·V pass; the next
// step's K/V lines are prefetched while this step computes; and no causal mask is needed (a
// decode row sees every key of its context). The tile's state (FlashTile) is shared, so split
// items and their merge work as for the tile engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_microkernels.h"
#include "attention_tile.h"
#include "vec.h"

namespace mmserve::attention {

constexpr int kDecodeKeys = 32;      // keys per online-softmax step
constexpr int kDecodeHeads = 3;      // query heads per pass over a tile (registers: 3 × 4 scores)
constexpr int kDecodeBlockKeys = 4;  // keys per score block

// Query heads [first, first + MR) of one head group: their packed queries and running state.
struct DecodeHeads {
  const float* query;  // [MR, head_dim], scaled
  float* acc;          // [MR, head_dim]
  float* max;          // [MR]
  float* sum;          // [MR]
  int head_dim;
  // [MR, head_dim], unscaled, where the keys' products can take vdpbf16ps (decode_scores_dot);
  // else nullptr
  const c10::BFloat16* query_bf16;
  float scale;
};

// sums[a] = Σ lanes of acc[a] for a score block's N accumulators, eight or four at a time.
template <int N>
inline void block_sums(const Vec* acc, float* sums) {
  if constexpr (N % 8 == 0) {
    for (int a = 0; a < N; a += 8) lane_sums<8>(acc + a, sums + a);
  } else {
    for (int a = 0; a < N; a += 4) lane_sums<4>(acc + a, sums + a);
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
constexpr bool kDecodeScoresDot = true;
constexpr int kDotDims = 32;  // bfloat16 elements per zmm: 16 pairs, one vdpbf16ps

// decode_scores for a bfloat16 query against bfloat16 keys, on AVX512-BF16: one vdpbf16ps per
// 32 dimensions, key and head, where the float32 path widens each key vector (a shift and a
// mask per 16 dimensions) before its FMAs. A bfloat16 product is exact in float32, and the
// query is the caller's own bfloat16 (unscaled), so only the order of the float32 additions and
// the scale (applied to the sum instead of to each query element) differ. head_dim % 32 == 0.
template <int MR>
inline void decode_scores_dot(const DecodeHeads& heads, const c10::BFloat16* const* k, float* scores) {
  constexpr int N = MR * kDecodeBlockKeys;
  const int head_dim = heads.head_dim;
  Vec acc[N];
  for (int a = 0; a < N; ++a) acc[a] = Vec(0.f);
  for (int d = 0; d < head_dim; d += kDotDims) {
    __m512bh queries[MR];
    for (int i = 0; i < MR; ++i) queries[i] = (__m512bh)_mm512_loadu_si512(heads.query_bf16 + i * head_dim + d);
    for (int j = 0; j < kDecodeBlockKeys; ++j) {
      const __m512bh key = (__m512bh)_mm512_loadu_si512(k[j] + d);
      for (int i = 0; i < MR; ++i) {
        Vec& sum = acc[i * kDecodeBlockKeys + j];
        sum = Vec(_mm512_dpbf16_ps(sum, queries[i], key));
      }
    }
  }
  static_assert(kDecodeBlockKeys == 4, "one head's block of sums is one __m128");
  const __m128 scale = _mm_set1_ps(heads.scale);
  for (int i = 0; i < MR; ++i)
    _mm_storeu_ps(scores + i * kDecodeKeys, _mm_mul_ps(four_lane_sums(acc + i * kDecodeBlockKeys), scale));
}

// The probabilities of MR heads (decode_softmax's, zero past the tile's count) as bfloat16
// pairs, rounded to nearest even: keys 2m and 2m + 1 in word m, what decode_values_dot broadcasts.
template <int MR>
inline void probability_pairs(const float* p, int32_t* pairs) {
  static_assert(kDecodeKeys == 32, "one zmm of bfloat16 per head");
  for (int i = 0; i < MR; ++i) {
    const float* row = p + i * kDecodeKeys;
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
    _mm512_storeu_si512(pairs + i * (kDecodeKeys / 2), (__m512i)both);
  }
}

// acc_i[d0, d0 + 32 · DB) ← alpha_i · acc_i + Σ_n p_i[n] · v_n for MR heads, bfloat16 values on
// vdpbf16ps: per key pair, the two rows' 32 dimensions are interleaved (unpacklo/hi_epi16) into
// pairs along the keys and multiplied by the broadcast probability pair. The interleave holds,
// per 128-bit lane, dimensions 8l..8l+3 (lo) and 8l+4..8l+7 (hi), so the accumulators are
// loaded into that order and stored back in natural order (permutex2var).
template <int MR, int DB>
inline void decode_values_dot(const DecodeHeads& heads, const int32_t* pairs, const float* alpha,
                              const c10::BFloat16* const* v, int count, int d0) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  __m512 lo[MR][DB], hi[MR][DB];
  for (int i = 0; i < MR; ++i) {
    const __m512 factor = _mm512_set1_ps(alpha[i]);
    for (int b = 0; b < DB; ++b) {
      const float* acc = heads.acc + i * heads.head_dim + d0 + b * kDotDims;
      const __m512 first = _mm512_mul_ps(_mm512_loadu_ps(acc), factor);
      const __m512 second = _mm512_mul_ps(_mm512_loadu_ps(acc + 16), factor);
      lo[i][b] = _mm512_permutex2var_ps(first, to_lo, second);
      hi[i][b] = _mm512_permutex2var_ps(first, to_hi, second);
    }
  }
  for (int n = 0; n < count; n += 2) {
    const c10::BFloat16* even = v[n];
    const c10::BFloat16* odd = v[std::min(n + 1, count - 1)];  // an odd count's last: times 0
    __m512bh weight[MR];
    for (int i = 0; i < MR; ++i) weight[i] = (__m512bh)_mm512_set1_epi32(pairs[i * (kDecodeKeys / 2) + n / 2]);
    for (int b = 0; b < DB; ++b) {
      const __m512i a = _mm512_loadu_si512(even + d0 + b * kDotDims);
      const __m512i c = _mm512_loadu_si512(odd + d0 + b * kDotDims);
      const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, c), high = (__m512bh)_mm512_unpackhi_epi16(a, c);
      for (int i = 0; i < MR; ++i) {
        lo[i][b] = _mm512_dpbf16_ps(lo[i][b], low, weight[i]);
        hi[i][b] = _mm512_dpbf16_ps(hi[i][b], high, weight[i]);
      }
    }
  }
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < MR; ++i) {
    for (int b = 0; b < DB; ++b) {
      float* acc = heads.acc + i * heads.head_dim + d0 + b * kDotDims;
      _mm512_storeu_ps(acc, _mm512_permutex2var_ps(lo[i][b], first_half, hi[i][b]));
      _mm512_storeu_ps(acc + 16, _mm512_permutex2var_ps(lo[i][b], second_half, hi[i][b]));
    }
  }
}

// The P·V pass on vdpbf16ps (decode_values_dot) over all of head_dim (a multiple of 32): the
// probabilities are rounded to bfloat16 for this product, as torch's flash kernel and
// varlen_attention_dot.cpp do; the normaliser (decode_softmax) stays float32.
template <int MR>
inline void decode_accumulate_dot(const DecodeHeads& heads, const float* p, const float* alpha,
                                  const c10::BFloat16* const* v, int count) {
  constexpr int DB = MR == 1 ? 4 : 2;  // 2 · MR · DB accumulators: 8 or 12
  int32_t pairs[MR * kDecodeKeys / 2];
  probability_pairs<MR>(p, pairs);
  int d = 0;
  for (; d + DB * kDotDims <= heads.head_dim; d += DB * kDotDims)
    decode_values_dot<MR, DB>(heads, pairs, alpha, v, count, d);
  for (; d < heads.head_dim; d += kDotDims) decode_values_dot<MR, 1>(heads, pairs, alpha, v, count, d);
}
#else
constexpr bool kDecodeScoresDot = false;
constexpr int kDotDims = 1;
#endif

// scores[i * kDecodeKeys + j] = q_i · k_j for MR heads and the kDecodeBlockKeys key rows k[j].
template <int MR, typename kv_t>
inline void decode_scores(const DecodeHeads& heads, const kv_t* const* k, float* scores) {
  constexpr int N = MR * kDecodeBlockKeys;
  const int head_dim = heads.head_dim;
  Vec acc[N];
  for (int a = 0; a < N; ++a) acc[a] = Vec(0.f);
  int d = 0;
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    Vec queries[MR];  // in registers: loaded once per key block, not once per key
    for (int i = 0; i < MR; ++i) queries[i] = in_register(Vec::loadu(heads.query + i * head_dim + d));
    for (int j = 0; j < kDecodeBlockKeys; ++j) {
      const Vec key = in_register(load_f32(k[j] + d));
      for (int i = 0; i < MR; ++i)
        acc[i * kDecodeBlockKeys + j] = at::vec::fmadd(queries[i], key, acc[i * kDecodeBlockKeys + j]);
    }
  }
  float sums[N];
  block_sums<N>(acc, sums);
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kDecodeBlockKeys; ++j) {
      float sum = sums[i * kDecodeBlockKeys + j];
      for (int t = d; t < head_dim; ++t) sum += heads.query[i * head_dim + t] * static_cast<float>(k[j][t]);
      scores[i * kDecodeKeys + j] = sum;
    }
  }
}

// Scores into probabilities in place (entries ≥ count ignored); returns each head's rescale
// factor e^(old max − new max) for its accumulator, and updates max and sum.
template <int MR>
inline void decode_softmax(const DecodeHeads& heads, float* scores, int count, float* alpha) {
#if defined(CPU_CAPABILITY_AVX512)
  // The MR heads side by side, so their reductions' latencies overlap; entries past count are
  // masked to −inf in registers, and the max is the plain vmaxps (a NaN score makes its
  // probabilities NaN either way: exp(NaN − max), or every exp(s − NaN)).
  static_assert(kDecodeKeys == 2 * kVecSize, "two vectors of scores per head");
  const __mmask16 low_mask = count >= 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  const __mmask16 high_mask = count >= 32 ? 0xffff : count <= 16 ? 0 : static_cast<__mmask16>((1u << (count - 16)) - 1);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 low[MR], high[MR];
  float new_max[MR];
  for (int i = 0; i < MR; ++i) {
    low[i] = _mm512_mask_loadu_ps(neg_inf, low_mask, scores + i * kDecodeKeys);
    high[i] = _mm512_mask_loadu_ps(neg_inf, high_mask, scores + i * kDecodeKeys + 16);
  }
  for (int i = 0; i < MR; ++i)
    new_max[i] = std::max(heads.max[i], _mm512_reduce_max_ps(_mm512_max_ps(low[i], high[i])));
  for (int i = 0; i < MR; ++i) {
    const Vec shift(new_max[i]);
    const Vec p_low = (Vec(low[i]) - shift).exp_u20(), p_high = (Vec(high[i]) - shift).exp_u20();
    p_low.store(scores + i * kDecodeKeys);
    p_high.store(scores + i * kDecodeKeys + 16);
    alpha[i] = std::exp(heads.max[i] - new_max[i]);  // 0 on the first tile (max was −inf)
    heads.sum[i] = heads.sum[i] * alpha[i] + _mm512_reduce_add_ps(p_low + p_high);
    heads.max[i] = new_max[i];
  }
#else
  for (int i = 0; i < MR; ++i) {
    float* s = scores + i * kDecodeKeys;
    std::fill(s + count, s + kDecodeKeys, kNegInf);
    Vec vmax(kNegInf);
    for (int c = 0; c < kDecodeKeys; c += kVecSize) vmax = at::vec::maximum(vmax, Vec::loadu(s + c));
    const float new_max = std::max(heads.max[i], reduce_max(vmax));
    const Vec shift(new_max);
    Vec vsum(0.f);
    for (int c = 0; c < kDecodeKeys; c += kVecSize) {
      const Vec p = (Vec::loadu(s + c) - shift).exp_u20();
      p.store(s + c);
      vsum = vsum + p;
    }
    alpha[i] = std::exp(heads.max[i] - new_max);  // 0 on the first tile (max was −inf)
    heads.sum[i] = heads.sum[i] * alpha[i] + reduce_sum(vsum);
    heads.max[i] = new_max;
  }
#endif
}

// acc_i[d0, d0 + DR vectors) ← alpha_i · acc_i + Σ_n p_i[n] · v_n for MR heads and count keys.
template <int MR, int DR, typename kv_t>
inline void decode_values(const DecodeHeads& heads, const float* p, const float* alpha, const kv_t* const* v,
                          int count, int d0) {
  Vec sum[MR][DR];
  for (int i = 0; i < MR; ++i) {
    const Vec factor(alpha[i]);
    for (int r = 0; r < DR; ++r) sum[i][r] = Vec::loadu(heads.acc + i * heads.head_dim + d0 + r * kVecSize) * factor;
  }
  for (int n = 0; n < count; ++n) {
    Vec weight[MR];
    for (int i = 0; i < MR; ++i) weight[i] = Vec(p[i * kDecodeKeys + n]);
    for (int r = 0; r < DR; ++r) {
      const Vec value = in_register(load_f32(v[n] + d0 + r * kVecSize));
      for (int i = 0; i < MR; ++i) sum[i][r] = at::vec::fmadd(weight[i], value, sum[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < DR; ++r) sum[i][r].store(heads.acc + i * heads.head_dim + d0 + r * kVecSize);
}

// The P·V pass over all of head_dim: blocks of DR vectors (12 accumulators at most), then
// single vectors, then scalar tails.
template <int MR, typename kv_t>
inline void decode_accumulate(const DecodeHeads& heads, const float* p, const float* alpha, const kv_t* const* v,
                              int count) {
  constexpr int DR = MR == 1 ? 8 : 4;
  const int head_dim = heads.head_dim;
  const int num_vecs = head_dim / kVecSize;
  int r = 0;
  for (; r + DR <= num_vecs; r += DR) decode_values<MR, DR>(heads, p, alpha, v, count, r * kVecSize);
  for (; r < num_vecs; ++r) decode_values<MR, 1>(heads, p, alpha, v, count, r * kVecSize);
  for (int i = 0; i < MR; ++i) {
    float* a = heads.acc + i * head_dim;
    for (int t = num_vecs * kVecSize; t < head_dim; ++t) {
      float total = a[t] * alpha[i];
      for (int n = 0; n < count; ++n) total += p[i * kDecodeKeys + n] * static_cast<float>(v[n][t]);
      a[t] = total;
    }
  }
}

// MR heads attend count ≤ kDecodeKeys keys (rows k[n], v[n]); the lines of `next` are
// prefetched a few per score block, so they overlap with the work instead of stalling on it.
template <int MR, typename kv_t>
inline void decode_tile(const DecodeHeads& heads, const kv_t* const* k, const kv_t* const* v, int count,
                        const NextRows& next) {
  float scores[MR * kDecodeKeys];
  const int64_t lines_per_row = (next.bytes + 63) / 64;
  const int64_t lines = next.count * lines_per_row;
  for (int j = 0; j < count; j += kDecodeBlockKeys) {
    const int64_t first = lines * j / count;
    const int64_t end = lines * std::min(count, j + kDecodeBlockKeys) / count;
    prefetch_lines(next.keys, lines_per_row, first, end);
    prefetch_lines(next.values, lines_per_row, first, end);
    const kv_t* block[kDecodeBlockKeys];  // a short last block repeats its last key (ignored)
    for (int b = 0; b < kDecodeBlockKeys; ++b) block[b] = k[std::min(j + b, count - 1)];
#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
    if constexpr (std::is_same_v<kv_t, c10::BFloat16>) {
      if (heads.query_bf16 != nullptr) {
        decode_scores_dot<MR>(heads, block, scores + j);
        continue;
      }
    }
#endif
    decode_scores<MR>(heads, block, scores + j);
  }
  float alpha[MR];
  decode_softmax<MR>(heads, scores, count, alpha);
#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
  if constexpr (std::is_same_v<kv_t, c10::BFloat16>) {
    if (heads.query_bf16 != nullptr) return decode_accumulate_dot<MR>(heads, scores, alpha, v, count);
  }
#endif
  decode_accumulate<MR>(heads, scores, alpha, v, count);
}

// Row `first` of the tile's bfloat16 query where decode_scores_dot can take it, else nullptr.
inline const c10::BFloat16* dot_query(const FlashTile& tile, int first) {
  if (!kDecodeScoresDot || tile.head_dim() % kDotDims != 0) return nullptr;
  return tile.bf16_query(first);
}

// One head group's heads in passes of ≤ kDecodeHeads, sized evenly (4 → 2 + 2, 7 → 3 + 2 + 2).
template <typename kv_t>
inline void decode_group(FlashTile& tile, const kv_t* const* k, const kv_t* const* v, int count,
                         const NextRows& next) {
  const int rows = tile.num_rows();
  const int passes = (rows + kDecodeHeads - 1) / kDecodeHeads;
  for (int pass = 0, first = 0; pass < passes; ++pass) {
    const int end = rows * (pass + 1) / passes;
    const DecodeHeads heads{tile.query(first), tile.mutable_acc(first), tile.mutable_max() + first,
                            tile.mutable_sum() + first, tile.head_dim(), dot_query(tile, first), tile.scale()};
    const NextRows ahead = pass == 0 ? next : NextRows{nullptr, nullptr, 0, 0};
    switch (end - first) {
      case 1: decode_tile<1>(heads, k, v, count, ahead); break;
      case 2: decode_tile<2>(heads, k, v, count, ahead); break;
      default: decode_tile<3>(heads, k, v, count, ahead); break;
    }
    first = end;
  }
}

// Decode rows: attends keys [key_begin, key_end) for `num_groups` consecutive head groups, each
// FlashTile holding one query token's heads of a group (every key visible), kDecodeKeys keys at
// a time, so each token's rows of all those kv heads (adjacent in memory) are read in one sweep.
template <typename Keys>
inline void attend_decode(FlashTile* tiles, int num_groups, const Keys& keys, int64_t key_begin,
                          int64_t key_end) {
  using kv_t = typename Keys::value_type;
  // The next tile's rows of every group (one stripe per token), prefetched a slice per group.
  const int64_t stripe_bytes =
      ((num_groups - 1) * keys.head_stride + tiles[0].head_dim()) * static_cast<int64_t>(sizeof(kv_t));
  const kv_t* k_src[2][kDecodeKeys];  // group 0's rows of this tile and of the next
  const kv_t* v_src[2][kDecodeKeys];
  const kv_t* k_group[kDecodeKeys];
  const kv_t* v_group[kDecodeKeys];
  int current = 0;
  int count = static_cast<int>(std::min<int64_t>(kDecodeKeys, key_end - key_begin));
  keys.fill(key_begin, count, k_src[0], v_src[0]);
  for (int64_t begin = key_begin; begin < key_end; begin += kDecodeKeys) {
    const int next = 1 - current;
    const int next_count = static_cast<int>(std::clamp<int64_t>(key_end - begin - kDecodeKeys, 0, kDecodeKeys));
    if (next_count > 0) keys.fill(begin + kDecodeKeys, next_count, k_src[next], v_src[next]);
    for (int g = 0; g < num_groups; ++g) {
      const int first = next_count * g / num_groups;
      const NextRows ahead{reinterpret_cast<const void* const*>(k_src[next] + first),
                           reinterpret_cast<const void* const*>(v_src[next] + first),
                           next_count * (g + 1) / num_groups - first, stripe_bytes};
      for (int n = 0; n < count; ++n) {
        k_group[n] = k_src[current][n] + g * keys.head_stride;
        v_group[n] = v_src[current][n] + g * keys.head_stride;
      }
      decode_group(tiles[g], k_group, v_group, count, ahead);
    }
    current = next;
    count = next_count;
  }
}

}  // namespace mmserve::attention
