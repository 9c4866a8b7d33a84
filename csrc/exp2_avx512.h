// 2^x in AVX-512 for the kernels' exponentials (AVX-512 builds only): 2^n · 2^f with n an
// integer next to x, 2^f by a polynomial fitted for relative error, 2^n applied by vscalefps; no
// table. Each variant is as accurate as its caller needs and no more.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstddef>

namespace mmserve {

constexpr float kLog2E = 1.4426950408889634f;

// Σ c[i] · f^(N−1−i) by Horner's rule: `coefficients` from the highest degree down.
template <std::size_t N>
inline __m512 polynomial(__m512 f, const float (&coefficients)[N]) {
  __m512 p = _mm512_set1_ps(coefficients[0]);
  for (std::size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coefficients[i]));
  return p;
}

// 2^f on [0, 1) by degree 5 (relative error under 1.6e-7 in float32 arithmetic): rounded to
// bfloat16, all but ~1e-5 of its results round as the exact 2^f does (as ATen's exp's do),
// where a degree-4 fit (2.7e-6) rounds a few in 10^4 otherwise.
constexpr float kExp2Degree5[] = {1.8778159207033958e-3f, 8.98876244522978e-3f, 5.582680134179193e-2f,
                                  0.24015345443050998f,   0.6931530919151266f,  0.9999999247316569f};

// 2^x for x ≤ 0, and 0 below 2^−126 (so −inf and NaN give 0, and no result is denormal): 2^⌊x⌋ ·
// 2^f with f = x − ⌊x⌋ by vreduceps, 2^f by kExp2Degree5, 2^⌊x⌋ applied by vscalefps. 9
// instructions (as the degree-4 fit it replaced) where ATen's exp_u20 and the subtraction and
// scaling before it take 21. Degree 5 because varlen_attention_dot.cpp rounds these
// probabilities to bfloat16 for P · V: with degree 4, 6e-4 of them rounded otherwise than the
// exact ones (tests/unit/ops/test_cpu_varlen_attention.py), enough to move a bfloat16 model's
// logits by rounding steps against transformers'. Its fifth FMA replaced a subtraction (vreduceps
// yields f): the kernel's time is unchanged within noise.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 p = polynomial(_mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF), kExp2Degree5);
  const __mmask16 representable = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(representable, p, x);
}

// For finite x ≤ 0 in the lanes of `lanes`, 0 in the others; degree 4 (relative error under
// 2.7e-6, where bfloat16's rounding of a softmax's probabilities is 2^−9). Below 2^−126 the
// result is flushed to 0 only under MXCSR's flush-to-zero, which the caller sets: 7 instructions.
// Kept for the AMX varlen kernel, whose bfloat16 probabilities so round otherwise than the exact
// ones' for a few in 10^4: kExp2Degree5 here, one FMA more, took it 6-8 % longer on a 2-core
// Emerald Rapids.
inline __m512 exp2_flushed(__m512 x, __mmask16 lanes) {
  constexpr float kCoefficients[] = {1.3534147292375565e-2f, 5.201150104403496e-2f, 0.2414427399635315f,
                                     0.6930038332939148f, 1.0000026226043701f};
  const __m512 p = polynomial(_mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF), kCoefficients);
  return _mm512_maskz_scalef_ps(lanes, p, x);
}

// For finite x in [−150, 127]; degree 5 (relative error under 1.6e-7 in float32 arithmetic,
// about that of a correctly rounded float32 result's neighbours), 2^x below 2^−149 is 0.
inline __m512 exp2_accurate(__m512 x) {
  return _mm512_scalef_ps(polynomial(_mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF), kExp2Degree5), x);
}

// σ(s) = 1 / (1 + 2^t), t = −s · log2 e clamped to [−150, 126] (beyond, σ is 1 or under 2^−126,
// and 1 + 2^t stays finite); the reciprocal by vrcp14ps and one Newton step (relative 2^−28).
// NaN lanes stay NaN (vmaxps / vminps return their second operand where one is NaN).
inline __m512 sigmoid_accurate(__m512 s) {
  __m512 t = _mm512_mul_ps(s, _mm512_set1_ps(-kLog2E));
  t = _mm512_min_ps(_mm512_set1_ps(126.f), _mm512_max_ps(_mm512_set1_ps(-150.f), t));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_accurate(t));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

}  // namespace mmserve

#endif
