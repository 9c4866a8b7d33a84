// Binding the OpenMP threads that run torch's and these kernels' parallel regions one to a core,
// as vLLM's CPU backend binds its worker's threads: a thread that never migrates keeps its
// caches warm and never queues behind a sibling on one core while another core idles.
// Contract: mmserve/worker/cpu_threads.py (`bind_threads`), which chooses the cores.
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <torch/library.h>

#include "parallel.h"

#include <cerrno>
#include <cstring>
#include <vector>

namespace mmserve {
namespace {

// Sets torch's intra-op thread count to len(cpus) and pins OpenMP thread i (the caller is
// thread 0) to cpus[i]. libgomp reuses the same pool threads for every later region of that
// size, so the binding holds for the process's parallel work from then on.
void bind_threads_op(c10::IntArrayRef cpus) {
  const int64_t count = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(count > 0, "bind_threads needs at least one CPU");
  for (const int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: CPU ", cpu, " is out of range");
  }
  at::set_num_threads(static_cast<int>(count));
  std::vector<int> failures(count, 0);
#pragma omp parallel num_threads(count)
  {
    const int thread = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[thread]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) failures[thread] = errno;
  }
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(failures[i] == 0, "bind_threads: pinning thread ", i, " to CPU ", cpus[i],
                " failed: ", std::strerror(failures[i]));
  }
}

// Sets the work above which the kernels' regions go parallel (parallel.h); returns the old value.
int64_t set_min_parallel_work_op(int64_t work) {
  TORCH_CHECK(work >= 0, "set_min_parallel_work: work must be >= 0, got ", work);
  return g_min_parallel_work.exchange(work);
}

}  // namespace
}  // namespace mmserve

// No tensor argument to dispatch on: registered with their one kernel each.
TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def("bind_threads(int[] cpus) -> ()", &mmserve::bind_threads_op);
  m.def("set_min_parallel_work(int work) -> int", &mmserve::set_min_parallel_work_op);
}
