// Long prompt chunks of a paged-attention call, through torch's flash attention for the CPU.
//
// Why: the tile engine (attention_tile.h) computes scores and values in vector registers; a long
// prompt's attention is two matrix products per tile, which torch's flash kernel runs as blocked
// GEMMs (oneDNN's brgemm: AMX tiles in bfloat16 where the CPU has them). Measured on a 2-core
// Sapphire Rapids, 12 query heads over 4 kv heads, head_dim 64 (benchmarks/prompt_attention_cpu.py,
// BENCHMARKS.md "Sapphire Rapids"): the flash kernel is 1.4× faster for a 64-token prompt in
// bfloat16 (1.0× in float32), 4.4× (1.6×) at 1024 tokens, 2.6× (1.3×) for 64 tokens after 960
// cached keys; at 32 tokens the tile engine is faster, so shorter chunks (and decode rows) stay
// on it. On an AVX2-only AMD EPYC SDPA was faster than the tile engine for a 1024-patch image
// (1.5×) and slower for segments of 64–256 (the vision tower's measurements,
// mmserve/ops/kernels.py): there only chunks of 512 or more go to it (not measured for prompts).
// Its bfloat16 differs from the tile engine's as every bfloat16 flash attention does (softmax
// probabilities rounded to bfloat16 before the product with V); float32 agrees to 1e-6.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "attention_plan.h"

namespace mmserve {

#ifdef CPU_CAPABILITY_AVX512
constexpr int32_t kPromptAttentionMinQueries = 64;
#else
constexpr int32_t kPromptAttentionMinQueries = 512;
#endif

// out rows of `sequence` (causal: its queries are the last of its keys) ← attention of its query
// rows over its keys, gathered from kv_cache through `blocks` (its block table row, ids checked).
void prompt_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const attention::Sequence& sequence, const int32_t* blocks, double scale);

}  // namespace mmserve
