// The two element types the kernels take, and the switch from the enum to the C++ type.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mmserve {

enum class Dtype : int8_t { kFloat32, kBFloat16 };

inline int64_t dtype_size(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

// Calls fn(T{}) with T = float or c10::BFloat16.
template <typename Fn>
inline void dispatch_dtype(Dtype dtype, const Fn& fn) {
  if (dtype == Dtype::kFloat32) {
    fn(float{});
  } else {
    fn(c10::BFloat16{});
  }
}

}  // namespace mmserve
