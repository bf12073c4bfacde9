#include "pagedoptim/paging/eviction_policy.h"

#include <stdexcept>
#include <string>

namespace pagedoptim::paging {

EvictionPolicy parse_eviction_policy(std::string_view name) {
  if (name == "auto") return EvictionPolicy::kAuto;
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "plan") return EvictionPolicy::kPlan;
  throw std::invalid_argument("policy must be 'auto', 'lru' or 'plan', got '" +
                              std::string(name) + "'");
}

const char* eviction_policy_name(EvictionPolicy policy) noexcept {
  switch (policy) {
    case EvictionPolicy::kAuto: return "auto";
    case EvictionPolicy::kLru: return "lru";
    case EvictionPolicy::kPlan: return "plan";
  }
  return "unknown";
}

void PlanTracker::resize(int32_t num_pages) {
  if (num_pages > int32_t(next_use_.size())) next_use_.resize(size_t(num_pages), kNeverUsed);
}

void PlanTracker::set(std::vector<int32_t> plan) {
  clear();
  plan_ = std::move(plan);
  next_same_.assign(plan_.size(), kNeverUsed);
  // Walking backwards, next_use_ holds each page's nearest later position; at the end it
  // holds each page's first position, which is what the cursor at 0 needs.
  for (int64_t i = int64_t(plan_.size()) - 1; i >= 0; --i) {
    const size_t page = size_t(plan_[size_t(i)]);
    next_same_[size_t(i)] = next_use_[page];
    next_use_[page] = i;
  }
}

void PlanTracker::clear() {
  for (int32_t page : plan_) next_use_[size_t(page)] = kNeverUsed;
  plan_.clear();
  next_same_.clear();
  cursor_ = 0;
}

bool PlanTracker::advance_if_next(int32_t page) {
  if (!active() || plan_[size_t(cursor_)] != page) return false;
  next_use_[size_t(page)] = next_same_[size_t(cursor_)];
  ++cursor_;
  return true;
}

bool evict_before(EvictionPolicy policy, const VictimInfo& a, const VictimInfo& b) noexcept {
  if (policy != EvictionPolicy::kLru && a.next_use != b.next_use) {
    return a.next_use > b.next_use;
  }
  return a.last_use < b.last_use;
}

}  // namespace pagedoptim::paging
