#include "pagedoptim/paging/page_cache.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {

void PageCache::FreeDeleter::operator()(std::byte* p) const {
  if (allocator != nullptr && allocator->release) {
    allocator->release(p);
  } else {
    std::free(p);
  }
}

PageCache::PageCache(int64_t page_bytes, int32_t budget_slots, EvictionPolicy policy,
                     SlotAllocator allocator)
    : page_bytes_(page_bytes),
      budget_slots_(budget_slots),
      policy_(policy),
      allocator_(std::move(allocator)) {
  if (bool(allocator_.allocate) != bool(allocator_.release)) {
    throw std::invalid_argument("a slot allocator needs both allocate and release");
  }
  if (page_bytes <= 0 || page_bytes % kPageAlignment != 0) {
    throw std::invalid_argument("page_bytes must be a positive multiple of 4096, got " +
                                std::to_string(page_bytes));
  }
  if (budget_slots < 1) {
    throw std::invalid_argument("the cache budget must hold at least one page, got " +
                                std::to_string(budget_slots));
  }
}

PageCache::~PageCache() = default;

std::unique_ptr<std::byte, PageCache::FreeDeleter> PageCache::allocate() const {
  if (allocator_.allocate) {
    void* memory = allocator_.allocate(page_bytes_);
    return std::unique_ptr<std::byte, FreeDeleter>(static_cast<std::byte*>(memory),
                                                   FreeDeleter{&allocator_});
  }
  void* memory = std::aligned_alloc(size_t(kPageAlignment), size_t(page_bytes_));
  if (memory == nullptr) throw std::bad_alloc();
  return std::unique_ptr<std::byte, FreeDeleter>(static_cast<std::byte*>(memory));
}

void PageCache::grow(int32_t count) {
  if (count <= num_pages()) return;
  pages_.resize(size_t(count));
  plan_.resize(count);
}

int32_t PageCache::take_free_slot() {
  int32_t slot = -1;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else if (int32_t(slots_.size()) < budget_slots_) {
    // Budget slots are allocated on first use, so a budget larger than the state costs
    // nothing. Overflow slots exist only once every budget slot does, so they never sit
    // below this index.
    slot = int32_t(slots_.size());
    slots_.push_back(allocate());
    owner_.push_back(-1);
  } else {
    return -1;
  }
  ++slots_in_use_;
  peak_slots_in_use_ = std::max(peak_slots_in_use_, slots_in_use_);
  return slot;
}

int32_t PageCache::take_overflow_slot() {
  if (int32_t(slots_.size()) < budget_slots_ || !free_slots_.empty()) {
    throw std::logic_error("overflow slot requested while the budget has room");
  }
  int32_t slot;
  if (!free_overflow_ids_.empty()) {
    slot = free_overflow_ids_.back();
    free_overflow_ids_.pop_back();
    slots_[size_t(slot)] = allocate();
  } else {
    slot = int32_t(slots_.size());
    slots_.push_back(allocate());
    owner_.push_back(-1);
  }
  ++overflow_in_use_;
  ++slots_in_use_;
  peak_slots_in_use_ = std::max(peak_slots_in_use_, slots_in_use_);
  return slot;
}

void PageCache::assign_slot(int32_t page, int32_t slot) {
  PageMeta& m = pages_[size_t(page)];
  m.slot = slot;
  owner_[size_t(slot)] = page;
}

void PageCache::release_slot(int32_t page) {
  PageMeta& m = pages_[size_t(page)];
  const int32_t slot = m.slot;
  if (slot < 0) throw std::logic_error("page " + std::to_string(page) + " holds no slot");
  owner_[size_t(slot)] = -1;
  m.slot = -1;
  m.state = PageState::kAbsent;
  m.loaded = false;
  --slots_in_use_;
  if (slot >= budget_slots_) {
    slots_[size_t(slot)].reset();
    free_overflow_ids_.push_back(slot);
    --overflow_in_use_;
  } else {
    free_slots_.push_back(slot);
  }
}

int32_t PageCache::find_victim(int64_t needed_at, bool dirty_allowed, bool overflow_only) const {
  int32_t best = -1;
  VictimInfo best_info{};
  for (size_t slot = overflow_only ? size_t(budget_slots_) : 0; slot < owner_.size(); ++slot) {
    const int32_t page = owner_[slot];
    if (page < 0) continue;
    const PageMeta& m = pages_[size_t(page)];
    if (m.state != PageState::kResident || m.pin_count > 0 || m.waiters > 0 ||
        (m.dirty && !dirty_allowed)) {
      continue;
    }
    const VictimInfo info{page, m.last_use, plan_.next_use(page)};
    // A page the plan needs no later than the page being loaded must stay: evicting it to
    // make room would only trade one miss for another.
    if (needed_at >= 0 && info.next_use <= needed_at) continue;
    if (best < 0 || evict_before(policy_, info, best_info)) {
      best = page;
      best_info = info;
    }
  }
  return best;
}

}  // namespace pagedoptim::paging
