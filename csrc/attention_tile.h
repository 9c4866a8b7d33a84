// The inner loop of every attention kernel: a block of query rows attends a run of keys, one
// tile of keys at a time, with an online softmax (flash attention on a CPU core).
//
// Query rows are packed once into float32 (pre-multiplied by the softmax scale). Keys and
// values are read through row pointers, so a tile may span any number of cache blocks and no
// gathered copy of the context is made: float32 rows are read where they lie, bfloat16 rows are
// widened into a per-thread tile buffer first. Register-blocked micro-kernels compute
// scores = Q·Kᵀ (kRowBlock rows × kKeyBlock keys, dot products over head_dim) and acc += P·V
// (kRowBlock rows × kDimBlock vectors of head_dim), so each K/V row is loaded once per
// kRowBlock query rows; the query heads that share a kv head are rows of the same block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace mmserve::attention {

constexpr int kKeyTile = 64;  // keys per online-softmax step
constexpr int kRowBlock = 4;  // query rows per register block
constexpr int kKeyBlock = 4;  // keys per register block of the score kernel
constexpr int kDimBlock = 3;  // head_dim vectors per register block of the P·V kernel

// scores[i * lds + j] = q_i · k_j for MR query rows (row stride ldq) and kKeyBlock keys.
template <int MR>
inline void score_block(const float* q, int ldq, const float* const* k, int head_dim, float* scores,
                        int lds) {
  Vec acc[MR][kKeyBlock];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kKeyBlock; ++j) acc[i][j] = Vec(0.f);
  int d = 0;
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    Vec kv[kKeyBlock];
    for (int j = 0; j < kKeyBlock; ++j) kv[j] = Vec::loadu(k[j] + d);
    for (int i = 0; i < MR; ++i) {
      const Vec qv = Vec::loadu(q + i * ldq + d);
      for (int j = 0; j < kKeyBlock; ++j) acc[i][j] = at::vec::fmadd(qv, kv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kKeyBlock; ++j) {
      float sum = reduce_sum(acc[i][j]);
      for (int t = d; t < head_dim; ++t) sum += q[i * ldq + t] * k[j][t];
      scores[i * lds + j] = sum;
    }
  }
}

// acc_i[d0, d0 + DR * kVecSize) += Σ_n p_i[n] · v_n[same range] for MR rows.
template <int MR, int DR>
inline void pv_block(const float* p, int ldp, const float* const* v, int num_keys, float* acc, int lda,
                     int d0) {
  Vec sum[MR][DR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < DR; ++r) sum[i][r] = Vec::loadu(acc + i * lda + d0 + r * kVecSize);
  for (int n = 0; n < num_keys; ++n) {
    Vec vv[DR];
    for (int r = 0; r < DR; ++r) vv[r] = Vec::loadu(v[n] + d0 + r * kVecSize);
    for (int i = 0; i < MR; ++i) {
      const Vec weight(p[i * ldp + n]);
      for (int r = 0; r < DR; ++r) sum[i][r] = at::vec::fmadd(weight, vv[r], sum[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < DR; ++r) sum[i][r].store(acc + i * lda + d0 + r * kVecSize);
}

template <int MR>
inline void pv_rows(const float* p, int ldp, const float* const* v, int num_keys, float* acc, int lda,
                    int head_dim) {
  const int num_vecs = head_dim / kVecSize;
  int r = 0;
  for (; r + kDimBlock <= num_vecs; r += kDimBlock)
    pv_block<MR, kDimBlock>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  if (num_vecs - r == 2) pv_block<MR, 2>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  if (num_vecs - r == 1) pv_block<MR, 1>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  for (int n = 0; n < num_keys; ++n)
    for (int i = 0; i < MR; ++i)
      for (int t = num_vecs * kVecSize; t < head_dim; ++t) acc[i * lda + t] += p[i * ldp + n] * v[n][t];
}

// One work item's state: up to max_rows query rows, their float32 accumulators and their
// running max / sum. Kept per thread and reused across items and calls.
class FlashTile {
 public:
  void reset(int num_rows, int head_dim);

  // Packs query row i (head_dim elements of q_t) scaled by `scale`; `last_key` is the absolute
  // index of the last key it may see (causal limit; anything ≥ the run's end means "all").
  template <typename q_t>
  void set_query(int i, const q_t* src, float scale, int64_t last_key);

  // Attends keys [key_begin, key_end) read through `keys.fill(begin, count, k_rows, v_rows)`.
  template <typename Keys>
  void attend(const Keys& keys, int64_t key_begin, int64_t key_end);

  int num_rows() const { return num_rows_; }
  const float* acc(int i) const { return acc_.data() + static_cast<int64_t>(i) * head_dim_; }
  float row_max(int i) const { return max_[i]; }
  float row_sum(int i) const { return sum_[i]; }

  // Writes row i normalised by its softmax sum into dst (head_dim elements).
  template <typename out_t>
  void store_row(int i, out_t* dst) const;

 private:
  template <typename kv_t>
  void widen(const kv_t* const* rows, int count, std::vector<float>& buffer, const float** out) const;
  void scores(const float* const* k_rows, int count);
  void mask(int64_t tile_begin, int count);
  void softmax_update(int count);
  void accumulate(const float* const* v_rows, int count);

  int num_rows_ = 0;
  int head_dim_ = 0;
  std::vector<float> query_;   // [rows, head_dim], scaled
  std::vector<float> acc_;     // [rows, head_dim]
  std::vector<float> scores_;  // [rows, kKeyTile]: scores, then probabilities
  std::vector<float> max_, sum_, alpha_;
  std::vector<int64_t> last_key_;
  std::vector<float> k_buffer_, v_buffer_;  // [kKeyTile, head_dim] widened bfloat16 rows
};

inline void FlashTile::reset(int num_rows, int head_dim) {
  num_rows_ = num_rows;
  head_dim_ = head_dim;
  const int64_t padded_rows = (num_rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  query_.assign(padded_rows * head_dim, 0.f);
  acc_.assign(padded_rows * head_dim, 0.f);
  scores_.resize(padded_rows * kKeyTile);
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

inline void FlashTile::scores(const float* const* k_rows, int count) {
  const int rows = num_rows_;
  for (int j = 0; j < count; j += kKeyBlock) {
    for (int i = 0; i < rows; i += kRowBlock) {
      const float* q = query_.data() + static_cast<int64_t>(i) * head_dim_;
      float* s = scores_.data() + static_cast<int64_t>(i) * kKeyTile + j;
      switch (std::min(kRowBlock, rows - i)) {
        case 1: score_block<1>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile); break;
        case 2: score_block<2>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile); break;
        case 3: score_block<3>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile); break;
        default: score_block<4>(q, head_dim_, k_rows + j, head_dim_, s, kKeyTile); break;
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
  for (int i = 0; i < rows; i += kRowBlock) {
    const float* p = scores_.data() + static_cast<int64_t>(i) * kKeyTile;
    float* a = acc_.data() + static_cast<int64_t>(i) * head_dim_;
    switch (std::min(kRowBlock, rows - i)) {
      case 1: pv_rows<1>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      case 2: pv_rows<2>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      case 3: pv_rows<3>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
      default: pv_rows<4>(p, kKeyTile, v_rows, count, a, head_dim_, head_dim_); break;
    }
  }
}

template <typename Keys>
inline void FlashTile::attend(const Keys& keys, int64_t key_begin, int64_t key_end) {
  using kv_t = typename Keys::value_type;
  const kv_t* k_src[kKeyTile];
  const kv_t* v_src[kKeyTile];
  const float* k_rows[kKeyTile];
  const float* v_rows[kKeyTile];
  for (int64_t begin = key_begin; begin < key_end; begin += kKeyTile) {
    const int count = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - begin));
    keys.fill(begin, count, k_src, v_src);
    if constexpr (std::is_same_v<kv_t, float>) {
      std::copy(k_src, k_src + count, k_rows);
      std::copy(v_src, v_src + count, v_rows);
    } else {
      widen(k_src, count, k_buffer_, k_rows);
      widen(v_src, count, v_buffer_, v_rows);
    }
    // The score kernel works on whole key blocks: pad with copies of the last row (masked).
    const int padded = (count + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    std::fill(k_rows + count, k_rows + padded, k_rows[count - 1]);
    scores(k_rows, padded);
    mask(begin, count);
    softmax_update(count);
    accumulate(v_rows, count);
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
