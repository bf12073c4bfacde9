// Host launchers of the CUDA table kernels (pagedoptim/kernels/step_table.h): one launch per
// StepTable, whatever its number of rows, and one launch per step for the per-parameter
// scalars. No torch header: plain nvcc compiles this next to a CPU-only torch; the caller
// (csrc/bindings/cuda_backend.cpp) brings device memory, the stream and the device guard.
//
// Each launcher returns the error of its own launch (cudaLaunchKernel's result), never a
// leftover error of someone else's: faults inside a kernel surface at the next
// synchronization, which is why the debug mode of the caller synchronizes after each launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pagedoptim/codec/skewadam_rules.h"
#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/kernels/step_table.h"
#include "pagedoptim/optim/groups.h"

namespace pagedoptim::kernels::cuda {

// Threads per block of the table kernels (a multiple of the warp).
constexpr int kTableThreadsPerBlock = 256;

// Runs every row of `table` (all pointers device pointers) with as many blocks as are
// resident at once on the device's `multiprocessors` (one wave; warps then stride over the
// units). cudaErrorInvalidValue for a variant without a kernel.
cudaError_t launch_step_table(const StepTable& table, int multiprocessors, cudaStream_t stream);

// scalars[i] for jobs[i], advancing each job's step counter, unless *found_inf (when given)
// is nonzero: then nothing is written at all and the table kernels skip too.
cudaError_t launch_prepare_adamw_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                         const optim::AdamWGroup* groups, const float* found_inf,
                                         codec::AdamWScalars* scalars, cudaStream_t stream);
cudaError_t launch_prepare_sgd_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                       const optim::SGDGroup* groups, const float* found_inf,
                                       codec::SGDScalars* scalars, cudaStream_t stream);
cudaError_t launch_prepare_lion_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                        const optim::LionGroup* groups, const float* found_inf,
                                        codec::LionScalars* scalars, cudaStream_t stream);

cudaError_t launch_prepare_skewadam_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                            const optim::SkewAdamGroup* groups,
                                            const float* found_inf,
                                            codec::SkewAdamScalars* scalars, cudaStream_t stream);

// SkewAdam's statistics of every factored matrix of a step, four launches in order (row
// means, column means and coefficients, norms, row coefficients); stops at the first launch
// that fails and returns its error.
cudaError_t launch_factor_statistics(const FactorMatrix* matrices, int32_t num_matrices,
                                     int64_t total_rows, int64_t total_cols,
                                     const codec::SkewAdamScalars* scalars, int multiprocessors,
                                     cudaStream_t stream);

}  // namespace pagedoptim::kernels::cuda
