// Work sharing for the CPU kernels (ragged_paged_attention.cc, panel_matmul.cc, greedy_head.cc): units of work
// handed out from one atomic counter to the calling thread and XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace sarathi_cpu {

// Runs run(i) for every i in [0, num_units): the caller and up to num_threads - 1 pool tasks take units from one
// counter. The caller waits only for units to be done (not for tasks to start), so it never depends on a free
// pool thread; a task that starts late finds no work and touches nothing but the counters it co-owns. `run` is
// copied into every task: what it reads must be captured by value (pointers are never followed by a late task).
template <typename Run>
void share_work(xla::ffi::ThreadPool& pool, int64_t num_units, const Run& run) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, num_units, run]() {
    for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < num_units;) {
      run(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t num_threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min<int64_t>(num_threads, num_units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(std::function<void()>(work));
  work();
  while (shared->done.load(std::memory_order_acquire) < num_units) std::this_thread::yield();
}

}  // namespace sarathi_cpu
