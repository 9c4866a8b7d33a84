// The vision tower's elementwise ops, each one pass over its rows instead of torch's three to
// five: the 2-D rotary embedding applied in place to q and k, and quick_gelu (x·σ(1.702·x)).
// Contracts: `vision_rotary` and `quick_gelu` in mmserve/ops/reference.py. The rotary runs in
// float32 whatever the input dtype and rounds once at the end (as the reference, and
// transformers' apply_rotary_pos_emb_vision, do); quick_gelu rounds a bfloat16 input where
// the reference's bfloat16 ops round.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "dtype.h"
#include "exp2_avx512.h"
#include "vec.h"

namespace mmserve {
namespace {

Dtype dtype_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? Dtype::kFloat32 : Dtype::kBFloat16;
}

// x: [N, H, D] (last dim contiguous, rows and heads strided), cos/sin: [N, D / 2] float32.
template <typename T>
void rotate_rows(T* x, int64_t rows, int64_t heads, int64_t half, int64_t token_stride, int64_t head_stride,
                 const float* cos, const float* sin) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_stride;
        T* x2 = x1 + half;
        int64_t i = 0;
        for (; i + kVecSize <= half; i += kVecSize) {
          const Vec a = load_f32(x1 + i), b = load_f32(x2 + i);
          const Vec cv = Vec::loadu(c + i), sv = Vec::loadu(s + i);
          store_f32(x1 + i, a * cv - b * sv);
          store_f32(x2 + i, b * cv + a * sv);
        }
        for (; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          x1[i] = static_cast<T>(a * c[i] - b * s[i]);
          x2[i] = static_cast<T>(b * c[i] + a * s[i]);
        }
      }
    }
  });
}

void vision_rotary_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const Dtype dtype = dtype_of(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [N, H, D], contiguous in D");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(0) == x.size(0) && table->size(1) == half,
                "cos and sin must be contiguous float32 [N, D / 2] = [", x.size(0), ", ", half, "], got ",
                table->sizes());
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rotate_rows(static_cast<T*>(x.data_ptr()), x.size(0), x.size(1), half, x.stride(0), x.stride(1),
                cos.const_data_ptr<float>(), sin.const_data_ptr<float>());
  });
}

// out = x · σ(1.702 · x) for n elements, rounded where the reference rounds: 1.702 · x and σ to
// T, then the product. With AVX-512, σ from exp2_avx512.h's polynomial and a reciprocal, and
// the roundings by vcvtneps2bf16 where the CPU has it: 2.7-3.9 ms against 7.3-7.4 for ATen's
// exp, a division and bit-twiddled roundings (mid's 4,032 × 2,560 bf16, 2-core Emerald Rapids,
// alternated processes); elsewhere ATen's vectorised exp.
template <typename T>
void quick_gelu_span(const T* src, T* dst, int64_t n) {
  const Vec alpha(1.702f);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) {
    const Vec v = load_f32(src + i);
    const Vec scaled = round_to<T>(alpha * v);
#if defined(CPU_CAPABILITY_AVX512)
    const Vec sigmoid = sigmoid_accurate(scaled);
#else
    const Vec sigmoid = Vec(1.f) / (Vec(1.f) + scaled.neg().exp());
#endif
    store_f32(dst + i, v * round_to<T>(sigmoid));
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(src[i]);
    const float scaled = round_to<T>(1.702f * v);
    dst[i] = static_cast<T>(v * round_to<T>(1.f / (1.f + std::exp(-scaled))));
  }
}

// out = quick_gelu(x); x and out contiguous, the same shape and dtype.
void quick_gelu_op(const at::Tensor& out, const at::Tensor& x) {
  const Dtype dtype = dtype_of(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "quick_gelu: x and out must be contiguous tensors of one shape and dtype");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(x.const_data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
      quick_gelu_span(src + begin, dst + begin, end - begin);
    });
  });
}

}  // namespace
}  // namespace mmserve

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def("vision_rotary(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("quick_gelu(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("vision_rotary", &mmserve::vision_rotary_op);
  m.impl("quick_gelu", &mmserve::quick_gelu_op);
}
