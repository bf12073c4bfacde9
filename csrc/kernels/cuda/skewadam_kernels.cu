// SkewAdam's CUDA kernels. Statistics of a factored parameter in five small launches, each
// deterministic (fixed reduction trees, no atomics), so a step gives the same bits every run:
//   row_sums    one block per (expert, row): mean of g^2 + eps along the row -> R
//   col_sums    one thread per (expert, column), walking down the rows: coalesced -> C, col_coef
//   row_coefs   one block per expert: mean(R) -> row_coef
//   row_rms     one block per (expert, row): sum of u^2 along the row -> scratch
//   clip        one block per expert: RMS of u -> clip folded into row_coef
// then grid-stride elementwise kernels per page segment.
#include "kernels/cuda/skewadam_kernels.cuh"
#include "pagedoptim/codec/float_convert.h"

namespace pagedoptim::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;

template <ElementType kType>
struct Load;

template <>
struct Load<ElementType::kFloat32> {
  using Storage = float;
  __device__ static float at(const float* p, int64_t i) { return p[i]; }
  __device__ static void store(float* p, int64_t i, float value) { p[i] = value; }
};

template <>
struct Load<ElementType::kBFloat16> {
  using Storage = uint16_t;
  __device__ static float at(const uint16_t* p, int64_t i) { return codec::bf16_to_float(p[i]); }
  __device__ static void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_bf16(value);
  }
};

template <>
struct Load<ElementType::kFloat16> {
  using Storage = uint16_t;
  __device__ static float at(const uint16_t* p, int64_t i) { return codec::fp16_to_float(p[i]); }
  __device__ static void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_fp16(value);
  }
};

// Sum over the block (kThreads threads) in a fixed tree; every thread gets the result.
template <class T>
__device__ T block_sum(T value) {
  __shared__ T partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const T total = partial[0];
  __syncthreads();
  return total;
}

// grad: [experts * rows, cols]; one block per row (grid-stride over rows).
template <ElementType kType>
__global__ void skewadam_row_sums_kernel(const void* __restrict__ grad_raw, int64_t all_rows,
                                         int64_t cols, float* __restrict__ row_means,
                                         codec::SkewAdamScalars s) {
  const auto* grad = static_cast<const typename Load<kType>::Storage*>(grad_raw);
  for (int64_t r = blockIdx.x; r < all_rows; r += gridDim.x) {
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      sum += codec::skewadam_squared_grad(Load<kType>::at(grad, r * cols + j), s);
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
      row_means[r] = codec::skewadam_running_mean(row_means[r], sum / float(cols), s);
    }
  }
}

// One thread per (expert, column): consecutive threads read consecutive columns of a row.
template <ElementType kType>
__global__ void skewadam_col_sums_kernel(const void* __restrict__ grad_raw, int64_t experts,
                                         int64_t rows, int64_t cols, float* __restrict__ col_means,
                                         float* __restrict__ col_coef, codec::SkewAdamScalars s) {
  const auto* grad = static_cast<const typename Load<kType>::Storage*>(grad_raw);
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < experts * cols;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t expert = c / cols;
    const int64_t j = c - expert * cols;
    const int64_t base = expert * rows * cols + j;
    float sum = 0.0f;
    for (int64_t i = 0; i < rows; ++i) {
      sum += codec::skewadam_squared_grad(Load<kType>::at(grad, base + i * cols), s);
    }
    col_means[c] = codec::skewadam_running_mean(col_means[c], sum / float(rows), s);
    col_coef[c] = codec::skewadam_col_coefficient(col_means[c]);
  }
}

// One block per expert.
__global__ void skewadam_row_coefs_kernel(int64_t rows, const float* __restrict__ row_means,
                                          float* __restrict__ row_coef,
                                          codec::SkewAdamScalars s) {
  const float* means = row_means + int64_t(blockIdx.x) * rows;
  float* coef = row_coef + int64_t(blockIdx.x) * rows;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) sum += double(means[i]);
  sum = block_sum(sum);
  const float inverse_norm = codec::skewadam_inverse_norm(sum, long(rows), s);
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
    coef[i] = codec::skewadam_row_coefficient(means[i], inverse_norm);
  }
}

// One block per row: the row's sum of u^2.
template <ElementType kType>
__global__ void skewadam_row_rms_kernel(const void* __restrict__ grad_raw, int64_t rows,
                                        int64_t all_rows, int64_t cols,
                                        const float* __restrict__ row_coef,
                                        const float* __restrict__ col_coef,
                                        float* __restrict__ row_scratch) {
  const auto* grad = static_cast<const typename Load<kType>::Storage*>(grad_raw);
  for (int64_t r = blockIdx.x; r < all_rows; r += gridDim.x) {
    const float* expert_cols = col_coef + (r / rows) * cols;
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      const float u = codec::skewadam_factored_direction(Load<kType>::at(grad, r * cols + j),
                                                         row_coef[r], expert_cols[j]);
      sum += u * u;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) row_scratch[r] = sum;
  }
}

// One block per expert.
__global__ void skewadam_clip_kernel(int64_t rows, int64_t cols,
                                     const float* __restrict__ row_scratch,
                                     float* __restrict__ row_coef) {
  const float* sums = row_scratch + int64_t(blockIdx.x) * rows;
  float* coef = row_coef + int64_t(blockIdx.x) * rows;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) sum += double(sums[i]);
  sum = block_sum(sum);
  const float clip = codec::skewadam_clip_factor(sum, double(rows) * double(cols));
  if (clip < 1.0f) {
    for (int64_t i = threadIdx.x; i < rows; i += kThreads) coef[i] *= clip;
  }
}

template <ElementType kType, bool kMomentum>
__global__ void skewadam_factored_kernel(void* __restrict__ param_raw,
                                         const void* __restrict__ grad_raw, int64_t count,
                                         int64_t first_element, int64_t rows, int64_t cols,
                                         const float* __restrict__ row_coef,
                                         const float* __restrict__ col_coef,
                                         float* __restrict__ m, codec::SkewAdamScalars s) {
  using Access = Load<kType>;
  auto* param = static_cast<typename Access::Storage*>(param_raw);
  const auto* grad = static_cast<const typename Access::Storage*>(grad_raw);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t element = first_element + i;
    const int64_t row = element / cols;  // over all experts
    const int64_t col = element - row * cols;
    const float u = codec::skewadam_factored_direction(Access::at(grad, i), row_coef[row],
                                                       col_coef[(row / rows) * cols + col]);
    float p = Access::at(param, i);
    float unused = 0.0f;
    codec::skewadam_factored_element<kMomentum>(p, u, kMomentum ? m[i] : unused, s);
    Access::store(param, i, p);
  }
}

template <ElementType kType, bool kMomentum>
__global__ void skewadam_exact_kernel(void* __restrict__ param_raw,
                                      const void* __restrict__ grad_raw, int64_t count,
                                      float* __restrict__ m, float* __restrict__ v,
                                      codec::SkewAdamScalars s) {
  using Access = Load<kType>;
  auto* param = static_cast<typename Access::Storage*>(param_raw);
  const auto* grad = static_cast<const typename Access::Storage*>(grad_raw);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = Access::at(param, i);
    float unused = 0.0f;
    codec::skewadam_exact_element<kMomentum>(p, Access::at(grad, i), kMomentum ? m[i] : unused,
                                             v[i], s);
    Access::store(param, i, p);
  }
}

unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return unsigned(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

template <class Launch>
cudaError_t dispatch_type(ElementType type, const Launch& launch) {
  switch (type) {
    case ElementType::kFloat32: launch.template operator()<ElementType::kFloat32>(); break;
    case ElementType::kBFloat16: launch.template operator()<ElementType::kBFloat16>(); break;
    case ElementType::kFloat16: launch.template operator()<ElementType::kFloat16>(); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_skewadam_factor_statistics(const void* grad, ElementType type, int64_t experts,
                                              int64_t rows, int64_t cols, float* row_means,
                                              float* col_means, float* row_coef,
                                              float* col_coef, float* row_scratch,
                                              const codec::SkewAdamScalars& scalars,
                                              cudaStream_t stream) {
  if (experts <= 0 || rows <= 0 || cols <= 0) return cudaErrorInvalidValue;
  if (experts > kMaxBlocks) return cudaErrorInvalidConfiguration;
  const int64_t all_rows = experts * rows;
  const unsigned row_blocks = blocks_for(all_rows, 1);
  return dispatch_type(type, [&]<ElementType kType>() {
    skewadam_row_sums_kernel<kType><<<row_blocks, kThreads, 0, stream>>>(grad, all_rows, cols,
                                                                         row_means, scalars);
    skewadam_col_sums_kernel<kType><<<blocks_for(experts * cols, kThreads), kThreads, 0, stream>>>(
        grad, experts, rows, cols, col_means, col_coef, scalars);
    skewadam_row_coefs_kernel<<<unsigned(experts), kThreads, 0, stream>>>(rows, row_means,
                                                                          row_coef, scalars);
    skewadam_row_rms_kernel<kType><<<row_blocks, kThreads, 0, stream>>>(
        grad, rows, all_rows, cols, row_coef, col_coef, row_scratch);
    skewadam_clip_kernel<<<unsigned(experts), kThreads, 0, stream>>>(rows, cols, row_scratch,
                                                                     row_coef);
  });
}

cudaError_t launch_skewadam_factored(void* param, const void* grad, ElementType type,
                                     int64_t count, int64_t first_element, int64_t rows,
                                     int64_t cols, const float* row_coef, const float* col_coef,
                                     float* m, const codec::SkewAdamScalars& scalars,
                                     cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const unsigned blocks = blocks_for(count, kThreads);
  return dispatch_type(type, [&]<ElementType kType>() {
    if (m != nullptr) {
      skewadam_factored_kernel<kType, true><<<blocks, kThreads, 0, stream>>>(
          param, grad, count, first_element, rows, cols, row_coef, col_coef, m, scalars);
    } else {
      skewadam_factored_kernel<kType, false><<<blocks, kThreads, 0, stream>>>(
          param, grad, count, first_element, rows, cols, row_coef, col_coef, nullptr, scalars);
    }
  });
}

cudaError_t launch_skewadam_exact(void* param, const void* grad, ElementType type, int64_t count,
                                  float* m, float* v, const codec::SkewAdamScalars& scalars,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const unsigned blocks = blocks_for(count, kThreads);
  return dispatch_type(type, [&]<ElementType kType>() {
    if (m != nullptr) {
      skewadam_exact_kernel<kType, true><<<blocks, kThreads, 0, stream>>>(param, grad, count, m,
                                                                          v, scalars);
    } else {
      skewadam_exact_kernel<kType, false><<<blocks, kThreads, 0, stream>>>(param, grad, count,
                                                                           nullptr, v, scalars);
    }
  });
}

}  // namespace pagedoptim::kernels::cuda
