// The kernels' pointer-level interface. ops.cpp checks tensors and fills these structs; the
// kernel translation units never see an at::Tensor, so they skip ATen's heaviest headers (the
// first build on a machine is paid by every fresh install, and header parsing dominates it).
#pragma once

#include <cstdint>
#include <vector>

#include "attention_plan.h"
#include "dtype.h"

namespace mmserve {

// [tokens, heads, head_dim] (or [tokens, width] with heads = 1) with a contiguous last dimension.
struct Rows {
  void* data;
  Dtype dtype;
  int64_t token_stride;
  int64_t head_stride;
};

struct PagedAttentionArgs {
  Rows out, query;
  const void* kv_cache;  // [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
  Dtype cache_dtype;
  int64_t num_blocks, block_size, num_kv_heads, num_heads, head_dim;
  std::vector<attention::Sequence> sequences;  // one per request with queries
  std::vector<const int32_t*> block_tables;    // each sequence's block table row (ids checked)
  float scale;
};

struct VarlenAttentionArgs {
  Rows out, query, key, value;
  int64_t num_heads, head_dim;
  std::vector<attention::Sequence> sequences;  // one per non-empty segment
  float scale;
};

struct WriteKvArgs {
  Rows key, value;
  void* kv_cache;
  Dtype cache_dtype;
  int64_t num_tokens, num_slots, num_kv_heads, head_dim;
  const int64_t* slots;  // [num_tokens], each < num_slots; negative: skip the token
};

struct RmsNormArgs {
  Rows out, x;  // [tokens, hidden]: head_stride unused
  const void* weight;
  Dtype weight_dtype;
  int64_t num_tokens, hidden;
  float eps;
};

struct FusedAddRmsNormArgs {
  Rows x, residual;  // x's dtype for both; out is written into x
  const void* weight;
  Dtype weight_dtype;
  int64_t num_tokens, hidden;
  float eps;
};

struct SiluAndMulArgs {
  Rows out, gate_up;
  int64_t num_tokens, width;  // out's width d; gate_up holds 2 * d
};

struct MropeArgs {
  Rows query, key;  // same dtype and head_dim
  int64_t num_tokens, num_heads, num_kv_heads, head_dim;
  const int64_t* positions;  // [3, num_tokens], all within the caches
  int64_t position_row_stride, position_token_stride;
  const float* cos_cache;  // [max_positions, head_dim / 2]
  const float* sin_cache;
  std::vector<int64_t> row_of_channel;  // [head_dim / 2], each 0, 1 or 2
};

// Output columns per panel of a packed weight (layout: linear.cpp).
constexpr int64_t kPanelColumns = 16;

// A weight [out_features, in_features] (float32 or bfloat16, rows row_stride apart) packed into
// panels [ceil(out_features / 16), in_features, 16] of packed_dtype (layout: linear.cpp).
struct PackWeightArgs {
  const void* weight;
  Dtype dtype;
  int64_t row_stride, out_features, in_features;
  void* packed;
  Dtype packed_dtype;
};

struct PackedLinearArgs {
  Rows out, x;           // [rows, out_features], [rows, in_features]: head_stride unused
  const void* weight;    // packed by pack_weight
  Dtype weight_dtype;    // the panels' dtype
  const void* bias;      // [out_features] or nullptr
  Dtype bias_dtype;      // any value when bias is nullptr
  int64_t num_rows, in_features, out_features;
  // A gate/up projection with its SiLU-and-mul applied as each task finishes (gated_width > 0):
  // out_features = 2 · gated_width (gate columns, then up), gated_width a multiple of 16; `out`
  // receives gate|up and `activation` [rows, gated_width] (out's dtype) silu(gate) · up.
  Rows activation{};
  int64_t gated_width = 0;
};

void paged_attention(const PagedAttentionArgs& args);
void varlen_attention(const VarlenAttentionArgs& args);
// varlen_attention on vdpbf16ps (varlen_attention_dot.cpp): false, having done nothing, unless this is an
// AVX512-BF16 build and the rows are bfloat16 with an even head_dim of at most 256.
bool varlen_attention_dot(const VarlenAttentionArgs& args);
// The same on AMX tiles (varlen_attention_amx.cpp): false, having done nothing, unless this is an
// AMX build in a process granted the tile registers and the rows are as varlen_attention_dot takes.
bool varlen_attention_amx(const VarlenAttentionArgs& args);
void write_kv(const WriteKvArgs& args);
void rms_norm(const RmsNormArgs& args);
void fused_add_rms_norm(const FusedAddRmsNormArgs& args);
void silu_and_mul(const SiluAndMulArgs& args);
void mrope(const MropeArgs& args);
void pack_weight(const PackWeightArgs& args);
// Whether this is an AVX512-BF16 build (MMSERVE_BF16_DOT): bfloat16 weights packed in K pairs for
// vdpbf16ps (linear.cpp), bfloat16 varlen attention on it (varlen_attention_dot.cpp).
bool bf16_dot_products();
// Whether bfloat16 linears of at least 2 rows over K-pair panels (linear_amx.h) and bfloat16
// varlen attention (varlen_attention_amx.cpp) run on AMX tiles: an AMX build (MMSERVE_AMX) in a
// process the kernel granted the tile registers, unless set_amx_tiles(false) turned them off.
bool amx_tiles();
// Turns the AMX kernels off (false) or back on where permitted, for the whole process; returns
// amx_tiles() as it was. Without AMX, nothing to turn on: returns false.
bool set_amx_tiles(bool on);
void packed_linear(const PackedLinearArgs& args);

}  // namespace mmserve
