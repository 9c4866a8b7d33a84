// Paged attention (a mixed step of decode rows and prompt chunks, read straight from the block
// table) and varlen attention (bidirectional within packed segments), over one tile engine.
#include "attention_run.h"
#include "kernels.h"
#include "parallel.h"

namespace mmserve {
namespace {

template <typename T>
attention::RowView<T> typed(const Rows& rows) {
  return {static_cast<T*>(rows.data), rows.token_stride, rows.head_stride};
}

// Keys/values of one request and kv head in a [2, blocks, block_size, kv_heads, head_dim] cache.
template <typename kv_t>
struct PagedKeys {
  using value_type = kv_t;
  const kv_t* keys;       // cache[0] at this kv head
  int64_t values_offset;  // elements from a key row to its value row (one cache plane)
  const int32_t* blocks;  // this request's block table row
  int64_t block_size;
  int64_t block_stride;  // elements per block
  int64_t token_stride;  // elements per token within a block
  int64_t head_stride;   // elements from one kv head's row to the next one's

  void fill(int64_t begin, int count, const kv_t** k, const kv_t** v) const {
    int64_t block = begin / block_size;
    int64_t offset = begin % block_size;
    const kv_t* base = keys + blocks[block] * block_stride;
    for (int n = 0; n < count; ++n) {
      k[n] = base + offset * token_stride;
      v[n] = k[n] + values_offset;
      if (++offset == block_size && n + 1 < count) {
        offset = 0;
        base = keys + blocks[++block] * block_stride;
      }
    }
  }
};

// Keys/values of one segment and head in [tokens, heads, head_dim] tensors.
template <typename kv_t>
struct DenseKeys {
  using value_type = kv_t;
  const kv_t* keys;  // the segment's first key row at this head
  const kv_t* values;
  int64_t key_stride;  // elements between consecutive tokens
  int64_t value_stride;
  int64_t head_stride;  // 0: varlen items hold one head each

  void fill(int64_t begin, int count, const kv_t** k, const kv_t** v) const {
    for (int n = 0; n < count; ++n) {
      k[n] = keys + (begin + n) * key_stride;
      v[n] = values + (begin + n) * value_stride;
    }
  }
};

// Work of an attention call: two multiply-adds per head_dim element for every query row and key
// it sees, and each sequence's keys and values read once per kv head (the decode case, where
// the bytes dominate).
int64_t attention_work(const std::vector<attention::Sequence>& sequences, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t kv_bytes) {
  int64_t work = 0;
  for (const attention::Sequence& seq : sequences) {
    const int64_t keys_seen = seq.causal ? seq.num_keys - seq.num_queries / 2 : seq.num_keys;
    work += 2 * head_dim * (seq.num_queries * num_heads * keys_seen +
                            kMacsPerByte * kv_bytes * num_kv_heads * seq.num_keys);
  }
  return work;
}

}  // namespace

void paged_attention(const PagedAttentionArgs& args) {
  const int group = static_cast<int>(args.num_heads / args.num_kv_heads);
  const int64_t work = attention_work(args.sequences, args.num_heads, args.num_kv_heads, args.head_dim,
                                      dtype_size(args.cache_dtype));
  const attention::Plan plan = attention::make_plan(args.sequences, static_cast<int>(args.num_kv_heads),
                                                    group, useful_threads(work, at::get_num_threads()), true);
  const attention::Problem problem{&args.sequences, group, static_cast<int>(args.head_dim), args.scale};
  const int64_t token_stride = args.num_kv_heads * args.head_dim;
  const int64_t plane = args.num_blocks * args.block_size * token_stride;
  dispatch_dtype(args.query.dtype, [&](auto q_tag) {
    using q_t = decltype(q_tag);
    dispatch_dtype(args.cache_dtype, [&](auto kv_tag) {
      using kv_t = decltype(kv_tag);
      const kv_t* keys = static_cast<const kv_t*>(args.kv_cache);
      auto make_keys = [&](int32_t sequence, int32_t kv_head) {
        return PagedKeys<kv_t>{keys + kv_head * args.head_dim,      plane, args.block_tables[sequence],
                               args.block_size, args.block_size * token_stride, token_stride,
                               args.head_dim};
      };
      attention::run_plan<q_t>(plan, problem, typed<const q_t>(args.query), typed<q_t>(args.out), make_keys);
    });
  });
}

void varlen_attention(const VarlenAttentionArgs& args) {
  if (varlen_attention_amx(args) || varlen_attention_dot(args)) return;
  const attention::Plan plan =
      attention::make_plan(args.sequences, static_cast<int>(args.num_heads), 1,
                           useful_threads(attention_work(args.sequences, args.num_heads, args.num_heads,
                                                         args.head_dim, dtype_size(args.query.dtype)),
                                          at::get_num_threads()),
                           false);
  const attention::Problem problem{&args.sequences, 1, static_cast<int>(args.head_dim), args.scale};
  dispatch_dtype(args.query.dtype, [&](auto tag) {
    using T = decltype(tag);
    const attention::RowView<const T> key = typed<const T>(args.key);
    const attention::RowView<const T> value = typed<const T>(args.value);
    auto make_keys = [&](int32_t sequence, int32_t head) {
      const int64_t first = args.sequences[sequence].query_begin;
      return DenseKeys<T>{key.row(first, head), value.row(first, head), key.token_stride, value.token_stride, 0};
    };
    attention::run_plan<T>(plan, problem, typed<const T>(args.query), typed<T>(args.out), make_keys);
  });
}

}  // namespace mmserve
