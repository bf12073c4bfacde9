#include "io/posix_engine.h"

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "io/blocking_transfer.h"
#include "pagedoptim/thread_start.h"
#include "io/request_check.h"

namespace pagedoptim::io {

std::unique_ptr<PosixEngine> PosixEngine::create(uint32_t queue_depth, uint32_t threads,
                                                 int* error) {
  auto fail = [error](int err) -> std::unique_ptr<PosixEngine> {
    if (error != nullptr) {
      *error = err;
    }
    return nullptr;
  };
  if (queue_depth == 0 || queue_depth > kMaxQueueDepth || threads == 0) {
    return fail(-EINVAL);
  }
  std::unique_ptr<PosixEngine> engine(new PosixEngine(queue_depth));
  const uint32_t count = std::min(threads, queue_depth);
  try {
    engine->workers_.reserve(count);
    for (uint32_t i = 0; i < count; ++i) {
      engine->workers_.push_back(start_thread([e = engine.get()] { e->run_worker(); }));
    }
  } catch (const std::system_error&) {
    return fail(-EAGAIN);
  } catch (const std::bad_alloc&) {
    return fail(-ENOMEM);
  }
  if (error != nullptr) {
    *error = 0;
  }
  return engine;
}

PosixEngine::PosixEngine(uint32_t queue_depth) : queue_depth_(queue_depth) {}

PosixEngine::~PosixEngine() {
  stop_workers();
  close();
}

void PosixEngine::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Queued requests have not touched their buffers yet and are dropped; running ones
    // finish before join() returns, so no worker writes into memory the caller frees next.
    in_flight_.fetch_sub(static_cast<int64_t>(pending_.size() + completed_.size()),
                         std::memory_order_acq_rel);
    pending_.clear();
    completed_.clear();
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) {
    t.join();
  }
  workers_.clear();
}

void PosixEngine::run_worker() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (pending_.empty()) {
      return;
    }
    const IoRequest request = pending_.front();
    pending_.pop_front();
    // Copied under the lock that published the request; open/close cannot run while it
    // is in flight.
    const int fd = file_.fd;
    const bool direct = file_.is_direct();
    lock.unlock();
    const int64_t result =
        transfer_blocking(fd, request.op, request.buf, request.length, request.offset, direct);
    lock.lock();
    if (stopping_) {
      in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      continue;
    }
    completed_.push_back({request.tag, result});
    done_cv_.notify_one();
  }
}

int PosixEngine::register_buffers(std::span<const iovec> buffers) {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  const int err = check_buffers(buffers);
  if (err < 0) {
    return err;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_.assign(buffers.begin(), buffers.end());
  return 0;
}

int PosixEngine::unregister_buffers() {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  buffers_.clear();
  return 0;
}

int PosixEngine::submit(std::span<const IoRequest> requests) {
  if (requests.empty()) {
    return 0;
  }
  std::vector<IoRequest> checked(requests.begin(), requests.end());
  std::unique_lock<std::mutex> lock(mutex_);
  for (IoRequest& r : checked) {
    const int err = normalize_request(r, file_, buffers_);
    if (err < 0) {
      return err;
    }
  }
  pending_.insert(pending_.end(), checked.begin(), checked.end());
  in_flight_.fetch_add(static_cast<int64_t>(checked.size()), std::memory_order_acq_rel);
  lock.unlock();
  if (checked.size() == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
  return static_cast<int>(checked.size());
}

int PosixEngine::take_locked(std::span<IoCompletion> out) {
  const size_t n = std::min(out.size(), completed_.size());
  std::copy_n(completed_.begin(), n, out.begin());
  completed_.erase(completed_.begin(), completed_.begin() + static_cast<std::ptrdiff_t>(n));
  if (n > 0 && in_flight_.fetch_sub(static_cast<int64_t>(n), std::memory_order_acq_rel) ==
                   static_cast<int64_t>(n)) {
    // Nothing left in flight: other threads blocked in wait() must return 0, not sleep.
    done_cv_.notify_all();
  }
  return static_cast<int>(n);
}

int PosixEngine::poll(std::span<IoCompletion> out) {
  std::lock_guard<std::mutex> lock(mutex_);
  return take_locked(out);
}

int PosixEngine::wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) {
  if (out.empty()) {
    return -EINVAL;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  auto ready = [this] {
    return !completed_.empty() || in_flight_.load(std::memory_order_acquire) == 0;
  };
  if (timeout < std::chrono::milliseconds::zero()) {
    done_cv_.wait(lock, ready);
  } else if (!done_cv_.wait_for(lock, timeout, ready)) {
    return -ETIME;
  }
  return take_locked(out);
}

}  // namespace pagedoptim::io
