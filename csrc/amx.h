// What every AMX kernel needs (built with MMSERVE_AMX: -mamx-tile -mamx-bf16): the process's
// permission to use the tile registers and the layout of a tile configuration.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace mmserve {
namespace amx {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileDepth = 32;  // K per tile: 64 bytes of bfloat16

// Linux hands AMX's tile registers to a process only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); until then a tile instruction is a SIGILL. The
// permission is the whole process's, so asking once is enough (oneDNN asks the same way).
inline bool permitted() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether the kernels run on the tiles: permitted, and not turned off by `set_amx_tiles(false)`
// (linear.cpp). Off, an AMX build runs the vdpbf16ps kernels of AVX512-BF16 CPUs without AMX
// (Zen 4), so tests reach those here without a second build.
inline std::atomic<bool> g_tiles_on{true};

inline bool tiles_on() { return g_tiles_on.load(std::memory_order_relaxed) && permitted(); }

// The 64-byte operand of ldtilecfg: palette 1, then bytes per row and rows of each tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kBlockRows = 2 * kTileRows;

// Configures this thread's tiles for a block of `rows0` + `rows1` rows (rows1 may be 0: tiles 2,
// 3 and 5 unused) in the 2 × 2 arrangement of every kernel here: C tiles 0, 1 (rows 0-15 ×
// columns 0-15, 16-31) and 2, 3 (rows 16-31), A tiles 4, 5 (rows 0-15, 16-31), B tiles 6, 7
// (32 K × 16 columns each); every row of every tile is 64 bytes. Two B tiles let one load while a
// product still reads the other (tile registers are not renamed).
inline void configure(int rows0, int rows1) {
  TileConfig config;
  const int rows_of_tile[8] = {rows0, rows0, rows1, rows1, rows0, rows1, kTileDepth / 2, kTileDepth / 2};
  for (int t = 0; t < 8; ++t) {
    if (rows_of_tile[t] == 0) continue;
    config.rows[t] = static_cast<uint8_t>(rows_of_tile[t]);
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace amx
}  // namespace mmserve
