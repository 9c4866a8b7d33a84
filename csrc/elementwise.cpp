// Row-wise kernels: KV-cache write, RMSNorm (plain and fused with the residual add), SiLU-and-mul,
// M-RoPE. One translation unit so the at::vec headers are parsed once per build.
//
// bfloat16 results reproduce the references' rounding: wherever the torch code materialises a
// bfloat16 intermediate (`normed.to(x.dtype)`, `F.silu(gate)`, each product of the rotary
// formula) the kernel rounds to bfloat16 at the same point.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace mmserve {
namespace {

// Rows per parallel task, so small calls (one decode token) stay on the calling thread.
int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

template <typename src_t, typename dst_t>
void copy_row(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    std::memcpy(dst, src, n * sizeof(src_t));
  } else {
    int64_t i = 0;
    for (; i + kVecSize <= n; i += kVecSize) store_f32(dst + i, load_f32(src + i));
    for (; i < n; ++i) dst[i] = static_cast<dst_t>(static_cast<float>(src[i]));
  }
}

template <typename x_t>
float sum_of_squares(const x_t* x, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kVecSize <= n; i += 2 * kVecSize) {
    const Vec a = load_f32(x + i), b = load_f32(x + i + kVecSize);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  for (; i + kVecSize <= n; i += kVecSize) {
    const Vec a = load_f32(x + i);
    acc0 = at::vec::fmadd(a, a, acc0);
  }
  float sum = reduce_sum(acc0 + acc1);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return sum;
}

float inverse_rms(float sum_of_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_of_squares / static_cast<float>(n) + eps);
}

// out = weight * (x * rstd rounded to x's dtype).
template <typename x_t, typename w_t, typename out_t>
void scale_row(const x_t* x, const w_t* weight, out_t* out, int64_t n, float rstd) {
  const Vec factor(rstd);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize)
    store_f32(out + i, load_f32(weight + i) * round_to<x_t>(load_f32(x + i) * factor));
  for (; i < n; ++i)
    out[i] = static_cast<out_t>(static_cast<float>(weight[i]) * round_to<x_t>(static_cast<float>(x[i]) * rstd));
}

// residual = x + residual, rounded to the dtype as the unfused add is.
template <typename x_t>
void add_into(const x_t* x, x_t* residual, int64_t n) {
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) store_f32(residual + i, load_f32(x + i) + load_f32(residual + i));
  for (; i < n; ++i) residual[i] = static_cast<x_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
}

// Rotates every head of one token in place: x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin.
template <typename T>
void rotate_heads(T* x, int64_t num_heads, int64_t head_stride, const float* cos, const float* sin,
                  int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    int64_t i = 0;
    for (; i + kVecSize <= half; i += kVecSize) {
      const Vec a = load_f32(x1 + i), b = load_f32(x2 + i);
      const Vec c = Vec::loadu(cos + i), s = Vec::loadu(sin + i);
      store_f32(x1 + i, round_to<T>(a * c) - round_to<T>(b * s));
      store_f32(x2 + i, round_to<T>(b * c) + round_to<T>(a * s));
    }
    for (; i < half; ++i) {
      const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
      x1[i] = static_cast<T>(round_to<T>(a * cos[i]) - round_to<T>(b * sin[i]));
      x2[i] = static_cast<T>(round_to<T>(b * cos[i]) + round_to<T>(a * sin[i]));
    }
  }
}

}  // namespace

void write_kv(const WriteKvArgs& args) {
  const int64_t row = args.num_kv_heads * args.head_dim;
  dispatch_dtype(args.key.dtype, [&](auto src_tag) {
    using src_t = decltype(src_tag);
    dispatch_dtype(args.cache_dtype, [&](auto dst_tag) {
      using dst_t = decltype(dst_tag);
      dst_t* keys = static_cast<dst_t*>(args.kv_cache);
      dst_t* values = keys + args.num_slots * row;
      const src_t* k = static_cast<const src_t*>(args.key.data);
      const src_t* v = static_cast<const src_t*>(args.value.data);
      at::parallel_for(0, args.num_tokens, rows_per_task(2 * row), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t slot = args.slots[t];
          if (slot < 0) continue;  // padding row
          for (int64_t h = 0; h < args.num_kv_heads; ++h) {
            copy_row(k + t * args.key.token_stride + h * args.key.head_stride,
                     keys + slot * row + h * args.head_dim, args.head_dim);
            copy_row(v + t * args.value.token_stride + h * args.value.head_stride,
                     values + slot * row + h * args.head_dim, args.head_dim);
          }
        }
      });
    });
  });
}

void rms_norm(const RmsNormArgs& args) {
  dispatch_dtype(args.x.dtype, [&](auto x_tag) {
    using x_t = decltype(x_tag);
    dispatch_dtype(args.weight_dtype, [&](auto w_tag) {
      using w_t = decltype(w_tag);
      // `weight * normed.to(x.dtype)` is bfloat16 only when both are.
      using out_t = std::conditional_t<std::is_same_v<x_t, w_t>, x_t, float>;
      const x_t* x = static_cast<const x_t*>(args.x.data);
      const w_t* weight = static_cast<const w_t*>(args.weight);
      out_t* out = static_cast<out_t*>(args.out.data);
      at::parallel_for(0, args.num_tokens, rows_per_task(args.hidden), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const x_t* row = x + t * args.x.token_stride;
          const float rstd = inverse_rms(sum_of_squares(row, args.hidden), args.hidden, args.eps);
          scale_row(row, weight, out + t * args.out.token_stride, args.hidden, rstd);
        }
      });
    });
  });
}

void fused_add_rms_norm(const FusedAddRmsNormArgs& args) {
  dispatch_dtype(args.x.dtype, [&](auto x_tag) {
    using x_t = decltype(x_tag);
    dispatch_dtype(args.weight_dtype, [&](auto w_tag) {
      using w_t = decltype(w_tag);
      x_t* x = static_cast<x_t*>(args.x.data);
      x_t* residual = static_cast<x_t*>(args.residual.data);
      const w_t* weight = static_cast<const w_t*>(args.weight);
      at::parallel_for(0, args.num_tokens, rows_per_task(args.hidden), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          x_t* row = x + t * args.x.token_stride;
          x_t* total = residual + t * args.residual.token_stride;
          add_into(static_cast<const x_t*>(row), total, args.hidden);
          const float rstd = inverse_rms(sum_of_squares(total, args.hidden), args.hidden, args.eps);
          scale_row(static_cast<const x_t*>(total), weight, row, args.hidden, rstd);
        }
      });
    });
  });
}

void silu_and_mul(const SiluAndMulArgs& args) {
  const int64_t d = args.width;
  dispatch_dtype(args.gate_up.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(args.gate_up.data);
    T* dst = static_cast<T*>(args.out.data);
    at::parallel_for(0, args.num_tokens, rows_per_task(d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = src + t * args.gate_up.token_stride;
        silu_mul_span(gate, gate + d, dst + t * args.out.token_stride, d);
      }
    });
  });
}

void mrope(const MropeArgs& args) {
  const int64_t half = args.head_dim / 2;
  dispatch_dtype(args.query.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* q = static_cast<T*>(args.query.data);
    T* k = static_cast<T*>(args.key.data);
    at::parallel_for(0, args.num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> cos(half), sin(half);  // one token's cos/sin, rounded to T as the reference casts
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c = 0; c < half; ++c) {
          const int64_t p = args.positions[args.row_of_channel[c] * args.position_row_stride +
                                           t * args.position_token_stride];
          cos[c] = round_to<T>(args.cos_cache[p * half + c]);
          sin[c] = round_to<T>(args.sin_cache[p * half + c]);
        }
        rotate_heads(q + t * args.query.token_stride, args.num_heads, args.query.head_stride, cos.data(),
                     sin.data(), half);
        rotate_heads(k + t * args.key.token_stride, args.num_kv_heads, args.key.head_stride, cos.data(),
                     sin.data(), half);
      }
    });
  });
}

}  // namespace mmserve
