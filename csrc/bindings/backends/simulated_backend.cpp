#include "bindings/backends/simulated_backend.h"

#include "bindings/page_store_binding.h"
#include "device/testing/simulated_device.h"
#include "device/testing/simulated_table_runner.h"
#include "pagedoptim/paging/device_cache_store.h"

namespace pagedoptim::bindings {
namespace {

// One simulated device and compute stream for the process: never destroyed, since stores
// may use them until interpreter exit.
struct Simulation {
  device::SimulatedDevice device;
  device::Stream compute = device.create_stream();
};

Simulation& simulation() {
  static auto* instance = new Simulation();
  return *instance;
}

}  // namespace

std::unique_ptr<paging::PageStore> make_simulated_page_store(const pybind11::object& options,
                                                             int64_t page_bytes) {
  TORCH_CHECK_VALUE(!options.is_none(), "the simulated device is for paged state: give "
                    "offload='host' or 'nvme' (or cache_bytes)");
  return make_device_page_store(options, page_bytes, simulation().device);
}

bool on_simulated_device(optim::PagedState& state) {
  auto* store = dynamic_cast<paging::DeviceCacheStore*>(&state.store());
  return store != nullptr && &store->device() == &simulation().device;
}

pybind11::dict simulated_device_usage() {
  const device::SimulatedDeviceUsage usage = simulation().device.usage();
  const std::pair<const char*, int64_t> fields[] = {
      {"device_bytes", usage.device_bytes},
      {"pinned_host_bytes", usage.host_bytes},
      {"device_allocations", usage.device_allocations},
      {"pinned_host_allocations", usage.host_allocations},
      {"streams", usage.streams},
      {"events", usage.events}};
  pybind11::dict d;
  for (const auto& [name, value] : fields) d[name] = value;
  return d;
}

const float* host_scalar(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->numel() == 1,
                    name, " must be a one-element float32 cpu tensor on the simulated device, "
                    "got ", t->scalar_type(), " with ", t->numel(), " elements on ", t->device());
  return t->data_ptr<float>();
}

void run_on_simulated_device(optim::PagedState& state, SimulatedAmp amp,
                             const std::function<void(optim::TableRunner&)>& step) {
  auto& store = dynamic_cast<paging::DeviceCacheStore&>(state.store());
  Simulation& sim = simulation();
  store.begin_use(sim.compute);
  try {
    // Waits for the stream when destroyed.
    device::SimulatedTableRunner runner(sim.device, sim.compute, amp.found_inf, amp.grad_scale);
    step(runner);
  } catch (...) {
    store.end_use();
    throw;
  }
  store.end_use();
}

}  // namespace pagedoptim::bindings
