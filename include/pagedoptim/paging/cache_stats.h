// What every page cache reports, whatever it caches and whatever lies below it: the
// CPU's TieredPageStore (PagingStats) and the GPU's DeviceCacheStore (DeviceCacheStats)
// extend it with their tiers' counters.
#pragma once

#include <cstdint>
#include <string>

namespace pagedoptim::paging {

struct CacheStats {
  int64_t hits = 0;           // pins of pages the cache held (not brought in for them)
  int64_t misses = 0;         // pins of pages that had to be brought in
  int64_t prefetch_hits = 0;  // misses whose page the prefetcher had started or finished
  int64_t evictions = 0;
  int32_t num_pages = 0;
  int32_t budget_pages = 0;
  int32_t resident_pages = 0;
  int32_t peak_resident_pages = 0;
  int32_t over_budget_pages = 0;
  int32_t pin_limit = 0;
  int32_t prefetch = 0;
  std::string policy;
  std::string pending_error;  // an error not thrown yet; empty when none
};

}  // namespace pagedoptim::paging
