// The plan tracker, the eviction order of each policy, and the page cache's slot budget.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "pagedoptim/paging/eviction_policy.h"
#include "pagedoptim/paging/page_cache.h"

namespace pagedoptim::paging {
namespace {

TEST(PlanTracker, NextUseFollowsTheCursorAndRepeats) {
  PlanTracker plan;
  plan.resize(5);
  plan.set({3, 1, 3, 0});
  EXPECT_TRUE(plan.active());
  EXPECT_EQ(plan.next_use(3), 0);
  EXPECT_EQ(plan.next_use(1), 1);
  EXPECT_EQ(plan.next_use(0), 3);
  EXPECT_EQ(plan.next_use(4), kNeverUsed);
  EXPECT_FALSE(plan.advance_if_next(1));  // not the page the plan expects next
  EXPECT_TRUE(plan.advance_if_next(3));
  EXPECT_EQ(plan.next_use(3), 2);  // its second use
  EXPECT_TRUE(plan.advance_if_next(1));
  EXPECT_EQ(plan.next_use(1), kNeverUsed);
  EXPECT_TRUE(plan.advance_if_next(3));
  EXPECT_EQ(plan.next_use(3), kNeverUsed);
  EXPECT_TRUE(plan.advance_if_next(0));
  EXPECT_FALSE(plan.active());
  plan.set({4});
  EXPECT_EQ(plan.next_use(0), kNeverUsed);  // the old plan left nothing behind
  EXPECT_EQ(plan.next_use(4), 0);
  plan.clear();
  EXPECT_EQ(plan.next_use(4), kNeverUsed);
  EXPECT_FALSE(plan.active());
}

TEST(EvictionPolicy, ParseAndName) {
  EXPECT_EQ(parse_eviction_policy("lru"), EvictionPolicy::kLru);
  EXPECT_EQ(parse_eviction_policy("plan"), EvictionPolicy::kPlan);
  EXPECT_EQ(parse_eviction_policy("auto"), EvictionPolicy::kAuto);
  EXPECT_THROW(parse_eviction_policy("mru"), std::invalid_argument);
  EXPECT_STREQ(eviction_policy_name(EvictionPolicy::kPlan), "plan");
}

TEST(EvictionPolicy, Order) {
  const VictimInfo old_soon{0, 1, 5};
  const VictimInfo new_late{1, 9, 50};
  const VictimInfo old_never{2, 2, kNeverUsed};
  const VictimInfo new_never{3, 8, kNeverUsed};
  // lru: by last use only.
  EXPECT_TRUE(evict_before(EvictionPolicy::kLru, old_soon, new_late));
  EXPECT_FALSE(evict_before(EvictionPolicy::kLru, new_late, old_soon));
  // plan: furthest next use first, never-needed first of all, then the older of two.
  EXPECT_TRUE(evict_before(EvictionPolicy::kPlan, new_late, old_soon));
  EXPECT_TRUE(evict_before(EvictionPolicy::kPlan, new_never, new_late));
  EXPECT_TRUE(evict_before(EvictionPolicy::kPlan, old_never, new_never));
  EXPECT_FALSE(evict_before(EvictionPolicy::kPlan, new_never, old_never));
}

// Puts `page` into a fresh slot as a resident page last used now.
void make_resident(PageCache& cache, int32_t page) {
  const int32_t slot = cache.take_free_slot();
  ASSERT_GE(slot, 0);
  cache.assign_slot(page, slot);
  cache.meta(page).state = PageState::kResident;
  cache.meta(page).last_use = cache.tick();
}

TEST(PageCache, BudgetSlotsThenOverflowThatShrinksBack) {
  PageCache cache(8192, 2, EvictionPolicy::kLru);
  cache.grow(4);
  make_resident(cache, 0);
  make_resident(cache, 1);
  EXPECT_EQ(cache.take_free_slot(), -1);
  EXPECT_EQ(cache.slots_in_use(), 2);
  const int32_t extra = cache.take_overflow_slot();
  EXPECT_GE(extra, 2);
  cache.assign_slot(2, extra);
  cache.meta(2).state = PageState::kResident;
  cache.meta(2).last_use = cache.tick();
  EXPECT_EQ(cache.overflow_slots(), 1);
  EXPECT_EQ(cache.find_victim(-1, true, /*overflow_only=*/true), 2);
  EXPECT_EQ(cache.find_victim(-1, true), 0);  // the least recently used of all
  EXPECT_EQ(cache.peak_slots_in_use(), 3);
  cache.release_slot(2);
  EXPECT_EQ(cache.overflow_slots(), 0);
  EXPECT_EQ(cache.take_free_slot(), -1);  // an overflow slot is not kept
  cache.release_slot(0);
  EXPECT_EQ(cache.slots_in_use(), 1);
  const int32_t again = cache.take_free_slot();
  EXPECT_GE(again, 0);
  EXPECT_LT(again, 2);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache.slot_data(again)) % 4096, 0u);
  EXPECT_THROW(PageCache(8192, 0, EvictionPolicy::kLru), std::invalid_argument);
  EXPECT_THROW(PageCache(1000, 1, EvictionPolicy::kLru), std::invalid_argument);
}

TEST(PageCache, VictimsSkipPinnedDirtyAndSoonNeededPages) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kPlan}) {
    PageCache cache(4096, 6, policy);
    cache.grow(6);
    for (int32_t p = 0; p < 5; ++p) make_resident(cache, p);
    cache.meta(0).pin_count = 1;  // pinned: never a victim
    cache.meta(1).dirty = true;
    cache.plan().set({4, 2, 3, 1});
    // 1 is the oldest unpinned page but dirty. Without dirty pages lru takes the oldest
    // (2), plan the one needed last (3, at position 2).
    EXPECT_EQ(cache.find_victim(-1, false), policy == EvictionPolicy::kLru ? 2 : 3);
    // Loading for plan position 1 must not evict pages needed at or before it: page 4
    // (position 0) and page 2 (position 1) stay.
    const int32_t v = cache.find_victim(1, true);
    EXPECT_EQ(v, 1);  // plan: needed last (position 3); lru: the older of {1, 3}
    cache.meta(1).pin_count = 1;
    cache.meta(3).pin_count = 1;
    EXPECT_EQ(cache.find_victim(1, true), -1);
  }
}

}  // namespace
}  // namespace pagedoptim::paging
