#include "device/testing/simulated_device.h"
#include "pagedoptim/thread_start.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

namespace pagedoptim::device {

using Clock = std::chrono::steady_clock;

// One event: the generation of its latest record, and for every generation whether it
// completed and when. Generations complete out of order when an event is re-recorded on
// another stream, so each is tracked on its own.
struct SimulatedDevice::EventState {
  std::mutex mutex;
  std::condition_variable completed_cv;
  uint64_t recorded = 0;               // latest generation; 0: never recorded
  std::vector<double> completed_at{0};  // per generation, seconds; < 0: not yet

  void wait_for(uint64_t generation) {
    std::unique_lock<std::mutex> lock(mutex);
    completed_cv.wait(lock, [&] { return completed_at[generation] >= 0; });
  }
};

struct SimulatedDevice::Worker {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  int64_t enqueued = 0;
  int64_t finished = 0;
  bool stopping = false;
  std::thread thread;

  Worker(uint64_t seed, int max_delay_us, int stall_one_in) {
    thread = start_thread(
        [this, seed, max_delay_us, stall_one_in] { run(seed, max_delay_us, stall_one_in); });
  }

  void run(uint64_t seed, int max_delay_us, int stall_one_in) {
    std::mt19937_64 random(seed);
    std::uniform_int_distribution<int> delay(0, std::max(0, max_delay_us));
    std::uniform_int_distribution<int> stall(0, std::max(0, stall_one_in - 1));
    for (;;) {
      std::function<void()> operation;
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        operation = std::move(queue.front());
        queue.pop_front();
      }
      int us = delay(random);
      if (stall_one_in > 0 && stall(random) == 0) us *= 20;
      if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
      operation();
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++finished;
      }
      cv.notify_all();
    }
  }

  void drain() {
    std::unique_lock<std::mutex> lock(mutex);
    const int64_t target = enqueued;
    cv.wait(lock, [&] { return finished >= target; });
  }

  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    thread.join();
  }
};

SimulatedDevice::SimulatedDevice(const SimulatedDeviceOptions& options)
    : options_(options),
      next_seed_(options.seed),
      null_stream_(std::make_unique<Worker>(options.seed ^ 0x6A09E667F3BCC909ull,
                                            options.max_delay_us, options.stall_one_in)) {}

SimulatedDevice::~SimulatedDevice() {
  null_stream_.reset();  // runs what is queued on it, which may still touch the memory below
  std::lock_guard<std::mutex> lock(memory_mutex_);
  for (auto& [memory, bytes] : allocations_) std::free(memory);
}

void* SimulatedDevice::take(int64_t bytes, bool host) {
  std::atomic<int64_t>& held = host ? host_bytes_ : device_bytes_;
  const int64_t limit = host ? options_.host_memory_limit : options_.device_memory_limit;
  const char* kind = host ? "pinned host" : "device";
  if (bytes <= 0) throw std::invalid_argument(std::string(kind) + " allocation of no bytes");
  if (limit >= 0 && held.load() + bytes > limit) {
    throw MemoryRefused(host, bytes, "the simulated device refused " + std::to_string(bytes) +
                                         " bytes of " + kind + " memory (" +
                                         std::to_string(held.load()) + " of " +
                                         std::to_string(limit) + " in use)");
  }
  const size_t rounded = (size_t(bytes) + 4095) / 4096 * 4096;
  void* memory = std::aligned_alloc(4096, rounded);
  if (memory == nullptr) {
    throw MemoryRefused(host, bytes, std::string("out of host memory for ") + kind + " memory");
  }
  held += bytes;
  std::lock_guard<std::mutex> lock(memory_mutex_);
  allocations_.emplace_back(memory, host ? -bytes : bytes);
  return memory;
}

void SimulatedDevice::give_back(void* memory, bool host) noexcept {
  if (memory == nullptr) return;
  std::lock_guard<std::mutex> lock(memory_mutex_);
  auto it = std::find_if(allocations_.begin(), allocations_.end(),
                         [&](const auto& a) { return a.first == memory; });
  if (it == allocations_.end()) return;
  (host ? host_bytes_ : device_bytes_) -= std::abs(it->second);
  std::free(memory);
  allocations_.erase(it);
}

void* SimulatedDevice::allocate(int64_t bytes) { return take(bytes, false); }
void SimulatedDevice::release(void* memory) noexcept { give_back(memory, false); }
void* SimulatedDevice::allocate_host(int64_t bytes) { return take(bytes, true); }
void SimulatedDevice::release_host(void* memory) noexcept { give_back(memory, true); }

Stream SimulatedDevice::create_stream() {
  Stream stream = new Worker(next_seed_.fetch_add(0x9E3779B97F4A7C15ull),
                             options_.max_delay_us, options_.stall_one_in);
  ++streams_;
  return stream;
}

void SimulatedDevice::destroy_stream(Stream stream) noexcept {
  if (stream == nullptr) return;
  delete static_cast<Worker*>(stream);  // runs what is queued, then joins
  --streams_;
}

SimulatedDeviceUsage SimulatedDevice::usage() {
  SimulatedDeviceUsage usage;
  usage.device_bytes = device_bytes_.load();
  usage.host_bytes = host_bytes_.load();
  usage.streams = streams_.load();
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    for (const auto& allocation : allocations_) {
      ++(allocation.second < 0 ? usage.host_allocations : usage.device_allocations);
    }
  }
  std::lock_guard<std::mutex> lock(events_mutex_);
  usage.events = int64_t(events_.size());
  return usage;
}

SimulatedDevice::Worker* SimulatedDevice::worker(Stream stream) {
  return stream == nullptr ? null_stream_.get() : static_cast<Worker*>(stream);
}

void SimulatedDevice::enqueue(Stream stream, std::function<void()> operation) {
  Worker* worker = this->worker(stream);
  {
    std::lock_guard<std::mutex> lock(worker->mutex);
    worker->queue.push_back(std::move(operation));
    ++worker->enqueued;
  }
  worker->cv.notify_all();
}

void SimulatedDevice::copy(Stream stream, void* dst, const void* src, int64_t bytes,
                           CopyKind /*kind*/) {
  enqueue(stream, [dst, src, bytes] { std::memcpy(dst, src, size_t(bytes)); });
}

void SimulatedDevice::launch(Stream stream, std::function<void()> work) {
  enqueue(stream, std::move(work));
}

void SimulatedDevice::synchronize_stream(Stream stream) { worker(stream)->drain(); }

// The operations queued for an event share its state, so an event may be destroyed with
// records or waits still queued, as CUDA allows.
std::shared_ptr<SimulatedDevice::EventState> SimulatedDevice::event_state(Event event) {
  std::lock_guard<std::mutex> lock(events_mutex_);
  auto it = events_.find(event);
  if (it == events_.end()) throw std::invalid_argument("not an event of this device");
  return it->second;
}

Event SimulatedDevice::create_event(bool /*timing*/) {
  auto state = std::make_shared<EventState>();
  std::lock_guard<std::mutex> lock(events_mutex_);
  events_.emplace(state.get(), state);
  return state.get();
}

void SimulatedDevice::destroy_event(Event event) noexcept {
  std::lock_guard<std::mutex> lock(events_mutex_);
  events_.erase(event);
}

void SimulatedDevice::record(Event event, Stream stream) {
  std::shared_ptr<EventState> state = event_state(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    generation = ++state->recorded;
    state->completed_at.push_back(-1.0);
  }
  enqueue(stream, [state, generation] {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->completed_at[generation] =
        std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    state->completed_cv.notify_all();
  });
}

void SimulatedDevice::wait(Stream stream, Event event) {
  std::shared_ptr<EventState> state = event_state(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    generation = state->recorded;
  }
  if (generation == 0) return;
  enqueue(stream, [state, generation] { state->wait_for(generation); });
}

void SimulatedDevice::synchronize(Event event) {
  std::shared_ptr<EventState> state = event_state(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    generation = state->recorded;
  }
  state->wait_for(generation);
}

double SimulatedDevice::elapsed(Event start, Event end) {
  std::shared_ptr<EventState> a = event_state(start);
  std::shared_ptr<EventState> b = event_state(end);
  double begin = 0, finish = 0;
  {
    std::lock_guard<std::mutex> lock(a->mutex);
    begin = a->completed_at[a->recorded];
  }
  {
    std::lock_guard<std::mutex> lock(b->mutex);
    finish = b->completed_at[b->recorded];
  }
  if (begin < 0 || finish < 0) throw std::logic_error("elapsed() of an event not completed");
  return std::max(0.0, finish - begin);
}

}  // namespace pagedoptim::device
