// Splitting a custom call's work over XLA's intra-op thread pool, shared by the CPU kernels.

#ifndef JAXSERVE_CPU_PARALLEL_H_
#define JAXSERVE_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Calls fn(c) once for each chunk c in [0, num_chunks), on the caller and the pool's other
// threads, which take chunks as they come free; returns when all are done. A pool task that
// starts after the call returned finds no chunk left and touches nothing but the counters,
// which it co-owns.
template <typename F>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t num_chunks, F fn) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [fn, counters, num_chunks] {
    for (int64_t c; (c = counters->next.fetch_add(1)) < num_chunks;) {
      fn(c);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, num_chunks); ++i) {
    pool.Schedule(decltype(work)(work));  // a copy each
  }
  work();
  while (counters->done.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_PARALLEL_H_
