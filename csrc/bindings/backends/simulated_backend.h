// Optimizer state on the simulated device (csrc/device/testing/simulated_device.h), for tests: a
// device page cache over "pinned" host memory or the page file, stepped by the host
// emulation of the CUDA table kernels on a simulated stream, so that the Python tests can
// run the GPU paging orchestration on machines without a GPU. The params are CPU tensors
// (the simulated device's memory is host memory); a step waits for its stream before it
// returns, as a CPU step does.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include <torch/extension.h>

#include "pagedoptim/optim/paged_state.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::bindings {

// The store of a state on the simulated device; `options` must ask for paging.
std::unique_ptr<paging::PageStore> make_simulated_page_store(const pybind11::object& options,
                                                             int64_t page_bytes);

bool on_simulated_device(optim::PagedState& state);

// What the process's simulated device holds now (bytes, allocations, streams, events), for
// the leak tests: its compute stream is always one of the streams.
pybind11::dict simulated_device_usage();

// GradScaler's found_inf / grad_scale for a step on the simulated device: one float each in
// host memory (the simulated device's memory), or null. The emulated kernels unscale and
// skip as the CUDA ones do.
struct SimulatedAmp {
  const float* found_inf = nullptr;
  const float* grad_scale = nullptr;
};

// The float of a one-element float32 CPU tensor `t` (named `name` in errors), or null.
const float* host_scalar(const std::optional<at::Tensor>& t, const char* name);

// Runs `step` (a table-driver step of PagedState) on the simulated device.
template <class Params, class Groups, class Step>
void simulated_step(optim::PagedState& state, const Params& params, const Groups& groups,
                    Step step, SimulatedAmp amp = {});

// Type-erased core of simulated_step: begin_use, a runner on the simulated compute stream,
// the step, end_use, and a wait for the stream.
void run_on_simulated_device(optim::PagedState& state, SimulatedAmp amp,
                             const std::function<void(optim::TableRunner&)>& step);

template <class Params, class Groups, class Step>
void simulated_step(optim::PagedState& state, const Params& params, const Groups& groups,
                    Step step, SimulatedAmp amp) {
  run_on_simulated_device(state, amp, [&](optim::TableRunner& runner) {
    (state.*step)(params, groups, runner);
  });
}

}  // namespace pagedoptim::bindings
