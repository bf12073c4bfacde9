// The kernels of the simulated device: the host emulation of the table kernels
// (host_table_runner.h), enqueued on a simulated stream as launches. Each call's inputs
// are copied, since the step driver's tables are gone before the stream runs them. The
// destructor waits for the stream: the enqueued work refers to the runner.
#pragma once

#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "device/host_table_runner.h"
#include "device/simulated_device.h"

namespace pagedoptim::device {

class SimulatedTableRunner final : public optim::TableRunner {
 public:
  SimulatedTableRunner(SimulatedDevice& device, Stream stream)
      : device_(device), stream_(stream) {}
  ~SimulatedTableRunner() override { device_.synchronize_stream(stream_); }

  void prepare_adamw(const std::vector<kernels::ScalarJob>& jobs,
                     const std::vector<optim::AdamWGroup>& groups) override {
    launch([this, jobs, groups] { inner_.prepare_adamw(jobs, groups); });
  }
  void prepare_sgd(const std::vector<kernels::ScalarJob>& jobs,
                   const std::vector<optim::SGDGroup>& groups) override {
    launch([this, jobs, groups] { inner_.prepare_sgd(jobs, groups); });
  }
  void prepare_lion(const std::vector<kernels::ScalarJob>& jobs,
                    const std::vector<optim::LionGroup>& groups) override {
    launch([this, jobs, groups] { inner_.prepare_lion(jobs, groups); });
  }
  void prepare_skewadam(const std::vector<kernels::ScalarJob>& jobs,
                        const std::vector<optim::SkewAdamGroup>& groups) override {
    launch([this, jobs, groups] { inner_.prepare_skewadam(jobs, groups); });
  }
  void* scratch(int64_t bytes) override { return inner_.scratch(bytes); }
  void copy(void* dst, const void* src, int64_t bytes) override {
    launch([dst, src, bytes] { std::memcpy(dst, src, size_t(bytes)); });
  }
  void run_statistics(const std::vector<kernels::FactorMatrix>& matrices) override {
    launch([this, matrices] { inner_.run_statistics(matrices); });
  }
  void run(const optim::TableBatch& batch) override {
    launch([this, batch] { inner_.run(batch); });
  }

 private:
  void launch(std::function<void()> work) { device_.launch(stream_, std::move(work)); }

  SimulatedDevice& device_;
  Stream stream_;
  kernels::emulation::HostTableRunner inner_;
};

}  // namespace pagedoptim::device
