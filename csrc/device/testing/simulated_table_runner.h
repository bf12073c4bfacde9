// The kernels of the simulated device: the host emulation of the table kernels
// (host_table_runner.h), enqueued on a simulated stream as launches. Each call's inputs
// are copied, since the step driver's tables are gone before the stream runs them. The
// destructor waits for the stream: the enqueued work refers to the runner.
#pragma once

#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "device/testing/host_table_runner.h"
#include "device/testing/simulated_device.h"

namespace pagedoptim::device {

class SimulatedTableRunner final : public optim::TableRunner {
 public:
  // found_inf / grad_scale: GradScaler's scalars (host memory, alive until the runner is
  // destroyed), or null.
  SimulatedTableRunner(SimulatedDevice& device, Stream stream, const float* found_inf = nullptr,
                       const float* grad_scale = nullptr)
      : device_(device), stream_(stream), inner_(2, found_inf, grad_scale) {}
  ~SimulatedTableRunner() override { device_.synchronize_stream(stream_); }

  // The inner runner only records a preparation (it runs with the first kernel), so it is
  // handed over here rather than enqueued: the stream sees it before that kernel.
  void prepare_adamw(const std::vector<kernels::ScalarJob>& jobs,
                     const std::vector<optim::AdamWGroup>& groups) override {
    inner_.prepare_adamw(jobs, groups);
  }
  void prepare_sgd(const std::vector<kernels::ScalarJob>& jobs,
                   const std::vector<optim::SGDGroup>& groups) override {
    inner_.prepare_sgd(jobs, groups);
  }
  void prepare_lion(const std::vector<kernels::ScalarJob>& jobs,
                    const std::vector<optim::LionGroup>& groups) override {
    inner_.prepare_lion(jobs, groups);
  }
  void prepare_skewadam(const std::vector<kernels::ScalarJob>& jobs,
                        const std::vector<optim::SkewAdamGroup>& groups) override {
    inner_.prepare_skewadam(jobs, groups);
  }
  bool counters_advanced() const override { return kernel_queued_; }
  void* scratch(int64_t bytes) override { return inner_.scratch(bytes); }
  void copy(void* dst, const void* src, int64_t bytes) override {
    launch([dst, src, bytes] { std::memcpy(dst, src, size_t(bytes)); });
  }
  void run_statistics(const std::vector<kernels::FactorMatrix>& matrices) override {
    launch([this, matrices] { inner_.run_statistics(matrices); });
    kernel_queued_ = true;
  }
  void run(const optim::TableBatch& batch) override {
    launch([this, batch] { inner_.run(batch); });
    kernel_queued_ = true;
  }

 private:
  void launch(std::function<void()> work) { device_.launch(stream_, std::move(work)); }

  SimulatedDevice& device_;
  Stream stream_;
  kernels::emulation::HostTableRunner inner_;
  bool kernel_queued_ = false;
};

}  // namespace pagedoptim::device
