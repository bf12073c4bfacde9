#include "device/cuda/cuda_device.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pagedoptim::device {
namespace {

class CudaDevice final : public device::Device {
 public:
  explicit CudaDevice(int index) : index_(index) {}

  int index() const { return index_; }
  std::string name() const override { return "cuda:" + std::to_string(index_); }

  void* allocate(int64_t bytes) override {
    c10::cuda::CUDAGuard guard(index_);
    try {
      return c10::cuda::CUDACachingAllocator::raw_alloc(size_t(bytes));
    } catch (const c10::OutOfMemoryError& e) {
      throw device::MemoryRefused(false, bytes, "cuda:" + std::to_string(index_) +
                                                    " could not give " + std::to_string(bytes) +
                                                    " bytes for the page cache: " + e.what());
    }
  }

  void release(void* memory) noexcept override {
    if (memory == nullptr) return;
    try {
      c10::cuda::CUDAGuard guard(index_);
      c10::cuda::CUDACachingAllocator::raw_delete(memory);
    } catch (...) {
    }
  }

  void* allocate_host(int64_t bytes) override {
    c10::cuda::CUDAGuard guard(index_);
    void* memory = nullptr;
    const cudaError_t error = cudaHostAlloc(&memory, size_t(bytes), cudaHostAllocPortable);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      throw device::MemoryRefused(true, bytes, std::string("cudaHostAlloc of ") +
                                                   std::to_string(bytes) +
                                                   " bytes failed: " + cudaGetErrorString(error));
    }
    return memory;
  }

  void release_host(void* memory) noexcept override {
    if (memory == nullptr) return;
    try {
      c10::cuda::CUDAGuard guard(index_);  // never a context on device 0 for another rank
      (void)cudaFreeHost(memory);
    } catch (...) {
    }
  }

  device::Stream create_stream() override {
    c10::cuda::CUDAGuard guard(index_);
    cudaStream_t stream = nullptr;
    // Non-blocking: the copy streams must not wait for the legacy default stream.
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a copy stream");
    return stream;
  }

  void destroy_stream(device::Stream stream) noexcept override {
    if (stream != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  }

  void copy(device::Stream stream, void* dst, const void* src, int64_t bytes,
            device::CopyKind kind) override {
    c10::cuda::CUDAGuard guard(index_);
    const cudaMemcpyKind cuda_kind = kind == device::CopyKind::kHostToDevice
                                         ? cudaMemcpyHostToDevice
                                         : kind == device::CopyKind::kDeviceToHost
                                               ? cudaMemcpyDeviceToHost
                                               : cudaMemcpyDeviceToDevice;
    check(cudaMemcpyAsync(dst, src, size_t(bytes), cuda_kind, static_cast<cudaStream_t>(stream)),
          "copying a page");
  }

  device::Event create_event(bool timing) override {
    c10::cuda::CUDAGuard guard(index_);
    cudaEvent_t event = nullptr;
    // Timing events are the ones the page cache's retirer waits on: blocking sync, so that
    // the wait sleeps instead of spinning a core while copies are in flight.
    check(cudaEventCreateWithFlags(&event, timing ? cudaEventBlockingSync
                                                  : cudaEventDisableTiming),
          "creating an event");
    return event;
  }

  void destroy_event(device::Event event) noexcept override {
    if (event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }

  void record(device::Event event, device::Stream stream) override {
    c10::cuda::CUDAGuard guard(index_);
    check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
          "recording an event");
  }

  void wait(device::Stream stream, device::Event event) override {
    c10::cuda::CUDAGuard guard(index_);
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event),
                              0),
          "ordering a stream after an event");
  }

  // The retirer thread calls these two: its current device must be this one, or the runtime
  // would create a context on device 0 (500 MiB there for every rank but rank 0).
  void synchronize(device::Event event) override {
    c10::cuda::CUDAGuard guard(index_);
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "waiting for a page copy");
  }

  double elapsed(device::Event start, device::Event end) override {
    c10::cuda::CUDAGuard guard(index_);
    float ms = 0;
    check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                               static_cast<cudaEvent_t>(end)),
          "timing a page copy");
    return double(ms) / 1e3;
  }

 private:
  void check(cudaError_t error, const char* what) const {
    if (error == cudaSuccess) return;
    (void)cudaGetLastError();  // ours: keep it off the next unrelated launch check
    throw device::DeviceError(std::string("pagedoptim: ") + what + " on cuda:" +
                              std::to_string(index_) + " failed: " + cudaGetErrorName(error) +
                              ": " + cudaGetErrorString(error));
  }

  int index_;
};

}  // namespace

device::Device& cuda_device(int index) {
  static std::mutex mutex;
  // Never destroyed: stores may use their device until interpreter exit, after static
  // destructors would have run.
  static auto* devices = new std::vector<std::unique_ptr<CudaDevice>>();
  TORCH_CHECK_VALUE(index >= 0 && index < at::cuda::device_count(), "CUDA device ", index,
                    " does not exist (", at::cuda::device_count(), " devices visible)");
  std::lock_guard<std::mutex> lock(mutex);
  if (devices->size() <= size_t(index)) devices->resize(size_t(index) + 1);
  auto& slot = (*devices)[size_t(index)];
  if (slot == nullptr) slot = std::make_unique<CudaDevice>(index);
  return *slot;
}

int cuda_index_of(const device::Device& device) {
  const auto* cuda = dynamic_cast<const CudaDevice*>(&device);
  return cuda == nullptr ? -1 : cuda->index();
}

}  // namespace pagedoptim::device
