// Varlen (vision-tower) attention in bfloat16 on AMX tiles, for AMX builds (MMSERVE_AMX):
// bidirectional within each packed segment, online softmax in float32.
//
// The packs of varlen_attention_pack.h are AMX's B operands as they stand: 16 pairs of a key
// panel are a B tile of q · kᵀ (pairs along head_dim, head_dim padded to whole tiles with zero
// pairs), 16 key pairs of a value column panel a B tile of p · v. A block of up to 32 query rows
// runs over blocks of up to 128 keys, in amx::configure's 2 × 2 arrangement of tiles:
//   1. scores: 32 rows × 2 key panels per four C tiles, over head_dim 32 at a time (A: the rows,
//      from a zero-padded copy), stored to L1;
//   2. softmax in AVX-512 (base 2, running max and lane-wise normaliser in float32,
//      probabilities rounded to bfloat16 as torch's flash kernel does), rescaling a row's output
//      sums where its max rose; the next key block's scores are made between its rows;
//   3. output: the float32 sums of 32 rows × 2 column panels loaded into four C tiles, plus
//      probabilities (A, 32 keys per tile) · value panels (B), stored back.
// Moving a tile between the registers and L1 costs about as much as a product on these cores (a
// 2-core Emerald Rapids), so blocks are as large as the registers and L1 allow: per 128 keys a
// block makes 64 products (head_dim 64) for 24 tile stores and 72 loads. Work: one task per
// kTaskRows query rows of a (segment, head); tiles are configured per task and released after it
// (oneDNN, in the same thread, configures its own).
#include "kernels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT) && defined(MMSERVE_AMX)
#include <algorithm>
#include <cmath>
#include <limits>

#include "amx.h"
#include "exp2_avx512.h"
#include "varlen_attention_pack.h"

namespace mmserve {
namespace {

using namespace varlen;
constexpr int64_t kTaskRows = 64;
constexpr int64_t kMaxKeys = 2 * kBlockKeys;  // keys per block: 128, or 64 at a segment's end
constexpr int64_t kScoresBytes = kMaxKeys * sizeof(float);
constexpr int64_t kProbsBytes = kMaxKeys * sizeof(BFloat16);
constexpr int64_t kTileKeys = amx::kTileDepth;  // keys per A tile of probabilities

// Sets MXCSR's flush-to-zero and denormals-are-zero for its lifetime: the softmax's tiny
// exponentials and rescaled sums become 0 instead of denormals (which can cost Intel cores a
// microcode assist each), as exp2_flushed relies on; the tiles flush bfloat16 denormals anyway.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
  unsigned saved_;
};

// The running state of a block of query rows; ~88 KB, one per task.
struct RowBlock {
  int rows;                                                 // ≤ 32
  alignas(64) BFloat16 q[amx::kBlockRows * kMaxHeadDim];    // [rows][2 · pairs], zero past head_dim
  alignas(64) float out[amx::kBlockRows * kMaxHeadDim];     // [rows][width] output sums
  alignas(64) float scores[2][amx::kBlockRows * kMaxKeys];  // [rows][128]: this key block's, the next's
  alignas(64) BFloat16 probs[amx::kBlockRows * kMaxKeys];   // [rows][128]
  float max[amx::kBlockRows];                               // in raw score units
  __m512 sum[amx::kBlockRows];                              // normaliser, 16 lane sums per row
};

// The products of one key block's scores, scores [rows][0, keys) = q · keys [block, block +
// keys)ᵀ (unscaled), cut into steps of up to four tdpbf16ps (32 rows × two key panels × 32 of
// head_dim) that the softmax of the previous block runs between its rows. On a 2-core Emerald
// Rapids this took the mid model's 4,096-patch image from 0.89-0.90x SDPA's time (all scores
// first) to 0.62-0.66x on one thread, though the tiles and the vector units did not overlap in
// a microbenchmark there: a tile store is then long done when the softmax loads its scores.
template <bool kSecondRows>
class ScoreSteps {
 public:
  ScoreSteps(const RowBlock& b, const Packed& packed, const Shape& shape, int64_t block, int64_t keys, float* scores)
      : q0_(b.q),
        q1_(b.q + amx::kTileRows * 2 * shape.pairs),
        q_bytes_(shape.pairs * 2 * sizeof(BFloat16)),
        panels_(packed.keys + (block / kLanes) * shape.pairs * 2 * kLanes),
        panel_stride_(shape.pairs * 2 * kLanes),
        depth_steps_(shape.pairs / (amx::kTileDepth / 2)),
        total_(keys / (2 * kLanes) * depth_steps_),
        scores_(scores) {}

  int64_t total() const { return total_; }

  // Runs the steps before `end` (≤ total()) not yet run.
  void run_until(int64_t end) {
    for (; next_ < end; ++next_) step(next_);
  }

 private:
  void step(int64_t i) {
    const int64_t key = i / depth_steps_ * 2 * kLanes, depth = i % depth_steps_;
    const int64_t pair = depth * amx::kTileDepth / 2;
    if (depth == 0) {
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (kSecondRows) {
        _tile_zero(2);
        _tile_zero(3);
      }
    }
    const BFloat16* panel = panels_ + (key / kLanes) * panel_stride_ + pair * 2 * kLanes;
    _tile_loadd(4, q0_ + 2 * pair, q_bytes_);
    _tile_loadd(6, panel, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, panel + panel_stride_, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kSecondRows) {
      _tile_loadd(5, q1_ + 2 * pair, q_bytes_);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (depth + 1 < depth_steps_) return;
    float* scores = scores_ + key;
    _tile_stored(0, scores, kScoresBytes);
    _tile_stored(1, scores + kLanes, kScoresBytes);
    if constexpr (kSecondRows) {
      _tile_stored(2, scores + amx::kTileRows * kMaxKeys, kScoresBytes);
      _tile_stored(3, scores + amx::kTileRows * kMaxKeys + kLanes, kScoresBytes);
    }
  }

  const BFloat16 *q0_, *q1_;
  int64_t q_bytes_;
  const BFloat16* panels_;
  int64_t panel_stride_, depth_steps_, total_;
  float* scores_;
  int64_t next_ = 0;
};

// Each row's scores over the block's kVecs · 16 keys (keys past the segment's `valid` masked)
// into bfloat16 probabilities, computed in base 2 (e^(scale · (s − max)) = 2^(scale · log2 e ·
// (s − max))), updating its max and normaliser; where the max rose, its output sums are rescaled
// by the same factor for the old max (0 on the first block) before this block's products are
// added to them. After row r, `next` runs its share of the next block's score steps.
template <int kVecs, bool kSecondRows>
void block_softmax(RowBlock& b, const float* scores, int64_t width, int64_t valid, float scale,
                   ScoreSteps<kSecondRows>& next) {
  const float factor = scale * kLog2E;
  const __m512 factors = _mm512_set1_ps(factor);
  __mmask16 keep[kVecs];
  for (int t = 0; t < kVecs; ++t) {
    const int64_t lanes = std::clamp<int64_t>(valid - t * kLanes, 0, kLanes);
    keep[t] = lanes == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << lanes) - 1);
  }
  for (int r = 0; r < b.rows; ++r) {
    __m512 x[kVecs];
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int t = 0; t < kVecs; ++t) {
      x[t] = _mm512_load_ps(scores + r * kMaxKeys + t * kLanes);
      m = _mm512_mask_max_ps(m, keep[t], m, x[t]);
    }
    const float old_max = b.max[r];
    const bool max_rises = _mm512_cmp_ps_mask(m, _mm512_set1_ps(old_max), _CMP_GT_OQ) != 0;
    const float new_max = max_rises ? _mm512_reduce_max_ps(m) : old_max;
    const __m512 shift = _mm512_set1_ps(new_max * factor);
    __m512 total = _mm512_setzero_ps();
    for (int t = 0; t < kVecs; ++t) {
      x[t] = exp2_flushed(_mm512_fmsub_ps(x[t], factors, shift), keep[t]);
      total = _mm512_add_ps(total, x[t]);
    }
    if (max_rises) {
      const __m512 alpha = _mm512_set1_ps(std::exp2((old_max - new_max) * factor));
      b.sum[r] = _mm512_fmadd_ps(b.sum[r], alpha, total);
      float* out = b.out + r * width;
      for (int64_t d = 0; d < width; d += kLanes) _mm512_store_ps(out + d, _mm512_mul_ps(_mm512_load_ps(out + d), alpha));
    } else {
      b.sum[r] = _mm512_add_ps(b.sum[r], total);
    }
    b.max[r] = new_max;
    BFloat16* row = b.probs + r * kMaxKeys;
    for (int t = 0; t < kVecs; t += 2)  // 32 probabilities, in order, per instruction
      _mm512_store_si512(row + t * kLanes, (__m512i)_mm512_cvtne2ps_pbh(x[t + 1], x[t]));
    next.run_until(next.total() * (r + 1) / b.rows);
  }
}

// out [rows][column panels c, c + 1 (if kSecondPanel)] += probs [rows][0, keys) · the values of
// keys [block, block + keys).
template <bool kSecondRows, bool kSecondPanel>
void block_values_pair(RowBlock& b, const Packed& packed, const Shape& shape, int64_t block, int64_t keys,
                       int64_t c) {
  const int64_t width = shape.column_panels * kLanes;
  const int64_t out_bytes = width * sizeof(float);
  const int64_t pair_stride = shape.column_panels * 2 * kLanes;  // elements per key pair
  const int64_t pair_bytes = pair_stride * sizeof(BFloat16);
  float* out0 = b.out + c * kLanes;
  float* out1 = out0 + amx::kTileRows * width;
  _tile_loadd(0, out0, out_bytes);
  if constexpr (kSecondPanel) _tile_loadd(1, out0 + kLanes, out_bytes);
  if constexpr (kSecondRows) _tile_loadd(2, out1, out_bytes);
  if constexpr (kSecondRows && kSecondPanel) _tile_loadd(3, out1 + kLanes, out_bytes);
  const BFloat16* values = packed.values + (block / 2) * pair_stride + c * 2 * kLanes;
  for (int64_t key = 0; key < keys; key += kTileKeys) {
    const BFloat16* panels = values + (key / 2) * pair_stride;
    _tile_loadd(4, b.probs + key, kProbsBytes);
    _tile_loadd(6, panels, pair_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kSecondPanel) {
      _tile_loadd(7, panels + 2 * kLanes, pair_bytes);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kSecondRows) {
      _tile_loadd(5, b.probs + amx::kTileRows * kMaxKeys + key, kProbsBytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kSecondPanel) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out0, out_bytes);
  if constexpr (kSecondPanel) _tile_stored(1, out0 + kLanes, out_bytes);
  if constexpr (kSecondRows) _tile_stored(2, out1, out_bytes);
  if constexpr (kSecondRows && kSecondPanel) _tile_stored(3, out1 + kLanes, out_bytes);
}

template <bool kSecondRows>
void block_values(RowBlock& b, const Packed& packed, const Shape& shape, int64_t block, int64_t keys) {
  int64_t c = 0;
  for (; c + 1 < shape.column_panels; c += 2)
    block_values_pair<kSecondRows, true>(b, packed, shape, block, keys, c);
  if (c < shape.column_panels) block_values_pair<kSecondRows, false>(b, packed, shape, block, keys, c);
}

// The block's rows (tiles configured for them) over all the segment's keys: blocks of 128 keys
// (64 at the end), each block's scores made during the previous block's softmax.
template <bool kSecondRows>
void attend_keys(RowBlock& b, const Packed& packed, const Shape& shape, int64_t num_keys, float scale) {
  const int64_t width = shape.column_panels * kLanes;
  const auto keys_from = [&](int64_t block) { return std::clamp<int64_t>(shape.padded_keys - block, 0, kMaxKeys); };
  ScoreSteps<kSecondRows> first(b, packed, shape, 0, keys_from(0), b.scores[0]);
  first.run_until(first.total());
  for (int64_t block = 0, current = 0; block < shape.padded_keys; block += kMaxKeys, current ^= 1) {
    const int64_t keys = keys_from(block);
    ScoreSteps<kSecondRows> next(b, packed, shape, block + keys, keys_from(block + keys), b.scores[current ^ 1]);
    if (keys == kMaxKeys) block_softmax<kMaxKeys / kLanes>(b, b.scores[current], width, num_keys - block, scale, next);
    else block_softmax<kBlockKeys / kLanes>(b, b.scores[current], width, num_keys - block, scale, next);
    next.run_until(next.total());
    block_values<kSecondRows>(b, packed, shape, block, keys);
  }
}

// Query rows [first, first + rows) of the segment (rows ≤ 32) over all its keys, written to out.
void attend_block(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                  const Packed& packed, const Shape& shape, int64_t first, RowBlock& b) {
  const int64_t padded_dim = 2 * shape.pairs;
  const int64_t width = shape.column_panels * kLanes;
  for (int r = 0; r < b.rows; ++r) {
    const BFloat16* row = static_cast<const BFloat16*>(args.query.data) +
                          (segment.query_begin + first + r) * args.query.token_stride + head * args.query.head_stride;
    std::copy(row, row + shape.head_dim, b.q + r * padded_dim);
    std::fill(b.q + r * padded_dim + shape.head_dim, b.q + (r + 1) * padded_dim, BFloat16(0.f));
  }
  std::fill(b.out, b.out + b.rows * width, 0.f);
  std::fill(b.max, b.max + b.rows, -std::numeric_limits<float>::infinity());
  std::fill(b.sum, b.sum + b.rows, _mm512_setzero_ps());
  if (b.rows > amx::kTileRows) attend_keys<true>(b, packed, shape, segment.num_queries, args.scale);
  else attend_keys<false>(b, packed, shape, segment.num_queries, args.scale);
  for (int r = 0; r < b.rows; ++r) {
    BFloat16* out = static_cast<BFloat16*>(args.out.data) + (segment.query_begin + first + r) * args.out.token_stride +
                    head * args.out.head_stride;
    const float inverse = 1.f / _mm512_reduce_add_ps(b.sum[r]);
    for (int64_t d = 0; d < shape.head_dim; ++d) out[d] = BFloat16(b.out[r * width + d] * inverse);
  }
}

void attend_rows(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                 const Packed& packed, const Shape& shape, int64_t begin, int64_t end) {
  const FlushDenormals flush;
  RowBlock b;
  b.rows = 0;
  for (int64_t row = begin; row < end; row += amx::kBlockRows) {
    const int rows = static_cast<int>(std::min(amx::kBlockRows, end - row));
    if (rows != b.rows) {
      amx::configure(std::min<int>(rows, amx::kTileRows), std::max<int>(rows - amx::kTileRows, 0));
      b.rows = rows;
    }
    attend_block(args, segment, head, packed, shape, row, b);
  }
  _tile_release();
}

}  // namespace

bool varlen_attention_amx(const VarlenAttentionArgs& args) {
  if (!takes(args) || !amx::tiles_on()) return false;
  attend_tasks(args, amx::kTileDepth / 2, kTaskRows, attend_rows);
  return true;
}

}  // namespace mmserve

#else

namespace mmserve {
bool varlen_attention_amx(const VarlenAttentionArgs&) { return false; }
}  // namespace mmserve

#endif
