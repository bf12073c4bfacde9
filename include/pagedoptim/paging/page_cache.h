// The page cache: a budget of page slots on the compute device (host memory on a machine
// without a GPU), per-page metadata, and the choice of eviction victims.
//
// Not thread-safe: TieredPageStore holds its lock around every call. The cache makes no
// I/O; it records what the store's pager decided (a load started, a write-back finished)
// and answers what the pager asks (a free slot, the best victim).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "pagedoptim/paging/eviction_policy.h"

namespace pagedoptim::paging {

enum class PageState : uint8_t {
  kAbsent,    // not in the cache: on the tier when on_tier, else all zero
  kLoading,   // a slot is assigned and a read (or zero fill) into it is in flight
  kResident,  // in its slot; may be pinned, may be dirty
  kWriting,   // resident and dirty, a write-back from its slot is in flight; not pinnable
};

struct PageMeta {
  PageState state = PageState::kAbsent;
  int32_t slot = -1;
  int32_t pin_count = 0;
  int32_t waiters = 0;        // pins waiting for it to become resident: never a victim
  bool dirty = false;         // the slot differs from the tier copy
  bool on_tier = false;       // the tier holds a copy (written at least once)
  bool loaded = false;        // brought in since its last pin: its next pin counts a miss
  bool in_tier = false;       // a request for it was handed to the tier and not completed
  uint32_t crc = 0;           // crc32c of the tier copy, checked on every read
  uint32_t pending_crc = 0;   // crc32c of the write-back in flight
  int32_t read_attempts = 0;  // of the read in flight
  uint64_t last_use = 0;      // logical clock of the last pin or unpin
  uint64_t use_count = 0;     // pins

  // Whether a pin now counts a hit: the page is in memory and was not brought in for it
  // (a page being written back is still in memory). The pager reads ahead only the others.
  bool pin_would_hit() const {
    return (state == PageState::kResident && !loaded) || state == PageState::kWriting;
  }
};

// Where slot memory comes from: 4 KiB aligned host memory when empty, pinned host memory
// when the cache is the bounce buffer between a device and a page file. `allocate` throws
// on failure (std::bad_alloc or device::MemoryRefused).
struct SlotAllocator {
  std::function<void*(int64_t bytes)> allocate;
  std::function<void(void* memory)> release;
};

class PageCache {
 public:
  // `budget_slots` >= 1 slots of `page_bytes` each (4 KiB aligned, allocated on first use).
  PageCache(int64_t page_bytes, int32_t budget_slots, EvictionPolicy policy,
            SlotAllocator allocator = {});
  ~PageCache();
  PageCache(const PageCache&) = delete;
  PageCache& operator=(const PageCache&) = delete;

  int64_t page_bytes() const noexcept { return page_bytes_; }
  int32_t budget_slots() const noexcept { return budget_slots_; }
  EvictionPolicy policy() const noexcept { return policy_; }

  void grow(int32_t num_pages);
  int32_t num_pages() const noexcept { return int32_t(pages_.size()); }
  PageMeta& meta(int32_t page) { return pages_[size_t(page)]; }
  const PageMeta& meta(int32_t page) const { return pages_[size_t(page)]; }
  PlanTracker& plan() noexcept { return plan_; }
  const PlanTracker& plan() const noexcept { return plan_; }

  // A slot within the budget that holds no page, or -1.
  int32_t take_free_slot();
  // A slot beyond the budget, for when every slot is pinned or holds a page that cannot be
  // written back: memory is never a reason to drop state. Throws std::bad_alloc.
  int32_t take_overflow_slot();
  // Gives `page`'s slot back (slots beyond the budget are freed) and makes the page absent.
  void release_slot(int32_t page);
  void assign_slot(int32_t page, int32_t slot);
  std::byte* slot_data(int32_t slot) const { return slots_[size_t(slot)].get(); }

  // The best victim under the policy among resident, unpinned pages (dirty ones only when
  // `dirty_allowed`, only those in slots past the budget when `overflow_only`) whose next
  // use in the plan is after `needed_at` (-1: any), or -1. A linear scan over the slots:
  // a few thousand at most, next to a page of I/O.
  int32_t find_victim(int64_t needed_at, bool dirty_allowed, bool overflow_only = false) const;

  // Slots holding a page (any state) and the most there ever were.
  int32_t slots_in_use() const noexcept { return slots_in_use_; }
  int32_t peak_slots_in_use() const noexcept { return peak_slots_in_use_; }
  int32_t overflow_slots() const noexcept { return overflow_in_use_; }

  uint64_t tick() noexcept { return ++clock_; }

 private:
  struct FreeDeleter {
    const SlotAllocator* allocator = nullptr;
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, FreeDeleter> allocate() const;

  const int64_t page_bytes_;
  const int32_t budget_slots_;
  const EvictionPolicy policy_;
  const SlotAllocator allocator_;
  std::vector<PageMeta> pages_;
  PlanTracker plan_;
  // slots_[s] is the memory of slot s (null until first used); owner_[s] the page in it.
  // Slots [0, budget) are kept once allocated; slots past the budget are freed on release.
  std::vector<std::unique_ptr<std::byte, FreeDeleter>> slots_;
  std::vector<int32_t> owner_;
  std::vector<int32_t> free_slots_;           // within the budget, allocated, unowned
  std::vector<int32_t> free_overflow_ids_;    // past the budget, unallocated
  int32_t slots_in_use_ = 0;
  int32_t peak_slots_in_use_ = 0;
  int32_t overflow_in_use_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace pagedoptim::paging
