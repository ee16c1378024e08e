// ParallelFor for the kernels in this folder, over worker threads of their own.
//
// XLA's intra-op pool wakes a sleeping thread in tens of microseconds, about what one projection of a
// decode step takes: splitting those over it measured no faster. These workers spin for a while after
// each job, so the back-to-back calls of a step find them awake, and sleep once calls stop coming. While
// spinning they yield the core now and then: between two kernels the step's other ops, and the engine's
// host thread, need it on a machine with few cores (a worker that held it measured 3-8 % slower decoding
// at one request on two cores).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define JSERVE_PAUSE() _mm_pause()
#else
#define JSERVE_PAUSE() std::this_thread::yield()
#endif

namespace jserve {

class Workers {
 public:
  // How long an idle worker spins before it sleeps.
  static constexpr std::chrono::microseconds kSpin{200};

  // One set per process, one worker per hardware thread beside the caller's. Never destroyed: the
  // workers may still be asleep on it when the process exits.
  static Workers& Get() {
    static Workers* workers = new Workers(std::max(1u, std::thread::hardware_concurrency()) - 1);
    return *workers;
  }

  // The threads a ParallelFor runs on: the workers and the caller.
  int64_t NumThreads() const { return int64_t(threads_.size()) + 1; }

  // Runs body(i) for i in [0, count) on the calling thread and on the workers; returns when all are done.
  // Items are claimed from a shared counter, so a worker that is late (or descheduled) only means the
  // caller claims more. Concurrent callers (XLA may run two calls at once) get the workers in turn; one
  // that finds them taken runs its items alone.
  void ParallelFor(int64_t count, const std::function<void(int64_t)>& body) {
    if (count <= 0) return;
    std::unique_lock<std::mutex> caller(callers_, std::try_to_lock);
    if (count == 1 || threads_.empty() || !caller.owns_lock()) {
      for (int64_t i = 0; i < count; ++i) body(i);
      return;
    }
    Job job{&body, count};
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mu_); }  // a worker between its check and its wait gets the notify
      wake_.notify_all();
    }
    Run(job);
    while (job.done.load() != count) JSERVE_PAUSE();
    job_.store(nullptr);
    while (active_.load() != 0) JSERVE_PAUSE();  // no worker still holds &job
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* body;
    int64_t count;
    std::atomic<int64_t> next{0}, done{0};
  };

  explicit Workers(unsigned count) {
    for (unsigned i = 0; i < count; ++i) threads_.emplace_back([this] { Loop(); });
    for (auto& thread : threads_) thread.detach();
  }

  static void Run(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1)) < job.count;) {
      (*job.body)(i);
      job.done.fetch_add(1);
    }
  }

  void Loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int spins = 0; generation_.load() == seen; ++spins) {
        JSERVE_PAUSE();
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        } else if (spins % 64 == 0) {
          std::this_thread::yield();  // returns at once unless another thread is waiting for this core
        }
      }
      seen = generation_.load();
      active_.fetch_add(1);  // before reading job_: the caller waits for it before its job goes away
      if (Job* job = job_.load()) Run(*job);
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex callers_, mu_;
  std::condition_variable wake_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_{0}, sleepers_{0};
};

template <typename Body>
void ParallelFor(int64_t count, const Body& body) {
  Workers::Get().ParallelFor(count, std::function<void(int64_t)>(std::cref(body)));
}

}  // namespace jserve
