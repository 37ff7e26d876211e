// The threads `k3_native::parallel_chunks` runs on: a region waits only for the chunks a thread took.
//
// torch's regions (OpenMP) end at a barrier: the calling thread, having taken every chunk itself, still waits
// for each worker to arrive, and a worker whose core another process holds arrives a scheduler turn later
// (milliseconds, for regions of tens of microseconds). Here the caller and the workers take chunks from one
// counter; a region is over once every chunk is done, and a worker that wakes after that finds nothing to take
// and waits again (docs/native-cpus.md "A shared machine").
//
// One ticket holds a region's generation, its number of chunks and the next chunk to take, so that taking a
// chunk is one compare-and-swap that fails for a region that has ended: a worker reads the region's function
// only after it took one of its chunks, and a region cannot end (nor the next one replace its function) before
// that chunk is done. Which thread computes a chunk changes no bits (parallel_chunks' callers compute every
// output inside one chunk). Workers spin a while after a region (a decode step's regions come microseconds
// apart inside its native call), then sleep; how long is CoreShare's choice. One pool a process, rebuilt when
// torch's thread count changes or after a fork (the child has none of the parent's threads), never destroyed
// (at exit its workers sleep).
#pragma once

#include <immintrin.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace k3_native {

// How long a worker spins before it sleeps: 500 us while its core is its own, 50 us for 100 ms after the
// scheduler took the core from it (an involuntary context switch of this thread, as getrusage counts them:
// another process wants the core). One a worker, in its own thread. A fixed spin served one case only (`mini`,
// 2 threads, medians of 300 steps over five rounds, Zen 3): beside one spinning process OpenMP's regions took
// 12.9 ms, the pool spinning 500 us 15.0 (the worker spent its share of the core spinning, then was swapped out
// holding a chunk), 50 us 10.4, this choice 9.6; alone 7.6, 7.6, 8.1 (a futex wake at most native calls), 7.6.
class CoreShare {
 public:
  std::chrono::microseconds spin() {
    rusage usage;
    const auto now = std::chrono::steady_clock::now();
    if (getrusage(RUSAGE_THREAD, &usage) == 0 && usage.ru_nivcsw != switched_) {
      switched_ = usage.ru_nivcsw;
      shared_until_ = now + kSharedFor;
    }
    return now < shared_until_ ? kSpinShared : kSpinAlone;
  }

 private:
  static constexpr auto kSpinAlone = std::chrono::microseconds(500);
  static constexpr auto kSpinShared = std::chrono::microseconds(50);
  static constexpr auto kSharedFor = std::chrono::milliseconds(100);  // how long a switch counts
  long switched_ = 0;
  std::chrono::steady_clock::time_point shared_until_{};
};

class ChunkPool {
 public:
  // The pool of `threads` threads in all (the caller and threads - 1 workers). A pool left for another thread
  // count stops its workers unless a region runs on it; its few bytes stay (a caller may still hold it).
  static ChunkPool& with_threads(int64_t threads) {
    static std::mutex replacing;
    static ChunkPool* pool = nullptr;
    std::lock_guard<std::mutex> lock(replacing);
    if (pool == nullptr || pool->pid_ != getpid() || pool->threads_ != threads) {
      if (pool != nullptr && pool->pid_ == getpid() && !pool->busy_.exchange(true)) pool->stop();
      pool = new ChunkPool(threads);  // a forked child's pool had threads that do not exist here: left as is
    }
    return *pool;
  }

  // fn(c) for every c in [0, chunks), the caller taking chunks with the workers; returns once every chunk is
  // done, rethrowing the first exception a chunk threw. False, with nothing run, when another region holds the
  // pool (a second caller thread, or a chunk of a region, the caller's or a worker's): run it alone then.
  template <typename F>
  bool run(int64_t chunks, const F& fn) {
    if (chunks <= 0) return true;
    if (chunks > kMaxChunks || busy_.exchange(true, std::memory_order_acquire)) return false;
    call_ = [](const void* f, int64_t c) { (*static_cast<const F*>(f))(c); };
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    generation_ = (generation_ + 1) & kGenerationMask;
    ticket_.store(generation_ << 40 | static_cast<uint64_t>(chunks) << 20, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {  // seq_cst: see the worker's side in wait_for_change
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (take_and_run(ticket)) {}
    while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();  // chunks workers took, still running
    std::exception_ptr error = error_;
    busy_.store(false, std::memory_order_release);
    if (error) std::rethrow_exception(error);
    return true;
  }

  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

 private:
  static constexpr uint64_t kMaxChunks = (uint64_t{1} << 20) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << 24) - 1;

  explicit ChunkPool(int64_t threads) : threads_(threads), pid_(getpid()) {
    try {
      for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
    } catch (const std::system_error&) {  // no more threads here (a process limit): the regions run on fewer
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true);
      wake_.notify_all();
    }
    for (std::thread& t : workers_) t.join();
  }

  static int64_t taken(uint64_t ticket) { return static_cast<int64_t>(ticket & kMaxChunks); }
  static int64_t chunks_of(uint64_t ticket) { return static_cast<int64_t>(ticket >> 20 & kMaxChunks); }

  // Takes the next chunk of `ticket`'s region and runs it: true if it did (ticket then reloaded), false when
  // the region has no chunk left (ticket: the value that said so).
  bool take_and_run(uint64_t& ticket) {
    while (taken(ticket) < chunks_of(ticket)) {
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;  // another thread took it, or a new region began: `ticket` holds what is there now
      try {
        call_(fn_, taken(ticket));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
      ticket = ticket_.load(std::memory_order_acquire);
      return true;
    }
    return false;
  }

  // The ticket once it differs from `seen` (spinning `spin`, then asleep), or `seen` when the pool stops.
  uint64_t wait_for_change(uint64_t seen, std::chrono::microseconds spin) {
    const auto until = std::chrono::steady_clock::now() + spin;
    for (int i = 0;; ++i) {
      const uint64_t now = ticket_.load(std::memory_order_acquire);
      if (now != seen || stopping_.load(std::memory_order_relaxed)) return now;
      if (i % 64 == 63 && std::chrono::steady_clock::now() > until) break;
      _mm_pause();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lock, [&] { return ticket_.load(std::memory_order_seq_cst) != seen || stopping_.load(); });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return ticket_.load(std::memory_order_acquire);
  }

  void work() {
    CoreShare core;
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (!stopping_.load(std::memory_order_relaxed))
      if (!take_and_run(ticket)) ticket = wait_for_change(ticket, core.spin());
  }

  const int64_t threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};  // generation (24 bits) | chunks (20) | chunks taken (20)
  std::atomic<int64_t> done_{0};
  std::atomic<bool> busy_{false}, stopping_{false};
  std::atomic<int> sleepers_{0};
  uint64_t generation_ = 0;  // the caller's, under busy_
  void (*call_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace k3_native
