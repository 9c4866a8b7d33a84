// The tensor side of the kernels: registers them with the dispatcher as torch.ops.mmserve_cpu.*,
// checks every argument (the kernels read raw pointers, so shapes, dtypes, strides and every
// index they will follow are checked here, before any thread starts) and fills kernels.h's
// structs. Outputs and in-place arguments are marked mutable (Tensor(a!)) in the schemas.
// Contracts: the function of the same name in mmserve/ops/reference.py.
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "ops.h"
#include "prompt_attention.h"

namespace mmserve {
namespace {

Dtype dtype_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? Dtype::kFloat32 : Dtype::kBFloat16;
}

// [tokens, heads, head_dim] (dims = 3) or [tokens, width] (dims = 2), last dimension contiguous.
Rows rows_of(const at::Tensor& t, const char* name, int64_t dims) {
  const Dtype dtype = dtype_of(t, name);
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.stride(dims - 1) == 1 || t.size(dims - 1) <= 1, name, " must be contiguous in its last dimension");
  return {t.data_ptr(), dtype, t.stride(0), dims == 3 ? t.stride(1) : 0};
}

// A small index tensor read on the host (no tensor ops: this runs once per layer and step).
std::vector<int64_t> host_indices(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1, name, " must be a 1-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64");
  std::vector<int64_t> values(t.numel());
  const int64_t stride = t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* data = t.const_data_ptr<int32_t>();
    for (size_t i = 0; i < values.size(); ++i) values[i] = data[i * stride];
  } else {
    const int64_t* data = t.const_data_ptr<int64_t>();
    for (size_t i = 0; i < values.size(); ++i) values[i] = data[i * stride];
  }
  return values;
}

void check_cache(const at::Tensor& kv_cache) {
  dtype_of(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
}

// Fills the request layout and checks every block id the kernel will read.
void add_requests(PagedAttentionArgs& args, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  const at::Tensor& block_table, int64_t num_tokens) {
  const std::vector<int64_t> starts = host_indices(query_start_loc, "query_start_loc");
  const std::vector<int64_t> lengths = host_indices(seq_lens, "seq_lens");
  const int64_t num_requests = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == num_requests + 1,
              "query_start_loc must have one more entry than seq_lens");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.dim() == 2 && block_table.size(0) >= num_requests &&
                  block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table must be a CPU int32 [requests, max_blocks] tensor with contiguous rows");
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t num_queries = starts[r + 1] - starts[r];
    TORCH_CHECK(num_queries >= 0 && starts[r] >= 0 && starts[r + 1] <= num_tokens,
                "query_start_loc must be non-decreasing within the query rows");
    TORCH_CHECK(lengths[r] >= num_queries, "request ", r, " has ", num_queries, " queries but a context of ",
                lengths[r]);
    if (num_queries == 0) continue;
    const int64_t used_blocks = (lengths[r] + args.block_size - 1) / args.block_size;
    TORCH_CHECK(used_blocks <= block_table.size(1), "request ", r, " needs ", used_blocks,
                " blocks but the block table has ", block_table.size(1));
    const int32_t* row = block_table.const_data_ptr<int32_t>() + r * block_table.stride(0);
    for (int64_t b = 0; b < used_blocks; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < args.num_blocks, "request ", r, " uses block id ", row[b],
                  " outside the cache (", args.num_blocks, " blocks)");
    args.sequences.push_back({starts[r], static_cast<int32_t>(num_queries), lengths[r], true});
    args.block_tables.push_back(row);
  }
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  dtype_of(weight, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [hidden] tensor");
}

void check_positions(const MropeArgs& args, int64_t max_positions) {
  for (const int64_t row : args.row_of_channel) {
    TORCH_CHECK(row >= 0 && row < 3, "row_of_channel entries must be 0, 1 or 2, got ", row);
    for (int64_t t = 0; t < args.num_tokens; ++t) {
      const int64_t p = args.positions[row * args.position_row_stride + t * args.position_token_stride];
      TORCH_CHECK(p >= 0 && p < max_positions, "position ", p, " is outside the rotary cache (", max_positions, ")");
    }
  }
}

void check_packed(const at::Tensor& packed, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(packed.device().is_cpu() &&
                  (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat) &&
                  packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (out_features + kPanelColumns - 1) / kPanelColumns &&
                  packed.size(1) == in_features && packed.size(2) == kPanelColumns,
              "packed weight must be a contiguous float32 or bfloat16 [ceil(", out_features, " / 16), ",
              in_features, ", 16] tensor, got ", packed.scalar_type(), " ", packed.sizes());
}

}  // namespace

void paged_attention_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                        const at::Tensor& block_table, double scale) {
  PagedAttentionArgs args{rows_of(out, "out", 3), rows_of(query, "query", 3)};
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query's shape and dtype");
  check_cache(kv_cache);
  args.kv_cache = kv_cache.const_data_ptr();
  args.cache_dtype = dtype_of(kv_cache, "kv_cache");
  args.num_blocks = kv_cache.size(1);
  args.block_size = kv_cache.size(2);
  args.num_kv_heads = kv_cache.size(3);
  args.num_heads = query.size(1);
  args.head_dim = query.size(2);
  args.scale = static_cast<float>(scale);
  TORCH_CHECK(kv_cache.size(4) == args.head_dim, "kv_cache head_dim ", kv_cache.size(4), " != query's ",
              args.head_dim);
  TORCH_CHECK(args.num_kv_heads > 0 && args.num_heads % args.num_kv_heads == 0, "query heads (", args.num_heads,
              ") must be a multiple of kv heads (", args.num_kv_heads, ")");
  add_requests(args, query_start_loc, seq_lens, block_table, query.size(0));
  // Long prompt chunks go to torch's flash kernel (prompt_attention.h), the rest to the tile engine.
  size_t kept = 0;
  for (size_t s = 0; s < args.sequences.size(); ++s) {
    if (args.sequences[s].num_queries >= kPromptAttentionMinQueries) {
      prompt_attention(out, query, kv_cache, args.sequences[s], args.block_tables[s], scale);
      continue;
    }
    args.sequences[kept] = args.sequences[s];
    args.block_tables[kept++] = args.block_tables[s];
  }
  args.sequences.resize(kept);
  args.block_tables.resize(kept);
  if (!args.sequences.empty()) paged_attention(args);
}

void varlen_attention_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const at::Tensor& cu_seqlens, double scale) {
  VarlenAttentionArgs args{rows_of(out, "out", 3), rows_of(query, "query", 3), rows_of(key, "key", 3),
                           rows_of(value, "value", 3)};
  for (const at::Tensor* t : {&out, &key, &value})
    TORCH_CHECK(t->sizes() == query.sizes() && t->scalar_type() == query.scalar_type(),
                "query, key, value and out must have the same shape and dtype");
  args.num_heads = query.size(1);
  args.head_dim = query.size(2);
  args.scale = static_cast<float>(scale);
  const std::vector<int64_t> bounds = host_indices(cu_seqlens, "cu_seqlens");
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    TORCH_CHECK(bounds[s] >= 0 && bounds[s] <= bounds[s + 1] && bounds[s + 1] <= query.size(0),
                "cu_seqlens must be non-decreasing within the rows of query");
    const int64_t length = bounds[s + 1] - bounds[s];
    if (length > 0) args.sequences.push_back({bounds[s], static_cast<int32_t>(length), length, false});
  }
  varlen_attention(args);
}

void write_kv_op(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping) {
  WriteKvArgs args{rows_of(key, "key", 3), rows_of(value, "value", 3)};
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type(),
              "key and value must have the same shape and dtype");
  check_cache(kv_cache);
  TORCH_CHECK(kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2), "kv_cache ", kv_cache.sizes(),
              " does not match key ", key.sizes());
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous CPU int64 [tokens] tensor");
  args.kv_cache = kv_cache.data_ptr();
  args.cache_dtype = dtype_of(kv_cache, "kv_cache");
  args.num_tokens = key.size(0);
  args.num_slots = kv_cache.size(1) * kv_cache.size(2);
  args.num_kv_heads = key.size(1);
  args.head_dim = key.size(2);
  args.slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < args.num_tokens; ++t)
    TORCH_CHECK(args.slots[t] < args.num_slots, "slot ", args.slots[t], " of token ", t,
                " is outside the cache (", args.num_slots, " slots)");
  write_kv(args);
}

void rms_norm_op(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  RmsNormArgs args{rows_of(out, "out", 2), rows_of(x, "x", 2)};
  check_weight(weight, x);
  TORCH_CHECK(out.sizes() == x.sizes() &&
                  out.scalar_type() == c10::promoteTypes(x.scalar_type(), weight.scalar_type()),
              "out must have x's shape and the promoted dtype of x and weight");
  args.weight = weight.const_data_ptr();
  args.weight_dtype = dtype_of(weight, "weight");
  args.num_tokens = x.size(0);
  args.hidden = x.size(1);
  args.eps = static_cast<float>(eps);
  rms_norm(args);
}

void fused_add_rms_norm_op(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                           double eps) {
  FusedAddRmsNormArgs args{rows_of(x, "x", 2), rows_of(residual, "residual", 2)};
  check_weight(weight, x);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must have x's shape and dtype");
  TORCH_CHECK(c10::promoteTypes(x.scalar_type(), weight.scalar_type()) == x.scalar_type(),
              "the result is written into x, so weight (", weight.scalar_type(), ") must not promote x (",
              x.scalar_type(), ")");
  args.weight = weight.const_data_ptr();
  args.weight_dtype = dtype_of(weight, "weight");
  args.num_tokens = x.size(0);
  args.hidden = x.size(1);
  args.eps = static_cast<float>(eps);
  fused_add_rms_norm(args);
}

void silu_and_mul_op(const at::Tensor& out, const at::Tensor& gate_up) {
  SiluAndMulArgs args{rows_of(out, "out", 2), rows_of(gate_up, "gate_up", 2)};
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
                  out.scalar_type() == gate_up.scalar_type(),
              "out must be [tokens, d] for gate_up [tokens, 2 * d], with gate_up's dtype");
  args.num_tokens = out.size(0);
  args.width = out.size(1);
  silu_and_mul(args);
}

void mrope_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& positions,
              const at::Tensor& cos_cache, const at::Tensor& sin_cache, const at::Tensor& row_of_channel) {
  MropeArgs args{rows_of(query, "query", 3), rows_of(key, "key", 3)};
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && key.size(0) == query.size(0) &&
                  key.size(2) == query.size(2) && query.size(2) % 2 == 0,
              "key must match query's dtype, tokens and (even) head_dim");
  args.num_tokens = query.size(0);
  args.num_heads = query.size(1);
  args.num_kv_heads = key.size(1);
  args.head_dim = query.size(2);
  for (const at::Tensor* cache : {&cos_cache, &sin_cache})
    TORCH_CHECK(cache->device().is_cpu() && cache->dim() == 2 && cache->size(1) == args.head_dim / 2 &&
                    cache->scalar_type() == at::kFloat && cache->is_contiguous() &&
                    cache->size(0) == cos_cache.size(0),
                "cos_cache and sin_cache must be contiguous float32 [max_positions, head_dim / 2]");
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 2 && positions.size(0) == 3 &&
                  positions.size(1) == args.num_tokens && positions.scalar_type() == at::kLong,
              "positions must be a CPU int64 [3, tokens] tensor");
  args.positions = positions.const_data_ptr<int64_t>();
  args.position_row_stride = positions.stride(0);
  args.position_token_stride = positions.stride(1);
  args.cos_cache = cos_cache.const_data_ptr<float>();
  args.sin_cache = sin_cache.const_data_ptr<float>();
  args.row_of_channel = host_indices(row_of_channel, "row_of_channel");
  TORCH_CHECK(static_cast<int64_t>(args.row_of_channel.size()) == args.head_dim / 2,
              "row_of_channel must have head_dim / 2 entries");
  check_positions(args, cos_cache.size(0));
  mrope(args);
}

void pack_weight_op(const at::Tensor& packed, const at::Tensor& weight) {
  const Dtype dtype = dtype_of(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && (weight.stride(1) == 1 || weight.size(1) <= 1),
              "weight must be [out_features, in_features] with contiguous rows");
  check_packed(packed, weight.size(0), weight.size(1));
  pack_weight({weight.const_data_ptr(), dtype, weight.stride(0), weight.size(0), weight.size(1), packed.data_ptr(),
               dtype_of(packed, "packed")});
}

namespace {

// The arguments of a packed linear x [..., K] → out [rows, out_features] (allocated here).
PackedLinearArgs linear_args(const at::Tensor& rows, const at::Tensor& out, const at::Tensor& packed,
                             const std::optional<at::Tensor>& bias, int64_t out_features) {
  PackedLinearArgs args{rows_of(out, "out", 2), rows_of(rows, "x", 2)};
  args.num_rows = rows.size(0);
  args.in_features = rows.size(1);
  args.out_features = out_features;
  check_packed(packed, args.out_features, args.in_features);
  args.weight = packed.const_data_ptr();
  args.weight_dtype = dtype_of(packed, "packed");
  args.bias = nullptr;
  args.bias_dtype = Dtype::kFloat32;
  if (bias.has_value()) {
    args.bias_dtype = dtype_of(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == args.out_features && bias->is_contiguous(),
                "bias must be a contiguous [out_features] tensor");
    args.bias = bias->const_data_ptr();
  }
  return args;
}

std::vector<int64_t> shape_with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last;
  return shape;
}

}  // namespace

// x: [..., in_features] → [..., out_features] in x's dtype. Allocates its result, and reshapes
// in C++: a decode step makes ~50 of these calls, and each Python-side tensor op costs more
// than the arithmetic of a small one.
at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1, "x must have an in_features dimension");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty({rows.size(0), out_features}, x.options());
  packed_linear(linear_args(rows, out, packed, bias, out_features));
  return out.view(shape_with_last(x, out_features));
}

// x: [..., in_features] → silu(gate) · up [..., out_features / 2] for a gate/up weight packed
// whole (gate rows, then up rows): silu_and_mul(packed_linear(x)), bit for bit, in one parallel
// pass (linear.cpp). out_features / 2 must be a multiple of 16 (a panel).
at::Tensor gated_packed_linear_op(const at::Tensor& x, const at::Tensor& packed,
                                  const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1, "x must have an in_features dimension");
  TORCH_CHECK(out_features % (2 * kPanelColumns) == 0, "gated_packed_linear: out_features / 2 must be a multiple of ",
              kPanelColumns, ", got ", out_features);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor gate_up = at::empty({rows.size(0), out_features}, x.options());
  at::Tensor activation = at::empty({rows.size(0), out_features / 2}, x.options());
  PackedLinearArgs args = linear_args(rows, gate_up, packed, bias, out_features);
  args.activation = rows_of(activation, "activation", 2);
  args.gated_width = out_features / 2;
  packed_linear(args);
  return activation.view(shape_with_last(x, out_features / 2));
}

}  // namespace mmserve

TORCH_LIBRARY(mmserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_table, float scale) -> ()");
  m.def(
      "varlen_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, "
      "float scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "mrope(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos_cache, Tensor sin_cache, "
      "Tensor row_of_channel) -> ()");
  m.def("pack_weight(Tensor(a!) packed, Tensor weight) -> ()");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("gated_packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  // The shortest prompt chunk paged_attention hands to torch's flash kernel (prompt_attention.h).
  m.def("bf16_dot_products() -> bool", []() -> bool { return mmserve::bf16_dot_products(); });
  m.def("amx_tiles() -> bool", []() -> bool { return mmserve::amx_tiles(); });
  m.def("set_amx_tiles(bool on) -> bool", [](bool on) -> bool { return mmserve::set_amx_tiles(on); });
  m.def("prompt_attention_min_queries() -> int",
        []() -> int64_t { return mmserve::kPromptAttentionMinQueries; });
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("paged_attention", &mmserve::paged_attention_op);
  m.impl("varlen_attention", &mmserve::varlen_attention_op);
  m.impl("write_kv", &mmserve::write_kv_op);
  m.impl("rms_norm", &mmserve::rms_norm_op);
  m.impl("fused_add_rms_norm", &mmserve::fused_add_rms_norm_op);
  m.impl("silu_and_mul", &mmserve::silu_and_mul_op);
  m.impl("mrope", &mmserve::mrope_op);
  m.impl("pack_weight", &mmserve::pack_weight_op);
  m.impl("packed_linear", &mmserve::packed_linear_op);
  m.impl("gated_packed_linear", &mmserve::gated_packed_linear_op);
}
