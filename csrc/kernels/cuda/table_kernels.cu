// CUDA wrappers of the table kernel bodies (csrc/kernels/table/step_bodies.h): a __global__
// per body, a Lane built on the thread indices and warp shuffles, and the launchers.
//
// The element math is the shared codec's; the build compiles this file with -fmad=false and
// IEEE division and square root (scripts/ptx_lint.py checks the PTX), so these kernels
// round exactly as the CPU kernels do.
#include "kernels/cuda/table_kernels.cuh"
#include "kernels/table/visit_body.h"

namespace pagedoptim::kernels::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kPrepareThreadsPerBlock = 128;
static_assert(kGroupSize == 32, "one warp per quantization group");
static_assert(kTableThreadsPerBlock % kGroupSize == 0, "blocks of whole warps");

// The hardware side of a body's Lane (see step_bodies.h). __host__ __device__ only so the
// bodies, which are __host__ __device__ for the host emulation, may name it; it is used on
// the device alone.
struct DeviceLane {
  __host__ __device__ int lane() const {
#ifdef __CUDA_ARCH__
    return int(threadIdx.x % kGroupSize);
#else
    return 0;
#endif
  }
  __host__ __device__ int64_t first_warp() const {
#ifdef __CUDA_ARCH__
    return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kGroupSize;
#else
    return 0;
#endif
  }
  __host__ __device__ int64_t warp_stride() const {
#ifdef __CUDA_ARCH__
    return int64_t(gridDim.x) * blockDim.x / kGroupSize;
#else
    return 1;
#endif
  }
  __host__ __device__ uint32_t warp_max(uint32_t value) const {
#ifdef __CUDA_ARCH__
    for (int offset = kGroupSize / 2; offset > 0; offset /= 2) {
      const uint32_t other = __shfl_xor_sync(kFullWarp, value, offset);
      value = other > value ? other : value;
    }
#endif
    return value;
  }
  __host__ __device__ uint32_t group_max(uint32_t value, int width) const {
#ifdef __CUDA_ARCH__
    for (int offset = width / 2; offset > 0; offset /= 2) {
      const uint32_t other = __shfl_xor_sync(kFullWarp, value, offset);
      value = other > value ? other : value;
    }
#endif
    return value;
  }
  __host__ __device__ void gather(float value, float* all) const {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int src = 0; src < kGroupSize; ++src) all[src] = __shfl_sync(kFullWarp, value, src);
#else
    all[0] = value;
#endif
  }
};

template <class Body>
__global__ void __launch_bounds__(kTableThreadsPerBlock) step_table_kernel(StepTable table) {
  Body::run(table, DeviceLane{});
}

template <class Body>
__global__ void __launch_bounds__(kTableThreadsPerBlock)
    factor_statistics_kernel(table::FactorTable factors) {
  Body::run(factors, DeviceLane{});
}


// One thread per parameter of the call; `Prepare` is one of table::prepare_*_scalars.
template <class Group, class Scalars, void (*Prepare)(const ScalarJob&, const Group&, Scalars&)>
__global__ void prepare_scalars_kernel(const ScalarJob* jobs, int32_t num_jobs,
                                       const Group* groups, const float* found_inf,
                                       Scalars* scalars) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < num_jobs;
       i += gridDim.x * blockDim.x) {
    Prepare(jobs[i], groups[jobs[i].group], scalars[i]);
  }
}

unsigned prepare_blocks(int32_t num_jobs) {
  const int32_t blocks = (num_jobs + kPrepareThreadsPerBlock - 1) / kPrepareThreadsPerBlock;
  return unsigned(blocks < 1 ? 1 : (blocks < 1024 ? blocks : 1024));
}

template <class Group, class Scalars>
cudaError_t launch_prepare(void (*kernel)(const ScalarJob*, int32_t, const Group*, const float*,
                                          Scalars*),
                           const ScalarJob* jobs, int32_t num_jobs, const Group* groups,
                           const float* found_inf, Scalars* scalars, cudaStream_t stream) {
  if (num_jobs <= 0) return cudaSuccess;
  void* args[] = {&jobs, &num_jobs, &groups, &found_inf, &scalars};
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(prepare_blocks(num_jobs)),
                          dim3(kPrepareThreadsPerBlock), args, 0, stream);
}

// Blocks of `kernel` resident on one multiprocessor at once (its registers decide), asked
// once per kernel: a grid of exactly one wave leaves no under-filled second wave behind.
int blocks_per_multiprocessor(const void* kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kTableThreadsPerBlock, 0) !=
          cudaSuccess ||
      blocks < 1) {
    (void)cudaGetLastError();  // our own failed query; one block per SM still runs
    blocks = 1;
  }
  return blocks;
}

// A grid for `units` warps of work, one wave at most.
unsigned table_blocks(int64_t warps, int per_multiprocessor, int multiprocessors) {
  constexpr int64_t kWarpsPerBlock = kTableThreadsPerBlock / kGroupSize;
  int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t wave = int64_t(per_multiprocessor) * (multiprocessors > 0 ? multiprocessors : 1);
  if (blocks > wave) blocks = wave;
  return unsigned(blocks < 1 ? 1 : blocks);
}

}  // namespace

cudaError_t launch_step_table(const StepTable& table, int multiprocessors, cudaStream_t stream) {
  if (table.num_rows <= 0 || table.num_units <= 0) return cudaSuccess;
  StepTable argument = table;
  void* args[] = {&argument};
  cudaError_t error = cudaErrorInvalidValue;
  table::visit_step_body(table.variant, [&]<class Body>() {
    const void* kernel = reinterpret_cast<const void*>(&step_table_kernel<Body>);
    static const int per_multiprocessor = blocks_per_multiprocessor(kernel);
    // The vector bodies give a warp four groups per iteration.
    const int64_t warps = table.variant.vector
                              ? (table.num_units + table::kGroupsPerWarp - 1) / table::kGroupsPerWarp
                              : table.num_units;
    error = cudaLaunchKernel(kernel, dim3(table_blocks(warps, per_multiprocessor, multiprocessors)),
                             dim3(kTableThreadsPerBlock), args, 0, stream);
  });
  return error;
}

cudaError_t launch_prepare_adamw_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                         const optim::AdamWGroup* groups, const float* found_inf,
                                         codec::AdamWScalars* scalars, cudaStream_t stream) {
  return launch_prepare(
      &prepare_scalars_kernel<optim::AdamWGroup, codec::AdamWScalars, table::prepare_adamw_scalars>,
      jobs, num_jobs, groups, found_inf, scalars, stream);
}

cudaError_t launch_prepare_sgd_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                       const optim::SGDGroup* groups, const float* found_inf,
                                       codec::SGDScalars* scalars, cudaStream_t stream) {
  return launch_prepare(
      &prepare_scalars_kernel<optim::SGDGroup, codec::SGDScalars, table::prepare_sgd_scalars>,
      jobs, num_jobs, groups, found_inf, scalars, stream);
}

cudaError_t launch_prepare_lion_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                        const optim::LionGroup* groups, const float* found_inf,
                                        codec::LionScalars* scalars, cudaStream_t stream) {
  return launch_prepare(
      &prepare_scalars_kernel<optim::LionGroup, codec::LionScalars, table::prepare_lion_scalars>,
      jobs, num_jobs, groups, found_inf, scalars, stream);
}

cudaError_t launch_prepare_skewadam_scalars(const ScalarJob* jobs, int32_t num_jobs,
                                            const optim::SkewAdamGroup* groups,
                                            const float* found_inf,
                                            codec::SkewAdamScalars* scalars, cudaStream_t stream) {
  return launch_prepare(&prepare_scalars_kernel<optim::SkewAdamGroup, codec::SkewAdamScalars,
                                                table::prepare_skewadam_scalars>,
                        jobs, num_jobs, groups, found_inf, scalars, stream);
}

cudaError_t launch_factor_statistics(const FactorMatrix* matrices, int32_t num_matrices,
                                     int64_t total_rows, int64_t total_cols,
                                     const codec::SkewAdamScalars* scalars, int multiprocessors,
                                     cudaStream_t stream) {
  if (num_matrices <= 0) return cudaSuccess;
  table::FactorTable factors;
  factors.matrices = matrices;
  factors.num_matrices = num_matrices;
  factors.total_rows = total_rows;
  factors.total_cols = total_cols;
  factors.scalars = scalars;
  // Enough warps for the widest of the four passes (two rows per warp; one column, row or
  // matrix per thread), one wave at most; the bodies stride over whatever is left.
  const int64_t lines = total_rows > total_cols ? total_rows : total_cols;
  const int64_t thread_warps = (lines + kGroupSize - 1) / kGroupSize;
  const int64_t row_warps = (total_rows + 1) / 2;
  const int64_t warps = thread_warps > row_warps ? thread_warps : row_warps;
  void* args[] = {&factors};
  cudaError_t error = cudaSuccess;
  table::visit_statistics_bodies([&]<class Body>() {
    if (error != cudaSuccess) return;
    const void* kernel = reinterpret_cast<const void*>(&factor_statistics_kernel<Body>);
    static const int per_multiprocessor = blocks_per_multiprocessor(kernel);
    error = cudaLaunchKernel(kernel, dim3(table_blocks(warps, per_multiprocessor, multiprocessors)),
                             dim3(kTableThreadsPerBlock), args, 0, stream);
  });
  return error;
}

}  // namespace pagedoptim::kernels::cuda
