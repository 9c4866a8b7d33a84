// Register-blocked float32 micro-kernels of the attention tile: scores = Q·Kᵀ as dot products
// over head_dim (K rows are read where they lie, so no transposed copy is made), and
// acc += P·V. Block sizes keep every accumulator in a register on AVX2's 16 vector registers.
#pragma once

#include <cstdint>

#include "vec.h"

namespace mmserve::attention {

constexpr int kScoreRows = 2;  // query rows per score block
constexpr int kScoreKeys = 4;  // keys per score block
constexpr int kValueRows = 4;  // query rows per P·V block
constexpr int kValueVecs = 3;  // head_dim vectors per P·V block

// The value, kept in a register: GCC otherwise folds a load used by several FMAs into each of
// them, loading a key once per query row (the score kernel then waits on loads, not FMAs).
inline Vec in_register(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 raw = v;
  asm("" : "+v"(raw));
  return Vec(raw);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 raw = v;
  asm("" : "+x"(raw));
  return Vec(raw);
#else
  return v;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// [Σ lanes of acc[0], …, Σ lanes of acc[3]]: unpack/shuffle adds leave the four sums side by side
// in each 128-bit lane, then the four lanes are folded: 13 instructions instead of ~32.
inline __m128 four_lane_sums(const Vec* acc) {
  const __m512 a = acc[0], b = acc[1], c = acc[2], d = acc[3];
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d per lane
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(sums), _mm512_extractf32x8_ps(sums, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

// out[n] = Σ lanes of acc[n] for the N = MR * kScoreKeys accumulators of a score block.
template <int N>
inline void lane_sums(const Vec* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  // hadd trees: 8 sums for 9 instructions instead of 6 per accumulator.
  static_assert(N == 4 || N == 8);
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]);
  const __m256 t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [Σ₀₋₃ of acc 0..3 | Σ₄₋₇ of acc 0..3]
  if constexpr (N == 4) {
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1)));
  } else {
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]);
    const __m256 t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u1 = _mm256_hadd_ps(t2, t3);
    const __m256 low = _mm256_permute2f128_ps(u0, u1, 0x20);
    const __m256 high = _mm256_permute2f128_ps(u0, u1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(low, high));
  }
#elif defined(CPU_CAPABILITY_AVX512)
  static_assert(N % 4 == 0);
  for (int n = 0; n < N; n += 4) _mm_storeu_ps(out + n, four_lane_sums(acc + n));
#else
  for (int n = 0; n < N; ++n) out[n] = reduce_sum(acc[n]);
#endif
}

// scores[i * lds + j] = q_i · k_j for MR query rows (row stride ldq) and kScoreKeys keys.
template <int MR>
inline void score_block(const float* q, int ldq, const float* const* k, int head_dim, float* scores,
                        int lds) {
  Vec acc[MR * kScoreKeys];
  for (int a = 0; a < MR * kScoreKeys; ++a) acc[a] = Vec(0.f);
  int d = 0;
  for (; d + kVecSize <= head_dim; d += kVecSize) {
    Vec queries[MR];
    for (int i = 0; i < MR; ++i) queries[i] = Vec::loadu(q + i * ldq + d);
    for (int j = 0; j < kScoreKeys; ++j) {
      const Vec key = in_register(Vec::loadu(k[j] + d));
      for (int i = 0; i < MR; ++i) acc[i * kScoreKeys + j] = at::vec::fmadd(queries[i], key, acc[i * kScoreKeys + j]);
    }
  }
  float sums[MR * kScoreKeys];
  lane_sums<MR * kScoreKeys>(acc, sums);
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kScoreKeys; ++j) {
      float sum = sums[i * kScoreKeys + j];
      for (int t = d; t < head_dim; ++t) sum += q[i * ldq + t] * k[j][t];
      scores[i * lds + j] = sum;
    }
  }
}

// acc_i[d0, d0 + DR * kVecSize) += Σ_n p_i[n] · v_n[same range] for MR rows.
template <int MR, int DR>
inline void pv_block(const float* p, int ldp, const float* const* v, int num_keys, float* acc, int lda,
                     int d0) {
  Vec sum[MR][DR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < DR; ++r) sum[i][r] = Vec::loadu(acc + i * lda + d0 + r * kVecSize);
  for (int n = 0; n < num_keys; ++n) {
    Vec values[DR];
    for (int r = 0; r < DR; ++r) values[r] = Vec::loadu(v[n] + d0 + r * kVecSize);
    for (int i = 0; i < MR; ++i) {
      const Vec weight(p[i * ldp + n]);
      for (int r = 0; r < DR; ++r) sum[i][r] = at::vec::fmadd(weight, values[r], sum[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < DR; ++r) sum[i][r].store(acc + i * lda + d0 + r * kVecSize);
}

// acc_i += Σ_n p_i[n] · v_n over all of head_dim for MR rows.
template <int MR>
inline void pv_rows(const float* p, int ldp, const float* const* v, int num_keys, float* acc, int lda,
                    int head_dim) {
  const int num_vecs = head_dim / kVecSize;
  int r = 0;
  // Blocks of 3 vectors, ending 2 + 2 rather than 3 + 1 (a 1-vector block is load-bound).
  for (; num_vecs - r >= kValueVecs && num_vecs - r != 4; r += kValueVecs)
    pv_block<MR, kValueVecs>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  for (; num_vecs - r >= 2; r += 2) pv_block<MR, 2>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  if (num_vecs - r == 1) pv_block<MR, 1>(p, ldp, v, num_keys, acc, lda, r * kVecSize);
  for (int n = 0; n < num_keys; ++n)
    for (int i = 0; i < MR; ++i)
      for (int t = num_vecs * kVecSize; t < head_dim; ++t) acc[i * lda + t] += p[i * ldp + n] * v[n][t];
}

// Asks for the 64-byte line at p, into L2: a prefetch into L1 holds one of the few L1 miss
// buffers until the line arrives, and with a whole step's K/V lines asked for ahead those ran out
// and stalled the decode loop (perf: ~13 % of its samples on the instruction after a prefetcht0).
// On x86 an asm statement, not __builtin_prefetch: GCC 12 deletes a loop whose only effect is
// __builtin_prefetch once it is inlined (prefetch_lines was).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for lines [first, end) of `rows` (each `lines_per_row` 64-byte lines), ahead of their use.
// One division per call, not per line: an integer division costs more than the prefetch itself.
inline void prefetch_lines(const void* const* rows, int64_t lines_per_row, int64_t first, int64_t end) {
  if (first >= end) return;
  int64_t row = first / lines_per_row;
  int64_t line = first - row * lines_per_row;
  for (int64_t n = first; n < end; ++n) {
    prefetch_line(static_cast<const char*>(rows[row]) + line * 64);
    if (++line == lines_per_row) {
      line = 0;
      ++row;
    }
  }
}

}  // namespace mmserve::attention
