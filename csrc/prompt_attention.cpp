// See prompt_attention.h.
#include "prompt_attention.h"

#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>

#include <limits>
#include <optional>

namespace mmserve {

void prompt_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const attention::Sequence& sequence, const int32_t* blocks, double scale) {
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  const int64_t group = query.size(1) / kv_heads;
  const int64_t queries = sequence.num_queries, keys = sequence.num_keys, context = keys - queries;
  const int64_t used_blocks = (keys + block_size - 1) / block_size;
  const c10::ScalarType dtype = c10::promoteTypes(query.scalar_type(), kv_cache.scalar_type());
  const at::Tensor ids = at::from_blob(const_cast<int32_t*>(blocks), {used_blocks}, at::kInt).to(at::kLong);
  // [2, keys, kv_heads, head_dim]: the request's keys and values, in the order of its positions
  const at::Tensor kv = kv_cache.index_select(1, ids)
                            .view({2, used_blocks * block_size, kv_heads, head_dim})
                            .narrow(1, 0, keys)
                            .to(dtype);
  // SDPA's [batch, heads, length, head_dim]: a batch per kv head, its query heads as the heads,
  // and its keys and values broadcast over them (stride 0): GQA without a copy per query head.
  auto per_kv_head = [&](const at::Tensor& rows, int64_t length) {  // [length, kv_heads · group, D]
    return rows.view({length, kv_heads, group, head_dim}).permute({1, 2, 0, 3});
  };
  auto broadcast = [&](const at::Tensor& rows) {  // [keys, kv_heads, D]
    return rows.permute({1, 0, 2}).unsqueeze(1).expand({kv_heads, group, keys, head_dim});
  };
  const at::Tensor q = per_kv_head(query.narrow(0, sequence.query_begin, queries), queries).to(dtype);
  // Query i sees keys up to context + i. SDPA's causal flag aligns query 0 with key 0, so it
  // serves a prompt with no cached context; a chunk after cached keys takes an additive mask.
  std::optional<at::Tensor> mask;
  if (context > 0) {
    const at::Tensor key_position = at::arange(keys, at::kLong).unsqueeze(0);
    const at::Tensor last_seen = at::arange(context, keys, at::kLong).unsqueeze(1);
    mask = at::zeros({queries, keys}, q.options())
               .masked_fill_(key_position.gt(last_seen), -std::numeric_limits<double>::infinity())
               .expand({1, 1, queries, keys});
  }
  const auto attended = at::_scaled_dot_product_flash_attention_for_cpu(q, broadcast(kv[0]), broadcast(kv[1]), 0.0,
                                                                        context == 0, mask, scale);
  per_kv_head(out.narrow(0, sequence.query_begin, queries), queries).copy_(std::get<0>(attended));
}

}  // namespace mmserve
