#include "pagedoptim/paging/device_cache_store.h"
#include "pagedoptim/thread_start.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace pagedoptim::paging {
namespace {

int32_t budget_of(const DeviceCacheOptions& options) {
  if (options.page_bytes <= 0) {
    throw std::invalid_argument("page_bytes must be positive, got " +
                                std::to_string(options.page_bytes));
  }
  if (options.cache_bytes < options.page_bytes) {
    throw std::invalid_argument("cache_bytes must hold at least one page of " +
                                std::to_string(options.page_bytes) + " bytes, got " +
                                std::to_string(options.cache_bytes));
  }
  return int32_t(std::min<int64_t>(options.cache_bytes / options.page_bytes, INT32_MAX));
}

}  // namespace

DeviceCacheStore::DeviceCacheStore(device::Device& device, std::unique_ptr<PageStore> home,
                                   const DeviceCacheOptions& options)
    : device_(device),
      home_(std::move(home)),
      page_bytes_(options.page_bytes),
      budget_slots_(budget_of(options)),
      slot_cap_(budget_slots_),
      prefetch_(options.prefetch),
      policy_(options.policy == EvictionPolicy::kAuto ? EvictionPolicy::kPlan : options.policy) {
  if (home_ == nullptr) throw std::invalid_argument("a device cache needs a home store");
  if (home_->page_bytes() != page_bytes_) {
    throw std::invalid_argument("the home store's page size differs from the cache's");
  }
  if (options.prefetch < 0) {
    throw std::invalid_argument("prefetch must be >= 0, got " + std::to_string(options.prefetch));
  }
  counters_.policy = eviction_policy_name(options.policy);
  to_device_ = device_.create_stream();
  to_host_ = device_.create_stream();
  compute_done_ = device_.create_event(false);
  sync_event_ = device_.create_event(false);
  retirer_ = start_thread([this] { retirer_loop(); });  // last: nothing after it throws
}

DeviceCacheStore::~DeviceCacheStore() {
  try {
    std::unique_lock<std::mutex> lock(mutex_);
    jobs_cv_.wait(lock, [&] { return jobs_.empty(); });
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  jobs_cv_.notify_all();
  retirer_.join();
  // Slots may still be read by kernels or copies: wait for each slot's last uses.
  for (Slot& slot : slots_) {
    try {
      device_.synchronize(slot.released);
      device_.synchronize(slot.drained);
      device_.synchronize(slot.ready);
    } catch (...) {
    }
  }
  for (Slot& slot : slots_) {
    device_.release(slot.memory);
    device_.destroy_event(slot.ready);
    device_.destroy_event(slot.released);
    device_.destroy_event(slot.drained);
  }
  for (device::Event event : free_events_) device_.destroy_event(event);
  device_.destroy_event(compute_done_);
  device_.destroy_event(sync_event_);
  device_.destroy_stream(to_device_);
  device_.destroy_stream(to_host_);
}

device::Stream DeviceCacheStore::compute() const {
  if (!compute_named_) {
    throw std::logic_error("the device cache was used before begin_use() named a stream");
  }
  return compute_;
}

void DeviceCacheStore::begin_use(device::Stream compute) {
  if (compute_named_ && compute != compute_) device_.wait(compute, compute_done_);
  compute_ = compute;
  compute_named_ = true;
}

void DeviceCacheStore::end_use() { device_.record(compute_done_, compute()); }

void DeviceCacheStore::grow(int32_t num_pages) {
  if (num_pages <= this->num_pages()) return;
  home_->grow(num_pages);  // throws before anything changed here
  std::lock_guard<std::mutex> lock(mutex_);
  pages_.resize(size_t(num_pages));
  in_round_.resize(size_t(num_pages), 0);
  learned_position_.resize(size_t(num_pages), -1);
  plan_.resize(num_pages);
}

int32_t DeviceCacheStore::pin_limit() const { return std::max(1, slot_cap_ / 2); }

int64_t DeviceCacheStore::resident_bytes() const { return int64_t(slots_.size()) * page_bytes_; }

void DeviceCacheStore::plan(const std::vector<int32_t>& pages) {
  for (int32_t page : pages) {
    if (page < 0 || page >= num_pages()) {
      throw std::out_of_range("plan names page " + std::to_string(page) + " of " +
                              std::to_string(num_pages()));
    }
  }
  // Gradient release: a call whose pages this round has all seen, among them the round's
  // first page, starts the next round (backward visits the parameters in the same order
  // every time; a small parameter that shares pages with earlier ones has all its pages
  // seen too, but rarely the round's first). The round just ended becomes the order to
  // prefetch by.
  const bool all_seen = !pages.empty() && !round_.empty() &&
                        std::all_of(pages.begin(), pages.end(),
                                    [&](int32_t page) { return in_round_[size_t(page)] != 0; }) &&
                        std::find(pages.begin(), pages.end(), round_.front()) != pages.end();
  if (all_seen) {
    for (int32_t page : learned_) learned_position_[size_t(page)] = -1;
    learned_ = std::move(round_);
    round_.clear();
    for (int32_t page : learned_) in_round_[size_t(page)] = 0;
    for (size_t i = 0; i < learned_.size(); ++i) {
      if (learned_position_[size_t(learned_[i])] < 0) learned_position_[size_t(learned_[i])] = int64_t(i);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.learned_order_pages = int64_t(learned_.size());
  }
  for (int32_t page : pages) {
    if (in_round_[size_t(page)] == 0) {
      in_round_[size_t(page)] = 1;
      round_.push_back(page);
    }
  }
  // The call's pages, then what the learned order says comes after the latest of them.
  std::vector<int32_t> extended = pages;
  if (!pages.empty() && !learned_.empty()) {
    int64_t at = -1;
    for (int32_t page : pages) at = std::max(at, learned_position_[size_t(page)]);
    if (at >= 0) {
      const int64_t horizon = std::max<int64_t>(budget_slots_, prefetch_);
      for (int64_t i = at + 1; i < int64_t(learned_.size()) && i <= at + horizon; ++i) {
        extended.push_back(learned_[size_t(i)]);
      }
    }
  }
  plan_end_ = int64_t(pages.size());
  // The home store reads ahead (the page file) in the order its pages will be wanted,
  // the learned ones included.
  std::vector<int32_t> missing;
  for (int32_t page : extended) {
    if (pages_[size_t(page)].slot < 0) missing.push_back(page);
  }
  plan_.set(std::move(extended));
  home_->plan(missing);
}

int32_t DeviceCacheStore::find_victim(int64_t needed_at) const {
  int32_t best = -1;
  VictimInfo best_info{};
  for (const Slot& slot : slots_) {
    if (slot.page < 0) continue;
    const Page& p = pages_[size_t(slot.page)];
    if (p.pin_count > 0) continue;
    const VictimInfo info{slot.page, p.last_use, plan_.next_use(slot.page)};
    // A page needed no later than the one coming in stays: evicting it would only trade one
    // miss for another.
    if (needed_at >= 0 && info.next_use <= needed_at) continue;
    if (best < 0 || evict_before(policy_, info, best_info)) {
      best = slot.page;
      best_info = info;
    }
  }
  return best;
}

void DeviceCacheStore::give_back_events(const Job& job) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (job.start != nullptr) free_events_.push_back(job.start);
  if (job.end != nullptr) free_events_.push_back(job.end);
}

void DeviceCacheStore::enqueue_copy(device::Stream stream, const Job& job, void* dst,
                                    const void* src, device::CopyKind kind,
                                    device::Event done) {
  device_.record(job.start, stream);
  device_.copy(stream, dst, src, page_bytes_, kind);
  device_.record(job.end, stream);
  device_.record(done, stream);
}

void DeviceCacheStore::abandon_copy(const Job& job) noexcept {
  give_back_events(job);
  try {
    home_->unpin(job.page, /*dirty=*/false);
  } catch (...) {
  }
}

DeviceCacheStore::Job DeviceCacheStore::new_job(JobKind kind, int32_t page) {
  Job job{kind, page, nullptr, nullptr};
  try {
    job.start = take_timing_event();
    job.end = take_timing_event();
  } catch (...) {
    give_back_events(job);
    throw;
  }
  return job;
}

int32_t DeviceCacheStore::evict(int32_t victim, bool demand) {
  Page& v = pages_[size_t(victim)];
  const int32_t index = v.slot;
  Slot& slot = slots_[size_t(index)];
  const bool write_back = v.dirty;
  Job job{JobKind::kWriteBack, victim, nullptr, nullptr};
  if (write_back) {
    // Everything that can fail comes first: until the copy is enqueued the victim stays
    // resident and dirty, and nothing else changed.
    std::byte* home = nullptr;
    try {
      job = new_job(JobKind::kWriteBack, victim);
      home = home_->pin_overwrite(victim);
    } catch (...) {
      give_back_events(job);
      if (demand) throw;
      return -1;
    }
    try {
      device_.wait(to_host_, slot.released);
      enqueue_copy(to_host_, job, home, slot.memory, device::CopyKind::kDeviceToHost,
                   slot.drained);
    } catch (...) {
      // The device failed: the victim keeps its slot, and the home page goes back
      // unwritten (its old bytes, or a claimed bounce buffer, must not count as state).
      abandon_copy(job);
      if (demand) throw;
      return -1;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++counters_.evictions;
    if (write_back) {
      ++v.writes_pending;
      v.home_slot = index;
      jobs_.push_back(job);
    }
  }
  if (write_back) jobs_cv_.notify_all();
  slot.page = -1;
  v.slot = -1;
  v.dirty = false;
  v.loaded = false;
  --slots_in_use_;
  return index;
}

int32_t DeviceCacheStore::new_slot() {
  Slot slot;
  slot.memory = static_cast<std::byte*>(device_.allocate(page_bytes_));
  try {
    slot.ready = device_.create_event(false);
    slot.released = device_.create_event(false);
    slot.drained = device_.create_event(false);
    // The memory may be what the caching allocator got back from work still queued on the
    // compute stream (its stream): the first copy into the slot waits for that work.
    device_.record(slot.released, compute());
  } catch (...) {
    for (device::Event event : {slot.ready, slot.released, slot.drained}) {
      if (event != nullptr) device_.destroy_event(event);
    }
    device_.release(slot.memory);
    throw;
  }
  slots_.push_back(slot);
  return int32_t(slots_.size()) - 1;
}

int32_t DeviceCacheStore::take_slot(int64_t needed_at, bool demand) {
  if (!free_slots_.empty()) {
    const int32_t index = free_slots_.back();
    free_slots_.pop_back();
    return index;
  }
  try {
    if (int32_t(slots_.size()) < slot_cap_) {
      try {
        return new_slot();
      } catch (const device::MemoryRefused&) {
        // The device has less free memory than the budget promised (other tensors grew):
        // work within the slots there are from now on, if there are any.
        if (slots_.empty()) throw;
        slot_cap_ = int32_t(slots_.size());
      }
    }
    const int32_t victim = find_victim(demand ? -1 : needed_at);
    if (victim >= 0) return evict(victim, demand);
    if (!demand) return -1;
    if (!free_overflow_.empty()) {
      const int32_t index = free_overflow_.back();
      free_overflow_.pop_back();
      return index;
    }
    // Every slot is pinned: go past the budget rather than fail a pin (the driver pins at
    // most pin_limit() pages, so only pins outside a step's batches get here).
    return new_slot();
  } catch (...) {
    if (demand) throw;
    return -1;  // a prefetch that found no memory just does not happen
  }
}

bool DeviceCacheStore::load(int32_t page, int64_t needed_at, bool demand) {
  const int32_t index = take_slot(needed_at, demand);
  if (index < 0) return false;
  Page& p = pages_[size_t(page)];
  Slot& slot = slots_[size_t(index)];
  // Everything that can fail comes before the page is marked resident: a failure leaves the
  // slot free, the home page unpinned and the page where it was.
  Job job{JobKind::kLoad, page, nullptr, nullptr};
  std::byte* home = nullptr;
  try {
    job = new_job(JobKind::kLoad, page);
    home = home_->pin(page);
  } catch (...) {
    give_back_events(job);
    release_slot(index);
    if (demand) throw;
    return false;
  }
  try {
    // The slot's previous page is done with (its kernels, its write-back) ...
    device_.wait(to_device_, slot.released);
    device_.wait(to_device_, slot.drained);
    {
      // ... and so is this page's latest write-back into the home copy.
      std::lock_guard<std::mutex> lock(mutex_);
      if (p.writes_pending > 0) device_.wait(to_device_, slots_[size_t(p.home_slot)].drained);
    }
    enqueue_copy(to_device_, job, slot.memory, home, device::CopyKind::kHostToDevice,
                 slot.ready);
  } catch (...) {
    abandon_copy(job);
    release_slot(index);
    if (demand) throw;
    return false;
  }
  slot.page = page;
  slot.ready_unwaited = true;
  p.slot = index;
  p.loaded = true;
  p.dirty = false;
  ++slots_in_use_;
  peak_slots_in_use_ = std::max(peak_slots_in_use_, slots_in_use_);
  push_job(job);
  return true;
}

void DeviceCacheStore::prefetch_ahead() {
  const int64_t end = std::min(plan_.size(), plan_.cursor() + prefetch_);
  for (int64_t position = plan_.cursor(); position < end; ++position) {
    const int32_t page = plan_.page_at(position);
    if (pages_[size_t(page)].slot >= 0) continue;
    // In plan order: a later page must not take the slot an earlier one needs.
    if (!load(page, position, /*demand=*/false)) return;
  }
}

std::byte* DeviceCacheStore::pin(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    throw std::out_of_range("page " + std::to_string(page) + " does not exist (the store has " +
                            std::to_string(num_pages()) + ")");
  }
  const device::Stream stream = compute();
  Page& p = pages_[size_t(page)];
  const bool was_resident = p.slot >= 0;
  const bool hit = was_resident && !p.loaded;
  if (!was_resident) load(page, -1, /*demand=*/true);
  // A copy, not a reference: prefetching below may add slots.
  const Slot slot = slots_[size_t(p.slot)];
  // The compute stream waits for each record of `ready` once: a hit on a page it has
  // waited for since its last copy costs no device call.
  slots_[size_t(p.slot)].ready_unwaited = false;
  if (hit) {
    if (slot.ready_unwaited) device_.wait(stream, slot.ready);
  } else {
    // The time between these two events is the time the compute stream stood still
    // waiting for the page.
    const Job stall = new_job(JobKind::kStall, page);
    try {
      device_.record(stall.start, stream);
      device_.wait(stream, slot.ready);
      device_.record(stall.end, stream);
    } catch (...) {
      give_back_events(stall);
      throw;
    }
    push_job(stall);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (hit) {
      ++counters_.hits;
    } else {
      ++counters_.misses;
      if (was_resident) ++counters_.prefetch_hits;
    }
  }
  p.loaded = false;
  ++p.pin_count;
  ++pins_;
  p.last_use = ++clock_;
  plan_.advance_if_next(page);
  try {
    prefetch_ahead();
  } catch (...) {
    // A prefetch is a hint: the page it wanted is loaded (or fails) at its own pin. This
    // pin succeeded and must not throw after counting itself.
  }
  return slot.memory;
}

void DeviceCacheStore::unpin(int32_t page, bool dirty) {
  if (page < 0 || page >= num_pages() || pages_[size_t(page)].pin_count == 0) {
    throw std::logic_error("unpin of page " + std::to_string(page) + " that is not pinned");
  }
  Page& p = pages_[size_t(page)];
  device_.record(slots_[size_t(p.slot)].released, compute());
  --p.pin_count;
  --pins_;
  p.dirty = p.dirty || dirty;
  p.last_use = ++clock_;
  if (pins_ == 0 && plan_end_ > 0 && plan_.cursor() >= plan_end_) finish_plan();
}

void DeviceCacheStore::finish_plan() {
  plan_end_ = 0;
  plan_.clear();
  throw_pending();
  // A page-file write-back that failed behind this step: its plan may never end (it holds
  // pages of later calls), so ask for its error here.
  home_->raise_pending_error();
}

void DeviceCacheStore::read_bytes(int32_t page, int64_t offset, void* out, int64_t bytes) {
  if (page < 0 || page >= num_pages() || offset < 0 || bytes < 0 ||
      offset + bytes > page_bytes_) {
    throw std::out_of_range("read of bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset + bytes) + ") of page " + std::to_string(page));
  }
  const Page& p = pages_[size_t(page)];
  if (p.slot >= 0) {
    const Slot& slot = slots_[size_t(p.slot)];
    device_.wait(to_host_, slot.ready);
    device_.wait(to_host_, slot.released);
    device_.copy(to_host_, out, slot.memory + offset, bytes, device::CopyKind::kDeviceToHost);
    device_.record(sync_event_, to_host_);
    device_.synchronize(sync_event_);
    return;
  }
  // The home copy is complete once its write-backs retired. An error they met is not this
  // read's: the state stays readable for a checkpoint after a failed write-back.
  wait_for_jobs();
  home_->read_bytes(page, offset, out, bytes);
}

void DeviceCacheStore::write_bytes(int32_t page, int64_t offset, const void* in, int64_t bytes) {
  if (page < 0 || page >= num_pages() || offset < 0 || bytes < 0 ||
      offset + bytes > page_bytes_) {
    throw std::out_of_range("write of bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset + bytes) + ") of page " + std::to_string(page));
  }
  Page& p = pages_[size_t(page)];
  if (p.slot >= 0) {
    Slot& slot = slots_[size_t(p.slot)];
    device_.wait(to_device_, slot.ready);
    device_.wait(to_device_, slot.released);
    device_.copy(to_device_, slot.memory + offset, in, bytes, device::CopyKind::kHostToDevice);
    device_.record(slot.ready, to_device_);
    slot.ready_unwaited = true;
    device_.record(sync_event_, to_device_);
    device_.synchronize(sync_event_);  // `in` is the caller's, free once this returns
    p.dirty = true;
    return;
  }
  wait_for_jobs();
  home_->write_bytes(page, offset, in, bytes);
}

device::Event DeviceCacheStore::take_timing_event() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_events_.empty()) {
      device::Event event = free_events_.back();
      free_events_.pop_back();
      return event;
    }
  }
  return device_.create_event(true);
}

void DeviceCacheStore::push_job(const Job& job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(job);
  }
  jobs_cv_.notify_all();
}

void DeviceCacheStore::latch_error_locked(std::exception_ptr error) {
  if (!pending_error_) pending_error_ = std::move(error);
}

void DeviceCacheStore::throw_pending() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = std::exchange(pending_error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void DeviceCacheStore::wait_for_jobs() {
  std::unique_lock<std::mutex> lock(mutex_);
  jobs_cv_.wait(lock, [&] { return jobs_.empty(); });
}

void DeviceCacheStore::drain() {
  wait_for_jobs();
  throw_pending();
  home_->raise_pending_error();
}

void DeviceCacheStore::release_slot(int32_t index) {
  (index < budget_slots_ ? free_slots_ : free_overflow_).push_back(index);
}

void DeviceCacheStore::retirer_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      jobs_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = jobs_.front();
    }
    std::exception_ptr error;
    double seconds = 0;
    try {
      device_.synchronize(job.end);
      seconds = device_.elapsed(job.start, job.end);
    } catch (...) {
      error = std::current_exception();
    }
    // The copy is done with the home page: a load read it, a write-back wrote it (unless
    // the device failed: then the home keeps what it had, and the error is reported).
    if (job.kind != JobKind::kStall) {
      try {
        home_->unpin(job.page, job.kind == JobKind::kWriteBack && !error);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error) latch_error_locked(error);
      switch (job.kind) {
        case JobKind::kLoad:
          ++counters_.loads;
          counters_.bytes_to_device += page_bytes_;
          counters_.seconds_to_device += seconds;
          break;
        case JobKind::kWriteBack: {
          ++counters_.write_backs;
          counters_.bytes_to_host += page_bytes_;
          counters_.seconds_to_host += seconds;
          Page& p = pages_[size_t(job.page)];
          if (--p.writes_pending == 0) p.home_slot = -1;
          break;
        }
        case JobKind::kStall:
          counters_.compute_wait_seconds += seconds;
          break;
      }
      free_events_.push_back(job.start);
      free_events_.push_back(job.end);
      jobs_.pop_front();
    }
    jobs_cv_.notify_all();
  }
}

DeviceCacheStats DeviceCacheStore::stats() const {
  DeviceCacheStats s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s = counters_;
    if (pending_error_) {
      try {
        std::rethrow_exception(pending_error_);
      } catch (const std::exception& e) {
        s.pending_error = e.what();
      } catch (...) {
        s.pending_error = "unknown error";
      }
    }
  }
  s.num_pages = num_pages();
  s.budget_pages = budget_slots_;
  s.resident_pages = slots_in_use_;
  s.peak_resident_pages = peak_slots_in_use_;
  s.over_budget_pages = std::max(0, int32_t(slots_.size()) - budget_slots_);
  s.pin_limit = pin_limit();
  s.prefetch = prefetch_;
  return s;
}

}  // namespace pagedoptim::paging
