// CUDA step kernels over one page segment: a grid-stride loop per element, the element
// math shared with the CPU kernels (codec/update_rules.h), parameters read and written in
// their own dtype and updated in fp32.
#include "kernels/cuda/step_kernels.cuh"
#include "pagedoptim/codec/float_convert.h"

namespace pagedoptim::kernels::cuda {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxBlocks = 65535;

template <ElementType kType>
struct ElementAccess;

template <>
struct ElementAccess<ElementType::kFloat32> {
  using Storage = float;
  __device__ static float load(const float* p, int64_t i) { return p[i]; }
  __device__ static void store(float* p, int64_t i, float value) { p[i] = value; }
};

template <>
struct ElementAccess<ElementType::kBFloat16> {
  using Storage = uint16_t;
  __device__ static float load(const uint16_t* p, int64_t i) { return codec::bf16_to_float(p[i]); }
  __device__ static void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_bf16(value);
  }
};

template <>
struct ElementAccess<ElementType::kFloat16> {
  using Storage = uint16_t;
  __device__ static float load(const uint16_t* p, int64_t i) { return codec::fp16_to_float(p[i]); }
  __device__ static void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_fp16(value);
  }
};

template <ElementType kType, bool kAmsgrad>
__global__ void adamw_fp32_state_kernel(void* __restrict__ param_raw,
                                        const void* __restrict__ grad_raw, int64_t count,
                                        float* __restrict__ m, float* __restrict__ v,
                                        float* __restrict__ v_max, codec::AdamWScalars s) {
  using Access = ElementAccess<kType>;
  auto* param = static_cast<typename Access::Storage*>(param_raw);
  const auto* grad = static_cast<const typename Access::Storage*>(grad_raw);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = Access::load(param, i);
    float unused_max = 0.0f;
    codec::adamw_element<kAmsgrad>(p, Access::load(grad, i), m[i], v[i],
                                   kAmsgrad ? v_max[i] : unused_max, s);
    Access::store(param, i, p);
  }
}

template <ElementType kType>
__global__ void sgd_fp32_state_kernel(void* __restrict__ param_raw,
                                      const void* __restrict__ grad_raw, int64_t count,
                                      float* __restrict__ buffer, codec::SGDScalars s) {
  using Access = ElementAccess<kType>;
  auto* param = static_cast<typename Access::Storage*>(param_raw);
  const auto* grad = static_cast<const typename Access::Storage*>(grad_raw);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = Access::load(param, i);
    if (buffer != nullptr) {
      codec::sgd_momentum_element(p, Access::load(grad, i), buffer[i], s);
    } else {
      codec::sgd_element(p, Access::load(grad, i), s);
    }
    Access::store(param, i, p);
  }
}

template <ElementType kType>
__global__ void lion_fp32_state_kernel(void* __restrict__ param_raw,
                                       const void* __restrict__ grad_raw, int64_t count,
                                       float* __restrict__ m, codec::LionScalars s) {
  using Access = ElementAccess<kType>;
  auto* param = static_cast<typename Access::Storage*>(param_raw);
  const auto* grad = static_cast<const typename Access::Storage*>(grad_raw);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = Access::load(param, i);
    codec::lion_element(p, Access::load(grad, i), m[i], s);
    Access::store(param, i, p);
  }
}

unsigned grid_for(int64_t count) {
  const int64_t blocks = (count + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return unsigned(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

// Instantiates `launch.template operator()<Type>()` for the run-time element type.
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

cudaError_t launch_adamw_fp32_state(void* param, const void* grad, ElementType type,
                                    int64_t count, float* m, float* v, float* v_max,
                                    const codec::AdamWScalars& scalars, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return dispatch_type(type, [&]<ElementType kType>() {
    if (v_max != nullptr) {
      adamw_fp32_state_kernel<kType, true><<<grid_for(count), kThreadsPerBlock, 0, stream>>>(
          param, grad, count, m, v, v_max, scalars);
    } else {
      adamw_fp32_state_kernel<kType, false><<<grid_for(count), kThreadsPerBlock, 0, stream>>>(
          param, grad, count, m, v, nullptr, scalars);
    }
  });
}

cudaError_t launch_sgd_fp32_state(void* param, const void* grad, ElementType type,
                                  int64_t count, float* buffer,
                                  const codec::SGDScalars& scalars, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return dispatch_type(type, [&]<ElementType kType>() {
    sgd_fp32_state_kernel<kType><<<grid_for(count), kThreadsPerBlock, 0, stream>>>(
        param, grad, count, buffer, scalars);
  });
}

cudaError_t launch_lion_fp32_state(void* param, const void* grad, ElementType type,
                                   int64_t count, float* m, const codec::LionScalars& scalars,
                                   cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return dispatch_type(type, [&]<ElementType kType>() {
    lion_fp32_state_kernel<kType><<<grid_for(count), kThreadsPerBlock, 0, stream>>>(
        param, grad, count, m, scalars);
  });
}

}  // namespace pagedoptim::kernels::cuda
