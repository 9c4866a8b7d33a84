// How one attention call is cut into work items for the CPU cores.
//
// A sequence (a request's query rows in paged attention, an image segment in varlen attention)
// is cut into items along three axes: head groups (a kv head and the query heads that share
// it; small tiles such as decode rows take all groups in one item, so a token's rows of every kv
// head are read in one sweep), query tiles (enough query tokens that tokens × group size fills
// a tile), and, when
// an item is large compared with a core's share of the call, its keys (split-KV). Split items
// write unnormalised partial results that the last of them to finish merges, so one long context
// or one long prompt never leaves a core idle. Items are handed out longest first from a shared counter.
#pragma once

#include <cstdint>
#include <vector>

namespace mmserve::attention {

struct Sequence {
  int64_t query_begin;  // first query row in the token dimension of q / out
  int32_t num_queries;
  int64_t num_keys;  // keys visible to the last query row
  bool causal;       // query i sees keys [0, num_keys - num_queries + i]; otherwise all keys
};

struct WorkItem {
  int32_t sequence;
  int32_t head_group;  // the first of num_groups consecutive head groups
  int32_t num_groups;
  int32_t query_offset;  // first query token of the tile, relative to the sequence
  int32_t num_queries;   // query tokens in the tile
  int64_t key_begin;
  int64_t key_end;
  int64_t partial;  // -1: normalise straight into out; else the first group's partial slot
  int64_t partial_group_stride;  // slots from one group's partial to the next group's
  int64_t cost;
  int32_t split_set;  // -1: not split; else the index of its SplitSet
};

// The splits of one query tile, merged into out after all items ran.
struct MergeGroup {
  int32_t sequence;
  int32_t head_group;
  int32_t query_offset;
  int32_t num_queries;
  int64_t first_partial;
  int32_t num_splits;
};

// The items that split one query tile and the merges of their results: whichever item finishes
// last runs the merges, so the call needs no second parallel pass.
struct SplitSet {
  int32_t first_merge;
  int32_t num_merges;  // one per head group of the items
  int32_t num_splits;  // items in the set
};

struct Plan {
  std::vector<WorkItem> items;  // longest first
  std::vector<MergeGroup> merges;
  std::vector<SplitSet> split_sets;
  int64_t num_partials = 0;
  int max_rows = 0;  // query rows (tokens × group size) of the largest tile of one group
  int num_threads = 1;  // threads the items were cut for (and run on)
};

// `rows_per_token` is the number of query heads per head group (the GQA ratio); `group_heads`
// allows items spanning head groups (the key source then steps between kv heads' rows).
Plan make_plan(const std::vector<Sequence>& sequences, int num_head_groups, int rows_per_token,
               int num_threads, bool group_heads);

}  // namespace mmserve::attention
