// Host launchers of SkewAdam's CUDA kernels (the math is codec/skewadam_rules.h, shared with
// the CPU kernels). Raw device pointers only: no torch header, plain nvcc builds this.
//
// A factored parameter [experts, rows, cols] takes launch_skewadam_factor_statistics once
// per step (it reduces over the whole gradient), then launch_skewadam_factored per page
// segment; parameters with an exact second moment take launch_skewadam_exact per segment.
// State is fp32 here, as in the other CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/step_kernels.cuh"
#include "pagedoptim/codec/skewadam_rules.h"

namespace pagedoptim::kernels::cuda {

// Updates the running means row_means [experts * rows] and col_means [experts * cols] from
// `grad` [experts, rows, cols] and writes row_coef / col_coef, laid out alike, with each
// expert's update clipping folded into its row coefficients. `row_scratch` is device memory
// for experts * rows floats. Kernels on `stream`, in order; returns the launch error.
cudaError_t launch_skewadam_factor_statistics(const void* grad, ElementType type, int64_t experts,
                                              int64_t rows, int64_t cols, float* row_means,
                                              float* col_means, float* row_coef,
                                              float* col_coef, float* row_scratch,
                                              const codec::SkewAdamScalars& scalars,
                                              cudaStream_t stream);

// Elements [first_element, first_element + count) of a factored parameter with `rows` x
// `cols` matrices; row_coef / col_coef as written by launch_skewadam_factor_statistics.
// m: fp32 momentum of these elements, or nullptr (experts tier).
cudaError_t launch_skewadam_factored(void* param, const void* grad, ElementType type,
                                     int64_t count, int64_t first_element, int64_t rows,
                                     int64_t cols, const float* row_coef, const float* col_coef,
                                     float* m, const codec::SkewAdamScalars& scalars,
                                     cudaStream_t stream);

// `count` elements with an exact fp32 second moment v; m as above.
cudaError_t launch_skewadam_exact(void* param, const void* grad, ElementType type, int64_t count,
                                  float* m, float* v, const codec::SkewAdamScalars& scalars,
                                  cudaStream_t stream);

}  // namespace pagedoptim::kernels::cuda
