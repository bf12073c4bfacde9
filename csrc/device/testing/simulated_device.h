// A device for CPU tests: memory is host memory, each stream is a worker thread that runs
// its queue in order, and every operation completes after a random delay. Work on two
// streams therefore interleaves differently on every run, and a missing wait() shows up as
// wrong bytes (and, under TSan, as a data race: the only ordering between the workers is
// the one events create).
//
// Events follow CUDA's rules: wait() and synchronize() refer to the latest record at the
// time they are called; an event never recorded is complete.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pagedoptim/device/device.h"

namespace pagedoptim::device {

struct SimulatedDeviceOptions {
  // Each operation waits a uniformly random time in [0, max_delay_us] before it runs, and
  // one in `stall_one_in` operations (0: none) waits 20 times as long, as a copy stuck
  // behind other traffic does: orderings that hold only "usually" then break.
  int max_delay_us = 50;
  int stall_one_in = 8;
  uint64_t seed = 1;
  // Allocations refused (MemoryRefused) once this many bytes are held; -1: no limit.
  int64_t device_memory_limit = -1;
  int64_t host_memory_limit = -1;
};

// What a simulated device holds now: leak tests check that it returns to what it was.
struct SimulatedDeviceUsage {
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;  // pinned host memory
  int64_t device_allocations = 0;
  int64_t host_allocations = 0;
  int64_t streams = 0;
  int64_t events = 0;
};

class SimulatedDevice final : public Device {
 public:
  explicit SimulatedDevice(const SimulatedDeviceOptions& options = {});
  // Finishes the work of every stream, then stops the workers.
  ~SimulatedDevice() override;

  std::string name() const override { return "simulated"; }
  void* allocate(int64_t bytes) override;
  void release(void* memory) noexcept override;
  void* allocate_host(int64_t bytes) override;
  void release_host(void* memory) noexcept override;
  Stream create_stream() override;
  void destroy_stream(Stream stream) noexcept override;
  void copy(Stream stream, void* dst, const void* src, int64_t bytes, CopyKind kind) override;
  Event create_event(bool timing) override;
  void destroy_event(Event event) noexcept override;
  void record(Event event, Stream stream) override;
  void wait(Stream stream, Event event) override;
  void synchronize(Event event) override;
  double elapsed(Event start, Event end) override;

  // Runs `work` on `stream` in order with its other work: the simulated kernel launch.
  void launch(Stream stream, std::function<void()> work);
  // Blocks until every operation enqueued on `stream` so far has run.
  void synchronize_stream(Stream stream);

  int64_t device_bytes() const { return device_bytes_.load(); }
  int64_t host_bytes() const { return host_bytes_.load(); }
  SimulatedDeviceUsage usage();

 private:
  struct EventState;
  struct Worker;
  void* take(int64_t bytes, bool host);
  void give_back(void* memory, bool host) noexcept;
  Worker* worker(Stream stream);  // the null stream's for nullptr
  void enqueue(Stream stream, std::function<void()> operation);
  std::shared_ptr<EventState> event_state(Event event);

  const SimulatedDeviceOptions options_;
  std::atomic<int64_t> device_bytes_{0};
  std::atomic<int64_t> host_bytes_{0};
  std::atomic<uint64_t> next_seed_;
  std::atomic<int64_t> streams_{0};
  std::mutex memory_mutex_;
  std::vector<std::pair<void*, int64_t>> allocations_;  // memory -> bytes, both kinds
  std::mutex events_mutex_;
  std::unordered_map<Event, std::shared_ptr<EventState>> events_;
  // The null stream: CUDA's default stream, which torch's current stream is unless a user
  // chose another. Every stream here, like every stream the CUDA device and torch's pool
  // create, is non-blocking, so it is ordered with the null stream only by events (the
  // legacy default stream's implicit waits apply to blocking streams alone).
  std::unique_ptr<Worker> null_stream_;
};

}  // namespace pagedoptim::device
