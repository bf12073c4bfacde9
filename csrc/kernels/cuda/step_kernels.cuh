// Host launchers of the CUDA step kernels. Raw device pointers and the shared scalar
// structs only: no torch header, so this builds with plain nvcc next to a CPU-only torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedoptim/codec/update_rules.h"

namespace pagedoptim::kernels::cuda {

enum class ElementType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// AdamW with fp32 state over `count` elements of one page segment. v_max may be nullptr
// (amsgrad off). Returns the launch error, if any.
cudaError_t launch_adamw_fp32_state(void* param, const void* grad, ElementType type,
                                    int64_t count, float* m, float* v, float* v_max,
                                    const codec::AdamWScalars& scalars, cudaStream_t stream);

cudaError_t launch_sgd_fp32_state(void* param, const void* grad, ElementType type,
                                  int64_t count, float* buffer,
                                  const codec::SGDScalars& scalars, cudaStream_t stream);

cudaError_t launch_lion_fp32_state(void* param, const void* grad, ElementType type,
                                   int64_t count, float* m, const codec::LionScalars& scalars,
                                   cudaStream_t stream);

}  // namespace pagedoptim::kernels::cuda
