#include "pagedoptim/paging/tiered_page_store.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "pagedoptim/io/crc32c.h"
#include "pagedoptim/paging/page_errors.h"
#include "pagedoptim/thread_start.h"

namespace pagedoptim::paging {
namespace {

using Clock = std::chrono::steady_clock;

int32_t budget_pages(const TieredStoreOptions& options) {
  if (options.page_bytes <= 0) {
    throw std::invalid_argument("page_bytes must be positive, got " +
                                std::to_string(options.page_bytes));
  }
  if (options.cache_bytes < 0) {
    throw std::invalid_argument("cache_bytes must be >= 0, got " +
                                std::to_string(options.cache_bytes));
  }
  const int64_t pages = options.cache_bytes / options.page_bytes;
  return int32_t(std::clamp<int64_t>(pages, 1, INT32_MAX));
}

}  // namespace

TieredPageStore::TieredPageStore(const TieredStoreOptions& options,
                                 std::unique_ptr<BackingTier> tier)
    : prefetch_(options.prefetch),
      read_attempts_(options.read_attempts),
      max_writes_in_flight_(std::max(1, options.prefetch)),
      tier_(std::move(tier)),
      cache_(options.page_bytes, budget_pages(options),
             options.policy == EvictionPolicy::kAuto ? EvictionPolicy::kPlan : options.policy,
             options.slots) {
  if (tier_ == nullptr) throw std::invalid_argument("a tiered page store needs a backing tier");
  if (tier_->page_bytes() != options.page_bytes) {
    throw std::invalid_argument("the backing tier's page size differs from the store's");
  }
  if (options.prefetch < 0) {
    throw std::invalid_argument("prefetch must be >= 0, got " + std::to_string(options.prefetch));
  }
  if (options.read_attempts < 1) {
    throw std::invalid_argument("read_attempts must be >= 1, got " +
                                std::to_string(options.read_attempts));
  }
  counters_.policy = eviction_policy_name(options.policy);
  submitter_ = start_thread([this] { submitter_loop(); });
  try {
    reaper_ = start_thread([this] { reaper_loop(); });
  } catch (...) {
    stop_threads();  // a joinable submitter_ destroyed by the unwinding would terminate
    throw;
  }
}

TieredPageStore::~TieredPageStore() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // The tier may still be writing into (or reading from) cache slots: they must outlive
    // every request, so the threads stop only once nothing is in flight.
    state_cv_.wait(lock, [&] { return idle_locked(); });
  }
  stop_threads();
}

void TieredPageStore::stop_threads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  reap_cv_.notify_all();
  if (submitter_.joinable()) submitter_.join();
  if (reaper_.joinable()) reaper_.join();
}

bool TieredPageStore::idle_locked() const {
  return actions_.empty() && loads_in_flight_ == 0 && writes_in_flight_ == 0 &&
         tier_in_flight_ == 0;
}

void TieredPageStore::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  state_cv_.wait(lock, [&] { return idle_locked(); });
}

void TieredPageStore::grow(int32_t num_pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (num_pages <= cache_.num_pages()) return;
  tier_->grow(num_pages);  // throws before anything changed here
  cache_.grow(num_pages);
}

int32_t TieredPageStore::num_pages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cache_.num_pages();
}

int64_t TieredPageStore::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return int64_t(cache_.slots_in_use()) * cache_.page_bytes();
}

int32_t TieredPageStore::pin_limit() const {
  const int32_t budget = cache_.budget_slots();
  // The driver pins a batch, runs its kernels, then unpins it; the pages of a pinned batch
  // cannot make room for reads ahead. Pinning nearly the whole budget (the budget less the
  // prefetch window, as before), a warm step of 1e9 params with a 2 GiB cache began with
  // 0.4 s without I/O: its first batch was all hits, and nothing came free to read the
  // misses into until that batch was done (docs/paging.md, "Where it lost it").
  return std::max(1, budget / 8);
}

void TieredPageStore::plan(const std::vector<int32_t>& pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int32_t page : pages) {
    if (page < 0 || page >= cache_.num_pages()) {
      throw std::out_of_range("plan names page " + std::to_string(page) + " of " +
                              std::to_string(cache_.num_pages()));
    }
  }
  cache_.plan().set(pages);
  plan_running_ = !pages.empty();
  // A new step tries again what failed in the last one: write-backs (the disk may have
  // room again) and reads.
  degraded_ = false;
  read_errors_.clear();
  schedule_locked();
}

void TieredPageStore::schedule_locked() {
  if (stopping_) return;
  // Write-backs in flight each free one slot when they finish; a load that finds no slot
  // claims one of them instead of starting yet another write-back.
  int64_t write_credit = writes_in_flight_;
  // Demanded pages first: a pin is waiting for each of them.
  for (size_t i = 0; i < demand_.size(); ++i) {
    if (std::find(demand_.begin(), demand_.begin() + i, demand_[i]) != demand_.begin() + i) {
      continue;
    }
    load_locked(demand_[i], LoadKind::kDemand, -1, write_credit);
  }
  // Then the pages ahead of the cursor that the step would miss, in plan order. Pages it
  // will hit (resident since before this plan) are passed over: counting them, a run of
  // hits ahead of the cursor kept the disk idle while the kernels worked through it.
  //  - The first `prefetch` of them are the window: a page in it may take the slot of any
  //    page the plan needs later than it. A page read ahead and not yet pinned still
  //    counts, so which pages the window evicts does not depend on timing.
  //  - Past the window, while fewer than `prefetch` reads are in flight (DESIGN.md: the
  //    pages in flight ahead of the step), a page is read ahead into a free slot or the
  //    slot of the policy's victim, only if the plan is done with that victim. Such a read
  //    costs the step no hit, so how far ahead it gets (timing) changes only when pages
  //    arrive. Allowed to evict pages still needed, reads running ahead of a
  //    same-direction scan displaced the pages it needed next, and its hits varied by run.
  PlanTracker& plan = cache_.plan();
  const int64_t end =
      prefetch_ > 0 ? std::min(plan.size(), plan.cursor() + int64_t(cache_.budget_slots())) : 0;
  int32_t window = 0;
  bool earlier_in_flight = true;  // every miss before this position is loading or loaded
  for (int64_t position = plan.cursor(); position < end; ++position) {
    const int32_t page = plan.page_at(position);
    const PageMeta& m = cache_.meta(page);
    if (m.pin_would_hit()) continue;
    const bool in_window = window++ < prefetch_;
    // A read ahead waits until the misses before it are in flight (a window page waiting
    // for a write-back would otherwise see a later page take the clean slot it could use,
    // and the reads in flight could exceed `prefetch`).
    if (!in_window && (!earlier_in_flight || loads_in_flight_ >= prefetch_)) break;
    // A demanded page had its turn above: asking again would claim a second slot for it
    // (a second write-back whose slot nobody takes).
    if (std::find(demand_.begin(), demand_.end(), page) == demand_.end()) {
      // In plan order: a later page must not take the slot an earlier one waits for.
      const LoadKind kind = in_window ? LoadKind::kWindow : LoadKind::kReadAhead;
      if (load_locked(page, kind, position, write_credit) == LoadResult::kBlocked) break;
    }
    if (m.state == PageState::kAbsent) earlier_in_flight = false;
  }
  shrink_to_budget_locked();
  if (!actions_.empty()) work_cv_.notify_one();
}

void TieredPageStore::shrink_to_budget_locked() {
  // Slots past the budget exist because write-backs failed (or every slot was pinned).
  // Once write-backs work again, give that memory back: evict the pages in them (writing
  // back first), in policy order. A write-back in flight frees its slot when it finishes.
  if (degraded_ || cache_.overflow_slots() == 0) return;
  int64_t excess = int64_t(cache_.overflow_slots()) - writes_in_flight_;
  while (excess > 0) {
    const int32_t victim =
        cache_.find_victim(-1, /*dirty_allowed=*/true, /*overflow_only=*/true);
    if (victim < 0) return;
    if (!cache_.meta(victim).dirty) {
      cache_.release_slot(victim);
      ++counters_.evictions;
    } else if (writes_in_flight_ < max_writes_in_flight_) {
      start_write_locked(victim);
    } else {
      return;
    }
    --excess;
  }
}

TieredPageStore::LoadResult TieredPageStore::load_locked(int32_t page, LoadKind kind,
                                                         int64_t needed_at,
                                                         int64_t& write_credit) {
  PageMeta& m = cache_.meta(page);
  if (m.state != PageState::kAbsent || read_errors_.count(page) != 0) return LoadResult::kDone;
  const bool demand = kind == LoadKind::kDemand;
  try {
    return load_into_slot_locked(page, kind, needed_at, write_credit);
  } catch (const std::exception&) {
    // Slots are allocated on first use, possibly on a pager thread, where an exception
    // must not escape (std::bad_alloc, or pinned memory a device refused). A prefetch just
    // does not happen; a pin gets the error.
    if (demand) read_errors_[page] = LatchedError{std::current_exception(), ++error_clock_};
    return LoadResult::kBlocked;
  }
}

TieredPageStore::LoadResult TieredPageStore::load_into_slot_locked(int32_t page,
                                                                   LoadKind kind,
                                                                   int64_t needed_at,
                                                                   int64_t& write_credit) {
  PageMeta& m = cache_.meta(page);
  const bool demand = kind == LoadKind::kDemand;
  int32_t slot = cache_.take_free_slot();
  while (slot < 0) {
    int32_t victim = cache_.find_victim(needed_at, /*dirty_allowed=*/!degraded_);
    // A write-back in flight frees a slot soon; a page the plan still needs, evicted now,
    // is read again later in the step. Waiting is the cheaper of the two, and it keeps a
    // step's traffic independent of how its I/O and its pins interleave.
    bool needed_later = victim >= 0 && cache_.plan().next_use(victim) != kNeverUsed;
    // A read past the window takes the policy's victim only if the plan is done with it:
    // then reading early costs no hit, however far ahead the timing lets it get.
    if (kind == LoadKind::kReadAhead && needed_later) {
      victim = -1;
      needed_later = false;
    }
    if (victim >= 0 && !cache_.meta(victim).dirty && !(needed_later && write_credit > 0)) {
      // Evicting a clean page is free. A page in a slot past the budget gives no slot
      // back, so the loop goes on evicting: that is how the cache shrinks to its budget
      // again after write-backs failed.
      cache_.release_slot(victim);
      ++counters_.evictions;
      slot = cache_.take_free_slot();
    } else if (write_credit > 0) {
      --write_credit;
      return LoadResult::kWaiting;
    } else if (victim >= 0) {
      if (writes_in_flight_ >= max_writes_in_flight_) return LoadResult::kBlocked;
      start_write_locked(victim);
      return LoadResult::kWaiting;
    } else if (demand && loads_in_flight_ == 0 && writes_in_flight_ == 0) {
      // Every slot is pinned or holds a dirty page that cannot be written back, and
      // nothing in flight will free one: go over the budget rather than wait forever or
      // drop a page.
      slot = cache_.take_overflow_slot();
    } else {
      return LoadResult::kBlocked;
    }
  }
  cache_.assign_slot(page, slot);
  m.state = PageState::kLoading;
  m.read_attempts = 1;
  ++loads_in_flight_;
  // Skip the read only when every pin waiting for the page overwrites it.
  const auto overwrites = std::count(overwrite_.begin(), overwrite_.end(), page);
  const bool claim =
      demand && overwrites > 0 && overwrites == std::count(demand_.begin(), demand_.end(), page);
  const ActionKind action =
      claim ? ActionKind::kClaim : (m.on_tier ? ActionKind::kRead : ActionKind::kZero);
  actions_.push_back(Action{action, page, cache_.slot_data(slot)});
  return LoadResult::kDone;
}

void TieredPageStore::start_write_locked(int32_t page) {
  PageMeta& m = cache_.meta(page);
  m.state = PageState::kWriting;
  ++writes_in_flight_;
  actions_.push_back(Action{ActionKind::kWrite, page, cache_.slot_data(m.slot)});
}

std::byte* TieredPageStore::pin(int32_t page) { return pin_page(page, false); }

std::byte* TieredPageStore::pin_overwrite(int32_t page) { return pin_page(page, true); }

std::byte* TieredPageStore::pin_page(int32_t page, bool overwrite) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (page < 0 || page >= cache_.num_pages()) {
    throw std::out_of_range("page " + std::to_string(page) + " does not exist (the store has " +
                            std::to_string(cache_.num_pages()) + ")");
  }
  bool counted = false;
  bool hit = false;
  bool waiting = false;
  Clock::time_point wait_start{};
  const auto stop_waiting = [&] {
    if (!waiting) return;
    --cache_.meta(page).waiters;
    demand_.erase(std::find(demand_.begin(), demand_.end(), page));
    if (overwrite) overwrite_.erase(std::find(overwrite_.begin(), overwrite_.end(), page));
    counters_.stall_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();
  };
  // Errors latched before this pin began (a prefetch of an earlier step, a pin that gave
  // up) are stale: the fault may be gone, so this pin reads again rather than rethrow them.
  const uint64_t first_fresh_error = error_clock_ + 1;
  for (;;) {
    if (auto it = read_errors_.find(page); it != read_errors_.end()) {
      if (it->second.generation < first_fresh_error) {
        read_errors_.erase(it);
        continue;
      }
      std::exception_ptr error = it->second.error;
      read_errors_.erase(it);
      stop_waiting();
      // The step that wanted this page is over; its prefetch window must not keep loading.
      cache_.plan().clear();
      plan_running_ = false;
      std::rethrow_exception(error);
    }
    PageMeta& m = cache_.meta(page);
    if (!counted) {
      counted = true;
      hit = m.pin_would_hit();
    }
    if (m.state == PageState::kResident) {
      if (hit) {
        ++counters_.hits;
      } else {
        ++counters_.misses;
        if (!waiting) ++counters_.prefetch_hits;
      }
      stop_waiting();
      m.loaded = false;
      ++m.pin_count;
      ++m.use_count;
      m.last_use = cache_.tick();
      ++total_pins_;
      cache_.plan().advance_if_next(page);
      schedule_locked();  // the window moved
      return cache_.slot_data(m.slot);
    }
    if (!waiting) {
      waiting = true;
      wait_start = Clock::now();
      // Once loaded, the page must stay until this pin wakes up: the pager may run
      // first, and a clean page in a slot past the budget is what it evicts first.
      ++cache_.meta(page).waiters;
      demand_.push_back(page);
      if (overwrite) overwrite_.push_back(page);
    }
    schedule_locked();
    state_cv_.wait(lock);
  }
}

void TieredPageStore::unpin(int32_t page, bool dirty) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (page < 0 || page >= cache_.num_pages() || cache_.meta(page).pin_count == 0) {
    throw std::logic_error("unpin of page " + std::to_string(page) + " that is not pinned");
  }
  PageMeta& m = cache_.meta(page);
  --m.pin_count;
  --total_pins_;
  m.dirty = m.dirty || dirty;
  m.last_use = cache_.tick();
  schedule_locked();
  state_cv_.notify_all();
  if (plan_running_ && !cache_.plan().active() && total_pins_ == 0) finish_plan_locked(lock);
}

void TieredPageStore::finish_plan_locked(std::unique_lock<std::mutex>& lock) {
  plan_running_ = false;
  cache_.plan().clear();
  // Write-backs of this step report in this step.
  state_cv_.wait(lock, [&] { return writes_in_flight_ == 0; });
  if (pending_error_) {
    std::exception_ptr error = pending_error_;
    pending_error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void TieredPageStore::complete_read_locked(int32_t page, int64_t result, bool checksum_ok,
                                           uint32_t actual) {
  PageMeta& m = cache_.meta(page);
  m.in_tier = false;
  const int64_t page_bytes = cache_.page_bytes();
  if (result == page_bytes && checksum_ok) {
    m.state = PageState::kResident;
    m.loaded = true;
    --loads_in_flight_;
    ++counters_.reads;
    counters_.bytes_read += page_bytes;
    return;
  }
  if (m.read_attempts < read_attempts_ && tier_failed_ == 0) {
    ++m.read_attempts;
    ++counters_.read_retries;
    actions_.push_back(Action{ActionKind::kRead, page, cache_.slot_data(m.slot)});
    return;
  }
  const std::string& path = tier_->info().location;
  std::exception_ptr error;
  if (result == page_bytes) {
    ++counters_.checksum_errors;
    error = std::make_exception_ptr(
        PageCorruptionError(path, page, m.crc, actual, m.read_attempts));
  } else {
    ++counters_.read_errors;
    const int err = result < 0 ? int(-result) : EIO;
    const std::string what =
        result < 0 ? "reading page " + std::to_string(page) + " from " + path + " failed in " +
                         std::to_string(m.read_attempts) + " attempts"
                   : "short read of page " + std::to_string(page) + " from " + path + ": " +
                         std::to_string(result) + " of " + std::to_string(page_bytes) +
                         " bytes";
    error = std::make_exception_ptr(PageIoError(err, path, page, what));
  }
  read_errors_[page] = LatchedError{error, ++error_clock_};
  cache_.release_slot(page);
  --loads_in_flight_;
}

void TieredPageStore::complete_write_locked(int32_t page, int64_t result) {
  PageMeta& m = cache_.meta(page);
  m.in_tier = false;
  --writes_in_flight_;
  const int64_t page_bytes = cache_.page_bytes();
  if (result == page_bytes) {
    m.on_tier = true;
    m.crc = m.pending_crc;
    m.dirty = false;
    ++counters_.writes;
    counters_.bytes_written += page_bytes;
    // The page stays, clean: evicting it is now free, and the schedule that follows does so
    // only if a load still wants the slot. A load may have found another slot meanwhile
    // (another write-back finished first); evicting here regardless would throw away a page
    // the next step finds resident, so a step's traffic would depend on I/O timing.
    m.state = PageState::kResident;
    return;
  }
  // The write-back failed (or tore the tier copy): the slot keeps the only good copy, so
  // the page stays resident and dirty, and no further write-back is tried in this plan.
  m.state = PageState::kResident;
  ++counters_.write_errors;
  degraded_ = true;
  if (!pending_error_) {
    const std::string& path = tier_->info().location;
    const int err = result < 0 ? int(-result) : EIO;
    std::string what = "writing back page " + std::to_string(page) + " to " + path + " failed";
    if (result >= 0) {
      what += " (short write: " + std::to_string(result) + " of " + std::to_string(page_bytes) +
              " bytes)";
    }
    what += "; the page stays in memory and no optimizer state was lost (state_dict() still "
            "works)";
    pending_error_ = std::make_exception_ptr(PageIoError(err, path, page, what));
  }
}

void TieredPageStore::fail_in_flight_locked(int err) {
  tier_failed_ = err;
  for (int32_t page = 0; page < cache_.num_pages(); ++page) {
    PageMeta& m = cache_.meta(page);
    if (!m.in_tier) continue;
    if (m.state == PageState::kWriting) {
      complete_write_locked(page, err);
    } else {
      m.read_attempts = read_attempts_;
      complete_read_locked(page, err, false, 0);
    }
  }
  tier_in_flight_ = 0;
}

void TieredPageStore::submitter_loop() {
  const int64_t page_bytes = cache_.page_bytes();
  std::vector<Action> batch;
  std::vector<TierRequest> requests;
  std::vector<std::pair<int32_t, uint32_t>> checksums;
  std::vector<int32_t> zeroed;
  std::vector<int32_t> claimed;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !actions_.empty(); });
      if (actions_.empty()) return;
      batch.clear();
      batch.swap(actions_);
    }
    // The pages of the batch are kLoading or kWriting: no other thread touches their slots
    // until their completion is recorded under the mutex.
    requests.clear();
    checksums.clear();
    zeroed.clear();
    claimed.clear();
    for (const Action& a : batch) {
      switch (a.kind) {
        case ActionKind::kZero:
          std::memset(a.slot, 0, size_t(page_bytes));
          zeroed.push_back(a.page);
          break;
        case ActionKind::kClaim:
          claimed.push_back(a.page);
          break;
        case ActionKind::kWrite:
          checksums.emplace_back(a.page, io::crc32c(a.slot, size_t(page_bytes)));
          requests.push_back(TierRequest{io::OpKind::kWrite, a.page, a.slot,
                                         tag_of(a.page, io::OpKind::kWrite)});
          break;
        case ActionKind::kRead:
          requests.push_back(TierRequest{io::OpKind::kRead, a.page, a.slot,
                                         tag_of(a.page, io::OpKind::kRead)});
          break;
      }
    }
    int failed = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [page, crc] : checksums) cache_.meta(page).pending_crc = crc;
      for (int32_t page : zeroed) {
        PageMeta& m = cache_.meta(page);
        m.state = PageState::kResident;
        m.loaded = true;
        --loads_in_flight_;
        ++counters_.zero_fills;
      }
      for (int32_t page : claimed) {
        PageMeta& m = cache_.meta(page);
        m.state = PageState::kResident;
        m.loaded = true;
        --loads_in_flight_;
      }
      failed = tier_failed_;
      if (failed == 0) {
        for (const TierRequest& r : requests) cache_.meta(r.page).in_tier = true;
        tier_in_flight_ += int64_t(requests.size());
      }
      if (!zeroed.empty() || !claimed.empty()) {
        schedule_locked();
        state_cv_.notify_all();
      }
    }
    if (requests.empty()) continue;
    if (failed == 0) {
      reap_cv_.notify_one();
      failed = tier_->submit(requests);
      if (failed >= 0) continue;
    }
    // Nothing of the batch reached the tier: complete it here with the error.
    std::lock_guard<std::mutex> lock(mutex_);
    for (const TierRequest& r : requests) {
      PageMeta& m = cache_.meta(r.page);
      if (m.in_tier) {
        m.in_tier = false;
        --tier_in_flight_;
      }
      if (r.op == io::OpKind::kWrite) {
        complete_write_locked(r.page, failed);
      } else {
        m.read_attempts = read_attempts_;
        complete_read_locked(r.page, failed, false, 0);
      }
    }
    schedule_locked();
    state_cv_.notify_all();
  }
}

void TieredPageStore::reaper_loop() {
  const int64_t page_bytes = cache_.page_bytes();
  std::vector<TierCompletion> done(64);
  struct Checked {
    int32_t page;
    bool write;
    std::byte* slot;
    uint32_t expected;
    uint32_t actual;
  };
  std::vector<Checked> checked;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      reap_cv_.wait(lock, [&] { return stopping_ || tier_in_flight_ > 0; });
      if (tier_in_flight_ == 0) return;  // stopping, and the destructor drained everything
    }
    const int n = tier_->wait(done);
    if (n == 0 || n == -ETIME || n == -EINTR) {
      // 0: the submitter counted its batch but has not handed it over yet.
      if (n == 0) std::this_thread::yield();
      continue;
    }
    if (n < 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      fail_in_flight_locked(n);
      schedule_locked();
      state_cv_.notify_all();
      continue;
    }
    checked.clear();
    {
      // Taking the mutex here also orders the slot bytes the submitter's side wrote
      // before the request after this thread's reads of them below.
      std::lock_guard<std::mutex> lock(mutex_);
      for (int i = 0; i < n; ++i) {
        const int32_t page = int32_t(done[size_t(i)].tag >> 1);
        const PageMeta& m = cache_.meta(page);
        checked.push_back(Checked{page, (done[size_t(i)].tag & 1) != 0,
                                  cache_.slot_data(m.slot), m.crc, 0});
      }
    }
    for (int i = 0; i < n; ++i) {
      Checked& c = checked[size_t(i)];
      if (!c.write && done[size_t(i)].result == page_bytes) {
        c.actual = io::crc32c(c.slot, size_t(page_bytes));
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < n; ++i) {
      const Checked& c = checked[size_t(i)];
      const int64_t result = done[size_t(i)].result;
      if (c.write) {
        complete_write_locked(c.page, result);
      } else {
        complete_read_locked(c.page, result, c.actual == c.expected, c.actual);
      }
    }
    tier_in_flight_ -= n;
    schedule_locked();
    state_cv_.notify_all();
  }
}

void TieredPageStore::raise_pending_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pending_error_) return;
  std::exception_ptr error = std::exchange(pending_error_, nullptr);
  std::rethrow_exception(error);
}

PagingStats TieredPageStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PagingStats s = counters_;
  s.num_pages = cache_.num_pages();
  s.budget_pages = cache_.budget_slots();
  s.resident_pages = cache_.slots_in_use();
  s.peak_resident_pages = cache_.peak_slots_in_use();
  s.over_budget_pages = cache_.overflow_slots();
  s.pin_limit = pin_limit();
  s.prefetch = prefetch_;
  s.tier = tier_->info();
  if (pending_error_) {
    try {
      std::rethrow_exception(pending_error_);
    } catch (const std::exception& e) {
      s.pending_error = e.what();
    }
  }
  return s;
}

}  // namespace pagedoptim::paging
