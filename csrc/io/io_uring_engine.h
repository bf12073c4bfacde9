// The io_uring backend: one ring per engine, batched submission, registered buffers and a
// registered file descriptor.
#pragma once

#include <liburing.h>
#include <sys/uio.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "io/file_engine.h"

namespace pagedoptim::io {

class IoUringEngine final : public FileEngine {
 public:
  // nullptr with *error = -EINVAL for a queue depth outside [1, kMaxQueueDepth], or the
  // errno of io_uring_queue_init / eventfd registration.
  static std::unique_ptr<IoUringEngine> create(uint32_t queue_depth, int* error);
  ~IoUringEngine() override;

  Backend backend() const noexcept override { return Backend::kIoUring; }
  uint32_t queue_depth() const noexcept override { return queue_depth_; }

  int register_buffers(std::span<const iovec> buffers) override;
  int unregister_buffers() override;
  bool fixed_buffers_in_kernel() const noexcept override { return fixed_in_kernel_; }

  int submit(std::span<const IoRequest> requests) override;
  int poll(std::span<IoCompletion> out) override;
  int wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) override;
  int64_t in_flight() const noexcept override { return in_flight_.load(std::memory_order_acquire); }

 private:
  // A request the kernel holds; `done` counts bytes already moved by earlier partial
  // completions, so a retry continues where the kernel stopped.
  struct Slot {
    IoRequest request;
    uint32_t done = 0;
    int retries = 0;
  };

  explicit IoUringEngine(uint32_t queue_depth);
  int after_open() override;
  void before_close() override;

  void prepare_locked(io_uring_sqe* sqe, uint32_t slot);
  int pump_locked();
  int flush_locked();
  int reap_locked(std::span<IoCompletion> out);
  void drain_for_destruction();
  void wake_waiters();

  const uint32_t queue_depth_;
  io_uring ring_{};
  bool ring_ready_ = false;
  // Completions also signal this eventfd, so wait() can sleep in poll(2) with a timeout
  // without touching the submission ring (liburing's own timed wait may queue a timeout
  // SQE on older kernels, which would race with a concurrent submitter).
  int event_fd_ = -1;

  // Lock order: cq_mutex_ before sq_mutex_. sq_mutex_ guards the submission ring and the
  // bookkeeping below; cq_mutex_ makes reaping single-consumer, as the CQ ring requires.
  std::mutex sq_mutex_;
  std::mutex cq_mutex_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  std::deque<IoRequest> pending_;  // accepted, waiting for a free slot
  int fatal_error_ = 0;            // io_uring_submit failed for a reason retrying won't fix

  std::vector<iovec> buffers_;
  bool fixed_in_kernel_ = false;
  bool file_registered_ = false;

  std::atomic<int64_t> in_flight_{0};
  std::atomic<int> waiters_{0};
};

}  // namespace pagedoptim::io
