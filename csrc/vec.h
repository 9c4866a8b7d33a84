// Float32 vector helpers over ATen's at::vec::Vectorized, shared by every kernel.
//
// The vector width follows the CPU_CAPABILITY the library was compiled for (AVX-512: 16 floats,
// AVX2: 8, DEFAULT: an 8-float array the compiler vectorises as it can), so each kernel is
// written once. Inputs may be float or bfloat16; arithmetic is always float32.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace mmserve {

using BFloat16 = c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int kVecSize = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Loads kVecSize consecutive elements as float32.
inline Vec load_f32(const float* p) { return Vec::loadu(p); }
inline Vec load_f32(const BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

// Stores kVecSize float32 lanes, rounding to nearest-even for bfloat16.
inline void store_f32(float* p, const Vec& v) { v.store(p); }
inline void store_f32(BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));  // 1 instruction, not 7
#else
  at::vec::convert_float_bfloat16(v, v).store(p, kVecSize);
#endif
}

// Rounds each lane to T's precision and back (identity for float): reproduces the dtype
// round trips of the torch references, e.g. `normed.to(x.dtype)` before a multiply.
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
    // vcvtneps2bf16 rounds to nearest even (denormal inputs to zero), then back to float32.
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
#elif defined(CPU_CAPABILITY_AVX512)
    // In registers: round to nearest even on the low 16 bits (NaN lanes left as they are).
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __m512 rounded =
        _mm512_castsi512_ps(_mm512_and_si512(biased, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v, rounded);
#else
    __at_align__ BFloat16 packed[2 * kVecSize];
    at::vec::convert_float_bfloat16(v, v).store(packed);
    Vec out;
    at::vec::load_fp32_from_bf16(packed, out);
    return out;
#endif
  }
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// out[i] = round_to<T>(silu(gate[i])) · up[i] for i < n, rounded to T: F.silu(gate) * up with
// the bfloat16 intermediate the torch reference materialises. Shared by silu_and_mul
// (elementwise.cpp) and the gate/up linear that applies it to its own output (linear.cpp), so the
// two agree bit for bit: spans that start on a multiple of kVecSize take the same vector lanes.
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t n) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) {
    const Vec g = load_f32(gate + i);
    store_f32(out + i, round_to<T>(g / (one + g.neg().exp())) * load_f32(up + i));
  }
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(round_to<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}

}  // namespace mmserve
