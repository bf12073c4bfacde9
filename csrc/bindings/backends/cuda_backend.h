// The CUDA side of the engine, for parameters on a GPU: a page store whose pages are device
// memory from torch's caching allocator, and the step entry points that run the table
// kernels on the current stream. Compiled only when PAGEDOPTIM_WITH_CUDA is defined.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "pagedoptim/optim/paged_state.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::bindings {

// A store of device-resident pages for state on CUDA device `device_index`.
std::unique_ptr<paging::PageStore> make_cuda_page_store(int64_t page_bytes, int device_index);

// The CUDA device of a state whose store came from make_cuda_page_store; -1 otherwise.
int cuda_device_of(optim::PagedState& state);

// One step of `state` (whose pages are on a CUDA device) through the table kernels. The
// tensors are validated here; `hyperparameters` are the groups of the call. AMP: found_inf
// and grad_scale are GradScaler's device scalars (torch's fused-optimizer protocol).
struct CudaStepArgs {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& grads;
  const std::vector<at::Tensor>& steps;
  const std::vector<int64_t>& slots;
  const std::vector<int64_t>& groups;
  const std::optional<at::Tensor>& found_inf;
  const std::optional<at::Tensor>& grad_scale;
};
void cuda_step_adamw(optim::PagedState& state, const CudaStepArgs& args,
                     const std::vector<optim::AdamWGroup>& hyperparameters);
void cuda_step_sgd(optim::PagedState& state, const CudaStepArgs& args,
                   const std::vector<optim::SGDGroup>& hyperparameters);
void cuda_step_lion(optim::PagedState& state, const CudaStepArgs& args,
                    const std::vector<optim::LionGroup>& hyperparameters);

// SkewAdam: per parameter its factor slot (-1: exact second moment), factored shape
// (experts, rows, cols) and whether it keeps momentum, as the CPU binding takes them.
using SkewAdamLayout = std::tuple<int64_t, int64_t, int64_t, int64_t, bool>;
void cuda_step_skewadam(optim::PagedState& state, const CudaStepArgs& args,
                        const std::vector<optim::SkewAdamGroup>& hyperparameters,
                        const std::vector<SkewAdamLayout>& layouts);

}  // namespace pagedoptim::bindings
