// The kernels' thread pool (one per process and instruction set) and parallel_for over it.
#pragma once

#include <ATen/Parallel.h>  // at::get_num_threads: the pool's size
#include <c10/util/Exception.h>

#if defined(__aarch64__)
inline void cpu_relax() { asm volatile("yield" ::: "memory"); }
#else
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace {

// A pool of helper threads for the step's small parallel loops, in place of OpenMP's.
// The caller never waits for a helper that has not started: the caller claims tasks from
// the front of a loop, helpers from the back (each side streams through memory in
// order), and a loop ends when every task is done, whoever ran it. On a machine whose
// cores the cluster's other processes share, a helper descheduled between loops costs
// nothing but its share of the work, where an OpenMP barrier would hold every one of a
// step's ~150 loops for it. Helpers spin briefly between loops, then sleep.
class Pool {
 public:
  using Fn = void (*)(const void*, int64_t);

  static Pool& get() {
    static Pool* pool = new Pool(std::max(1, at::get_num_threads()) - 1);  // never destroyed: helpers outlive exit
    return *pool;
  }

  // fn(ctx, i) for every i in [0, n). Serial where another thread holds the pool.
  void run(int64_t n, Fn fn, const void* ctx) {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (helpers_ == 0 || n <= 1 || !lock.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    TORCH_CHECK(n < (1 << 24), "pool: too many tasks");
    const uint64_t gen = ((ticket_.load(std::memory_order_relaxed) >> 48) + 1) & 0xffff;
    Job& job = jobs_[gen & 1];
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(gen << 48 | static_cast<uint64_t>(n), std::memory_order_release);  // front 0, back n
    if (sleepers_.load(std::memory_order_acquire) > 0) ticket_.notify_all();
    work(true);
    while (done_.load(std::memory_order_acquire) < n) cpu_relax();
  }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
  };

  explicit Pool(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { loop(); }).detach();
  }

  // Claim (from the front or the back) and run tasks of the current loop until none are left.
  void work(bool front) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t lo = (t >> 24) & 0xffffff, hi = t & 0xffffff;
      if (lo >= hi) return;
      const uint64_t claimed = front ? t + (uint64_t{1} << 24) : t - 1;
      if (!ticket_.compare_exchange_weak(t, claimed, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // The claim succeeded while this loop was current: its job slot is stable until done.
      const Job& job = jobs_[(t >> 48) & 1];
      job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed),
                                             static_cast<int64_t>(front ? lo : hi - 1));
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    using clock = std::chrono::steady_clock;
    uint64_t seen = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const auto spin_until = clock::now() + std::chrono::microseconds(200);
      int polls = 0;
      while (ticket_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if (++polls % 256 == 0 && clock::now() > spin_until) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          ticket_.wait(seen, std::memory_order_acquire);
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      work(false);
      seen = ticket_.load(std::memory_order_acquire);
    }
  }

  const int helpers_;
  std::mutex mu_;
  Job jobs_[2];
  // generation (16 bits) | front: next task from the front (24) | back: one past the last unclaimed (24)
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
};

// parallel_for over [0, n) in chunks of grain, on the pool.
template <class F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  const int64_t chunks = (n + grain - 1) / grain;
  struct Ctx {
    const F* f;
    int64_t n, grain;
  } ctx{&f, n, grain};
  Pool::get().run(chunks, [](const void* c, int64_t i) {
    const Ctx& x = *static_cast<const Ctx*>(c);
    (*x.f)(i * x.grain, std::min(x.n, (i + 1) * x.grain));
  }, &ctx);
}

}  // namespace
