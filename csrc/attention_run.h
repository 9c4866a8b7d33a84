// Runs a Plan: every work item on the CPU cores (longest first, from a shared counter), and
// the merge of each set of split items by the last of them to finish, in one parallel pass. Shared by paged attention and varlen attention, which differ only
// in where a sequence's keys and values live (the `make_keys` callback).
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <memory>
#include <vector>

#include "attention_decode.h"
#include "attention_plan.h"
#include "attention_tile.h"

namespace mmserve::attention {

// Rows of a [tokens, heads, head_dim] tensor whose last dimension is contiguous.
template <typename T>
struct RowView {
  T* data;
  int64_t token_stride;
  int64_t head_stride;
  T* row(int64_t token, int64_t head) const { return data + token * token_stride + head * head_stride; }
};

// Unnormalised results of split items: acc [slots, max_rows, head_dim], max and sum [slots, max_rows].
struct Partials {
  std::vector<float> acc, max, sum;
  int max_rows = 0;
  int head_dim = 0;
};

struct Problem {
  const std::vector<Sequence>* sequences;
  int rows_per_token;  // query heads per head group
  int head_dim;
  float scale;
};

// Per-thread tile states, one per head group of the largest item seen; reused across calls.
inline FlashTile* thread_tiles(int count) {
  static thread_local std::vector<FlashTile> tiles;
  if (static_cast<int>(tiles.size()) < count) tiles.resize(count);
  return tiles.data();
}

// Packs the item's query rows of head group `group` (tokens × heads of the group) into `tile`.
template <typename q_t>
void load_queries(FlashTile& tile, const WorkItem& item, int group, const Problem& problem,
                  const RowView<const q_t>& query) {
  const Sequence& seq = (*problem.sequences)[item.sequence];
  const int heads = problem.rows_per_token;
  tile.reset(item.num_queries * heads, problem.head_dim);
  for (int t = 0; t < item.num_queries; ++t) {
    const int64_t last_key =
        seq.causal ? seq.num_keys - seq.num_queries + item.query_offset + t : seq.num_keys - 1;
    for (int h = 0; h < heads; ++h) {
      const q_t* src = query.row(seq.query_begin + item.query_offset + t, static_cast<int64_t>(group) * heads + h);
      tile.set_query(t * heads + h, src, problem.scale, last_key);
    }
  }
}

// Normalised rows into out, or the unnormalised state into the item's partial slot.
template <typename q_t>
void store_results(const FlashTile& tile, const WorkItem& item, int group, int64_t partial,
                   const Problem& problem, const RowView<q_t>& out, Partials& partials) {
  const Sequence& seq = (*problem.sequences)[item.sequence];
  const int heads = problem.rows_per_token;
  for (int row = 0; row < tile.num_rows(); ++row) {
    if (partial < 0) {
      tile.store_row(row, out.row(seq.query_begin + item.query_offset + row / heads,
                                  static_cast<int64_t>(group) * heads + row % heads));
      continue;
    }
    const int64_t slot = partial * partials.max_rows + row;
    std::copy(tile.acc(row), tile.acc(row) + problem.head_dim, partials.acc.data() + slot * problem.head_dim);
    partials.max[slot] = tile.row_max(row);
    partials.sum[slot] = tile.row_sum(row);
  }
}

template <typename q_t, typename Keys>
void run_item(const WorkItem& item, const Problem& problem, const RowView<const q_t>& query,
              const RowView<q_t>& out, const Keys& keys, Partials& partials) {
  FlashTile* tiles = thread_tiles(item.num_groups);
  for (int g = 0; g < item.num_groups; ++g) load_queries(tiles[g], item, item.head_group + g, problem, query);
  if (item.num_queries == 1) {  // a decode row: sees every key of its range
    attend_decode(tiles, item.num_groups, keys, item.key_begin, item.key_end);
  } else {
    attend(tiles, item.num_groups, keys, item.key_begin, item.key_end);
  }
  for (int g = 0; g < item.num_groups; ++g) {
    const int64_t partial = item.partial < 0 ? -1 : item.partial + g * item.partial_group_stride;
    store_results(tiles[g], item, item.head_group + g, partial, problem, out, partials);
  }
}

// out row = Σ_s e^(max_s - max) acc_s / Σ_s e^(max_s - max) sum_s over the splits s.
template <typename q_t>
void merge_group(const MergeGroup& merge, const Problem& problem, const RowView<q_t>& out,
                 const Partials& partials) {
  const Sequence& seq = (*problem.sequences)[merge.sequence];
  const int group = problem.rows_per_token;
  const int head_dim = problem.head_dim;
  std::vector<float> total(head_dim);
  for (int row = 0; row < merge.num_queries * group; ++row) {
    float max = kNegInf;
    for (int s = 0; s < merge.num_splits; ++s)
      max = std::max(max, partials.max[(merge.first_partial + s) * partials.max_rows + row]);
    std::fill(total.begin(), total.end(), 0.f);
    float sum = 0.f;
    for (int s = 0; s < merge.num_splits; ++s) {
      const int64_t slot = (merge.first_partial + s) * partials.max_rows + row;
      if (partials.max[slot] == kNegInf) continue;  // this split saw no key of this row
      const float weight = std::exp(partials.max[slot] - max);
      sum += weight * partials.sum[slot];
      const float* acc = partials.acc.data() + slot * head_dim;
      for (int d = 0; d < head_dim; ++d) total[d] += weight * acc[d];
    }
    q_t* dst = out.row(seq.query_begin + merge.query_offset + row / group,
                       static_cast<int64_t>(merge.head_group) * group + row % group);
    for (int d = 0; d < head_dim; ++d) dst[d] = static_cast<q_t>(total[d] / sum);
  }
}

// make_keys(sequence index, head group) → a key source with value_type and fill().
template <typename q_t, typename MakeKeys>
void run_plan(const Plan& plan, const Problem& problem, const RowView<const q_t>& query,
              const RowView<q_t>& out, const MakeKeys& make_keys) {
  Partials partials;
  partials.max_rows = plan.max_rows;
  partials.head_dim = problem.head_dim;
  const int64_t slots = plan.num_partials * plan.max_rows;
  partials.acc.resize(slots * problem.head_dim);
  partials.max.resize(slots);
  partials.sum.resize(slots);

  // Splits of each set still running; the item that brings its set's count to 0 merges it
  // (acq_rel: that item sees every other split's partial results).
  const size_t num_sets = plan.split_sets.size();
  std::unique_ptr<std::atomic<int32_t>[]> running(new std::atomic<int32_t>[num_sets]);
  for (size_t s = 0; s < num_sets; ++s) running[s].store(plan.split_sets[s].num_splits, std::memory_order_relaxed);

  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(plan.num_threads, num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const WorkItem& item = plan.items[i];
      run_item(item, problem, query, out, make_keys(item.sequence, item.head_group), partials);
      if (item.split_set < 0 || running[item.split_set].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      const SplitSet& set = plan.split_sets[item.split_set];
      for (int32_t m = set.first_merge; m < set.first_merge + set.num_merges; ++m)
        merge_group(plan.merges[m], problem, out, partials);
    }
  });
}

}  // namespace mmserve::attention
