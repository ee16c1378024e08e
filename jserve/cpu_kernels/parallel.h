// ParallelFor over XLA's intra-op thread pool, for the kernels in this folder.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jserve {

// Runs body(i) for i in [0, count) on the calling thread and on pool threads; returns when all are done.
// Items are claimed from a shared counter, so the caller never waits for a task that has not started: a
// task that starts late finds nothing to claim and touches only the shared counters (no deadlock when the
// pool's threads are busy, and nothing of the caller's is used after it returns).
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, const Body& body) {
  if (count <= 0) return;
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable finished;
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, count, &body] {
    for (int64_t i; (i = progress->next.fetch_add(1)) < count;) {
      body(i);
      if (progress->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(progress->mu);
        progress->finished.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->finished.wait(lock, [&] { return progress->done.load() == count; });
}

}  // namespace jserve
