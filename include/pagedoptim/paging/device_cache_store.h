// DeviceCacheStore: the page store for state on a compute device that does not fit there.
// A cache of `cache_bytes` of device slots holds the hot pages; every page has a home in a
// store of host memory below it: pinned host slabs (PinnedHostStore, offload="host") or a
// TieredPageStore over the NVMe page file whose cache slots are pinned bounce buffers
// (offload="nvme", checksums verified there, on the host).
//
// The protocol is asynchronous; the host never waits for the device inside a step.
//   pin(page)    makes the page's slot ready on the compute stream: a miss copies the home
//                copy in on the host-to-device stream and makes the compute stream wait
//                for that copy's event. It returns the slot's device address.
//   unpin(page)  records, on the compute stream, the event after which the kernels that
//                the caller enqueued on the page are done.
//   eviction     a dirty victim is copied out on the device-to-host stream after its
//                kernels' event; the next load into its slot waits for that copy.
// So a slot is reused only after its kernels and its write-back both finished, and a page
// is read from its home only after its last write-back there finished: all by stream
// order, without a host wait. A retirer thread waits for the copies' events, hands the
// home pages back (home unpin), and measures each link's busy time.
//
// Prefetch keeps `prefetch` pages of the plan ahead of the pin cursor in flight, taking
// only free slots or pages the plan needs later than the page brought in. With
// gradient release the step runs one parameter at a time; the store learns the order of
// those calls over one round (a backward pass: a round ends when a page of the round comes
// back) and prefetches the next parameters' pages in that order in the following rounds.
//
// Errors: a home pin that fails (a read error, a checksum mismatch) throws from pin() and
// leaves the page where it was. An error the retirer meets (a failed page-file write-back,
// a device error) is thrown at the end of the next plan, or by drain(). No page is ever
// dropped: a write-back that fails leaves the page dirty in the home's cache.
//
// Threads: pin, unpin, plan, grow, read_bytes, write_bytes, begin_use and end_use come from
// one thread at a time (the step's); the retirer runs beside it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pagedoptim/device/device.h"
#include "pagedoptim/paging/cache_stats.h"
#include "pagedoptim/paging/eviction_policy.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::paging {

struct DeviceCacheOptions {
  int64_t page_bytes = 2 << 20;
  // The device budget: whole pages, at least one (smaller is an error).
  int64_t cache_bytes = int64_t(1) << 30;
  int32_t prefetch = 4;
  EvictionPolicy policy = EvictionPolicy::kAuto;
};

struct DeviceCacheStats : CacheStats {
  int64_t loads = 0;          // page copies home -> device
  int64_t write_backs = 0;    // page copies device -> home
  int64_t bytes_to_device = 0;
  int64_t bytes_to_host = 0;
  double seconds_to_device = 0;  // summed duration of the retired copies of each direction
  double seconds_to_host = 0;
  double compute_wait_seconds = 0;  // time the compute stream waited for a missed page
  int64_t learned_order_pages = 0;  // pages of the gradient-release order learned so far
};

class DeviceCacheStore final : public PageStore {
 public:
  // `device` must outlive the store. `home` holds every page in host memory the device can
  // copy from asynchronously (pinned). Throws std::invalid_argument for a cache that holds
  // no whole page.
  DeviceCacheStore(device::Device& device, std::unique_ptr<PageStore> home,
                   const DeviceCacheOptions& options);
  // Waits for every copy, then frees the slots, events and copy streams.
  ~DeviceCacheStore() override;
  DeviceCacheStore(const DeviceCacheStore&) = delete;
  DeviceCacheStore& operator=(const DeviceCacheStore&) = delete;

  // The compute stream of the pins that follow. Work on it is ordered after the pages'
  // uses on the previous compute stream. A null handle is a stream too: CUDA's default
  // stream, which is what torch's current stream is unless the user chose another.
  void begin_use(device::Stream compute);
  // Everything enqueued on the compute stream so far is the pages' latest use.
  void end_use();

  void grow(int32_t num_pages) override;
  void plan(const std::vector<int32_t>& pages) override;
  std::byte* pin(int32_t page) override;
  void unpin(int32_t page, bool dirty) override;
  // Half the budget: one batch runs while the next one's pages come in.
  int32_t pin_limit() const override;
  // Synchronous copies for state_dict(), ordered after every use of the page.
  void read_bytes(int32_t page, int64_t offset, void* out, int64_t bytes) override;
  void write_bytes(int32_t page, int64_t offset, const void* in, int64_t bytes) override;
  int32_t num_pages() const override { return int32_t(pages_.size()); }
  int64_t page_bytes() const override { return page_bytes_; }
  // Device memory held by slots.
  int64_t resident_bytes() const override;

  DeviceCacheStats stats() const;
  PageStore& home() noexcept { return *home_; }
  device::Device& device() noexcept { return device_; }
  // Waits until every copy retired; throws the retirer's pending error, if any.
  void drain();

 private:
  struct Slot {
    std::byte* memory = nullptr;
    int32_t page = -1;
    device::Event ready = nullptr;     // host-to-device stream: the page's bytes arrived
    device::Event released = nullptr;  // compute stream: the kernels on the page are done
    device::Event drained = nullptr;   // device-to-host stream: its write-back finished
    bool ready_unwaited = false;  // `ready` was recorded since the compute stream waited
  };
  struct Page {
    int32_t slot = -1;
    int32_t pin_count = 0;
    bool dirty = false;   // the slot is newer than the home copy
    bool loaded = false;  // copied in since its last pin (the next pin is a miss)
    uint64_t last_use = 0;
    // Guarded by mutex_: write-backs into the home not retired yet, and the slot whose
    // `drained` event follows the latest of them.
    int32_t writes_pending = 0;
    int32_t home_slot = -1;
  };
  enum class JobKind : uint8_t { kLoad, kWriteBack, kStall };
  struct Job {
    JobKind kind;
    int32_t page;
    device::Event start;
    device::Event end;
  };

  // A slot for a page needed at plan position `needed_at`: a free one, a new one within
  // the budget, or a victim's. -1 when there is none (only when !demand: a demand goes
  // past the budget, and its errors propagate).
  int32_t take_slot(int64_t needed_at, bool demand);
  int32_t new_slot();
  void release_slot(int32_t index);
  int32_t find_victim(int64_t needed_at) const;
  // Copies `victim` to its home if dirty and returns its slot, now unowned; -1 when its
  // home page could not be pinned (the victim stays; a demand rethrows).
  int32_t evict(int32_t victim, bool demand);
  // Brings `page` to a slot; false (prefetch only) when no slot could be had.
  bool load(int32_t page, int64_t needed_at, bool demand);
  void prefetch_ahead();
  void finish_plan();
  device::Event take_timing_event();
  // A job with its two timing events; throws (taking none) when the device has no events.
  Job new_job(JobKind kind, int32_t page);
  void give_back_events(const Job& job) noexcept;
  // Enqueues the job's timed copy of one page on `stream` and records `done` behind it (the
  // caller makes the stream wait for what must finish first).
  void enqueue_copy(device::Stream stream, const Job& job, void* dst, const void* src,
                    device::CopyKind kind, device::Event done);
  // A copy that could not be enqueued whole: its events go back, its home page unwritten.
  void abandon_copy(const Job& job) noexcept;
  void push_job(const Job& job);
  void latch_error_locked(std::exception_ptr error);
  void throw_pending();
  void wait_for_jobs();
  void retirer_loop();
  device::Stream compute() const;

  device::Device& device_;
  std::unique_ptr<PageStore> home_;
  const int64_t page_bytes_;
  const int32_t budget_slots_;
  int32_t slot_cap_;  // the budget, or fewer slots once the device refused memory
  const int32_t prefetch_;
  const EvictionPolicy policy_;
  device::Stream to_device_ = nullptr;
  device::Stream to_host_ = nullptr;
  device::Stream compute_ = nullptr;  // meaningful once compute_named_
  bool compute_named_ = false;        // begin_use() has named a stream (the null one counts)
  device::Event compute_done_ = nullptr;  // the compute stream's latest use of the pages
  device::Event sync_event_ = nullptr;    // read_bytes / write_bytes wait on it

  // The step thread's state.
  std::vector<Page> pages_;
  std::vector<Slot> slots_;
  std::vector<int32_t> free_slots_;  // within the budget, allocated, unowned
  std::vector<int32_t> free_overflow_;  // past the budget, allocated, unowned
  int32_t slots_in_use_ = 0;
  int32_t peak_slots_in_use_ = 0;
  PlanTracker plan_;
  int64_t plan_end_ = 0;  // positions of the plan that belong to the call (the rest: learned)
  int32_t pins_ = 0;
  uint64_t clock_ = 0;
  // Gradient release: the order of this round's plans, and the last round's.
  std::vector<int32_t> round_;
  std::vector<char> in_round_;
  std::vector<int32_t> learned_;
  std::vector<int64_t> learned_position_;  // per page: its position in learned_, or -1

  mutable std::mutex mutex_;  // guards what the retirer shares, below
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  std::vector<device::Event> free_events_;
  std::exception_ptr pending_error_;
  bool stopping_ = false;
  DeviceCacheStats counters_;

  std::thread retirer_;
};

}  // namespace pagedoptim::paging
