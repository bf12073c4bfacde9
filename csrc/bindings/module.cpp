// The pagedoptim._C extension module.
#include <torch/extension.h>

#include "bindings/backends/simulated_backend.h"
#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/io/crc32c.h"

#ifdef PAGEDOPTIM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pagedoptim::bindings {
void bind_paged_state(pybind11::module_& m);
void bind_codecs(pybind11::module_& m);
void bind_page_store(pybind11::module_& m);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "PagedOptim native engine: paged optimizer state and fused step kernels";
  pagedoptim::bindings::bind_paged_state(m);
  pagedoptim::bindings::bind_codecs(m);
  pagedoptim::bindings::bind_page_store(m);
#ifdef PAGEDOPTIM_WITH_CUDA
  m.def("cuda_built", [] { return true; },
        "Whether this build has the CUDA kernels (params on a GPU can be stepped).");
  m.def("cuda_version", [] { return CUDART_VERSION; },
        "The CUDA runtime version the kernels were built against, as 1000 * major + 10 * minor.");
#else
  m.def("cuda_built", [] { return false; },
        "Whether this build has the CUDA kernels (params on a GPU can be stepped).");
  m.def("cuda_version", [] { return 0; }, "0: this build has no CUDA kernels.");
#endif
  m.def("crc32c",
        [](const pybind11::buffer& data, uint32_t crc) {
          const pybind11::buffer_info info = data.request();
          TORCH_CHECK_VALUE(info.ndim <= 1 && (info.ndim == 0 || info.strides[0] == info.itemsize),
                            "crc32c takes a contiguous buffer");
          const size_t size = size_t(info.size) * size_t(info.itemsize);
          pybind11::gil_scoped_release no_gil;
          return pagedoptim::io::crc32c(info.ptr, size, crc);
        },
        pybind11::arg("data"), pybind11::arg("crc") = 0,
        "crc32c (Castagnoli) of a contiguous buffer's bytes, continuing `crc`: the page "
        "checksum, also the checkpoint records' (pagedoptim/checkpoint/stream.py).");
  m.def("simulated_device_usage", &pagedoptim::bindings::simulated_device_usage,
        "What the simulated device (pagedoptim.paging.simulated_device()) holds now: device "
        "and pinned host bytes and allocations, streams, events.");
  m.def("cpu_isa", [] { return std::string(pagedoptim::kernels::cpu_kernels().isa); },
        "The ISA of the CPU kernels chosen for this machine.");
  m.def("cpu_runs_isa", [](const std::string& isa) {
          return pagedoptim::kernels::cpu_kernels_for_isa(isa.c_str()) != nullptr &&
                 pagedoptim::kernels::cpu_runs_isa(isa.c_str());
        },
        pybind11::arg("isa"),
        "Whether this module has CPU kernels for `isa` ('avx512', 'avx2' or 'baseline') and "
        "this CPU can run them.");
}
