// The device seam: every operation the page cache needs from a compute device, behind one
// small interface, so that the same orchestration runs on a GPU and in CPU tests.
//
//   memory:  device memory for cache slots, pinned host memory for the tiers below;
//   streams: queues that run work in order (copies, and the kernels the table runner
//            launches, csrc/optim/table_runner.h); different streams run concurrently;
//   events:  markers recorded on a stream. wait() makes a stream wait for the work before
//            the marker's latest record (captured when wait() is called, as CUDA does);
//            synchronize() makes the host wait for it.
//
// Implementations: the CUDA device (csrc/device/cuda/cuda_device.cpp, a thin layer over the
// CUDA runtime and torch's caching allocator) and the simulated device, test support
// (csrc/device/testing/simulated_device.h: host memory, worker threads as streams, random
// completion delays).
// Launching a kernel is the table runner's job; the device only hands it a stream.
//
// Thread safety: every method may be called from any thread (the page cache's retirer
// thread synchronizes events while the step's thread enqueues copies).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pagedoptim::device {

// Opaque handles, owned by the device that made them (a cudaStream_t / cudaEvent_t on CUDA).
using Stream = void*;
using Event = void*;

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// Memory the device could not give. `host` is true for pinned host memory.
class MemoryRefused : public std::runtime_error {
 public:
  MemoryRefused(bool host, int64_t bytes, const std::string& what)
      : std::runtime_error(what), host_(host), bytes_(bytes) {}
  bool host() const noexcept { return host_; }
  int64_t bytes() const noexcept { return bytes_; }

 private:
  bool host_;
  int64_t bytes_;
};

// The device failed as a whole (a CUDA error): nothing enqueued after it can be trusted.
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Device {
 public:
  virtual ~Device() = default;

  // "cuda:0", "simulated".
  virtual std::string name() const = 0;

  // Device memory, 256-byte aligned at least. Throws MemoryRefused.
  virtual void* allocate(int64_t bytes) = 0;
  // Frees memory from allocate(); every stream's work on it must have completed.
  virtual void release(void* memory) noexcept = 0;
  // Page-locked host memory the device copies from and to asynchronously, 4 KiB aligned.
  // Throws MemoryRefused naming the bytes.
  virtual void* allocate_host(int64_t bytes) = 0;
  virtual void release_host(void* memory) noexcept = 0;

  // Streams the device owns (the copy streams); the compute stream is the caller's.
  virtual Stream create_stream() = 0;
  virtual void destroy_stream(Stream stream) noexcept = 0;

  // Enqueues a copy of `bytes` bytes on `stream`.
  virtual void copy(Stream stream, void* dst, const void* src, int64_t bytes,
                    CopyKind kind) = 0;

  // `timing`: elapsed() may measure between two such events.
  virtual Event create_event(bool timing) = 0;
  virtual void destroy_event(Event event) noexcept = 0;
  virtual void record(Event event, Stream stream) = 0;
  // Work enqueued on `stream` after this call runs after the event's latest record.
  virtual void wait(Stream stream, Event event) = 0;
  // Blocks the calling thread until the event's latest record completed. Throws DeviceError
  // when the device failed.
  virtual void synchronize(Event event) = 0;
  // Seconds between two completed timing events.
  virtual double elapsed(Event start, Event end) = 0;
};

}  // namespace pagedoptim::device
