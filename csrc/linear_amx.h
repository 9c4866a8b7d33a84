// AMX tiles over the K-pair panels of linear.cpp (built with MMSERVE_AMX: CPUs with AMX-BF16).
//
// A K-pair panel is already the layout AMX's tdpbf16ps reads for its B operand: 32 K rows × 16
// columns are 16 tile rows of 64 bytes, pair i holding W[c][k + 2i], W[c][k + 2i + 1] for
// c = 0..15, contiguous. So the one packed copy of a language model's weight serves both decode
// (a few rows, bound by memory: vdpbf16ps tiles) and prefill (many rows, bound by arithmetic:
// 16 × 16 × 32 multiply-adds per tdpbf16ps), and no second copy of the weight is kept for oneDNN.
//
// A block is up to 32 rows (two 16-row A tiles) × up to two panels (a gated linear's gate and up
// panels, or one panel), accumulated over the whole K in up to four C tiles:
//   tiles 0, 1: rows 0-15 × panel 0, 1;  tiles 2, 3: rows 16-31 × panel 0, 1;
//   tiles 4, 5: A, rows 0-15 and 16-31;   tiles 6, 7: B, panel 0 and 1.
// Tile numbers are immediates of the instructions, hence the template over which tiles a block uses.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx.h"
#include "kernels.h"

namespace mmserve {
namespace amx {

// Bytes ahead of the B tile being loaded at which a panel coming from memory (in a task's first
// block of rows) is prefetched into L2: a tile load that misses waits for its 16 lines, and the
// hardware prefetcher alone left 8-row linears at ~75 % of the bandwidth one row reaches.
constexpr int64_t kStreamAheadBytes = 4096;

// Prefetches into L2 the B tile `kStreamAheadBytes` after `tile` (16 lines of 64 bytes).
inline void prefetch_next_tile(const c10::BFloat16* tile) {
  const char* ahead = reinterpret_cast<const char*>(tile) + kStreamAheadBytes;
  for (int line = 0; line < kTileDepth / 2; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
}

// acc0 / acc1 [block rows][16] float32 (rows 16-31 at +16 · 16) = x[block rows][0, k_size) ·
// panel0 / panel1, k_size a multiple of kTileDepth; x_stride in elements. Tiles configured.
// `stream`: the panels come from memory, so they are prefetched ahead.
template <bool kSecondRows, bool kSecondPanel>
void block_times_panels(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel0,
                        const c10::BFloat16* panel1, int64_t k_size, float* acc0, float* acc1, bool stream) {
  const int64_t x_bytes = x_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  const c10::BFloat16* x1 = x + kTileRows * x_stride;
  _tile_zero(0);
  if constexpr (kSecondPanel) _tile_zero(1);
  if constexpr (kSecondRows) _tile_zero(2);
  if constexpr (kSecondRows && kSecondPanel) _tile_zero(3);
  for (int64_t k = 0; k < k_size; k += kTileDepth) {
    if (stream) {
      prefetch_next_tile(panel0 + k * kPanelColumns);
      if constexpr (kSecondPanel) prefetch_next_tile(panel1 + k * kPanelColumns);
    }
    _tile_loadd(6, panel0 + k * kPanelColumns, 64);
    if constexpr (kSecondPanel) _tile_loadd(7, panel1 + k * kPanelColumns, 64);
    _tile_loadd(4, x + k, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kSecondPanel) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kSecondRows) {
      _tile_loadd(5, x1 + k, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kSecondPanel) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kAccBytes = kPanelColumns * sizeof(float);
  _tile_stored(0, acc0, kAccBytes);
  if constexpr (kSecondPanel) _tile_stored(1, acc1, kAccBytes);
  if constexpr (kSecondRows) _tile_stored(2, acc0 + kTileRows * kPanelColumns, kAccBytes);
  if constexpr (kSecondRows && kSecondPanel) _tile_stored(3, acc1 + kTileRows * kPanelColumns, kAccBytes);
}

// For each block of up to 32 rows of x[first, last) (the rows of x at x + row · x_stride), its
// product with panel[j] (j < panel_count, 1 or 2) over K into acc[j] [32][16] float32, then
// `store(block_first, block_last)`: a block's results leave while they are in L1. k_size a
// multiple of kTileDepth. Leaves this thread's tiles released (oneDNN, in the same thread, expects
// to configure them itself).
template <typename Store>
void rows_times_panels(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* const* panels,
                       int panel_count, int64_t k_size, int64_t first, int64_t last, float* const* acc,
                       const Store& store) {
  int configured[2] = {-1, -1};
  const c10::BFloat16* panel1 = panel_count > 1 ? panels[1] : nullptr;
  for (int64_t row = first; row < last; row += kBlockRows) {
    const int rows0 = static_cast<int>(std::min(kTileRows, last - row));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(last - row - kTileRows, 0, kTileRows));
    if (rows0 != configured[0] || rows1 != configured[1]) {
      configure(rows0, rows1);
      configured[0] = rows0, configured[1] = rows1;
    }
    const c10::BFloat16* block = x + row * x_stride;
    const auto run = [&](auto second_rows, auto second_panel) {
      // the first block brings the panels in from memory; the others find them in L1 / L2
      block_times_panels<second_rows(), second_panel()>(block, x_stride, panels[0], panel1, k_size, acc[0], acc[1],
                                                        row == first);
    };
    if (rows1 > 0 && panel_count > 1) run(std::true_type{}, std::true_type{});
    else if (rows1 > 0) run(std::true_type{}, std::false_type{});
    else if (panel_count > 1) run(std::false_type{}, std::true_type{});
    else run(std::false_type{}, std::false_type{});
    store(row, row + rows0 + rows1);
  }
  _tile_release();
}

}  // namespace amx
}  // namespace mmserve
