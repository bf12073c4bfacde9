// The host-memory tier: a second pool of page buffers next to the cache.
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

#include "pagedoptim/common.h"
#include "pagedoptim/paging/backing_tier.h"

namespace pagedoptim::paging {
namespace {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

class HostTier final : public BackingTier {
 public:
  explicit HostTier(int64_t page_bytes) : page_bytes_(page_bytes) {
    info_.name = "host";
    info_.location = "host memory";
    info_.backend = "memcpy";
    info_.direct = "not applicable";
  }

  const TierInfo& info() const noexcept override { return info_; }
  int64_t page_bytes() const noexcept override { return page_bytes_; }

  void grow(int32_t num_pages) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (num_pages > int32_t(pages_.size())) pages_.resize(size_t(num_pages));
  }

  // Copies on the caller's thread (the pager's submitter), so the copy overlaps the kernel
  // running on the compute threads just as a DMA would.
  int submit(std::span<const TierRequest> requests) override {
    for (const TierRequest& r : requests) {
      if (r.slot == nullptr || r.page < 0) return -EINVAL;
    }
    for (const TierRequest& r : requests) {
      std::byte* buffer = nullptr;
      int64_t result = page_bytes_;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (size_t(r.page) >= pages_.size()) {
          result = -EINVAL;
        } else if (pages_[size_t(r.page)] == nullptr && r.op == io::OpKind::kWrite) {
          void* memory = std::aligned_alloc(size_t(kPageAlignment), size_t(page_bytes_));
          if (memory == nullptr) {
            result = -ENOMEM;
          } else {
            pages_[size_t(r.page)].reset(static_cast<std::byte*>(memory));
          }
        }
        if (result > 0) buffer = pages_[size_t(r.page)].get();
        if (result > 0 && buffer == nullptr) result = -EINVAL;  // read of a page never written
      }
      // The page's buffer is touched by one request at a time: the store never has two
      // requests in flight for one page.
      if (result > 0) {
        if (r.op == io::OpKind::kWrite) {
          std::memcpy(buffer, r.slot, size_t(page_bytes_));
        } else {
          std::memcpy(r.slot, buffer, size_t(page_bytes_));
        }
      }
      std::lock_guard<std::mutex> lock(mutex_);
      done_.push_back(TierCompletion{r.tag, result});
      ready_.notify_one();
    }
    return int(requests.size());
  }

  int wait(std::span<TierCompletion> out) override {
    if (out.empty()) return -EINVAL;
    std::unique_lock<std::mutex> lock(mutex_);
    // submit() completes synchronously, so anything in flight is already in done_; the
    // timed wait covers a reaper that looks before the submitter has finished copying.
    if (!ready_.wait_for(lock, std::chrono::milliseconds(50), [&] { return !done_.empty(); })) {
      return -ETIME;
    }
    size_t n = 0;
    while (n < out.size() && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return int(n);
  }

 private:
  const int64_t page_bytes_;
  TierInfo info_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<std::unique_ptr<std::byte, FreeDeleter>> pages_;
  std::deque<TierCompletion> done_;
};

}  // namespace

std::unique_ptr<BackingTier> make_host_tier(int64_t page_bytes) {
  return std::make_unique<HostTier>(page_bytes);
}

}  // namespace pagedoptim::paging
