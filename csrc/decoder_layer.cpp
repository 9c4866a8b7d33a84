// A whole Qwen2-family decoder layer in one call: torch.ops.mmserve_cpu.decoder_layer.
//
// Why: from Python, each of a layer's ten kernel calls and the views between them costs a few
// microseconds of dispatch on a small CPU — ~0.3 ms a layer, more than a tiny model's whole
// arithmetic and over a tenth of a mid model's decode step. This chains the same checked ops
// (ops.h) in the order the layer's modules call them (mmserve/models/qwen2.py), so its results
// are those of the unfused layer bit for bit. A linear's weight is either csrc's panels
// (packed_linear) or oneDNN's blocked copy (an mkldnn tensor: bfloat16 on CPUs with AVX512-BF16 /
// AMX, mmserve/ops/linear.py), called through the dispatcher as OneDnnLinear calls it.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

#include "kernels.h"
#include "ops.h"

namespace mmserve {
namespace {

// weights: the input norm, q/k/v (packed), o (packed), the post-attention norm, gate/up (packed),
// down (packed); qk_norms: the per-head q and k norms (Qwen3) or none.
enum Weight { kInputNorm, kQkv, kO, kPostNorm, kGateUp, kDown, kNumWeights };
// tokens for which the MLP's SwiGLU runs inside the gate/up linear (gate_up_activation)
constexpr int64_t kMinGatedRows = 4;
constexpr int64_t kMaxGatedRows = 48;

// torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], None): x Wᵀ + b over oneDNN's
// weight, what mmserve.ops.linear.OneDnnLinear calls.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view, c10::List<std::optional<c10::Scalar>>,
                               std::optional<std::string_view>);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Signature>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

// x [T, K] → [T, out_features] over either kind of packed weight.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  int64_t out_features) {
  if (weight.is_mkldnn()) return onednn_linear(x, weight, bias);
  return packed_linear_op(x, weight, bias, out_features);
}

// silu(gate) · up [T, intermediate] of h [T, hidden]: in the gate/up linear's own tasks where its
// panels allow and T is a decode batch of a few rows or more (gated_packed_linear), else the
// linear and then silu_and_mul. Measured on Zen 4 (`benchmarks.linear_cpu --shape 768 4096
// --only gate/up`: mid's MLP, bf16, weights streamed from memory), gated ÷ separate: 0.83-0.97 at
// 4-8 rows, 0.96-1.06 at 2-3, 1.02-1.19 at 1 (one row's SwiGLU is negligible, and two weight
// streams read a little slower than one), ~1.0 at 16, 1.02 at 64, 0.99 at 512.
at::Tensor gate_up_activation(const at::Tensor& h, const at::Tensor& weight, int64_t intermediate) {
  const int64_t tokens = h.size(0);
  if (!weight.is_mkldnn() && intermediate % kPanelColumns == 0 && tokens >= kMinGatedRows &&
      tokens <= kMaxGatedRows)
    return gated_packed_linear_op(h, weight, std::nullopt, 2 * intermediate);
  const at::Tensor gate_up = linear(h, weight, std::nullopt, 2 * intermediate);
  const at::Tensor activation = at::empty({h.size(0), intermediate}, gate_up.options());
  silu_and_mul_op(activation, gate_up);
  return activation;
}

at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  // heads: [T, heads, D], rows strided → a new contiguous [T, heads, D], as Qwen3Attention does.
  const at::Tensor rows = heads.reshape({-1, heads.size(2)});
  at::Tensor out = at::empty(rows.sizes(), rows.options().dtype(c10::promoteTypes(rows.scalar_type(),
                                                                                  weight.scalar_type())));
  rms_norm_op(out, rows, weight, eps);
  return out.view(heads.sizes());
}

}  // namespace

// x: [T, hidden], the previous layer's output (the embeddings when residual is none); residual:
// the stream before it. Returns this layer's MLP output; x and residual are overwritten, the
// residual (x itself when none was given) with the stream before that output.
at::Tensor decoder_layer_op(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                            const at::Tensor& positions, const at::Tensor& kv_cache,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            const at::Tensor& block_table, const at::Tensor& slot_mapping, at::TensorList weights,
                            const std::optional<at::Tensor>& qkv_bias, at::TensorList qk_norms,
                            const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                            const at::Tensor& row_of_channel, int64_t num_heads, int64_t num_kv_heads, double eps,
                            double scale) {
  TORCH_CHECK(weights.size() == kNumWeights, "decoder_layer takes ", static_cast<int>(kNumWeights),
              " weights, got ", weights.size());
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2, "qk_norms must be empty or [q_norm, k_norm]");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden], got ", x.sizes());
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache must be [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = kv_cache.size(4);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(weights[kDown].is_mkldnn() || weights[kDown].dim() == 3,
              "the down projection must be packed: [panels, intermediate, 16] or oneDNN's [hidden, intermediate]");
  const int64_t intermediate = weights[kDown].size(1);

  at::Tensor normed = x;
  if (residual.has_value()) {
    fused_add_rms_norm_op(x, *residual, weights[kInputNorm], eps);
  } else {
    normed = at::empty(x.sizes(), x.options().dtype(c10::promoteTypes(x.scalar_type(),
                                                                      weights[kInputNorm].scalar_type())));
    rms_norm_op(normed, x, weights[kInputNorm], eps);
  }
  const at::Tensor& stream = residual.has_value() ? *residual : x;

  const at::Tensor qkv = linear(normed, weights[kQkv], qkv_bias, q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  if (!qk_norms.empty()) {
    q = head_norm(q, qk_norms[0], eps);
    k = head_norm(k, qk_norms[1], eps);
  }
  mrope_op(q, k, positions, cos_cache, sin_cache, row_of_channel);
  write_kv_op(k, v, kv_cache, slot_mapping);
  const at::Tensor attention = at::empty({tokens, num_heads, head_dim}, q.options());
  paged_attention_op(attention, q, kv_cache, query_start_loc, seq_lens, block_table, scale);

  const at::Tensor h = linear(attention.view({tokens, q_size}), weights[kO], std::nullopt, hidden);
  fused_add_rms_norm_op(h, stream, weights[kPostNorm], eps);
  return linear(gate_up_activation(h, weights[kGateUp], intermediate), weights[kDown], std::nullopt, hidden);
}

}  // namespace mmserve

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def(
      "decoder_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor positions, Tensor(c!) kv_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor slot_mapping, Tensor[] weights, "
      "Tensor? qkv_bias, Tensor[] qk_norms, Tensor cos_cache, Tensor sin_cache, Tensor row_of_channel, "
      "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("decoder_layer", &mmserve::decoder_layer_op); }
// oneDNN's weights are MkldnnCPU tensors, which decide the dispatch key when in `weights`.
TORCH_LIBRARY_IMPL(mmserve_cpu, MkldnnCPU, m) { m.impl("decoder_layer", &mmserve::decoder_layer_op); }
