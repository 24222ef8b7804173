// Splitting a custom call's work over worker threads, shared by the CPU kernels.
//
// XLA's intra-op pool puts idle threads to sleep, and waking one takes a sizeable part of a
// short call: at one row a decode step makes a matmul call per projection and layer back to
// back, each short, and a sleeping core joins each late. These workers spin (yielding the core
// to anything runnable) for a while after each job, so the next call a few microseconds later
// starts on every core at once, and then sleep.

#ifndef JAXSERVE_CPU_PARALLEL_H_
#define JAXSERVE_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

class Workers {
 public:
  // The process's workers, started on first use: `threads` - 1 of them (the caller is one).
  static Workers& Get(int64_t threads) {
    static Workers* workers = new Workers(threads - 1);  // never destroyed: threads outlive exit
    return *workers;
  }

  // Calls fn(c) once for each c in [0, num_chunks) on the caller and the workers, which claim
  // chunks as they come free; returns when all are done. Only one job runs at a time: a caller
  // that finds the workers busy (another custom call running concurrently) runs its chunks
  // alone.
  template <typename F>
  void Run(int64_t num_chunks, F& fn) {
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (!busy.owns_lock() || num_workers_ == 0 || num_chunks <= 1 || num_chunks > kMaxChunks) {
      for (int64_t c = 0; c < num_chunks; ++c) fn(c);
      return;
    }
    fn_.store(&fn, std::memory_order_relaxed);
    invoke_.store([](void* f, int64_t c) { (*static_cast<F*>(f))(c); }, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // A new generation with its chunk count and chunk 0 next: claims of the previous one fail.
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(gen << 32 | static_cast<uint64_t>(num_chunks) << 16);  // seq_cst: see Loop
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(wake_);
      wake_cv_.notify_all();
    }
    Work(gen);
    while (done_.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
  }

 private:
  explicit Workers(int64_t num_workers) : num_workers_(std::max<int64_t>(0, num_workers)) {
    for (int64_t i = 0; i < num_workers_; ++i) std::thread([this] { Loop(); }).detach();
  }

  // Claims and runs chunks of generation gen until none is left. The ticket holds the
  // generation, its chunk count and the next chunk in one word, so a claim is valid only for
  // the job it read.
  void Work(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && (t & 0xffff) < ((t >> 16) & 0xffff)) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        // A claimed chunk is not done, so its caller is still waiting and fn_ is still its.
        invoke_.load(std::memory_order_relaxed)(fn_.load(std::memory_order_relaxed),
                                                static_cast<int64_t>(t & 0xffff));
        done_.fetch_add(1, std::memory_order_release);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
      while (gen == seen && std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
        gen = ticket_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(wake_);
        sleepers_.fetch_add(1);  // seq_cst: ordered against the load of ticket_ below
        while ((gen = ticket_.load() >> 32) == seen) wake_cv_.wait(lock);
        sleepers_.fetch_sub(1);
      }
      seen = gen;
      Work(gen);
    }
  }

  static constexpr int64_t kMaxChunks = 0xffff;
  const int64_t num_workers_;
  std::mutex submit_;
  // generation << 32 | number of chunks << 16 | next chunk to claim.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<void*> fn_{nullptr};
  std::atomic<void (*)(void*, int64_t)> invoke_{nullptr};
  std::atomic<int64_t> sleepers_{0};
  std::mutex wake_;
  std::condition_variable wake_cv_;
};

// Calls fn(c) once for each chunk c in [0, num_chunks), on the caller and as many workers as
// XLA's intra-op pool has threads; returns when all are done.
template <typename F>
void RunChunks(xla::ffi::ThreadPool& pool, int64_t num_chunks, F fn) {
  Workers::Get(std::max<int64_t>(1, pool.num_threads())).Run(num_chunks, fn);
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_PARALLEL_H_
