// How many threads a parallel region is worth. Forking and joining the OpenMP team costs a few
// microseconds on a quiet machine, and a scheduler time slice when a thread the join waits for
// has lost its core to another process (a preprocess worker or the API server on a 2-core
// machine): the calling thread then spins in the barrier. Regions too small to earn that back
// run on the calling thread alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace mmserve {

// Work is counted in multiply-add equivalents. One core streams a byte from memory in about the
// time of three bf16/float32 multiply-adds (Zen 4: ~50 G multiply-adds/s, ~18 GB/s).
constexpr int64_t kMacsPerByte = 3;

// Work above which a region takes a second thread (and a third above twice it, ...). The
// default, 2^20, is about 20 µs on one core; `set_min_parallel_work` (threads.cpp) changes it,
// and 0 makes every region with more than one task parallel (what the kernel tests use to reach
// the split and merge paths with small shapes).
inline std::atomic<int64_t> g_min_parallel_work{int64_t{1} << 20};

inline int64_t min_work_per_thread() { return g_min_parallel_work.load(std::memory_order_relaxed); }

// Threads for `work` in all (as at::parallel_for counts them from its grain): at most
// `max_threads`, at least one.
inline int useful_threads(int64_t work, int max_threads) {
  const int64_t unit = std::max<int64_t>(1, min_work_per_thread());
  return static_cast<int>(std::clamp<int64_t>((work + unit - 1) / unit, 1, max_threads));
}

// at::parallel_for's grain for tasks of `work_per_task` each.
inline int64_t grain_for(int64_t work_per_task) {
  const int64_t per_task = std::max<int64_t>(1, work_per_task);
  return std::max<int64_t>(1, (min_work_per_thread() + per_task - 1) / per_task);
}

}  // namespace mmserve
