// The CUDA side of the engine (see cuda_backend.h).
//
// Pages: slabs of device memory from torch's caching allocator (so they show in
// torch.cuda.memory_allocated() and torch can reuse them), zeroed on the stream that
// allocates them. Host code only ever offsets page pointers; bytes move through
// cudaMemcpyAsync.
//
// Paged state (offload='host'|'nvme') lives in a paging::DeviceCacheStore over the CUDA
// device of cuda_device.h instead; a step orders itself with either store the same way.
//
// A step: validate, then hand PagedState a CudaTableRunner. The runner packs the scalar jobs
// and the work-table rows of each batch into one pinned host buffer, copies it to the device
// asynchronously (torch's pinned allocator keeps the buffer until the copy is done), and
// launches the scalar preparation and one kernel per table on the current stream of the
// params' device. Nothing in a step waits for the device unless PAGEDOPTIM_CUDA_DEBUG_SYNC=1,
// which synchronizes and checks after every launch.
#include "bindings/backends/cuda_backend.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "device/cuda/cuda_device.h"
#include "bindings/tensor_args.h"
#include "kernels/cuda/table_kernels.cuh"
#include "pagedoptim/paging/device_cache_store.h"

namespace pagedoptim::bindings {
namespace {

using kernels::ScalarJob;
using kernels::StepRow;
using kernels::StepTable;

bool debug_sync() {
  static const bool on = [] {
    const char* value = std::getenv("PAGEDOPTIM_CUDA_DEBUG_SYNC");
    return value != nullptr && *value != '\0' && std::string(value) != "0";
  }();
  return on;
}

void check_cuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  // Our own call failed: take its error off the runtime's last-error slot, or the next
  // launch check of torch would report it against an unrelated op.
  (void)cudaGetLastError();
  TORCH_CHECK(false, "pagedoptim: ", what, " failed: ", cudaGetErrorName(error), ": ",
              cudaGetErrorString(error));
}

// The error of this launch (the launchers return cudaLaunchKernel's own result). In debug
// mode also waits for the kernel, so a fault inside it is reported here, by name, instead
// of at some later unrelated call.
void check_launch(cudaError_t error, const std::string& what, cudaStream_t stream) {
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // as in check_cuda: the error is ours and reported here
    TORCH_CHECK(false, "pagedoptim: launching ", what, " failed: ", cudaGetErrorName(error),
                ": ", cudaGetErrorString(error));
  }
  if (debug_sync()) {
    const cudaError_t done = cudaStreamSynchronize(stream);
    TORCH_CHECK(done == cudaSuccess, "pagedoptim: ", what, " failed on the device: ",
                cudaGetErrorName(done), ": ", cudaGetErrorString(done));
  }
}

std::string describe(const kernels::StepVariant& v) {
  const char* algorithms[] = {"adamw", "sgd", "lion", "skewadam factored", "skewadam exact"};
  const char* types[] = {"float32", "bfloat16", "float16"};
  const char* states[] = {"stateless", "fp32-state", "8bit-state"};
  return std::string("the ") + algorithms[int(v.algorithm)] + " table kernel (" +
         types[int(v.type)] + " params, " + states[int(v.state)] +
         ", residual " + std::to_string(int(v.residual_bits)) + (v.amsgrad ? ", amsgrad" : "") +
         (v.vector ? ", vector" : "") + ")";
}

class CudaPageStore final : public paging::PageStore {
 public:
  CudaPageStore(int64_t page_bytes, int device) : page_bytes_(page_bytes), device_(device) {}

  ~CudaPageStore() override {
    if (done_ == nullptr) return;
    // A destructor must not throw: at interpreter exit the CUDA runtime may already be
    // going away, and the guard's device switch would then fail.
    try {
      c10::cuda::CUDAGuard guard(device_);
      cudaEventDestroy(done_);
    } catch (...) {
    }
  }

  void grow(int32_t num_pages) override {
    if (num_pages <= this->num_pages()) return;
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device_).stream();
    begin_use(stream);
    const int64_t added = int64_t(num_pages) - this->num_pages();
    // One slab per growth (a parameter's new pages): few, large blocks for the allocator.
    // An out-of-memory here is torch's OutOfMemoryError with the bytes asked for; the
    // table then holds pages without memory, which the next growth allocates too.
    at::Tensor slab = at::zeros({added * page_bytes_},
                                at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    auto* base = static_cast<std::byte*>(slab.data_ptr());
    for (int64_t i = 0; i < added; ++i) pages_.push_back(base + i * page_bytes_);
    slabs_.push_back(std::move(slab));
    end_use(stream);
  }

  std::byte* pin(int32_t page) override {
    TORCH_CHECK_INDEX(page >= 0 && page < num_pages(), "page ", page, " out of range");
    return pages_[size_t(page)];
  }
  void unpin(int32_t, bool) override {}

  void read_bytes(int32_t page, int64_t offset, void* out, int64_t bytes) override {
    copy(out, pin(page) + offset, bytes, cudaMemcpyDeviceToHost);
  }
  void write_bytes(int32_t page, int64_t offset, const void* in, int64_t bytes) override {
    copy(pin(page) + offset, in, bytes, cudaMemcpyHostToDevice);
  }

  int32_t num_pages() const override { return int32_t(pages_.size()); }
  int64_t page_bytes() const override { return page_bytes_; }
  int64_t resident_bytes() const override { return page_bytes_ * num_pages(); }
  int device() const { return device_; }

  // The pages are worked on by one stream at a time. Work enqueued on `stream` from now on
  // waits for everything enqueued on the stream that used the pages last.
  void begin_use(cudaStream_t stream) {
    if (done_ == nullptr || stream == last_stream_) return;
    check_cuda(cudaStreamWaitEvent(stream, done_, 0), "ordering the state after its last use");
    // The slabs now live on two streams: tell the caching allocator, so that freeing them
    // waits for this stream's work too.
    for (const at::Tensor& slab : slabs_) {
      c10::cuda::CUDACachingAllocator::recordStream(
          slab.storage().data_ptr(), c10::cuda::getStreamFromExternal(stream, device_));
    }
  }
  // Everything enqueued on `stream` so far is the pages' last use.
  void end_use(cudaStream_t stream) {
    if (done_ == nullptr) {
      check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "creating an event");
    }
    check_cuda(cudaEventRecord(done_, stream), "recording the end of a step");
    last_stream_ = stream;
  }

 private:
  // state_dict / load_state_dict: ordered after the steps on the current stream, and
  // waited for, since the host reads or reuses its buffer right after.
  void copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind) {
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device_).stream();
    begin_use(stream);
    check_cuda(cudaMemcpyAsync(dst, src, size_t(bytes), kind, stream), "copying state");
    end_use(stream);
    check_cuda(cudaStreamSynchronize(stream), "copying state");
  }

  int64_t page_bytes_;
  int device_;
  std::vector<at::Tensor> slabs_;
  std::vector<std::byte*> pages_;
  cudaEvent_t done_ = nullptr;
  cudaStream_t last_stream_ = nullptr;
};

// Uploads byte ranges to the device in one asynchronous copy from pinned memory.
class Uploader {
 public:
  Uploader(int device, std::vector<at::Tensor>& keep) : device_(device), keep_(keep) {}

  // Returns the offset of `bytes` bytes at `data` in the upload.
  size_t add(const void* data, size_t bytes) {
    const size_t offset = total_;
    parts_.emplace_back(data, bytes);
    offsets_.push_back(offset);
    total_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return offset;
  }

  // The device copy's base address; the buffers stay alive in `keep` until the step ends
  // (the caching allocator then reuses them in stream order).
  std::byte* upload() {
    if (total_ == 0) return nullptr;
    at::Tensor host = at::empty({int64_t(total_)},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* bytes = static_cast<std::byte*>(host.data_ptr());
    for (size_t i = 0; i < parts_.size(); ++i) {
      std::memcpy(bytes + offsets_[i], parts_[i].first, parts_[i].second);
    }
    at::Tensor device = at::empty({int64_t(total_)},
                                  at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    device.copy_(host, /*non_blocking=*/true);
    keep_.push_back(device);
    return static_cast<std::byte*>(device.data_ptr());
  }

 private:
  static constexpr size_t kAlignment = 64;
  int device_;
  std::vector<at::Tensor>& keep_;
  std::vector<std::pair<const void*, size_t>> parts_;
  std::vector<size_t> offsets_;
  size_t total_ = 0;
};

class CudaTableRunner final : public optim::TableRunner {
 public:
  CudaTableRunner(int device, cudaStream_t stream, const float* found_inf,
                  const float* grad_scale)
      : device_(device), stream_(stream), found_inf_(found_inf), grad_scale_(grad_scale) {
    multiprocessors_ = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  }

  void prepare_adamw(const std::vector<ScalarJob>& jobs,
                     const std::vector<optim::AdamWGroup>& groups) override {
    prepare(jobs, groups, &kernels::cuda::launch_prepare_adamw_scalars, "adamw");
  }
  void prepare_sgd(const std::vector<ScalarJob>& jobs,
                   const std::vector<optim::SGDGroup>& groups) override {
    prepare(jobs, groups, &kernels::cuda::launch_prepare_sgd_scalars, "sgd");
  }
  void prepare_lion(const std::vector<ScalarJob>& jobs,
                    const std::vector<optim::LionGroup>& groups) override {
    prepare(jobs, groups, &kernels::cuda::launch_prepare_lion_scalars, "lion");
  }

  void prepare_skewadam(const std::vector<ScalarJob>& jobs,
                        const std::vector<optim::SkewAdamGroup>& groups) override {
    prepare(jobs, groups, &kernels::cuda::launch_prepare_skewadam_scalars, "skewadam");
  }
  // Launches the scalar preparation if it has not run yet.
  void flush_prepare() {
    if (!pending_prepare_) return;
    auto launch = std::move(pending_prepare_);
    pending_prepare_ = nullptr;
    launch();
    prepared_ = true;
  }
  bool counters_advanced() const override { return prepared_; }

  void* scratch(int64_t bytes) override {
    at::Tensor buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    keep_.push_back(buffer);
    return buffer.data_ptr();
  }

  void copy(void* dst, const void* src, int64_t bytes) override {
    check_cuda(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream_),
               "copying SkewAdam's factors");
  }

  void run_statistics(const std::vector<kernels::FactorMatrix>& matrices) override {
    Uploader uploader(device_, keep_);
    const size_t at = uploader.add(matrices.data(), matrices.size() * sizeof(kernels::FactorMatrix));
    std::byte* base = uploader.upload();
    flush_prepare();
    const kernels::FactorMatrix& last = matrices.back();
    check_launch(kernels::cuda::launch_factor_statistics(
                     reinterpret_cast<const kernels::FactorMatrix*>(base + at),
                     int32_t(matrices.size()), last.first_row + last.rows,
                     last.first_col + last.cols,
                     static_cast<const codec::SkewAdamScalars*>(scalars_), multiprocessors_, stream_),
                 "SkewAdam's statistics kernels", stream_);
  }

  void run(const optim::TableBatch& batch) override {
    Uploader uploader(device_, keep_);
    std::vector<size_t> offsets;
    for (const std::vector<StepRow>& rows : batch.rows) {
      offsets.push_back(uploader.add(rows.data(), rows.size() * sizeof(StepRow)));
    }
    std::byte* base = uploader.upload();
    flush_prepare();
    for (size_t t = 0; t < batch.variants.size(); ++t) {
      const std::vector<StepRow>& rows = batch.rows[t];
      StepTable table;
      table.variant = batch.variants[t];
      table.rows = reinterpret_cast<const StepRow*>(base + offsets[t]);
      table.num_rows = int32_t(rows.size());
      table.num_units = rows.back().first_unit + kernels::units_of(rows.back().count);
      table.scalars = scalars_;
      table.found_inf = found_inf_;
      table.grad_scale = grad_scale_;
      check_launch(kernels::cuda::launch_step_table(table, multiprocessors_, stream_),
                   describe(table.variant), stream_);
    }
  }

 private:
  template <class Group, class Scalars>
  void prepare(const std::vector<ScalarJob>& jobs, const std::vector<Group>& groups,
               cudaError_t (*launch)(const ScalarJob*, int32_t, const Group*, const float*,
                                     Scalars*, cudaStream_t),
               const char* name) {
    Uploader uploader(device_, keep_);
    const size_t jobs_at = uploader.add(jobs.data(), jobs.size() * sizeof(ScalarJob));
    const size_t groups_at = uploader.add(groups.data(), groups.size() * sizeof(Group));
    std::byte* base = uploader.upload();
    at::Tensor buffer = at::empty({int64_t(jobs.size() * sizeof(Scalars))},
                                  at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    keep_.push_back(buffer);
    void* scalars = buffer.data_ptr();
    scalars_ = scalars;
    // The launch advances the step counters, so it waits until the first batch has its own
    // memory: an out-of-memory there then leaves the step untouched and retryable.
    const auto* job_table = reinterpret_cast<const ScalarJob*>(base + jobs_at);
    const auto* group_table = reinterpret_cast<const Group*>(base + groups_at);
    const int32_t num_jobs = int32_t(jobs.size());
    pending_prepare_ = [=, this] {
      check_launch(launch(job_table, num_jobs, group_table, found_inf_,
                          static_cast<Scalars*>(scalars), stream_),
                   std::string("the ") + name + " scalar preparation", stream_);
    };
  }


  int device_;
  cudaStream_t stream_;
  const float* found_inf_;
  const float* grad_scale_;
  bool prepared_ = false;
  int multiprocessors_ = 0;
  const void* scalars_ = nullptr;
  std::function<void()> pending_prepare_;
  std::vector<at::Tensor> keep_;  // device buffers of this step
};

// The pages of a state on a GPU: all resident (CudaPageStore, offload=None), or a device
// cache over pinned host memory or the page file (DeviceCacheStore). Either way a step
// names its stream before its first pin and records its last use after its last launch.
class DeviceState {
 public:
  explicit DeviceState(optim::PagedState& state)
      : resident_(dynamic_cast<CudaPageStore*>(&state.store())),
        cached_(dynamic_cast<paging::DeviceCacheStore*>(&state.store())) {
    device_ = resident_ != nullptr ? resident_->device()
              : cached_ != nullptr ? pagedoptim::device::cuda_index_of(cached_->device())
                                   : -1;
    TORCH_CHECK(device_ >= 0, "this optimizer state lives on the CPU, not on a CUDA device");
  }
  int device() const { return device_; }
  void begin_use(cudaStream_t stream) {
    resident_ != nullptr ? resident_->begin_use(stream) : cached_->begin_use(stream);
  }
  void end_use(cudaStream_t stream) {
    resident_ != nullptr ? resident_->end_use(stream) : cached_->end_use();
  }

 private:
  CudaPageStore* resident_;
  paging::DeviceCacheStore* cached_;
  int device_ = -1;
};

const float* device_scalar(const std::optional<at::Tensor>& t, const char* name, int device) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->is_cuda() && t->get_device() == device && t->scalar_type() == at::kFloat &&
                        t->numel() == 1,
                    name, " must be a one-element float32 tensor on cuda:", device, ", got ",
                    t->scalar_type(), " with ", t->numel(), " elements on ", t->device());
  return t->data_ptr<float>();
}

std::vector<optim::ParamStep> cuda_param_steps(const CudaStepArgs& a, int device,
                                               size_t num_groups) {
  const size_t n = a.params.size();
  check_step_lists(n, a.grads.size(), a.steps.size(), a.slots.size(), a.groups.size());
  std::vector<optim::ParamStep> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = a.params[i];
    const at::Tensor& g = a.grads[i];
    const at::Tensor& s = a.steps[i];
    TORCH_CHECK_VALUE(p.is_cuda() && p.get_device() == device, "param ", i, " must be on cuda:",
                      device, " like the optimizer's state, got ", p.device());
    check_grad_of(p, g, i);
    TORCH_CHECK_VALUE(s.is_cuda() && s.get_device() == device && s.scalar_type() == at::kFloat &&
                          s.numel() == 1,
                      "step counter ", i, " must be a one-element float32 tensor on cuda:", device,
                      ", got ", s.scalar_type(), " on ", s.device());
    TORCH_CHECK_VALUE(a.groups[i] >= 0 && size_t(a.groups[i]) < num_groups, "group index ",
                      a.groups[i], " of param ", i, " is out of range");
    out.push_back(optim::ParamStep{
        int32_t(a.slots[i]),
        kernels::ParamSpan{p.data_ptr(), g.data_ptr(), p.numel(), element_type(p, "param", i)},
        int32_t(a.groups[i]), s.data_ptr<float>()});
  }
  return out;
}

// Runs enqueue(runner) on the current stream of the state's device, after everything that
// used the state last (another stream, say) and recorded as its new last use, whether or not
// it throws: what it enqueued before an error still orders later work.
template <class Enqueue>
void on_state_stream(DeviceState& store, const float* found_inf, const float* grad_scale,
                     const Enqueue& enqueue) {
  c10::cuda::CUDAGuard guard(store.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(store.device()).stream();
  // The work tables go through pinned buffers reused once copied, and pages move between
  // steps: a graph replay would read what later steps wrote (optimizer.py refuses first).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "asking whether the stream captures");
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
              "pagedoptim's step cannot be captured in a CUDA graph: a replay would reuse host "
              "buffers and pages that have changed since the capture");
  store.begin_use(stream);
  CudaTableRunner runner(store.device(), stream, found_inf, grad_scale);
  try {
    enqueue(runner);
    runner.flush_prepare();  // a step whose params hold no elements ran no batch
  } catch (...) {
    store.end_use(stream);
    throw;
  }
  store.end_use(stream);
}

template <class Group, class Step>
void cuda_step(optim::PagedState& state, const CudaStepArgs& args,
               const std::vector<Group>& hyperparameters, Step step) {
  DeviceState store(state);
  const int device = store.device();
  const std::vector<optim::ParamStep> param_steps =
      cuda_param_steps(args, device, hyperparameters.size());
  const float* found_inf = device_scalar(args.found_inf, "found_inf", device);
  const float* grad_scale = device_scalar(args.grad_scale, "grad_scale", device);
  on_state_stream(store, found_inf, grad_scale, [&](CudaTableRunner& runner) {
    (state.*step)(param_steps, hyperparameters, runner);
  });
}

}  // namespace

std::unique_ptr<paging::PageStore> make_cuda_page_store(int64_t page_bytes, int device_index) {
  TORCH_CHECK_VALUE(device_index >= 0 && device_index < at::cuda::device_count(),
                    "CUDA device ", device_index, " does not exist (", at::cuda::device_count(),
                    " devices visible)");
  return std::make_unique<CudaPageStore>(page_bytes, device_index);
}

int cuda_device_of(optim::PagedState& state) {
  if (auto* store = dynamic_cast<CudaPageStore*>(&state.store())) return store->device();
  if (auto* store = dynamic_cast<paging::DeviceCacheStore*>(&state.store())) {
    return pagedoptim::device::cuda_index_of(store->device());
  }
  return -1;
}

void cuda_step_adamw(optim::PagedState& state, const CudaStepArgs& args,
                     const std::vector<optim::AdamWGroup>& hyperparameters) {
  using Fn = void (optim::PagedState::*)(const std::vector<optim::ParamStep>&,
                                         const std::vector<optim::AdamWGroup>&,
                                         optim::TableRunner&);
  cuda_step(state, args, hyperparameters, static_cast<Fn>(&optim::PagedState::step_adamw));
}

void cuda_step_sgd(optim::PagedState& state, const CudaStepArgs& args,
                   const std::vector<optim::SGDGroup>& hyperparameters) {
  using Fn = void (optim::PagedState::*)(const std::vector<optim::ParamStep>&,
                                         const std::vector<optim::SGDGroup>&,
                                         optim::TableRunner&);
  cuda_step(state, args, hyperparameters, static_cast<Fn>(&optim::PagedState::step_sgd));
}

void cuda_step_lion(optim::PagedState& state, const CudaStepArgs& args,
                    const std::vector<optim::LionGroup>& hyperparameters) {
  using Fn = void (optim::PagedState::*)(const std::vector<optim::ParamStep>&,
                                         const std::vector<optim::LionGroup>&,
                                         optim::TableRunner&);
  cuda_step(state, args, hyperparameters, static_cast<Fn>(&optim::PagedState::step_lion));
}

void cuda_step_skewadam(optim::PagedState& state, const CudaStepArgs& args,
                        const std::vector<optim::SkewAdamGroup>& hyperparameters,
                        const std::vector<SkewAdamLayout>& layouts) {
  TORCH_CHECK_VALUE(layouts.size() == args.params.size(), "layouts must have one entry per "
                    "parameter, got ", layouts.size(), " for ", args.params.size());
  TORCH_CHECK_VALUE(!args.found_inf.has_value() && !args.grad_scale.has_value(),
                    "SkewAdam takes no found_inf/grad_scale: GradScaler unscales its gradients "
                    "before the step");
  DeviceState store(state);
  const int device = store.device();
  const std::vector<optim::ParamStep> param_steps =
      cuda_param_steps(args, device, hyperparameters.size());
  std::vector<optim::SkewAdamParamStep> steps;
  steps.reserve(param_steps.size());
  for (size_t i = 0; i < param_steps.size(); ++i) {
    const auto& [factor_slot, experts, rows, cols, momentum] = layouts[i];
    steps.push_back(optim::SkewAdamParamStep{param_steps[i], int32_t(factor_slot), experts, rows,
                                             cols, momentum});
  }
  on_state_stream(store, nullptr, nullptr, [&](CudaTableRunner& runner) {
    using Fn = void (optim::PagedState::*)(const std::vector<optim::SkewAdamParamStep>&,
                                           const std::vector<optim::SkewAdamGroup>&,
                                           optim::TableRunner&);
    (state.*static_cast<Fn>(&optim::PagedState::step_skewadam))(steps, hyperparameters, runner);
  });
}

}  // namespace pagedoptim::bindings
