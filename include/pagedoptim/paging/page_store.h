// Where page bytes live, and the pin/unpin protocol the step driver uses to reach them.
//
// The driver pins each page of its plan before the kernel touches it and unpins it after,
// saying whether the kernel wrote it. A store may move unpinned pages anywhere (a host
// cache, an NVMe file) but must hand back exactly the bytes last written. New pages start
// zero-filled: zero is the initial value of every state stream.
#pragma once

#include <cstddef>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace pagedoptim::paging {

class PageStore {
 public:
  virtual ~PageStore() = default;

  // Extends the store to `num_pages` pages of `page_bytes` each, zero-filled.
  virtual void grow(int32_t num_pages) = 0;
  // The plan of the coming step, in the order pages will be pinned: a store that moves
  // pages can prefetch and choose victims from it. The host store ignores it.
  virtual void plan(const std::vector<int32_t>& pages) { (void)pages; }
  // The same for a run of read_bytes / write_bytes calls (a checkpoint's records): the
  // pages those calls pin, in order, repeats included; an empty list ends it. Only a store
  // whose copies pin pages of a slower tier gains from reading ahead; the others ignore it
  // (a device cache copies its resident pages without pinning, and its plan() also learns
  // the order of gradient-release rounds, which copies must not disturb).
  virtual void plan_copies(const std::vector<int32_t>& pages) { (void)pages; }
  // Makes `page` resident and returns its bytes; they stay valid until the matching unpin.
  virtual std::byte* pin(int32_t page) = 0;
  // pin() for a caller that overwrites the whole page before it reads any of it (a device
  // cache writing its copy back): the store may skip bringing the old bytes in, so they
  // are unspecified. Unpin it as dirty.
  virtual std::byte* pin_overwrite(int32_t page) { return pin(page); }
  virtual void unpin(int32_t page, bool dirty) = 0;
  // How many pages may be pinned at once (the driver pins its plan in batches of this
  // size). A store with a budget returns what fits in it, at least 1.
  virtual int32_t pin_limit() const { return INT32_MAX; }

  // Copies `bytes` bytes at `offset` of a page out to / in from host memory (state_dict and
  // load_state_dict). The default pins the page and copies on this thread; a store whose
  // pages live in device memory copies through the device instead, since host code never
  // dereferences a device page.
  virtual void read_bytes(int32_t page, int64_t offset, void* out, int64_t bytes) {
    const std::byte* data = pin(page);
    std::memcpy(out, data + offset, size_t(bytes));
    unpin(page, /*dirty=*/false);
  }
  virtual void write_bytes(int32_t page, int64_t offset, const void* in, int64_t bytes) {
    std::byte* data = pin(page);
    std::memcpy(data + offset, in, size_t(bytes));
    unpin(page, /*dirty=*/true);
  }

  // Throws an error the store met behind the caller's back (a failed write-back) and has
  // not thrown yet; a store that has none does nothing.
  virtual void raise_pending_error() {}

  virtual int32_t num_pages() const = 0;
  virtual int64_t page_bytes() const = 0;
  // Bytes of page memory held on the compute device / in host memory right now.
  virtual int64_t resident_bytes() const = 0;
};

// Every page resident in host memory, 4 KiB aligned (the plain host tier; the page cache
// and the NVMe tier build on the same protocol).
class HostPageStore final : public PageStore {
 public:
  explicit HostPageStore(int64_t page_bytes);

  void grow(int32_t num_pages) override;
  std::byte* pin(int32_t page) override;
  void unpin(int32_t page, bool dirty) override;
  int32_t num_pages() const override { return int32_t(pages_.size()); }
  int64_t page_bytes() const override { return page_bytes_; }
  int64_t resident_bytes() const override { return page_bytes_ * num_pages(); }

 private:
  struct AlignedFree {
    void operator()(std::byte* p) const;
  };
  int64_t page_bytes_;
  std::vector<std::unique_ptr<std::byte, AlignedFree>> pages_;
  std::vector<int32_t> pin_counts_;
};

}  // namespace pagedoptim::paging
