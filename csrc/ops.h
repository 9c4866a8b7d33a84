// The tensor-level ops of ops.cpp, each checking its own arguments: registered as
// torch.ops.mmserve_cpu.*, and chained in C++ by the fused ops (decoder_layer.cpp). Contracts:
// the functions of the same name in mmserve/ops/reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace mmserve {

void paged_attention_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                        const at::Tensor& block_table, double scale);
void varlen_attention_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const at::Tensor& cu_seqlens, double scale);
void write_kv_op(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping);
void rms_norm_op(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm_op(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                           double eps);
void silu_and_mul_op(const at::Tensor& out, const at::Tensor& gate_up);
void mrope_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& positions,
              const at::Tensor& cos_cache, const at::Tensor& sin_cache, const at::Tensor& row_of_channel);
void pack_weight_op(const at::Tensor& packed, const at::Tensor& weight);
at::Tensor packed_linear_op(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t out_features);
at::Tensor gated_packed_linear_op(const at::Tensor& x, const at::Tensor& packed,
                                  const std::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace mmserve
