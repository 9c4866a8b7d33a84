// Long prompt chunks of a paged-attention call, through torch's flash attention for the CPU.
//
// Why: the tile engine (attention_tile.h) computes scores and values in vector registers; a long
// prompt's attention is two matrix products per tile, which torch's flash kernel runs as blocked
// GEMMs (oneDNN's brgemm: AMX tiles in bfloat16 where the CPU has them). Measured on a 2-core
// Sapphire Rapids, 12 query heads over 4 kv heads, head_dim 64 (BENCHMARKS.md, "Prompt attention
// through torch's flash kernel"): a 1024-token prompt 3.8× faster in bfloat16, 1.5× in float32; at
// 128 tokens 2.0× and 1.0×; at 32–64 the tile engine is faster, so shorter chunks stay on it.
// On an AVX2-only AMD EPYC SDPA was faster than the tile engine for a 1024-patch image (1.5×)
// and slower for segments of 64–256 (the vision tower's measurements, mmserve/ops/kernels.py):
// there only chunks of 512 or more go to it (between the two; not measured for prompts).
// Its bfloat16 differs from the tile engine's as every bfloat16 flash attention does (softmax
// probabilities rounded to bfloat16 before the product with V); float32 agrees to 1e-6.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "attention_plan.h"

namespace mmserve {

#ifdef CPU_CAPABILITY_AVX512
constexpr int32_t kPromptAttentionMinQueries = 128;
#else
constexpr int32_t kPromptAttentionMinQueries = 512;
#endif

// out rows of `sequence` (causal: its queries are the last of its keys) ← attention of its query
// rows over its keys, gathered from kv_cache through `blocks` (its block table row, ids checked).
void prompt_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const attention::Sequence& sequence, const int32_t* blocks, double scale);

}  // namespace mmserve
