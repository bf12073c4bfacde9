// Test support: the fault-injecting decorator behind make_fault_injecting_engine(), which
// tests (and store_overrides(faults=...)) wrap a real engine in to fail reads and writes.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

class FaultInjector final : public FaultInjectingEngine {
 public:
  explicit FaultInjector(std::unique_ptr<IoEngine> inner);
  ~FaultInjector() override;

  int set_rules(std::vector<FaultRule> rules) override;
  std::vector<int64_t> fire_counts() const override;
  IoEngine& inner() noexcept override { return *inner_; }

  Backend backend() const noexcept override { return inner_->backend(); }
  uint32_t queue_depth() const noexcept override { return inner_->queue_depth(); }
  int open(const std::string& path, const OpenOptions& options) override;
  int close() override;
  const FileInfo& file() const noexcept override { return inner_->file(); }
  int reserve(int64_t bytes) override { return inner_->reserve(bytes); }
  int sync() override { return inner_->sync(); }

  int register_buffers(std::span<const iovec> buffers) override;
  int unregister_buffers() override;
  bool fixed_buffers_in_kernel() const noexcept override {
    return inner_->fixed_buffers_in_kernel();
  }

  int submit(std::span<const IoRequest> requests) override;
  int poll(std::span<IoCompletion> out) override;
  int wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) override;
  int64_t in_flight() const noexcept override;

  int64_t read_page(void* buf, size_t length, int64_t offset) override;
  int64_t write_page(const void* buf, size_t length, int64_t offset) override;

 private:
  struct FreeDeleter {
    void operator()(char* p) const noexcept { std::free(p); }
  };
  using AlignedCopy = std::unique_ptr<char, FreeDeleter>;

  // What happens to one request. kind 0: nothing.
  struct Decision {
    int kind = 0;
    int64_t bytes = 0;  // kShort: bytes to move
    int64_t flip_at = 0;
    uint8_t flip_mask = 0;
  };

  // A request handed to the inner engine under an internal tag, so that user tags need not
  // be unique and the completion can be finished (byte flipped, copy freed).
  struct Tracked {
    uint64_t user_tag = 0;
    OpKind op = OpKind::kRead;
    char* buf = nullptr;
    uint32_t length = 0;
    Decision decision;
    AlignedCopy copy;
  };

  Decision decide_locked(OpKind op, int64_t offset, uint64_t length);
  int take_ready_locked(std::span<IoCompletion> out);
  void finish_inner(std::span<IoCompletion> out);
  static AlignedCopy flipped_copy(const void* buf, size_t length, const Decision& d);

  std::unique_ptr<IoEngine> inner_;
  mutable std::mutex mutex_;
  std::vector<FaultRule> rules_;
  std::vector<int64_t> seen_;   // requests each rule matched
  std::vector<int64_t> fired_;  // times each rule fired
  std::vector<iovec> buffers_;  // to resolve buffer indices before the inner engine does
  std::deque<IoCompletion> ready_;  // injected failures, not yet reaped
  std::atomic<int64_t> ready_count_{0};
  std::unordered_map<uint64_t, Tracked> tracked_;
  uint64_t next_tag_ = 0;
};

}  // namespace pagedoptim::io
