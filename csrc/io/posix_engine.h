// The portable backend: pread/pwrite on a small pool of worker threads.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/file_engine.h"

namespace pagedoptim::io {

class PosixEngine final : public FileEngine {
 public:
  // min(threads, queue_depth) workers. nullptr and *error = -EINVAL for a queue depth
  // outside [1, kMaxQueueDepth] or zero threads, -EAGAIN when a thread cannot be started.
  static std::unique_ptr<PosixEngine> create(uint32_t queue_depth, uint32_t threads,
                                             int* error);
  ~PosixEngine() override;

  Backend backend() const noexcept override { return Backend::kPosix; }
  uint32_t queue_depth() const noexcept override { return queue_depth_; }

  int register_buffers(std::span<const iovec> buffers) override;
  int unregister_buffers() override;
  bool fixed_buffers_in_kernel() const noexcept override { return false; }

  int submit(std::span<const IoRequest> requests) override;
  int poll(std::span<IoCompletion> out) override;
  int wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) override;
  int64_t in_flight() const noexcept override { return in_flight_.load(std::memory_order_acquire); }

 private:
  explicit PosixEngine(uint32_t queue_depth);
  void run_worker();
  int take_locked(std::span<IoCompletion> out);
  void stop_workers();

  const uint32_t queue_depth_;
  std::mutex mutex_;
  std::condition_variable work_cv_;  // a request was queued, or stop
  std::condition_variable done_cv_;  // a completion arrived, or nothing is in flight
  std::deque<IoRequest> pending_;
  std::deque<IoCompletion> completed_;
  bool stopping_ = false;
  // Submitted and not yet reaped (queued + running + completed). Written under mutex_;
  // read without it by in_flight(), which only needs a recent value.
  std::atomic<int64_t> in_flight_{0};
  std::vector<iovec> buffers_;
  std::vector<std::thread> workers_;
};

}  // namespace pagedoptim::io
