// TieredPageStore: the page store for optimizer state larger than its budget on the
// compute device. A page cache of cache_bytes holds the hot pages; every page also has a
// home on a backing tier (host memory or an NVMe page file). Two pager threads move pages:
//
//   submitter: takes the I/O the scheduler decided (reads of the next `prefetch` pages of
//              the plan, write-backs of dirty victims, zero fills of new pages), computes
//              the crc32c of each write-back and hands the batch to the tier.
//   reaper:    waits for the tier's completions, checks every read against the crc32c its
//              page was written with (re-reading a bad page up to read_attempts times),
//              then marks the page resident and schedules more.
//
// pin() waits only for the page it asks for: it joins the scheduler's demand list (ahead of
// the prefetch window) and sleeps until that page is resident.
//
// Failures never lose state. A failed or short write-back keeps the dirty page in the
// cache (over the budget if it must) and stops further write-backs until the next plan;
// the error is thrown once the step's last page is unpinned, after the whole step ran, and
// every page stays readable for a checkpoint. A page that cannot be read (EIO after the
// retries, a checksum mismatch) is never handed out: its pin throws PageIoError or
// PageCorruptionError.
//
// Locking: one mutex guards the cache, the metadata, the queues and the statistics. Page
// bytes are touched outside it only by the thread that owns the page's current state: the
// pinning caller while it is pinned, the submitter (checksum, copy) while it is kWriting or
// kLoading, the reaper (checksum) while it is kLoading. Each hand-over goes through the
// mutex, which orders the byte accesses of consecutive owners.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pagedoptim/paging/backing_tier.h"
#include "pagedoptim/paging/cache_stats.h"
#include "pagedoptim/paging/eviction_policy.h"
#include "pagedoptim/paging/page_cache.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::paging {

struct TieredStoreOptions {
  int64_t page_bytes = 2 << 20;
  // The budget of resident pages, in bytes: rounded down to whole pages, at least one.
  int64_t cache_bytes = int64_t(1) << 30;
  // Pages of the plan kept in flight ahead of the pin cursor (0: load on demand only).
  int32_t prefetch = 4;
  EvictionPolicy policy = EvictionPolicy::kAuto;
  // Reads of one page before its pin gives up (EIO, short read, checksum mismatch).
  int32_t read_attempts = 3;
  // Cache slot memory (pinned host memory under a device cache); empty: aligned host memory.
  SlotAllocator slots;
};

struct PagingStats : CacheStats {
  int64_t zero_fills = 0;     // first uses of pages never written
  int64_t reads = 0;          // successful page reads from the tier
  int64_t writes = 0;         // successful page write-backs to the tier
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t read_retries = 0;
  int64_t read_errors = 0;      // pins that failed for a read error
  int64_t checksum_errors = 0;  // pins that failed for a checksum mismatch
  int64_t write_errors = 0;
  double stall_seconds = 0.0;  // time pin() waited for I/O
  TierInfo tier;
};

class TieredPageStore final : public PageStore {
 public:
  TieredPageStore(const TieredStoreOptions& options, std::unique_ptr<BackingTier> tier);
  // Waits for the I/O in flight, then stops the pager threads. Dirty pages are dropped: the
  // state dies with its optimizer, and the page file with its tier.
  ~TieredPageStore() override;
  TieredPageStore(const TieredPageStore&) = delete;
  TieredPageStore& operator=(const TieredPageStore&) = delete;

  void grow(int32_t num_pages) override;
  void plan(const std::vector<int32_t>& pages) override;
  // Copies pin their pages like a step does, so their plan is followed the same way.
  void plan_copies(const std::vector<int32_t>& pages) override { plan(pages); }
  std::byte* pin(int32_t page) override;
  // Takes a slot for the page without reading it from the tier.
  std::byte* pin_overwrite(int32_t page) override;
  // Throws the step's write-back error, if any, when it unpins the plan's last page.
  void unpin(int32_t page, bool dirty) override;
  // An eighth of the budget (at least 1), so that the pages a step has finished with come
  // free while it works on the rest, for the reads ahead to load into (see schedule_locked).
  int32_t pin_limit() const override;
  int32_t num_pages() const override;
  int64_t page_bytes() const override { return cache_.page_bytes(); }
  int64_t resident_bytes() const override;

  // Throws the first write-back that has failed by now, once (without waiting for the
  // write-backs in flight: drain() first for those).
  void raise_pending_error() override;
  PagingStats stats() const;
  BackingTier& tier() noexcept { return *tier_; }
  // Blocks until no I/O is in flight or queued.
  void drain();

 private:
  // kClaim: a slot for a page its pinner overwrites; nothing to read or fill.
  enum class ActionKind : uint8_t { kRead, kWrite, kZero, kClaim };
  struct Action {
    ActionKind kind;
    int32_t page;
    std::byte* slot;
  };
  enum class LoadResult { kDone, kWaiting, kBlocked };
  // Who wants a page loaded: a pin waiting for it, the prefetch window, or a read past the
  // window, which may only take a slot the plan does not need again (see schedule_locked).
  enum class LoadKind { kDemand, kWindow, kReadAhead };
  struct LatchedError {
    std::exception_ptr error;
    uint64_t generation;  // error_clock_ when it was latched
  };

  std::byte* pin_page(int32_t page, bool overwrite);
  void schedule_locked();
  LoadResult load_locked(int32_t page, LoadKind kind, int64_t needed_at, int64_t& write_credit);
  LoadResult load_into_slot_locked(int32_t page, LoadKind kind, int64_t needed_at,
                                   int64_t& write_credit);
  void start_write_locked(int32_t page);
  void shrink_to_budget_locked();
  void complete_read_locked(int32_t page, int64_t result, bool checksum_ok, uint32_t actual);
  void complete_write_locked(int32_t page, int64_t result);
  void fail_in_flight_locked(int err);
  void finish_plan_locked(std::unique_lock<std::mutex>& lock);
  bool idle_locked() const;
  // Sets stopping_, wakes both threads and joins those that were started (also when the
  // constructor failed to start the second).
  void stop_threads();
  void submitter_loop();
  void reaper_loop();

  static uint64_t tag_of(int32_t page, io::OpKind op) {
    return (uint64_t(uint32_t(page)) << 1) | (op == io::OpKind::kWrite ? 1u : 0u);
  }

  const int32_t prefetch_;
  const int32_t read_attempts_;
  const int32_t max_writes_in_flight_;
  std::unique_ptr<BackingTier> tier_;

  mutable std::mutex mutex_;
  std::condition_variable state_cv_;  // page states changed: pins and drains re-check
  std::condition_variable work_cv_;   // actions_ became non-empty, or stopping_
  std::condition_variable reap_cv_;   // tier_in_flight_ became non-zero, or stopping_

  PageCache cache_;
  std::vector<Action> actions_;         // decided, not yet handed to the submitter
  std::vector<int32_t> demand_;         // pages a pin() waits for (a multiset)
  std::vector<int32_t> overwrite_;      // of those, pages their pinner overwrites
  std::unordered_map<int32_t, LatchedError> read_errors_;  // failed reads, until pinned
  uint64_t error_clock_ = 0;
  std::exception_ptr pending_error_;    // first failed write-back since the last throw
  int64_t loads_in_flight_ = 0;         // kLoading pages
  int64_t writes_in_flight_ = 0;        // kWriting pages
  int64_t tier_in_flight_ = 0;          // requests the tier holds
  int32_t total_pins_ = 0;
  bool plan_running_ = false;           // a plan was set and has not been finished
  bool degraded_ = false;               // a write-back failed: no more until the next plan
  int tier_failed_ = 0;                 // negative errno once the tier failed as a whole
  bool stopping_ = false;
  PagingStats counters_;

  std::thread submitter_;
  std::thread reaper_;
};

}  // namespace pagedoptim::paging
