// The inner loop of the attention kernels for prompt chunks and image segments (decode rows take
// attention_decode.h): a block of query rows attends a run of keys, one tile of keys at a time,
// with an online softmax (flash attention on a CPU core).
//
// Query rows are packed once into float32 (pre-multiplied by the softmax scale). Keys and
// values are read through row pointers, so a tile may span any number of cache blocks and no
// gathered copy of the context is made: float32 rows are read where they lie, bfloat16 rows are
// widened into a per-thread tile buffer first. Register-blocked micro-kernels compute
// scores = Q·Kᵀ and acc += P·V (attention_microkernels.h); the query heads that share a kv head
// are rows of the same tile, so each K/V row comes from memory once per head group. Items with
// few rows (a few query tokens) prefetch the next tile's rows while computing the current one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_microkernels.h"
#include "vec.h"

namespace mmserve::attention {

constexpr int kKeyTile = 64;          // keys per online-softmax step
constexpr int kPrefetchMaxRows = 16;  // items with more query rows per head group do not prefetch

// Rows of the next tile to prefetch, a few at a time while this tile's scores are computed
// (all at once would stall the core on its miss buffers instead of overlapping with work).
struct NextRows {
  const void* const* keys;
  const void* const* values;
  int count;
  int64_t bytes;  // from each row pointer on
};

// One head group's state: up to max_rows query rows, their float32 accumulators and their
// running max / sum. Kept per thread and reused across items and calls.
class FlashTile {
 public:
  void reset(int num_rows, int head_dim);

  // Packs query row i (head_dim elements of q_t) scaled by `scale`; `last_key` is the absolute
  // index of the last key it may see (causal limit; anything ≥ the run's end means "all").
  template <typename q_t>
  void set_query(int i, const q_t* src, float scale, int64_t last_key);

  // Attends one tile of count ≤ kKeyTile keys whose first has absolute index `begin`.
  template <typename kv_t>
  void attend_tile(const kv_t* const* k_src, const kv_t* const* v_src, int64_t begin, int count,
                   const NextRows& next);

  int num_rows() const { return num_rows_; }
  int head_dim() const { return head_dim_; }
  const float* acc(int i) const { return acc_.data() + static_cast<int64_t>(i) * head_dim_; }
  float row_max(int i) const { return max_[i]; }
  float row_sum(int i) const { return sum_[i]; }

  // The raw state, for the decode kernel (attention_decode.h), which keeps this layout.
  const float* query(int i) const { return query_.data() + static_cast<int64_t>(i) * head_dim_; }
  // Query row i as given (unscaled), where every row was set from bfloat16; else nullptr.
  const c10::BFloat16* bf16_query(int i) const {
    return bf16_rows_ == num_rows_ ? query_bf16_.data() + static_cast<int64_t>(i) * head_dim_ : nullptr;
  }
  float scale() const { return scale_; }
  float* mutable_acc(int i) { return acc_.data() + static_cast<int64_t>(i) * head_dim_; }
  float* mutable_max() { return max_.data(); }
  float* mutable_sum() { return sum_.data(); }

  // Writes row i normalised by its softmax sum into dst (head_dim elements).
  template <typename out_t>
  void store_row(int i, out_t* dst) const;

 private:
  template <typename kv_t>
  void widen(const kv_t* const* rows, int count, std::vector<float>& buffer, const float** out) const;
  void scores(const float* const* k_rows, int count, const NextRows& next);
  void mask(int64_t tile_begin, int count);
  void softmax_update(int count);
  void accumulate(const float* const* v_rows, int count);

  int num_rows_ = 0;
  int head_dim_ = 0;
  std::vector<float> query_;   // [rows, head_dim], scaled
  std::vector<c10::BFloat16> query_bf16_;  // [rows, head_dim], unscaled: rows set from bfloat16
  int bf16_rows_ = 0;
  float scale_ = 1.f;
  std::vector<float> acc_;     // [rows, head_dim]
  std::vector<float> scores_;  // [rows, kKeyTile]: scores, then probabilities
  std::vector<float> max_, sum_, alpha_;
  std::vector<int64_t> last_key_;
  std::vector<float> k_buffer_, v_buffer_;  // [kKeyTile, head_dim] widened bfloat16 rows
};

inline void FlashTile::reset(int num_rows, int head_dim) {
  num_rows_ = num_rows;
  head_dim_ = head_dim;
  query_.assign(static_cast<int64_t>(num_rows) * head_dim, 0.f);
  query_bf16_.resize(static_cast<int64_t>(num_rows) * head_dim);
  bf16_rows_ = 0;
  acc_.assign(static_cast<int64_t>(num_rows) * head_dim, 0.f);
  scores_.resize(static_cast<int64_t>(num_rows) * kKeyTile);
  max_.assign(num_rows, kNegInf);
  sum_.assign(num_rows, 0.f);
  alpha_.resize(num_rows);
  last_key_.resize(num_rows);
}

template <typename q_t>
inline void FlashTile::set_query(int i, const q_t* src, float scale, int64_t last_key) {
  float* dst = query_.data() + static_cast<int64_t>(i) * head_dim_;
  const Vec factor(scale);
  int d = 0;
  for (; d + kVecSize <= head_dim_; d += kVecSize) (load_f32(src + d) * factor).store(dst + d);
  for (; d < head_dim_; ++d) dst[d] = static_cast<float>(src[d]) * scale;
  if constexpr (std::is_same_v<q_t, c10::BFloat16>) {
    std::copy(src, src + head_dim_, query_bf16_.data() + static_cast<int64_t>(i) * head_dim_);
    ++bf16_rows_;
  }
  scale_ = scale;
  last_key_[i] = last_key;
}

template <typename kv_t>
inline void FlashTile::widen(const kv_t* const* rows, int count, std::vector<float>& buffer,
                             const float** out) const {
  buffer.resize(static_cast<int64_t>(kKeyTile) * head_dim_);
  for (int n = 0; n < count; ++n) {
    float* dst = buffer.data() + static_cast<int64_t>(n) * head_dim_;
    int d = 0;
    for (; d + kVecSize <= head_dim_; d += kVecSize) load_f32(rows[n] + d).store(dst + d);
    for (; d < head_dim_; ++d) dst[d] = static_cast<float>(rows[n][d]);
    out[n] = dst;
  }
}

inline void FlashTile::scores(const float* const* k_rows, int count, const NextRows& next) {
  const int rows = num_rows_;
  // The next rows' lines, spread evenly over this tile's key blocks.
  const int64_t lines_per_row = (next.bytes + 63) / 64;
  const int64_t lines = next.count * lines_per_row;
  const int key_blocks = count / kScoreKeys;
  for (int j = 0; j < count; j += kScoreKeys) {
    const int64_t first = lines * (j / kScoreKeys) / key_blocks;
    const int64_t end = lines * (j / kScoreKeys + 1) / key_blocks;
    prefetch_lines(next.keys, lines_per_row, first, end);
    prefetch_lines(next.values, lines_per_row, first, end);
    for (int i = 0; i < rows; i += kScoreRows) {
      const float* q = query_.data() + static_cast<int64_t>(i) * head_dim_;
      float* s = scores_.data() + static_cast<int64_t>(i) * kKeyTile + j;
      if (rows - i >= 2) {
        score_block<2>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile);
      } else {
        score_block<1>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile);
      }
    }
  }
}

// -inf for keys past each row's causal limit and for the padding columns of a short tile.
inline void FlashTile::mask(int64_t tile_begin, int count) {
  const int padded = (count + kVecSize - 1) / kVecSize * kVecSize;
  for (int i = 0; i < num_rows_; ++i) {
    const int64_t visible = std::clamp<int64_t>(last_key_[i] - tile_begin + 1, 0, count);
    std::fill(scores_.data() + static_cast<int64_t>(i) * kKeyTile + visible,
              scores_.data() + static_cast<int64_t>(i) * kKeyTile + padded, kNegInf);
  }
}

inline void FlashTile::softmax_update(int count) {
  const int num_vecs = (count + kVecSize - 1) / kVecSize;
  for (int i = 0; i < num_rows_; ++i) {
    float* s = scores_.data() + static_cast<int64_t>(i) * kKeyTile;
    Vec vmax(kNegInf);
    for (int c = 0; c < num_vecs; ++c) vmax = at::vec::maximum(vmax, Vec::loadu(s + c * kVecSize));
    const float new_max = std::max(max_[i], reduce_max(vmax));
    if (new_max == kNegInf) {  // nothing visible yet: contributes nothing, changes nothing
      std::fill(s, s + num_vecs * kVecSize, 0.f);
      alpha_[i] = 1.f;
      continue;
    }
    const Vec shift(new_max);
    Vec vsum(0.f);
    for (int c = 0; c < num_vecs; ++c) {
      const Vec p = (Vec::loadu(s + c * kVecSize) - shift).exp_u20();
      p.store(s + c * kVecSize);
      vsum = vsum + p;
    }
    alpha_[i] = std::exp(max_[i] - new_max);
    sum_[i] = sum_[i] * alpha_[i] + reduce_sum(vsum);
    max_[i] = new_max;
  }
}

inline void FlashTile::accumulate(const float* const* v_rows, int count) {
  const int rows = num_rows_;
  for (int i = 0; i < rows; ++i) {
    if (alpha_[i] == 1.f) continue;
    float* a = acc_.data() + static_cast<int64_t>(i) * head_dim_;
    const Vec factor(alpha_[i]);
    int d = 0;
    for (; d + kVecSize <= head_dim_; d += kVecSize) (Vec::loadu(a + d) * factor).store(a + d);
    for (; d < head_dim_; ++d) a[d] *= alpha_[i];
  }
  for (int i = 0; i < rows; i += kValueRows) {
    const float* p = scores_.data() + static_cast<int64_t>(i) * kKeyTile;
    float* a = acc_.data() + static_cast<int64_t>(i) * head_dim_;
    switch (std::min(kValueRows, rows - i)) {
      case 1: pv_rows<1>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      case 2: pv_rows<2>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      case 3: pv_rows<3>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      default: pv_rows<4>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
    }
  }
}

template <typename kv_t>
inline void FlashTile::attend_tile(const kv_t* const* k_src, const kv_t* const* v_src, int64_t begin, int count,
                                   const NextRows& next) {
  const float* k_rows[kKeyTile];
  const float* v_rows[kKeyTile];
  if constexpr (std::is_same_v<kv_t, float>) {
    std::copy(k_src, k_src + count, k_rows);
    std::copy(v_src, v_src + count, v_rows);
  } else {
    widen(k_src, count, k_buffer_, k_rows);
    widen(v_src, count, v_buffer_, v_rows);
  }
  // The score kernel works on whole key blocks: pad with copies of the last row (masked).
  const int padded = (count + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  std::fill(k_rows + count, k_rows + padded, k_rows[count - 1]);
  scores(k_rows, padded, next);
  mask(begin, count);
  softmax_update(count);
  accumulate(v_rows, count);
}

// Attends keys [key_begin, key_end) for `num_groups` consecutive head groups, tile by tile, so
// each token's rows of all those kv heads (adjacent in memory) are read in one sweep. `keys`
// gives the first group's rows (fill) and the distance to the next group's (head_stride).
template <typename Keys>
inline void attend(FlashTile* tiles, int num_groups, const Keys& keys, int64_t key_begin, int64_t key_end) {
  using kv_t = typename Keys::value_type;
  const int64_t stripe_bytes =
      ((num_groups - 1) * keys.head_stride + tiles[0].head_dim()) * static_cast<int64_t>(sizeof(kv_t));
  // Only memory-bound items (few query rows, e.g. decode) prefetch: larger ones find the keys
  // in cache, having been read for the previous query tile.
  const bool prefetch = tiles[0].num_rows() <= kPrefetchMaxRows;
  const kv_t* k_src[2][kKeyTile];  // group 0's rows of this tile and of the next
  const kv_t* v_src[2][kKeyTile];
  const kv_t* k_group[kKeyTile];
  const kv_t* v_group[kKeyTile];
  int current = 0;
  int count = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - key_begin));
  keys.fill(key_begin, count, k_src[0], v_src[0]);
  for (int64_t begin = key_begin; begin < key_end; begin += kKeyTile) {
    const int64_t next_begin = begin + kKeyTile;
    const int next_count = static_cast<int>(std::clamp<int64_t>(key_end - next_begin, 0, kKeyTile));
    const int next = 1 - current;
    if (next_count > 0) keys.fill(next_begin, next_count, k_src[next], v_src[next]);
    const int prefetch_count = prefetch ? next_count : 0;
    for (int g = 0; g < num_groups; ++g) {
      const int first = prefetch_count * g / num_groups;  // each group prefetches a slice of the stripes
      const NextRows ahead{reinterpret_cast<const void* const*>(k_src[next] + first),
                           reinterpret_cast<const void* const*>(v_src[next] + first),
                           prefetch_count * (g + 1) / num_groups - first, stripe_bytes};
      for (int n = 0; n < count; ++n) {
        k_group[n] = k_src[current][n] + g * keys.head_stride;
        v_group[n] = v_src[current][n] + g * keys.head_stride;
      }
      tiles[g].attend_tile(k_group, v_group, begin, count, ahead);
    }
    current = next;
    count = next_count;
  }
}

template <typename out_t>
inline void FlashTile::store_row(int i, out_t* dst) const {
  const float* a = acc(i);
  const float inv = 1.f / sum_[i];
  const Vec factor(inv);
  int d = 0;
  for (; d + kVecSize <= head_dim_; d += kVecSize) store_f32(dst + d, Vec::loadu(a + d) * factor);
  for (; d < head_dim_; ++d) dst[d] = static_cast<out_t>(a[d] * inv);
}

}  // namespace mmserve::attention
