// Checks and conversions shared by the CPU and CUDA step bindings: tensors in, raw
// pointers and element types out, with errors that name the offending argument.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedoptim/kernels/step_args.h"

namespace pagedoptim::bindings {

inline kernels::ElementType element_type(const at::Tensor& t, const char* what, size_t index) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::ElementType::kFloat32;
    case at::kBFloat16: return kernels::ElementType::kBFloat16;
    case at::kHalf: return kernels::ElementType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, what, " ", index, " must be float32, bfloat16 or float16, got ",
                       t.scalar_type());
  }
}

// The per-parameter lists of one step call must line up.
inline void check_step_lists(size_t n, size_t grads, size_t steps, size_t slots, size_t groups) {
  TORCH_CHECK_VALUE(grads == n && steps == n && slots == n && groups == n,
                    "params, grads, steps, slots and groups must have one entry per parameter, "
                    "got ", n, ", ", grads, ", ", steps, ", ", slots, ", ", groups);
}

// A gradient that matches its parameter: same dtype, same number of elements, both
// contiguous, and on the parameter's device.
inline void check_grad_of(const at::Tensor& p, const at::Tensor& g, size_t i) {
  TORCH_CHECK_VALUE(g.device() == p.device(), "grad for param ", i, " must be on ", p.device(),
                    " like its param, got ", g.device());
  TORCH_CHECK_VALUE(p.is_contiguous() && g.is_contiguous(), "param ", i,
                    " and its grad must be contiguous");
  TORCH_CHECK_TYPE(g.scalar_type() == p.scalar_type(), "grad for param ", i, " must be ",
                   p.scalar_type(), " like its param, got ", g.scalar_type());
  TORCH_CHECK_VALUE(g.numel() == p.numel(), "grad for param ", i, " has ", g.numel(),
                    " elements, the param has ", p.numel());
}

}  // namespace pagedoptim::bindings
