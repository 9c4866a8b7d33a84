// Linear layers over weights packed into column panels, float32 or bfloat16.
//
// The weight [N, K] is packed once, after loading, into panels of 16 output columns:
// packed[p][k][·] holds W[16p .. 16p + 15][k] (zero past N). float32 panels hold the 16 columns
// in order (two 256-bit loads per k). bfloat16 panels are interleaved so that 32-bit word j
// carries column j in its low half and column j + 8 in its high half: one 256-bit load then gives
// both halves as float32 with one shift and one mask (a bfloat16 is the top half of a float32),
// no cross-lane shuffles in the inner loop. A tile of up to 6 rows × 16 columns accumulates over
// the whole K in 12 float32 registers with FMA; at one or two rows the K loop is unrolled into
// independent accumulators, because there the FMA latency, not the bandwidth, would bound it. Small M is memory-bound (bfloat16 weights are half the bytes of
// float32 ones), so the weight is prefetched a fixed distance ahead of the row being read (but
// for one float32 row, which streams faster with the hardware prefetcher alone).
//
// On CPUs with AVX512-BF16 (built with MMSERVE_BF16_DOT) bfloat16 panels instead hold pairs of
// K: the 64 bytes at k (even) are W[16p + c][k], W[16p + c][k + 1] for c = 0..15, one zmm word per
// column, which is what vdpbf16ps multiplies by a broadcast pair of bfloat16 inputs: 32
// multiply-adds per instruction with no conversion, so a bfloat16 linear is bound by the memory
// at a few rows and by vdpbf16ps above (float32 inputs over such panels widen each pair with one
// shift and one mask). An odd K's last row is kept as 16 plain columns at (K - 1) · 16.
//
// Work is split over (row chunk, panel) with panels fastest: a chunk of rows stays in L2 while
// the weight streams past it; within a task K is blocked so the panel's block stays in L1.
// Above 6 rows a block is read by several tiles, of which only the first would stream it from
// memory, leaving the memory idle while the others compute from L1: so each tile of such a chunk
// also prefetches (into L2) its share of the weight's next block, and the stream keeps moving
// (float32 only: bfloat16 tiles of those heights are bound by their arithmetic, not the memory).
//
// Where the CPU has AMX (built with MMSERVE_AMX) a bfloat16 linear of two rows or more runs on
// AMX tiles over the same K-pair panels instead (linear_amx.h): tasks of up to 512 rows times two
// adjacent panels, so a panel pair read once from memory serves all of a chunk's rows.
//
// A gated linear (the MLP's gate/up projection) pairs gate panel p with up panel p + d/16 in one
// task and applies SiLU-and-mul to those 16 columns of its rows while they are in L1: no
// separate pass over the [rows, 2d] output, and the activation is computed by every thread
// instead of by the calling thread alone (at decode sizes the standalone kernel stays below
// the parallel threshold).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define MMSERVE_LINEAR_AVX2 1
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(MMSERVE_BF16_DOT)
#define MMSERVE_LINEAR_BF16_DOT 1
#endif
#if defined(MMSERVE_LINEAR_BF16_DOT) && defined(MMSERVE_AMX)
#include "linear_amx.h"
#define MMSERVE_LINEAR_AMX 1
#endif

namespace mmserve {
namespace {

using BFloat16 = c10::BFloat16;
constexpr int64_t kPanel = kPanelColumns;  // output columns per panel
constexpr int kMaxTileRows = 6;  // 12 accumulators + weights + broadcast fit AVX2's 16 registers
constexpr int64_t kChunkRows = 48;
// float32 rows up to which a linear is bound by the weight's bandwidth: 2M flops per 4-byte weight
// against ~8 flops per byte of memory bandwidth on a 2-core AVX2 machine
constexpr int64_t kMemoryBoundRows = 16;
constexpr int64_t kPrefetchBytes = 4096;  // ahead of the panel row being read (2 and 8 KiB: no better)
constexpr int64_t kLine = 64;             // bytes per cache line
constexpr int64_t kDepth = 256;  // K per block: 256 × 16 float32 = 16 KiB of panel (L1: 32 KiB)

// Where W[16p + c][k] lives in its panel (c = 0..15): row k of 16 columns, in order for float32,
// interleaved for bfloat16 (column c and c + 8 share a 32-bit word); or, for bfloat16 panels of
// K pairs, word c of the pair's 64 bytes.
template <typename p_t>
inline int64_t panel_offset(int64_t k, int64_t c, int64_t k_size) {
  if constexpr (std::is_same_v<p_t, float>) return k * kPanel + c;
#ifdef MMSERVE_LINEAR_BF16_DOT
  if (k + 1 < k_size || k_size % 2 == 0) return (k & ~int64_t{1}) * kPanel + 2 * c + (k & 1);
  return k * kPanel + c;  // an odd K's last row
#else
  (void)k_size;
  return k * kPanel + (c < 8 ? 2 * c : 2 * (c - 8) + 1);
#endif
}

template <typename w_t, typename p_t>
void pack_panels(const PackWeightArgs& args, int64_t begin, int64_t end) {
  const w_t* weight = static_cast<const w_t*>(args.weight);
  p_t* packed = static_cast<p_t*>(args.packed);
  const int64_t k_size = args.in_features;
  for (int64_t p = begin; p < end; ++p) {
    p_t* panel = packed + p * k_size * kPanel;
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t n = p * kPanel + c;
      for (int64_t k = 0; k < k_size; ++k)
        panel[panel_offset<p_t>(k, c, k_size)] =
            static_cast<p_t>(n < args.out_features ? static_cast<float>(weight[n * args.row_stride + k]) : 0.f);
    }
  }
}

// Lines to prefetch into L2 while a tile runs, spread evenly over its K loop.
struct FarPrefetch {
  const char* begin = nullptr;
  int64_t lines = 0;
};

#ifdef MMSERVE_LINEAR_AVX2
// Row k of a panel (16 columns) as float32: columns 0-7 (low) and 8-15 (high).
inline __m256 low_columns(const float* row) { return _mm256_loadu_ps(row); }
inline __m256 high_columns(const float* row) { return _mm256_loadu_ps(row + 8); }
inline __m256 low_columns(const BFloat16* row) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), 16));
}
inline __m256 high_columns(const BFloat16* row) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)),
                                              _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// acc[r][0..15] (+)= Σ_k x[r][k] · panel column; R rows, U independent accumulators per row.
// The accumulators are plain local arrays indexed by unrolled constants (no lambda or pointer
// to them), so they stay in registers.
// kFar: whether `far` is used at all; a tile without it has no extra loop in its K loop (with the
// loop compiled in, bfloat16 linears at M = 8 measured ~60 % slower).
template <int R, int U, bool kFar, typename p_t>
void tile(const float* x, int64_t x_stride, const p_t* panel, int64_t k_size, float* acc, bool accumulate,
          FarPrefetch far) {
  const int64_t iterations = k_size / U;
  int64_t far_due = 0;  // far.lines per iteration, counted in 1/iterations of a line
  __m256 lo[U][R], hi[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) lo[u][r] = hi[u][r] = _mm256_setzero_ps();
  if (accumulate)
    for (int r = 0; r < R; ++r) {
      lo[0][r] = _mm256_loadu_ps(acc + r * kPanel);
      hi[0][r] = _mm256_loadu_ps(acc + r * kPanel + 8);
    }
  constexpr int64_t kStepBytes = U * kPanel * sizeof(p_t);  // panel bytes per iteration
  int64_t k = 0;
  for (; k + U <= k_size; k += U) {
    // The weight streams from memory once per call: the hardware prefetcher alone falls behind
    // (measured: BENCHMARKS.md, "CPU linear layers") — except for one row of float32, since the
    // weights are on huge pages: there the prefetches cost 7–19 % of the time (mid shapes,
    // alternating; one row of bfloat16 is 9–11 % slower without them).
    if constexpr (R > 1 || !std::is_same_v<p_t, float>) {
      const char* ahead = reinterpret_cast<const char*>(panel + k * kPanel) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (kStepBytes > kLine) _mm_prefetch(ahead + kLine, _MM_HINT_T0);
      if constexpr (kStepBytes > 2 * kLine) {
        _mm_prefetch(ahead + 2 * kLine, _MM_HINT_T0);
        _mm_prefetch(ahead + 3 * kLine, _MM_HINT_T0);
      }
    }
    if constexpr (kFar)
      for (far_due += far.lines; far_due >= iterations; far_due -= iterations, far.begin += kLine)
        _mm_prefetch(far.begin, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256 w_lo = low_columns(panel + (k + u) * kPanel), w_hi = high_columns(panel + (k + u) * kPanel);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + k + u);
        lo[u][r] = _mm256_fmadd_ps(xr, w_lo, lo[u][r]);
        hi[u][r] = _mm256_fmadd_ps(xr, w_hi, hi[u][r]);
      }
    }
  }
  for (; k < k_size; ++k) {
    const __m256 w_lo = low_columns(panel + k * kPanel), w_hi = high_columns(panel + k * kPanel);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + k);
      lo[0][r] = _mm256_fmadd_ps(xr, w_lo, lo[0][r]);
      hi[0][r] = _mm256_fmadd_ps(xr, w_hi, hi[0][r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    __m256 sum_lo = lo[0][r], sum_hi = hi[0][r];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) {
      sum_lo = _mm256_add_ps(sum_lo, lo[u][r]);
      sum_hi = _mm256_add_ps(sum_hi, hi[u][r]);
    }
    _mm256_storeu_ps(acc + r * kPanel, sum_lo);
    _mm256_storeu_ps(acc + r * kPanel + 8, sum_hi);
  }
}
#else
template <int R, int U, bool kFar, typename p_t>
void tile(const float* x, int64_t x_stride, const p_t* panel, int64_t k_size, float* acc, bool accumulate,
          FarPrefetch) {
  if (!accumulate) std::fill(acc, acc + R * kPanel, 0.f);
  for (int64_t k = 0; k < k_size; ++k)
    for (int64_t c = 0; c < kPanel; ++c) {
      const float w = static_cast<float>(panel[panel_offset<p_t>(k, c, k_size)]);
      for (int r = 0; r < R; ++r) acc[r * kPanel + c] += x[r * x_stride + k] * w;
    }
}
#endif

template <bool kFar, typename p_t>
void run_tile_rows(int rows, const float* x, int64_t x_stride, const p_t* panel, int64_t k_size, float* acc,
                   bool accumulate, FarPrefetch far) {
  switch (rows) {
    case 1: return tile<1, 4, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
    case 2: return tile<2, 2, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
    case 3: return tile<3, 2, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
    case 4: return tile<4, 1, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
    case 5: return tile<5, 1, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
    default: return tile<6, 1, kFar>(x, x_stride, panel, k_size, acc, accumulate, far);
  }
}

template <typename p_t>
void run_tile(int rows, const float* x, int64_t x_stride, const p_t* panel, int64_t k_size, float* acc,
              bool accumulate, FarPrefetch far) {
  if (far.lines > 0) return run_tile_rows<true>(rows, x, x_stride, panel, k_size, acc, accumulate, far);
  run_tile_rows<false>(rows, x, x_stride, panel, k_size, acc, accumulate, far);
}

// Rows of the next tile: the remaining rows in equal tiles of at most kMaxTileRows (8 → 4 + 4).
int tile_rows(int64_t remaining) {
  const int64_t tiles = (remaining + kMaxTileRows - 1) / kMaxTileRows;
  return static_cast<int>((remaining + tiles - 1) / tiles);
}

template <typename out_t, typename bias_t>
void store_tile(const PackedLinearArgs& args, const float* acc, int64_t row, int rows, int64_t column) {
  const int64_t columns = std::min(kPanel, args.out_features - column);
  const bias_t* bias = static_cast<const bias_t*>(args.bias);
  for (int r = 0; r < rows; ++r) {
    out_t* out = static_cast<out_t*>(args.out.data) + (row + r) * args.out.token_stride + column;
    for (int64_t c = 0; c < columns; ++c) {
      const float b = bias == nullptr ? 0.f : static_cast<float>(bias[column + c]);
      out[c] = static_cast<out_t>(acc[r * kPanel + c] + b);
    }
  }
}

// The input rows as contiguous float32: each is read once per panel, so it is converted once.
const float* rows_as_float(const PackedLinearArgs& args, std::vector<float>& buffer, int64_t& stride) {
  if (args.x.dtype == Dtype::kFloat32) {
    stride = args.x.token_stride;
    return static_cast<const float*>(args.x.data);
  }
  const int64_t k_size = args.in_features;
  buffer.resize(args.num_rows * k_size);
  const BFloat16* x = static_cast<const BFloat16*>(args.x.data);
  at::parallel_for(0, args.num_rows, std::max<int64_t>(1, 16384 / k_size), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t k = 0; k < k_size; ++k)
        buffer[m * k_size + k] = static_cast<float>(x[m * args.x.token_stride + k]);
  });
  stride = k_size;
  return buffer.data();
}

// The panels of one task: one, or a gated linear's gate panel and its up panel (for_each_task).
struct TaskPanels {
  int count;
  int64_t index[2];
};

// One task: rows [first, last) (at most kChunkRows) × its panels, over K in blocks of kDepth so
// that a panel's block stays in L1 while every tile of the chunk reads it. Two panels advance
// through K together, so each streams on from where its prefetches reached.
template <typename p_t, typename out_t, typename bias_t>
void chunk_times_panel(const PackedLinearArgs& args, const float* x, int64_t x_stride, const p_t* packed,
                       int64_t first, int64_t last, TaskPanels panels) {
  float acc[2][kChunkRows * kPanel];
  const int64_t k_size = args.in_features;
  const int64_t rows_total = last - first;
  // float32 below kMemoryBoundRows only: above, and in bfloat16, the tiles wait on their arithmetic,
  // not on the weight (a 512-row prefill lost 30 % to the prefetch)
  const bool prefetch_next_block =
      std::is_same_v<p_t, float> && rows_total > kMaxTileRows && args.num_rows <= kMemoryBoundRows;
  for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k_size - k0);
    for (int j = 0; j < panels.count; ++j) {
      const p_t* panel = packed + panels.index[j] * k_size * kPanel;
      // The weight's next block: the rest of this panel, or the next panel (panels are adjacent).
      const char* next_block = reinterpret_cast<const char*>(panel + (k0 + depth) * kPanel);
      const int64_t rest = k_size - k0 - depth;
      const int64_t next_lines =
          std::min(kDepth, rest > 0 ? rest : k_size) * kPanel * static_cast<int64_t>(sizeof(p_t)) / kLine;
      for (int64_t row = first; row < last;) {
        const int rows = tile_rows(last - row);
        FarPrefetch far;  // this tile's share of the next block, in proportion to its rows
        if (prefetch_next_block) {
          const int64_t share_begin = next_lines * (row - first) / rows_total;
          far = {next_block + share_begin * kLine, next_lines * (row - first + rows) / rows_total - share_begin};
        }
        run_tile(rows, x + row * x_stride + k0, x_stride, panel + k0 * kPanel, depth,
                 acc[j] + (row - first) * kPanel, k0 > 0, far);
        row += rows;
      }
    }
  }
  for (int j = 0; j < panels.count; ++j) {
    for (int64_t row = first; row < last;) {
      const int rows = tile_rows(last - row);
      store_tile<out_t, bias_t>(args, acc[j] + (row - first) * kPanel, row, rows, panels.index[j] * kPanel);
      row += rows;
    }
  }
}

// How for_each_task cuts a linear into tasks: rows per chunk, and panels per task where not gated.
struct TaskShape {
  int64_t chunk_rows = kChunkRows;
  int64_t panels = 1;
};

// Work of one task (a chunk of rows times its panels): its multiply-adds and its panels' bytes.
int64_t task_work(const PackedLinearArgs& args, int64_t weight_bytes, int64_t chunk_rows, int64_t panels_per_task) {
  const int64_t rows = std::min(args.num_rows, chunk_rows);
  return panels_per_task * kPanel * args.in_features * (rows + kMacsPerByte * weight_bytes);
}

// activation[r][16p, 16p + 16) = silu(gate) · up for rows [first, last), from the gate and up
// columns that panel p and p + gated_width/16 just stored into out (gated_width % 16 == 0).
template <typename out_t>
void gate_panel_epilogue(const PackedLinearArgs& args, int64_t first, int64_t last, int64_t column) {
  for (int64_t row = first; row < last; ++row) {
    const out_t* gate = static_cast<const out_t*>(args.out.data) + row * args.out.token_stride + column;
    out_t* activation = static_cast<out_t*>(args.activation.data) + row * args.activation.token_stride + column;
    silu_mul_span(gate, gate + args.gated_width, activation, kPanel);
  }
}

// Runs `panel_task(chunk_first, chunk_last, TaskPanels)` for every (row chunk, panel) over the
// threads, or (row chunk, `shape.panels` adjacent panels); when gated, a task is gate panel p with
// up panel p + gated_width/16, then their epilogue.
template <typename out_t, typename PanelTask>
void for_each_task(const PackedLinearArgs& args, int64_t weight_bytes, const PanelTask& panel_task,
                   TaskShape shape = {}) {
  const int64_t panels = (args.out_features + kPanel - 1) / kPanel;
  const int64_t chunks = (args.num_rows + shape.chunk_rows - 1) / shape.chunk_rows;
  const int64_t gate_panels = args.gated_width / kPanel;
  const int64_t per_task = args.gated_width > 0 ? 2 : shape.panels;
  const int64_t task_panels = args.gated_width > 0 ? gate_panels : (panels + per_task - 1) / per_task;
  const int64_t grain = grain_for(task_work(args, weight_bytes, shape.chunk_rows, per_task));
  at::parallel_for(0, chunks * task_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task / task_panels, p = task % task_panels;
      const int64_t first = chunk * shape.chunk_rows, last = std::min(args.num_rows, first + shape.chunk_rows);
      if (args.gated_width == 0) {
        const int64_t panel = per_task * p;
        panel_task(first, last, TaskPanels{panel + 1 < panels ? static_cast<int>(per_task) : 1, {panel, panel + 1}});
        continue;
      }
      panel_task(first, last, TaskPanels{2, {p, p + gate_panels}});
      gate_panel_epilogue<out_t>(args, first, last, p * kPanel);
    }
  });
}

template <typename p_t, typename out_t, typename bias_t>
void linear_tasks(const PackedLinearArgs& args, const float* x, int64_t x_stride) {
  const p_t* packed = static_cast<const p_t*>(args.weight);
  for_each_task<out_t>(args, sizeof(p_t), [&](int64_t first, int64_t last, TaskPanels panels) {
    chunk_times_panel<p_t, out_t, bias_t>(args, x, x_stride, packed, first, last, panels);
  });
}

#ifdef MMSERVE_LINEAR_BF16_DOT
constexpr int kMaxPairTileRows = 12;  // 12 accumulators (24 for float32 rows) of AVX-512's 32 registers

// Rows of the next pair tile: the remaining rows in equal tiles of at most kMaxPairTileRows.
int pair_tile_rows(int64_t remaining) {
  const int64_t tiles = (remaining + kMaxPairTileRows - 1) / kMaxPairTileRows;
  return static_cast<int>((remaining + tiles - 1) / tiles);
}

inline int32_t load_pair(const BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// An odd K's last panel row (16 plain bfloat16 columns) as float32.
inline __m512 plain_row(const BFloat16* row) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Keeps the weight's stream ahead of the pairs being read: one line per 64 bytes of panel, into
// L2, not L1. A prefetch into L1 holds one of the core's few L1 miss buffers until its line
// arrives; at 8 rows a panel line is used for 8 vdpbf16ps, the loop runs slower than the memory,
// and those buffers stay full, so every further prefetch stalled the loop until one drained (Zen 4,
// 768 × 2048 at 8 rows: 0.20 → 0.10 ms; BENCHMARKS.md, "OpenMP spinning and L2 prefetches").
inline void prefetch_panel(const BFloat16* at) {
  _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T1);
}

// acc[r][0..15] (+)= Σ_k x[r][k] · panel column over `depth` rows of K, bfloat16 rows: one
// vdpbf16ps per K pair and row; U independent accumulators per row where R is small (the
// instruction's latency would bound R chains: on Zen 4, with the weight in cache, 4 rows took
// 0.041-0.046 ms with U = 2 against 0.053-0.060 with U = 1, 5 rows 0.047-0.053 against
// 0.053-0.060, and 6 rows the same either way; `benchmarks.linear_cpu --shape 768 2048`).
template <int R, int U>
void pair_tile(const BFloat16* x, int64_t x_stride, const BFloat16* panel, int64_t depth, float* acc,
               bool accumulate) {
  __m512 sum[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) sum[u][r] = _mm512_setzero_ps();
  if (accumulate)
    for (int r = 0; r < R; ++r) sum[0][r] = _mm512_loadu_ps(acc + r * kPanel);
  const int64_t pairs_end = depth & ~int64_t{1};
  int64_t k = 0;
  for (; k + 2 * U <= pairs_end; k += 2 * U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const BFloat16* row = panel + (k + 2 * u) * kPanel;
      prefetch_panel(row);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(row);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r)
        sum[u][r] = _mm512_dpbf16_ps(sum[u][r], (__m512bh)_mm512_set1_epi32(load_pair(x + r * x_stride + k + 2 * u)), w);
    }
  }
  for (; k < pairs_end; k += 2) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      sum[0][r] = _mm512_dpbf16_ps(sum[0][r], (__m512bh)_mm512_set1_epi32(load_pair(x + r * x_stride + k)), w);
  }
  if (k < depth) {  // an odd K's last row
    const __m512 w = plain_row(panel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      sum[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(x[r * x_stride + k])), w, sum[0][r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    __m512 total = sum[0][r];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, sum[u][r]);
    _mm512_storeu_ps(acc + r * kPanel, total);
  }
}

// The same over float32 rows (a float32 activation through a weight packed as bfloat16): each
// pair widened to float32 (even K in the low halves, odd in the high), two FMAs per row.
template <int R, int U>
void pair_tile(const float* x, int64_t x_stride, const BFloat16* panel, int64_t depth, float* acc,
               bool accumulate) {
  static_assert(U == 1 || U == 2, "float32 rows use even/odd accumulators only");
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  if (accumulate)
    for (int r = 0; r < R; ++r) even[r] = _mm512_loadu_ps(acc + r * kPanel);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t pairs_end = depth & ~int64_t{1};
  int64_t k = 0;
  for (; k < pairs_end; k += 2) {
    const BFloat16* row = panel + k * kPanel;
    prefetch_panel(row);
    const __m512i bits = _mm512_loadu_si512(row);
    const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(bits, high_half));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k]), w_even, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k + 1]), w_odd, odd[r]);
    }
  }
  if (k < depth) {
    const __m512 w = plain_row(panel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * x_stride + k]), w, even[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kPanel, _mm512_add_ps(even[r], odd[r]));
}

template <typename x_t>
void run_pair_tile(int rows, const x_t* x, int64_t x_stride, const BFloat16* panel, int64_t depth, float* acc,
                   bool accumulate) {
  constexpr bool kBf16 = std::is_same_v<x_t, BFloat16>;
  switch (rows) {
    case 1: return pair_tile<1, kBf16 ? 4 : 1>(x, x_stride, panel, depth, acc, accumulate);
    case 2: return pair_tile<2, kBf16 ? 2 : 1>(x, x_stride, panel, depth, acc, accumulate);
    case 3: return pair_tile<3, kBf16 ? 2 : 1>(x, x_stride, panel, depth, acc, accumulate);
    case 4: return pair_tile<4, kBf16 ? 2 : 1>(x, x_stride, panel, depth, acc, accumulate);
    case 5: return pair_tile<5, kBf16 ? 2 : 1>(x, x_stride, panel, depth, acc, accumulate);
    case 6: return pair_tile<6, 1>(x, x_stride, panel, depth, acc, accumulate);
    case 7: return pair_tile<7, 1>(x, x_stride, panel, depth, acc, accumulate);
    case 8: return pair_tile<8, 1>(x, x_stride, panel, depth, acc, accumulate);
    case 9: return pair_tile<9, 1>(x, x_stride, panel, depth, acc, accumulate);
    case 10: return pair_tile<10, 1>(x, x_stride, panel, depth, acc, accumulate);
    case 11: return pair_tile<11, 1>(x, x_stride, panel, depth, acc, accumulate);
    default: return pair_tile<12, 1>(x, x_stride, panel, depth, acc, accumulate);
  }
}

// Rows per task on AMX tiles: blocks of 32 rows that one panel pair, read once from memory, serves
// from L1/L2 (the chunk's inputs, 768 KiB at K = 768, stay in L2 while the thread's tasks go
// through the panels). Emerald Rapids, 768 × 2048 at 512 / 2048 rows: 2.4 / 10.0 ms with 128-row
// chunks, 2.2 / 9.8 with 256, 2.0 / 10.5 with 1024.
constexpr int64_t kAmxChunkRows = 512;

#ifdef MMSERVE_LINEAR_AMX
// Rows from which a bfloat16 linear runs on AMX tiles. One row streams the weight faster on
// vdpbf16ps (mid's 768 × 2048 on a 2-core Emerald Rapids: 0.095 against 0.111 ms); from two rows
// the tiles keep up with the memory where vdpbf16ps, at half its Zen 4 rate there, does not
// (8 rows: 0.10 against 0.21 ms).
constexpr int64_t kMinAmxRows = 2;

bool on_amx_tiles(const PackedLinearArgs& args) {
  return args.num_rows >= kMinAmxRows && args.in_features % amx::kTileDepth == 0 && amx::tiles_on();
}

// store_tile for the rows [first, last) of one AMX block (acc holds them from row `first`), 16
// columns at a time in AVX-512 where the panel is full: with the products on AMX, a scalar
// epilogue would be a large part of a task's instructions.
template <typename out_t, typename bias_t>
void store_rows(const PackedLinearArgs& args, const float* acc, int64_t first, int64_t last, int64_t column) {
  if (column + kPanel > args.out_features) return store_tile<out_t, bias_t>(args, acc, first, last - first, column);
  __m512 bias = _mm512_setzero_ps();
  if (args.bias != nullptr) {
    alignas(64) float b[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) b[c] = static_cast<float>(static_cast<const bias_t*>(args.bias)[column + c]);
    bias = _mm512_load_ps(b);
  }
  for (int64_t row = first; row < last; ++row) {
    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(acc + (row - first) * kPanel), bias);
    out_t* out = static_cast<out_t*>(args.out.data) + row * args.out.token_stride + column;
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(out, sum);
    } else {
      static_assert(std::is_same_v<out_t, BFloat16>);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}
#else
bool on_amx_tiles(const PackedLinearArgs&) { return false; }
#endif

// One task of a linear over K-pair panels: rows [first, last) × its panels, K in blocks of
// kDepth (even, so every block but an odd K's last starts on a pair); two panels advance through
// K together, as in chunk_times_panel.
template <typename x_t, typename out_t, typename bias_t>
void chunk_times_pair_panel(const PackedLinearArgs& args, const x_t* x, int64_t x_stride, const BFloat16* packed,
                            int64_t first, int64_t last, TaskPanels panels) {
  float acc[2][kChunkRows * kPanel];
  const int64_t k_size = args.in_features;
#ifdef MMSERVE_LINEAR_AMX
  if constexpr (std::is_same_v<x_t, BFloat16>) {
    if (on_amx_tiles(args)) {
      const BFloat16* panel_of[2] = {packed + panels.index[0] * k_size * kPanel,
                                     packed + panels.index[1] * k_size * kPanel};
      float* acc_of[2] = {acc[0], acc[1]};
      amx::rows_times_panels(x, x_stride, panel_of, panels.count, k_size, first, last, acc_of,
                             [&](int64_t block_first, int64_t block_last) {
                               for (int j = 0; j < panels.count; ++j)
                                 store_rows<out_t, bias_t>(args, acc[j], block_first, block_last,
                                                           panels.index[j] * kPanel);
                             });
      return;
    }
  }
#endif
  for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k_size - k0);
    for (int j = 0; j < panels.count; ++j) {
      const BFloat16* panel = packed + panels.index[j] * k_size * kPanel;
      for (int64_t row = first; row < last;) {
        const int rows = pair_tile_rows(last - row);
        run_pair_tile(rows, x + row * x_stride + k0, x_stride, panel + k0 * kPanel, depth,
                      acc[j] + (row - first) * kPanel, k0 > 0);
        row += rows;
      }
    }
  }
  for (int j = 0; j < panels.count; ++j) {
    for (int64_t row = first; row < last;) {
      const int rows = pair_tile_rows(last - row);
      store_tile<out_t, bias_t>(args, acc[j] + (row - first) * kPanel, row, rows, panels.index[j] * kPanel);
      row += rows;
    }
  }
}

// packed_linear over bfloat16 K-pair panels, for bfloat16 or float32 rows as they come.
void pair_panel_linear(const PackedLinearArgs& args) {
  const BFloat16* packed = static_cast<const BFloat16*>(args.weight);
  dispatch_dtype(args.x.dtype, [&](auto x_type) {
    using x_t = decltype(x_type);
    const x_t* x = static_cast<const x_t*>(args.x.data);
    dispatch_dtype(args.out.dtype, [&](auto out) {
      dispatch_dtype(args.bias_dtype, [&](auto bias) {
        const auto task = [&](int64_t first, int64_t last, TaskPanels panels) {
          chunk_times_pair_panel<x_t, decltype(out), decltype(bias)>(args, x, args.x.token_stride, packed, first,
                                                                     last, panels);
        };
        // On AMX tiles a block of rows reads each A tile once for two panels.
        const bool amx = std::is_same_v<x_t, BFloat16> && on_amx_tiles(args);
        for_each_task<decltype(out)>(args, sizeof(BFloat16), task, amx ? TaskShape{kAmxChunkRows, 2} : TaskShape{});
      });
    });
  });
}
#endif

}  // namespace

bool bf16_dot_products() {
#ifdef MMSERVE_LINEAR_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool amx_tiles() {
#ifdef MMSERVE_LINEAR_AMX
  return amx::tiles_on();
#else
  return false;
#endif
}

bool set_amx_tiles(bool on) {
  const bool before = amx_tiles();
#ifdef MMSERVE_LINEAR_AMX
  amx::g_tiles_on.store(on, std::memory_order_relaxed);
#else
  (void)on;
#endif
  return before;
}

void pack_weight(const PackWeightArgs& args) {
  const int64_t panels = (args.out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    dispatch_dtype(args.dtype, [&](auto w) {
      dispatch_dtype(args.packed_dtype, [&](auto p) { pack_panels<decltype(w), decltype(p)>(args, begin, end); });
    });
  });
}

void packed_linear(const PackedLinearArgs& args) {
#ifdef MMSERVE_LINEAR_BF16_DOT
  if (args.weight_dtype == Dtype::kBFloat16) return pair_panel_linear(args);
#endif
  std::vector<float> buffer;
  int64_t x_stride = 0;
  const float* x = rows_as_float(args, buffer, x_stride);
  dispatch_dtype(args.weight_dtype, [&](auto p) {
    dispatch_dtype(args.out.dtype, [&](auto out) {
      dispatch_dtype(args.bias_dtype, [&](auto bias) {
        linear_tasks<decltype(p), decltype(out), decltype(bias)>(args, x, x_stride);
      });
    });
  });
}

}  // namespace mmserve
