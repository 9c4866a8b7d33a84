#include "attention_plan.h"

#include <algorithm>
#include <limits>

namespace mmserve::attention {
namespace {

constexpr int kTargetRows = 128;        // query rows (tokens × heads of a group) per tile: each
                                        // pass over a context serves this many rows
constexpr int kGroupedRows = 32;        // tiles below this (decode rows) take all head groups at once
constexpr int64_t kMinSplitKeys = 128;  // below this a split's merge overhead is not worth it (a
                                        // 256-key decode row split over two threads: ~0.65x the time)
constexpr int64_t kSplitAlign = 64;     // split boundaries fall on key tiles
constexpr int64_t kItemsPerThread = 4;  // enough items for the shared counter to balance load
constexpr int64_t kItemOverhead = 64;   // per-item cost (packing queries, writing results) in keys

struct Tile {
  int32_t sequence;
  int32_t query_offset;
  int32_t num_queries;
  int64_t key_end;
  int64_t cost;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<Tile> query_tiles(const std::vector<Sequence>& sequences, int tokens_per_tile,
                              int rows_per_token) {
  std::vector<Tile> tiles;
  for (int32_t s = 0; s < static_cast<int32_t>(sequences.size()); ++s) {
    const Sequence& seq = sequences[s];
    for (int32_t offset = 0; offset < seq.num_queries; offset += tokens_per_tile) {
      const int32_t count = std::min(tokens_per_tile, seq.num_queries - offset);
      const int64_t key_end = seq.causal ? seq.num_keys - seq.num_queries + offset + count : seq.num_keys;
      const int64_t cost = static_cast<int64_t>(count) * rows_per_token * (key_end + kItemOverhead);
      tiles.push_back({s, offset, count, key_end, cost});
    }
  }
  return tiles;
}

// Keys per split, so that no item's cost is much above `target_cost` (key_end: no split).
int64_t split_length(const Tile& tile, int64_t target_cost) {
  if (tile.cost <= target_cost) return tile.key_end;
  const int64_t wanted = std::min(ceil_div(tile.cost, target_cost), tile.key_end / kMinSplitKeys);
  if (wanted < 2) return tile.key_end;
  return ceil_div(ceil_div(tile.key_end, wanted), kSplitAlign) * kSplitAlign;
}

// One item per key split of `tile` for head groups [first_group, first_group + num_groups).
void add_items(Plan& plan, const Tile& tile, int32_t first_group, int32_t num_groups, int rows_per_token,
               int64_t target_cost) {
  Tile items_tile = tile;
  items_tile.cost = tile.cost * num_groups;
  const int64_t split_len = split_length(items_tile, target_cost);
  const int64_t splits = ceil_div(tile.key_end, split_len);
  if (splits == 1) {
    plan.items.push_back({tile.sequence, first_group, num_groups, tile.query_offset, tile.num_queries, 0,
                          tile.key_end, -1, 0, items_tile.cost, -1});
    return;
  }
  // Partial slot of split s and group g: base + g * splits + s, so each merge reads consecutive slots.
  const int64_t base = plan.num_partials;
  const auto split_set = static_cast<int32_t>(plan.split_sets.size());
  plan.split_sets.push_back(
      {static_cast<int32_t>(plan.merges.size()), num_groups, static_cast<int32_t>(splits)});
  for (int32_t g = 0; g < num_groups; ++g)
    plan.merges.push_back({tile.sequence, first_group + g, tile.query_offset, tile.num_queries, base + g * splits,
                           static_cast<int32_t>(splits)});
  for (int64_t split = 0; split < splits; ++split) {
    const int64_t begin = split * split_len;
    const int64_t end = std::min(tile.key_end, begin + split_len);
    const int64_t cost =
        static_cast<int64_t>(tile.num_queries) * rows_per_token * num_groups * (end - begin + kItemOverhead);
    plan.items.push_back({tile.sequence, first_group, num_groups, tile.query_offset, tile.num_queries, begin, end,
                          base + split, splits, cost, split_set});
  }
  plan.num_partials += splits * num_groups;
}

}  // namespace

Plan make_plan(const std::vector<Sequence>& sequences, int num_head_groups, int rows_per_token,
               int num_threads, bool group_heads) {
  Plan plan;
  const int tokens_per_tile = std::max(1, kTargetRows / rows_per_token);
  const std::vector<Tile> tiles = query_tiles(sequences, tokens_per_tile, rows_per_token);
  int64_t total_cost = 0;
  for (const Tile& tile : tiles) {
    total_cost += tile.cost * num_head_groups;
    plan.max_rows = std::max(plan.max_rows, tile.num_queries * rows_per_token);
  }
  plan.num_threads = num_threads;
  const int64_t target_cost = num_threads > 1
                                  ? std::max<int64_t>(1, total_cost / (num_threads * kItemsPerThread))
                                  : std::numeric_limits<int64_t>::max();
  for (const Tile& tile : tiles) {
    // Small tiles (decode rows) are memory-bound: one sweep over the context for all kv heads.
    if (group_heads && tile.num_queries * rows_per_token < kGroupedRows) {
      add_items(plan, tile, 0, num_head_groups, rows_per_token, target_cost);
      continue;
    }
    for (int32_t group = 0; group < num_head_groups; ++group)
      add_items(plan, tile, group, 1, rows_per_token, target_cost);
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

}  // namespace mmserve::attention
