// Row copies with dtype conversion (float32 <-> bfloat16, rounding to nearest-even).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace mmserve {

template <typename src_t, typename dst_t>
inline void copy_row(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    std::memcpy(dst, src, n * sizeof(src_t));
  } else {
    int64_t i = 0;
    for (; i + kVecSize <= n; i += kVecSize) store_f32(dst + i, load_f32(src + i));
    for (; i < n; ++i) dst[i] = static_cast<dst_t>(static_cast<float>(src[i]));
  }
}

}  // namespace mmserve
