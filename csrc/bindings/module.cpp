// The pagedoptim._C extension module.
#include <torch/extension.h>

#include "kernels/cpu/step_kernels.h"

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
  m.def("cpu_isa", [] { return std::string(pagedoptim::kernels::cpu_kernels().isa); },
        "The ISA of the CPU kernels chosen for this machine.");
}
