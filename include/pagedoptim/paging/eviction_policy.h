// Eviction policies of the page cache and the step plan they read.
//
// The step driver knows, before a step starts, every page it will pin and in which order
// (the plan). PlanTracker follows the pin cursor through that plan and answers "when is
// this page needed next?" in O(1). The policies rank eviction candidates:
//   * kLru:  the least recently used page goes first (the classic, blind to the plan).
//   * kPlan: the page whose next use in the plan is furthest away goes first, a page the
//            plan no longer needs before all others (Belady's rule over the known future).
//            Among pages the plan no longer needs, the least recently used goes first, so
//            the pages used last stay: the driver reverses its scan every step, and those
//            are the first ones the next step pins. Without a plan this is kLru.
//   * kAuto: kPlan (the driver always hands over a plan).
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

namespace pagedoptim::paging {

enum class EvictionPolicy : int { kAuto = 0, kLru = 1, kPlan = 2 };

// "auto", "lru" or "plan"; throws std::invalid_argument naming the value otherwise.
EvictionPolicy parse_eviction_policy(std::string_view name);
const char* eviction_policy_name(EvictionPolicy policy) noexcept;

// A plan position that is never reached: the page is not needed again in this plan.
constexpr int64_t kNeverUsed = std::numeric_limits<int64_t>::max();

class PlanTracker {
 public:
  // Pages are numbered [0, num_pages); growing keeps the current plan.
  void resize(int32_t num_pages);

  // Starts following `plan` from its first position. Pages may repeat. The caller checks
  // that every page is in range.
  void set(std::vector<int32_t> plan);
  void clear();

  // A plan is being followed and not every position has been pinned yet.
  bool active() const noexcept { return cursor_ < int64_t(plan_.size()); }
  int64_t cursor() const noexcept { return cursor_; }
  int64_t size() const noexcept { return int64_t(plan_.size()); }
  int32_t page_at(int64_t position) const { return plan_[size_t(position)]; }

  // Moves the cursor past `page` when it is the page the plan expects next; returns whether
  // it was. A pin outside the plan (a checkpoint read) leaves the cursor where it is.
  bool advance_if_next(int32_t page);

  // The first position >= cursor() at which `page` is pinned, or kNeverUsed.
  int64_t next_use(int32_t page) const noexcept {
    return size_t(page) < next_use_.size() ? next_use_[size_t(page)] : kNeverUsed;
  }

 private:
  std::vector<int32_t> plan_;
  std::vector<int64_t> next_same_;  // per position: the next position of the same page
  std::vector<int64_t> next_use_;   // per page
  int64_t cursor_ = 0;
};

// What a policy knows about one eviction candidate.
struct VictimInfo {
  int32_t page;
  uint64_t last_use;  // logical time of its last pin or unpin
  int64_t next_use;   // PlanTracker::next_use, kNeverUsed without a plan
};

// Whether `a` should be evicted before `b` under `policy` (a strict weak order; ties keep
// the candidate found first).
bool evict_before(EvictionPolicy policy, const VictimInfo& a, const VictimInfo& b) noexcept;

}  // namespace pagedoptim::paging
