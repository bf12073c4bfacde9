// pybind11 binding of the optimizer engine (PagedState) for the Python optimizers.
//
// This is the boundary where tensors become raw pointers: every argument is validated here
// with messages that name it, then the GIL is released for the step itself.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <csignal>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedoptim/optim/paged_state.h"
#include "pagedoptim/paging/page_table.h"
#include "bindings/page_store_binding.h"
#include "bindings/backends/simulated_backend.h"
#include "bindings/tensor_args.h"
#ifdef PAGEDOPTIM_WITH_CUDA
#include "bindings/backends/cuda_backend.h"
#include "device/cuda/cuda_device.h"
#endif

namespace pagedoptim::bindings {
namespace {

namespace py = pybind11;
using optim::PagedState;

using optim::OptimizerKind;
using StreamTuple = std::tuple<std::string, int64_t, bool>;

OptimizerKind parse_kind(const std::string& kind) {
  if (kind == "adamw") return OptimizerKind::kAdamW;
  if (kind == "sgd") return OptimizerKind::kSGD;
  if (kind == "lion") return OptimizerKind::kLion;
  if (kind == "skewadam") return OptimizerKind::kSkewAdam;
  TORCH_CHECK_VALUE(false, "optimizer kind must be 'adamw', 'sgd', 'lion' or 'skewadam', got '",
                    kind, "'");
}

const optim::ParallelFor& torch_parallel_for() {
  static const optim::ParallelFor parallel_for =
      [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
        at::parallel_for(0, n, 1, body);
      };
  return parallel_for;
}

std::vector<std::vector<paging::StreamSpec>> to_stream_specs(
    const std::vector<std::vector<StreamTuple>>& kinds) {
  std::vector<std::vector<paging::StreamSpec>> specs;
  for (const auto& streams : kinds) {
    specs.emplace_back();
    for (const auto& [name, bytes_per_group, per_group] : streams) {
      specs.back().push_back(paging::StreamSpec{name, bytes_per_group, per_group});
    }
  }
  return specs;
}

// The number of pages PagedState would lay out for these params, without allocating any:
// the page table alone, so `python -m pagedoptim plan` can state a 70B model's state bytes
// exactly. Empty kinds (plain SGD) have no pages, as in PagedState.
int64_t count_pages(const std::vector<std::vector<StreamTuple>>& kinds, int64_t page_bytes,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t>>& params) {
  TORCH_CHECK_VALUE(page_bytes > 0 && page_bytes % 4096 == 0,
                    "page_bytes must be a positive multiple of 4096, got ", page_bytes);
  TORCH_CHECK_VALUE(!kinds.empty(), "kinds must name at least one page kind");
  std::vector<paging::PageGeometry> geometries;
  for (auto& streams : to_stream_specs(kinds)) {
    try {
      geometries.emplace_back(std::move(streams), page_bytes);
    } catch (const std::invalid_argument& error) {
      TORCH_CHECK_VALUE(false, error.what());
    }
  }
  paging::PageTable table(std::move(geometries));
  for (size_t i = 0; i < params.size(); ++i) {
    const auto [numel, kind, row_length] = params[i];
    TORCH_CHECK_VALUE(kind >= 0 && kind < int64_t(kinds.size()), "params[", i, "] has kind ",
                      kind, ", expected 0..", kinds.size() - 1);
    TORCH_CHECK_VALUE(numel >= 0, "params[", i, "] has ", numel, " elements, expected >= 0");
    TORCH_CHECK_VALUE(row_length >= 0 && (row_length == 0 || numel % row_length == 0),
                      "params[", i, "] has rows of ", row_length, " elements, which must be "
                      ">= 0 and divide its ", numel, " elements");
    if (!kinds[size_t(kind)].empty()) table.add_param(numel, int(kind), row_length);
  }
  return table.num_pages();
}

// Validates one call's tensors and turns them into the driver's ParamSteps.
std::vector<optim::ParamStep> to_param_steps(const std::vector<at::Tensor>& params,
                                             const std::vector<at::Tensor>& grads,
                                             const std::vector<at::Tensor>& steps,
                                             const std::vector<int64_t>& slots,
                                             const std::vector<int64_t>& groups,
                                             size_t num_groups) {
  const size_t n = params.size();
  check_step_lists(n, grads.size(), steps.size(), slots.size(), groups.size());
  std::vector<optim::ParamStep> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& s = steps[i];
    TORCH_CHECK_VALUE(p.device().is_cpu(), "param ", i, " must be on cpu like the optimizer's "
                      "state, got ", p.device());
    check_grad_of(p, g, i);
    TORCH_CHECK_VALUE(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.numel() == 1,
                      "step counter ", i, " must be a one-element float32 cpu tensor");
    TORCH_CHECK_VALUE(groups[i] >= 0 && size_t(groups[i]) < num_groups, "group index ",
                      groups[i], " of param ", i, " is out of range");
    out.push_back(optim::ParamStep{
        int32_t(slots[i]),
        kernels::ParamSpan{p.data_ptr(), g.data_ptr(), p.numel(), element_type(p, "param", i)},
        int32_t(groups[i]), s.data_ptr<float>()});
  }
  return out;
}

// PagedState::read_stream_range / write_stream_range over a host byte tensor: the whole
// tensor is the range. A range outside the stream is std::out_of_range: IndexError.
template <bool kIntoPages>
auto stream_range_copy() {
  return [](PagedState& s, int32_t slot, const std::string& stream, int64_t offset,
            const at::Tensor& buffer) {
    TORCH_CHECK_VALUE(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte &&
                          buffer.is_contiguous(),
                      kIntoPages ? "bytes" : "out", " for stream ", stream, " of slot ", slot,
                      " must be a contiguous uint8 cpu tensor");
    pybind11::gil_scoped_release no_gil;
    if constexpr (kIntoPages) {
      s.write_stream_range(slot, stream, offset, buffer.numel(), buffer.data_ptr());
    } else {
      s.read_stream_range(slot, stream, offset, buffer.numel(), buffer.data_ptr());
    }
  };
}

using OptionalTensor = std::optional<at::Tensor>;

// The device of the state's pages: -1 for host memory, else the CUDA device index.
int state_device(optim::PagedState& state) {
#ifdef PAGEDOPTIM_WITH_CUDA
  return cuda_device_of(state);
#else
  (void)state;
  return -1;
#endif
}

// Runs one step with the GIL released, after the tensors were validated with it held: on
// the CPU kernels for host state, through the CUDA table kernels for device state. AMP's
// found_inf/grad_scale are GradScaler's device scalars (CUDA state only; on the CPU,
// GradScaler unscales and checks the gradients itself before calling step()).
// The table-driver overload of the PagedState step for groups of type Group.
template <class Group, class TableStep>
TableStep table_step_for() {
  if constexpr (std::is_same_v<Group, optim::AdamWGroup>) {
    return static_cast<TableStep>(&PagedState::step_adamw);
  } else if constexpr (std::is_same_v<Group, optim::SGDGroup>) {
    return static_cast<TableStep>(&PagedState::step_sgd);
  } else {
    static_assert(std::is_same_v<Group, optim::LionGroup>);
    return static_cast<TableStep>(&PagedState::step_lion);
  }
}

template <class Group, class Step, class CudaStep>
void run_step(optim::PagedState& state, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& steps,
              const std::vector<int64_t>& slots, const std::vector<int64_t>& groups,
              const std::vector<Group>& group_values, Step step, CudaStep cuda_step,
              const OptionalTensor& found_inf, const OptionalTensor& grad_scale) {
  // The table overload of the same PagedState step, for the simulated device.
  using TableStep = void (PagedState::*)(const std::vector<optim::ParamStep>&,
                                         const std::vector<Group>&, optim::TableRunner&);
  if (state_device(state) >= 0) {
#ifdef PAGEDOPTIM_WITH_CUDA
    const CudaStepArgs args{params, grads, steps, slots, groups, found_inf, grad_scale};
    pybind11::gil_scoped_release no_gil;
    cuda_step(state, args, group_values);
#endif
    (void)cuda_step;
    return;
  }
  (void)cuda_step;
  const bool simulated = on_simulated_device(state);
  TORCH_CHECK_VALUE(simulated || (!found_inf.has_value() && !grad_scale.has_value()),
                    "found_inf and grad_scale are taken by steps of device state only (CUDA, "
                    "or the simulated device that emulates its kernels)");
  const std::vector<optim::ParamStep> param_steps =
      to_param_steps(params, grads, steps, slots, groups, group_values.size());
  if (simulated) {
    const SimulatedAmp amp{host_scalar(found_inf, "found_inf"),
                           host_scalar(grad_scale, "grad_scale")};
    pybind11::gil_scoped_release no_gil;
    simulated_step(state, param_steps, group_values, table_step_for<Group, TableStep>(), amp);
    return;
  }
  pybind11::gil_scoped_release no_gil;
  (state.*step)(param_steps, group_values, torch_parallel_for());
}

#ifdef PAGEDOPTIM_WITH_CUDA
#define PO_CUDA_STEP(name) &name
#else
#define PO_CUDA_STEP(name) nullptr
#endif

// The CPU overloads of PagedState's steps (the table overloads take a runner instead).
template <class Group>
using CpuStep = void (PagedState::*)(const std::vector<optim::ParamStep>&,
                                     const std::vector<Group>&, const optim::ParallelFor&);

constexpr int kSimulatedDevice = -2;

// "cpu" or "cuda:N" (what str(torch.device) gives) -> -1 or N; "simulated" (tests: the
// GPU paging orchestration on the simulated device) -> kSimulatedDevice.
int parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "simulated") return kSimulatedDevice;
  const std::string prefix = "cuda:";
  TORCH_CHECK_VALUE(device.rfind(prefix, 0) == 0 && device.size() > prefix.size() &&
                        device.find_first_not_of("0123456789", prefix.size()) == std::string::npos,
                    "device must be 'cpu' or 'cuda:N', got '", device, "'");
  return std::stoi(device.substr(prefix.size()));
}

std::unique_ptr<paging::PageStore> make_store(const py::object& store, int64_t page_bytes,
                                              int device) {
  if (device == kSimulatedDevice) return make_simulated_page_store(store, page_bytes);
  if (device < 0) return make_page_store(store, page_bytes);
#ifdef PAGEDOPTIM_WITH_CUDA
  if (!store.is_none()) {
    return make_device_page_store(store, page_bytes, pagedoptim::device::cuda_device(device));
  }
  return make_cuda_page_store(page_bytes, device);
#else
  TORCH_CHECK(false, "this build of pagedoptim has no CUDA kernels, so it cannot keep state on "
              "cuda:", device, ": rebuild it against a CUDA build of torch with a matching nvcc "
              "(pip install --no-build-isolation -e . with PAGEDOPTIM_WITH_CUDA=1)");
#endif
}

using AdamWGroupTuple = std::tuple<double, double, double, double, double, bool, bool>;
using SGDGroupTuple = std::tuple<double, double, double, double, bool, bool>;
using LionGroupTuple = std::tuple<double, double, double, double, bool>;
using SkewAdamGroupTuple = std::tuple<double, double, double, double, double>;
// Per parameter: factor slot (-1: exact second moment), factored shape (experts, rows, cols),
// and whether it keeps momentum.
using SkewAdamLayoutTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, bool>;

std::vector<optim::AdamWGroup> to_groups(const std::vector<AdamWGroupTuple>& in) {
  std::vector<optim::AdamWGroup> out;
  for (const auto& [lr, beta1, beta2, eps, wd, amsgrad, maximize] : in) {
    out.push_back(optim::AdamWGroup{lr, beta1, beta2, eps, wd, amsgrad, maximize});
  }
  return out;
}

std::vector<optim::SGDGroup> to_groups(const std::vector<SGDGroupTuple>& in) {
  std::vector<optim::SGDGroup> out;
  for (const auto& [lr, momentum, dampening, wd, nesterov, maximize] : in) {
    out.push_back(optim::SGDGroup{lr, momentum, dampening, wd, nesterov, maximize});
  }
  return out;
}

std::vector<optim::LionGroup> to_groups(const std::vector<LionGroupTuple>& in) {
  std::vector<optim::LionGroup> out;
  for (const auto& [lr, beta1, beta2, wd, maximize] : in) {
    out.push_back(optim::LionGroup{lr, beta1, beta2, wd, maximize});
  }
  return out;
}

std::vector<optim::SkewAdamGroup> to_groups(const std::vector<SkewAdamGroupTuple>& in) {
  std::vector<optim::SkewAdamGroup> out;
  for (const auto& [lr, beta1, beta2, eps, wd] : in) {
    out.push_back(optim::SkewAdamGroup{lr, beta1, beta2, eps, wd});
  }
  return out;
}

void step_skewadam(optim::PagedState& state, const std::vector<at::Tensor>& params,
                   const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& steps,
                   const std::vector<int64_t>& slots, const std::vector<int64_t>& groups,
                   const std::vector<SkewAdamGroupTuple>& hyper,
                   const std::vector<SkewAdamLayoutTuple>& layouts) {
  const std::vector<optim::SkewAdamGroup> group_values = to_groups(hyper);
  if (state_device(state) >= 0) {
#ifdef PAGEDOPTIM_WITH_CUDA
    const std::optional<at::Tensor> none;
    const CudaStepArgs args{params, grads, steps, slots, groups, none, none};
    pybind11::gil_scoped_release no_gil;
    cuda_step_skewadam(state, args, group_values, layouts);
#endif
    return;
  }
  const std::vector<optim::ParamStep> param_steps =
      to_param_steps(params, grads, steps, slots, groups, group_values.size());
  TORCH_CHECK_VALUE(layouts.size() == param_steps.size(), "layouts must have one entry per "
                    "parameter, got ", layouts.size(), " for ", param_steps.size());
  std::vector<optim::SkewAdamParamStep> skew_steps;
  skew_steps.reserve(param_steps.size());
  for (size_t i = 0; i < param_steps.size(); ++i) {
    const auto& [factor_slot, experts, rows, cols, momentum] = layouts[i];
    skew_steps.push_back(optim::SkewAdamParamStep{param_steps[i], int32_t(factor_slot), experts,
                                                  rows, cols, momentum});
  }
  pybind11::gil_scoped_release no_gil;
  if (on_simulated_device(state)) {
    using TableStep = void (PagedState::*)(const std::vector<optim::SkewAdamParamStep>&,
                                           const std::vector<optim::SkewAdamGroup>&,
                                           optim::TableRunner&);
    simulated_step(state, skew_steps, group_values,
                   static_cast<TableStep>(&PagedState::step_skewadam));
    return;
  }
  state.step_skewadam(skew_steps, group_values, torch_parallel_for());
}

// The hook every PagedState made here runs between two batches of a step: the step runs
// without the GIL, so a Ctrl-C would otherwise be seen only after the whole step. It takes
// the GIL for a moment and lets Python run its signal handlers; the KeyboardInterrupt (or
// whatever a handler raised) interrupts the step at this batch boundary, journaled.
// `sigint_before_batch` >= 0 (tests) first raises SIGINT in the process before that batch,
// once: a Ctrl-C that arrives exactly there.
optim::BatchBoundaryHook signal_checking_hook(int64_t sigint_before_batch = -1) {
  auto armed = std::make_shared<int64_t>(sigint_before_batch);
  return [armed](size_t next_batch) {
    if (*armed >= 0 && size_t(*armed) == next_batch) {
      *armed = -1;
      std::raise(SIGINT);
    }
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  };
}

}  // namespace

void bind_paged_state(pybind11::module_& m) {
  namespace py = pybind11;
  using optim::PagedState;
  py::class_<PagedState>(m, "PagedState",
                         "Paged optimizer state of one optimizer: page table, store, driver.")
      .def(py::init([](const std::string& kind, const std::vector<std::vector<StreamTuple>>& kinds,
                       int64_t page_bytes, const py::object& store, const std::string& device) {
             TORCH_CHECK_VALUE(page_bytes > 0 && page_bytes % 4096 == 0,
                               "page_bytes must be a positive multiple of 4096, got ",
                               page_bytes);
             auto state = std::make_unique<PagedState>(
                 parse_kind(kind), to_stream_specs(kinds),
                 make_store(store, page_bytes, parse_device(device)));
             state->set_batch_boundary_hook(signal_checking_hook());
             return state;
           }),
           py::arg("kind"), py::arg("kinds"), py::arg("page_bytes"), py::arg("store") = py::none(),
           py::arg("device") = "cpu",
           "kinds: per parameter kind, its streams as (name, bytes per group of 32, per_group); "
           "store: None (all pages in memory) or the paging options dict; device: where the "
           "pages live and the step runs, 'cpu', 'cuda:N' or 'simulated' (tests)")
      .def_property_readonly("device",
                             [](PagedState& s) {
                               if (on_simulated_device(s)) return std::string("simulated");
                               const int device = state_device(s);
                               return device < 0 ? std::string("cpu")
                                                 : "cuda:" + std::to_string(device);
                             })
      .def("paging_stats", [](PagedState& s) { return paging_stats(s.store()); },
           "Pager counters: hits, misses, bytes per tier, stall seconds, io backend.")
      .def("register_param", &PagedState::register_param, py::arg("numel"), py::arg("kind") = 0,
           py::arg("row_length") = 0)
      .def_property_readonly(
          "interrupted_step",
          [](const PagedState& s) -> py::object {
            const std::optional<optim::InterruptedStep> step = s.interrupted_step();
            if (!step) return py::none();
            py::dict d;
            d["pages_done"] = step->pages_done;
            d["pages"] = step->pages;
            d["resumable"] = step->resumable;
            d["complete"] = step->complete;
            return std::move(d);
          },
          "The journal of a step that raised before it finished, or None (docs/reliability.md, "
          "'Steps that fail').")
      .def("resume_next_step", &PagedState::resume_next_step,
           "The next step call finishes the interrupted step (same params, slots and groups) "
           "instead of starting a new one.")
      .def("discard_interrupted_step", &PagedState::discard_interrupted_step,
           "Forgets the interrupted step: its applied pages stay applied, the rest never will.")
      .def(
          "set_sigint_before_batch",
          [](PagedState& s, int64_t batch) {
            s.set_batch_boundary_hook(signal_checking_hook(batch));
          },
          py::arg("batch"),
          "Tests: the next step raises SIGINT in the process right before its batch `batch` "
          "(>= 1) of pinned pages, once; -1 disarms.")
      .def("step_adamw",
           [](PagedState& s, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& steps,
              const std::vector<int64_t>& slots, const std::vector<int64_t>& groups,
              const std::vector<AdamWGroupTuple>& hyper, const OptionalTensor& found_inf,
              const OptionalTensor& grad_scale) {
             run_step(s, params, grads, steps, slots, groups, to_groups(hyper),
                      static_cast<CpuStep<optim::AdamWGroup>>(&PagedState::step_adamw),
                      PO_CUDA_STEP(cuda_step_adamw), found_inf, grad_scale);
           },
           py::arg("params"), py::arg("grads"), py::arg("steps"), py::arg("slots"),
           py::arg("groups"), py::arg("hyperparameters"), py::arg("found_inf") = py::none(),
           py::arg("grad_scale") = py::none())
      .def("step_sgd",
           [](PagedState& s, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& steps,
              const std::vector<int64_t>& slots, const std::vector<int64_t>& groups,
              const std::vector<SGDGroupTuple>& hyper, const OptionalTensor& found_inf,
              const OptionalTensor& grad_scale) {
             run_step(s, params, grads, steps, slots, groups, to_groups(hyper),
                      static_cast<CpuStep<optim::SGDGroup>>(&PagedState::step_sgd),
                      PO_CUDA_STEP(cuda_step_sgd), found_inf, grad_scale);
           },
           py::arg("params"), py::arg("grads"), py::arg("steps"), py::arg("slots"),
           py::arg("groups"), py::arg("hyperparameters"), py::arg("found_inf") = py::none(),
           py::arg("grad_scale") = py::none())
      .def("step_lion",
           [](PagedState& s, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& steps,
              const std::vector<int64_t>& slots, const std::vector<int64_t>& groups,
              const std::vector<LionGroupTuple>& hyper, const OptionalTensor& found_inf,
              const OptionalTensor& grad_scale) {
             run_step(s, params, grads, steps, slots, groups, to_groups(hyper),
                      static_cast<CpuStep<optim::LionGroup>>(&PagedState::step_lion),
                      PO_CUDA_STEP(cuda_step_lion), found_inf, grad_scale);
           },
           py::arg("params"), py::arg("grads"), py::arg("steps"), py::arg("slots"),
           py::arg("groups"), py::arg("hyperparameters"), py::arg("found_inf") = py::none(),
           py::arg("grad_scale") = py::none())
      .def("step_skewadam", &step_skewadam, py::arg("params"), py::arg("grads"),
           py::arg("steps"), py::arg("slots"), py::arg("groups"), py::arg("hyperparameters"),
           py::arg("layouts"),
           "hyperparameters: per group (lr, beta1, beta2, eps, weight_decay); layouts: per "
           "param (factor slot or -1, experts, rows, cols, momentum)")
      .def("read_stream",
           [](PagedState& s, int32_t slot, const std::string& stream) {
             at::Tensor out = at::empty({s.stream_bytes(slot, stream)}, at::kByte);
             // pin() may wait for the disk: let other Python threads run meanwhile.
             pybind11::gil_scoped_release no_gil;
             s.read_stream(slot, stream, out.data_ptr());
             return out;
           },
           py::arg("slot"), py::arg("stream"),
           "The raw bytes of one state stream of one parameter, in element order.")
      .def("write_stream",
           [](PagedState& s, int32_t slot, const std::string& stream, const at::Tensor& bytes) {
             const int64_t expected = s.stream_bytes(slot, stream);
             TORCH_CHECK_VALUE(bytes.device().is_cpu() && bytes.scalar_type() == at::kByte &&
                                   bytes.is_contiguous() && bytes.numel() == expected,
                               "bytes for stream ", stream, " of slot ", slot,
                               " must be a contiguous uint8 cpu tensor of ", expected,
                               " elements");
             pybind11::gil_scoped_release no_gil;
             s.write_stream(slot, stream, bytes.data_ptr());
           },
           py::arg("slot"), py::arg("stream"), py::arg("bytes"))
      .def("read_stream_range", stream_range_copy</*into_pages=*/false>(), py::arg("slot"),
           py::arg("stream"), py::arg("offset"), py::arg("out"),
           "Fills `out` with the stream's bytes from byte `offset` on; pins only the pages "
           "of that range, one at a time (checkpoints of state larger than memory).")
      .def("write_stream_range", stream_range_copy</*into_pages=*/true>(), py::arg("slot"),
           py::arg("stream"), py::arg("offset"), py::arg("bytes"),
           "Writes `bytes` into the stream from byte `offset` on (the inverse of "
           "read_stream_range).")
      .def("plan_stream_ranges",
           [](PagedState& s,
              const std::vector<std::tuple<int32_t, std::string, int64_t, int64_t>>& ranges) {
             std::vector<PagedState::StreamRange> planned;
             planned.reserve(ranges.size());
             for (const auto& [slot, stream, offset, bytes] : ranges) {
               planned.push_back({slot, stream, offset, bytes});
             }
             s.plan_stream_ranges(planned);
           },
           py::arg("ranges"),
           "Announces the (slot, stream, offset, bytes) ranges the coming read_stream_range / "
           "write_stream_range calls copy, in that order: a paged store reads ahead of them. "
           "An empty list ends the plan.")
      .def("stream_bytes", &PagedState::stream_bytes, py::arg("slot"), py::arg("stream"),
           "Bytes the stream of the parameter in `slot` holds (its payload, no padding).")
      .def("memory_usage",
           [](PagedState& s) {
             const optim::MemoryUsage u = s.memory_usage();
             py::dict d;
             d["placement"] = state_placement(s.store(), state_device(s) >= 0);
             d["state_bytes"] = u.state_bytes;
             d["resident_bytes"] = u.resident_bytes;
             d["payload_bytes"] = u.payload_bytes;
             d["num_pages"] = u.num_pages;
             d["num_params"] = u.num_params;
             return d;
           })
      .def_property_readonly("num_params", [](const PagedState& s) { return s.table().num_params(); })
      .def_property_readonly("page_bytes",
                             [](const PagedState& s) { return s.table().page_bytes(); })
      .def("stream_names",
           [](const PagedState& s, int32_t slot) {
             TORCH_CHECK_INDEX(slot >= 0 && slot < s.table().num_params(), "slot ", slot,
                               " is not registered");
             std::vector<std::string> names;
             for (const auto& spec : s.table().geometry(s.table().param(slot).kind).streams()) {
               names.push_back(spec.name);
             }
             return names;
           },
           py::arg("slot"), "Names of the state streams of the parameter in `slot`.")
      .def_property_readonly("stateless", &PagedState::stateless)
      .def("set_vector_loads", &PagedState::set_vector_loads, py::arg("on"),
           "Whether CUDA steps may use the vector bodies (four elements per lane) for aligned "
           "rows; off runs every row one element per lane, to measure the difference. The "
           "results are the same bits either way.");
  m.def("count_pages", &count_pages, py::arg("kinds"), py::arg("page_bytes"),
        py::arg("params"),
        "Pages PagedState would lay out for params given as (numel, kind, row_length), each "
        "kind's streams as (name, bytes per group of 32, per_group); nothing is allocated.");
  m.def("count_groups",
        [](int64_t numel, int64_t row_length) {
          TORCH_CHECK_VALUE(numel >= 0, "numel must be >= 0, got ", numel);
          TORCH_CHECK_VALUE(row_length >= 0 && (row_length == 0 || numel % row_length == 0),
                            "row_length must be >= 0 and divide numel (", numel, "), got ",
                            row_length);
          return paging::PageTable::groups_of(numel, row_length);
        },
        py::arg("numel"), py::arg("row_length"),
        "Groups of 32 a param of numel elements in rows of row_length (0: one row) has, every "
        "row's last group possibly partial: what its per-group streams hold.");
}

}  // namespace pagedoptim::bindings
