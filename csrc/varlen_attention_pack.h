// What the bfloat16 varlen (vision-tower) attention kernels share (AVX512-BF16 builds): each
// (segment, head)'s keys and values packed once into K-pair panels, and the split of the queries
// into tasks.
//
// - Keys: panels of 16 keys (panel b, pair p: words c = (k[16b + c][2p], k[16b + c][2p + 1])),
//   so one zmm of scores is `pairs` vdpbf16ps, and 16 pairs of a panel are exactly AMX's B tile
//   for q · kᵀ. `pairs` may exceed head_dim / 2 (AMX reads 16 pairs at a time): those are zero.
// - Values: per key pair j and column panel c of head_dim, words (v[2j][16c + t], v[2j + 1][16c
//   + t]): the B operand of p · v, pairs along the keys. Columns past head_dim are zero.
// Keys past a segment's end pad it to whole blocks of kBlockKeys: zero in both packs, their
// scores masked to −inf.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"

namespace mmserve {
namespace varlen {

using BFloat16 = c10::BFloat16;
constexpr int kLanes = 16;                      // float32 lanes of a zmm: keys per score vector
constexpr int kScoreVecs = 4;                   // score vectors per row and block
constexpr int kBlockKeys = kLanes * kScoreVecs;  // keys per online-softmax step
constexpr int64_t kMaxHeadDim = 256;

inline int32_t load_pair(const BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// One (segment, head)'s packed keys and values.
struct Packed {
  const BFloat16* keys;    // [padded_keys / 16][pairs][16][2]
  const BFloat16* values;  // [padded_keys / 2][column_panels][16][2]
};

struct Shape {
  int64_t head_dim, pairs, column_panels, padded_keys;
};

inline void pack_keys_values(const VarlenAttentionArgs& args, const attention::Sequence& segment, int64_t head,
                             const Shape& shape, BFloat16* keys, BFloat16* values) {
  const BFloat16* key = static_cast<const BFloat16*>(args.key.data) + head * args.key.head_stride;
  const BFloat16* value = static_cast<const BFloat16*>(args.value.data) + head * args.value.head_stride;
  const int64_t num_keys = segment.num_queries;
  const int64_t head_pairs = shape.head_dim / 2;
  // Keys: per panel of 16 keys and pair p, the 16 keys' words p gathered into one zmm (keys past
  // the segment and pairs past head_dim are zero).
  const __m512i key_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(static_cast<int>(args.key.token_stride * 2)));
  for (int64_t first = 0; first < shape.padded_keys; first += kLanes) {
    const int64_t present = std::clamp<int64_t>(num_keys - first, 0, kLanes);
    const __mmask16 rows = present == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << present) - 1);
    const BFloat16* base = key + (segment.query_begin + first) * args.key.token_stride;
    BFloat16* panel = keys + (first / kLanes) * shape.pairs * 2 * kLanes;
    for (int64_t p = 0; p < shape.pairs; ++p) {
      const __m512i words = p < head_pairs ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, key_offsets, base + 2 * p, 1)
                                           : _mm512_setzero_si512();
      _mm512_storeu_si512(panel + p * 2 * kLanes, words);
    }
  }
  // Values: column d of keys 2j and 2j + 1 side by side at 2d of pair j's run (panel d / 16 of 16
  // words is exactly that), 16 columns of both rows interleaved per instruction; columns past
  // head_dim and keys past the segment are zero.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                              21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t width = shape.column_panels * kLanes;
  for (int64_t j = 0; j < shape.padded_keys / 2; ++j) {
    BFloat16* run = values + j * 2 * width;
    const BFloat16* row0 = value + (segment.query_begin + 2 * j) * args.value.token_stride;
    const BFloat16* row1 = row0 + args.value.token_stride;
    const bool has0 = 2 * j < num_keys, has1 = 2 * j + 1 < num_keys;
    for (int64_t d = 0; d < width; d += kLanes) {
      const int64_t columns = std::clamp<int64_t>(shape.head_dim - d, 0, kLanes);
      const __mmask16 lanes = columns == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << columns) - 1);
      const __m256i low = has0 ? _mm256_maskz_loadu_epi16(lanes, row0 + d) : _mm256_setzero_si256();
      const __m256i high = has1 ? _mm256_maskz_loadu_epi16(lanes, row1 + d) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      _mm512_storeu_si512(run + 2 * d, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Every (segment, head)'s packs, side by side; unit u = segment · num_heads + head.
struct Packs {
  std::vector<Shape> shapes;     // per segment
  std::vector<int64_t> offsets;  // per unit, into keys and values (elements)
  std::unique_ptr<BFloat16[]> keys, values;  // uninitialised until packed: every element is written

  Packed of(int64_t unit) const { return {keys.get() + offsets[unit], values.get() + offsets[unit]}; }
};

// Packs every (segment, head) in parallel, head_dim / 2 rounded up to a multiple of
// `pair_multiple` pairs per key.
inline Packs pack_segments(const VarlenAttentionArgs& args, int64_t pair_multiple) {
  const int64_t num_heads = args.num_heads;
  const int64_t column_panels = (args.head_dim + kLanes - 1) / kLanes;
  const int64_t pairs = (args.head_dim / 2 + pair_multiple - 1) / pair_multiple * pair_multiple;
  Packs packs;
  packs.offsets.push_back(0);
  for (const attention::Sequence& segment : args.sequences) {
    const int64_t padded = (segment.num_queries + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
    packs.shapes.push_back({args.head_dim, pairs, column_panels, padded});
    // Keys take padded · 2 · pairs elements, values padded · 16 · column_panels.
    const int64_t size = padded * std::max(2 * pairs, column_panels * kLanes);
    for (int64_t h = 0; h < num_heads; ++h) packs.offsets.push_back(packs.offsets.back() + size);
  }
  const int64_t units = static_cast<int64_t>(args.sequences.size()) * num_heads;
  packs.keys.reset(new BFloat16[packs.offsets.back()]);
  packs.values.reset(new BFloat16[packs.offsets.back()]);
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit)
      pack_keys_values(args, args.sequences[unit / num_heads], unit % num_heads, packs.shapes[unit / num_heads],
                       packs.keys.get() + packs.offsets[unit], packs.values.get() + packs.offsets[unit]);
  });
  return packs;
}

// Whether the bfloat16 kernels take these rows: bfloat16 with an even head_dim of at most 256.
inline bool takes(const VarlenAttentionArgs& args) {
  return args.query.dtype == Dtype::kBFloat16 && args.head_dim % 2 == 0 && args.head_dim <= kMaxHeadDim;
}

// Packs every (segment, head) (`pack_segments`), then runs attend(args, segment, head, packed,
// shape, begin, end) over tasks of up to `task_rows` query rows of one (segment, head), in parallel.
template <typename Attend>
void attend_tasks(const VarlenAttentionArgs& args, int64_t pair_multiple, int64_t task_rows, const Attend& attend) {
  const Packs packs = pack_segments(args, pair_multiple);
  const int64_t num_heads = args.num_heads;
  struct Task {
    int64_t unit, begin, end;
  };
  std::vector<Task> tasks;
  for (int64_t unit = 0; unit < static_cast<int64_t>(args.sequences.size()) * num_heads; ++unit) {
    const int64_t rows = args.sequences[unit / num_heads].num_queries;
    for (int64_t begin = 0; begin < rows; begin += task_rows) tasks.push_back({unit, begin, std::min(rows, begin + task_rows)});
  }
  // Each thread takes the next task from a shared counter rather than a share fixed up front: on a
  // machine whose cores run at different speeds (a neighbour on one of them) the faster thread
  // takes more, and neither waits long for the other at the end.
  const int64_t count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < count;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const Task& task = tasks[t];
      const int64_t s = task.unit / num_heads;
      attend(args, args.sequences[s], task.unit % num_heads, packs.of(task.unit), packs.shapes[s], task.begin, task.end);
    }
  });
}

}  // namespace varlen
}  // namespace mmserve
