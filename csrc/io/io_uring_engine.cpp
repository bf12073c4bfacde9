#include "io/io_uring_engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "io/request_check.h"

namespace pagedoptim::io {
namespace {

// -EAGAIN / -EINTR completions are resubmitted this many times before they are reported.
constexpr int kMaxRetries = 64;
// CQEs looked at per peek; a completion array on the stack.
constexpr unsigned kReapBatch = 64;
// While SQEs wait for the kernel to accept them (io_uring_submit said -EAGAIN / -EBUSY),
// no completion may come to wake a waiter, so waits sleep at most this long between retries.
constexpr int kRetrySliceMs = 1;

}  // namespace

std::unique_ptr<IoUringEngine> IoUringEngine::create(uint32_t queue_depth, int* error) {
  auto fail = [error](int err) -> std::unique_ptr<IoUringEngine> {
    if (error != nullptr) {
      *error = err;
    }
    return nullptr;
  };
  if (queue_depth == 0 || queue_depth > kMaxQueueDepth) {
    return fail(-EINVAL);
  }
  std::unique_ptr<IoUringEngine> engine(new IoUringEngine(queue_depth));
  // The CQ ring is twice the SQ ring and at most queue_depth requests are ever in the
  // kernel, so completions can never overflow.
  int err = io_uring_queue_init(queue_depth, &engine->ring_, 0);
  if (err < 0) {
    return fail(err);
  }
  engine->ring_ready_ = true;
  engine->event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (engine->event_fd_ < 0) {
    return fail(-errno);
  }
  err = io_uring_register_eventfd(&engine->ring_, engine->event_fd_);
  if (err < 0) {
    return fail(err);
  }
  if (error != nullptr) {
    *error = 0;
  }
  return engine;
}

IoUringEngine::IoUringEngine(uint32_t queue_depth)
    : queue_depth_(queue_depth), slots_(queue_depth) {
  free_slots_.reserve(queue_depth);
  for (uint32_t i = queue_depth; i > 0; --i) {
    free_slots_.push_back(i - 1);
  }
}

IoUringEngine::~IoUringEngine() {
  if (ring_ready_) {
    drain_for_destruction();
  }
  close();
  if (ring_ready_) {
    io_uring_queue_exit(&ring_);
  }
  if (event_fd_ >= 0) {
    ::close(event_fd_);
  }
}

// Tearing a ring down does not wait for its requests: the kernel would go on reading into
// buffers the caller frees right after the destructor. So requests the kernel holds are
// waited for here; queued ones that never reached it are dropped.
void IoUringEngine::drain_for_destruction() {
  std::lock_guard<std::mutex> cq_lock(cq_mutex_);
  {
    std::lock_guard<std::mutex> sq_lock(sq_mutex_);
    in_flight_.fetch_sub(static_cast<int64_t>(pending_.size()), std::memory_order_acq_rel);
    pending_.clear();
  }
  IoCompletion sink[kReapBatch];
  int idle_rounds = 0;
  while (in_flight_.load(std::memory_order_acquire) > 0) {
    const int n = reap_locked(sink);
    if (n < 0) {
      return;
    }
    if (n > 0) {
      idle_rounds = 0;
      continue;
    }
    {
      std::lock_guard<std::mutex> sq_lock(sq_mutex_);
      // pump_locked() refilled nothing (pending_ is empty); only resubmissions remain.
      if (flush_locked() < 0) {
        return;
      }
    }
    pollfd pfd{event_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 100) == 0 && ++idle_rounds > 600) {
      // A minute without progress: the device is gone. io_uring_queue_exit still cancels
      // what it can; better than hanging the process forever.
      return;
    }
    uint64_t drained;
    while (::read(event_fd_, &drained, sizeof(drained)) > 0) {
    }
  }
}

int IoUringEngine::after_open() {
  // A registered descriptor saves the kernel a file-table lookup and reference count per
  // request. Optional: without it requests name the descriptor directly.
  const int fd = file_.fd;
  file_registered_ = io_uring_register_files(&ring_, &fd, 1) == 0;
  return 0;
}

void IoUringEngine::before_close() {
  if (file_registered_) {
    io_uring_unregister_files(&ring_);
    file_registered_ = false;
  }
}

int IoUringEngine::register_buffers(std::span<const iovec> buffers) {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  const int err = check_buffers(buffers);
  if (err < 0) {
    return err;
  }
  std::lock_guard<std::mutex> lock(sq_mutex_);
  if (fixed_in_kernel_) {
    io_uring_unregister_buffers(&ring_);
    fixed_in_kernel_ = false;
  }
  buffers_.assign(buffers.begin(), buffers.end());
  // The kernel pins the pages and may refuse (RLIMIT_MEMLOCK, too many buffers, a buffer
  // over 1 GiB); index-based requests then go out as plain reads and writes.
  const auto count = static_cast<unsigned>(buffers_.size());
  fixed_in_kernel_ = io_uring_register_buffers(&ring_, buffers_.data(), count) == 0;
  return 0;
}

int IoUringEngine::unregister_buffers() {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  std::lock_guard<std::mutex> lock(sq_mutex_);
  if (fixed_in_kernel_) {
    io_uring_unregister_buffers(&ring_);
    fixed_in_kernel_ = false;
  }
  buffers_.clear();
  return 0;
}

void IoUringEngine::prepare_locked(io_uring_sqe* sqe, uint32_t slot) {
  const Slot& s = slots_[slot];
  const IoRequest& r = s.request;
  char* buf = static_cast<char*>(r.buf) + s.done;
  const unsigned length = r.length - s.done;
  const auto offset = static_cast<uint64_t>(r.offset) + s.done;
  const int fd = file_registered_ ? 0 : file_.fd;
  const bool fixed = fixed_in_kernel_ && r.buf_index >= 0;
  if (r.op == OpKind::kRead) {
    if (fixed) {
      io_uring_prep_read_fixed(sqe, fd, buf, length, offset, r.buf_index);
    } else {
      io_uring_prep_read(sqe, fd, buf, length, offset);
    }
  } else {
    if (fixed) {
      io_uring_prep_write_fixed(sqe, fd, buf, length, offset, r.buf_index);
    } else {
      io_uring_prep_write(sqe, fd, buf, length, offset);
    }
  }
  if (file_registered_) {
    sqe->flags |= IOSQE_FIXED_FILE;
  }
  io_uring_sqe_set_data64(sqe, slot);
}

int IoUringEngine::flush_locked() {
  if (fatal_error_ < 0) {
    return fatal_error_;
  }
  for (;;) {
    const int r = io_uring_submit(&ring_);
    if (r >= 0 || r == -EAGAIN || r == -EBUSY) {
      // On -EAGAIN / -EBUSY the SQEs stay in the ring and the next flush offers them again.
      return 0;
    }
    if (r != -EINTR) {
      fatal_error_ = r;
      return r;
    }
  }
}

int IoUringEngine::pump_locked() {
  while (!pending_.empty() && !free_slots_.empty()) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      break;
    }
    const uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = Slot{pending_.front(), 0, 0};
    pending_.pop_front();
    prepare_locked(sqe, slot);
  }
  return flush_locked();
}

int IoUringEngine::submit(std::span<const IoRequest> requests) {
  if (requests.empty()) {
    return 0;
  }
  std::vector<IoRequest> checked(requests.begin(), requests.end());
  std::lock_guard<std::mutex> lock(sq_mutex_);
  if (fatal_error_ < 0) {
    return fatal_error_;
  }
  for (IoRequest& r : checked) {
    const int err = normalize_request(r, file_, buffers_);
    if (err < 0) {
      return err;
    }
  }
  pending_.insert(pending_.end(), checked.begin(), checked.end());
  in_flight_.fetch_add(static_cast<int64_t>(checked.size()), std::memory_order_acq_rel);
  // A fatal error here is reported by the next poll or wait, which would otherwise wait
  // for completions that cannot come; the batch itself was accepted.
  pump_locked();
  return static_cast<int>(checked.size());
}

void IoUringEngine::wake_waiters() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof(one));
}

int IoUringEngine::reap_locked(std::span<IoCompletion> out) {
  size_t n = 0;
  io_uring_cqe* cqes[kReapBatch];
  while (n < out.size()) {
    const auto want = static_cast<unsigned>(std::min<size_t>(kReapBatch, out.size() - n));
    const unsigned got = io_uring_peek_batch_cqe(&ring_, cqes, want);
    if (got == 0) {
      break;
    }
    std::lock_guard<std::mutex> sq_lock(sq_mutex_);
    size_t finished = 0;
    for (unsigned i = 0; i < got; ++i) {
      const auto slot = static_cast<uint32_t>(io_uring_cqe_get_data64(cqes[i]));
      const int res = cqes[i]->res;
      Slot& s = slots_[slot];
      const IoRequest& r = s.request;
      int64_t result;
      bool retry = false;
      if (res == -EAGAIN || res == -EINTR) {
        retry = ++s.retries <= kMaxRetries;
        result = res;
      } else if (res < 0) {
        result = res;
      } else if (res == 0) {
        // End of file for a read; a write that moves nothing would otherwise spin.
        result = r.op == OpKind::kRead ? static_cast<int64_t>(s.done) : -EIO;
      } else {
        s.done += static_cast<uint32_t>(res);
        result = s.done;
        // A short direct read means end of file (see transfer_blocking); anything else
        // that is short continues from where it stopped.
        retry = s.done < r.length && !(r.op == OpKind::kRead && file_.is_direct());
      }
      if (retry) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        // Cannot be null: this slot's previous SQE has been consumed, and the SQ ring has
        // room for every slot.
        if (sqe != nullptr) {
          prepare_locked(sqe, slot);
          continue;
        }
        result = -EBUSY;
      }
      out[n++] = IoCompletion{r.tag, result};
      free_slots_.push_back(slot);
      ++finished;
    }
    io_uring_cq_advance(&ring_, got);
    const int err = pump_locked();
    if (finished > 0 &&
        in_flight_.fetch_sub(static_cast<int64_t>(finished), std::memory_order_acq_rel) ==
            static_cast<int64_t>(finished) &&
        waiters_.load(std::memory_order_acquire) > 0) {
      // Threads asleep in wait() must see that nothing is left and return 0.
      wake_waiters();
    }
    if (err < 0 && n == 0) {
      return err;
    }
  }
  return static_cast<int>(n);
}

int IoUringEngine::poll(std::span<IoCompletion> out) {
  std::lock_guard<std::mutex> lock(cq_mutex_);
  const int n = reap_locked(out);
  if (n != 0) {
    return n;
  }
  std::lock_guard<std::mutex> sq_lock(sq_mutex_);
  // Offers SQEs the kernel turned away earlier; also reports a fatal submit error.
  return io_uring_sq_ready(&ring_) > 0 || fatal_error_ < 0 ? flush_locked() : 0;
}

int IoUringEngine::wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) {
  if (out.empty()) {
    return -EINVAL;
  }
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout < std::chrono::milliseconds::zero();
  const Clock::time_point deadline = forever ? Clock::time_point::max() : Clock::now() + timeout;
  waiters_.fetch_add(1, std::memory_order_acq_rel);
  struct WaiterGuard {
    std::atomic<int>& count;
    ~WaiterGuard() { count.fetch_sub(1, std::memory_order_acq_rel); }
  } guard{waiters_};

  for (;;) {
    bool retry_submit = false;
    {
      std::lock_guard<std::mutex> lock(cq_mutex_);
      // Drain the eventfd before looking at the ring: a completion posted after this read
      // raises the counter again, so the poll(2) below cannot sleep through it.
      uint64_t drained;
      while (::read(event_fd_, &drained, sizeof(drained)) > 0) {
      }
      const int n = reap_locked(out);
      if (n != 0) {
        return n;
      }
      if (in_flight_.load(std::memory_order_acquire) == 0) {
        return 0;
      }
      std::lock_guard<std::mutex> sq_lock(sq_mutex_);
      if (io_uring_sq_ready(&ring_) > 0 || fatal_error_ < 0) {
        const int err = flush_locked();
        if (err < 0) {
          return err;
        }
        retry_submit = io_uring_sq_ready(&ring_) > 0;
      }
    }
    int slice_ms = -1;
    if (!forever) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        return -ETIME;
      }
      slice_ms = static_cast<int>(std::min<int64_t>(left, 60'000));
    }
    if (retry_submit && (slice_ms < 0 || slice_ms > kRetrySliceMs)) {
      slice_ms = kRetrySliceMs;
    }
    pollfd pfd{event_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, slice_ms) < 0 && errno != EINTR) {
      return -errno;
    }
  }
}

}  // namespace pagedoptim::io
