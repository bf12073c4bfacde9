// CUDA step kernels over one page segment.
//
// fp32 state: one thread per element, grid-stride. Companded 8-bit state: one warp per
// group of kGroupSize = 32 elements, one lane per element: each lane decodes its element,
// updates it, and the group's new scale is a warp max-reduction of the lanes' order keys
// (codec/companding.h), after which every lane encodes its own code. State memory is read
// and written once, as on the CPU. Parameters are read and written in their own dtype,
// joined with / split into the master residual when there is one.
#include "kernels/cuda/step_kernels.cuh"
#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/master_split.h"

namespace pagedoptim::kernels::cuda {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxBlocks = 65535;
constexpr unsigned kFullWarp = 0xffffffffu;
static_assert(kGroupSize == 32, "one warp per quantization group");

// --- parameter access, per element type and master mode --------------------------------------

struct Float32Io {
  float* param;
  const float* grad;
  __device__ Float32Io(const ParamSpan& s, const MasterResidual&)
      : param(static_cast<float*>(s.param)), grad(static_cast<const float*>(s.grad)) {}
  __device__ float load(int64_t i) const { return param[i]; }
  __device__ float gradient(int64_t i) const { return grad[i]; }
  __device__ void store(int64_t i, float v) const { param[i] = v; }
};

template <bool kBf16>
struct Half16Io {
  uint16_t* param;
  const uint16_t* grad;
  __device__ Half16Io(const ParamSpan& s, const MasterResidual&)
      : param(static_cast<uint16_t*>(s.param)), grad(static_cast<const uint16_t*>(s.grad)) {}
  __device__ static float to_float(uint16_t h) {
    return kBf16 ? codec::bf16_to_float(h) : codec::fp16_to_float(h);
  }
  __device__ float load(int64_t i) const { return to_float(param[i]); }
  __device__ float gradient(int64_t i) const { return to_float(grad[i]); }
  __device__ void store(int64_t i, float v) const {
    param[i] = kBf16 ? codec::float_to_bf16(v) : codec::float_to_fp16(v);
  }
};

template <bool kBf16, class Residual>
struct MasterIo {
  uint16_t* param;
  Residual* residual;
  const uint16_t* grad;
  __device__ MasterIo(const ParamSpan& s, const MasterResidual& r)
      : param(static_cast<uint16_t*>(s.param)),
        residual(static_cast<Residual*>(r.values)),
        grad(static_cast<const uint16_t*>(s.grad)) {}
  __device__ float load(int64_t i) const {
    return kBf16 ? codec::join_master_bf16<Residual>(param[i], residual[i])
                 : codec::join_master_fp16<Residual>(param[i], residual[i]);
  }
  __device__ float gradient(int64_t i) const {
    return kBf16 ? codec::bf16_to_float(grad[i]) : codec::fp16_to_float(grad[i]);
  }
  __device__ void store(int64_t i, float v) const {
    if constexpr (kBf16) {
      codec::split_master_bf16<Residual>(v, param[i], residual[i]);
    } else {
      codec::split_master_fp16<Residual>(v, param[i], residual[i]);
    }
  }
};

__device__ uint32_t warp_max(uint32_t value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(kFullWarp, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

// The lane's element of an 8-bit group, or -1 past the end of the span. Whole warps stay
// in the loop (inactive lanes included) because the scale reduction needs all 32 lanes.
struct GroupLane {
  int64_t group;
  int64_t element;
  bool active;
};

__device__ GroupLane group_lane(int64_t warp, int64_t count) {
  const int64_t element = warp * kGroupSize + (threadIdx.x % kGroupSize);
  return GroupLane{warp, element, element < count};
}

__device__ int64_t first_warp() { return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; }
__device__ int64_t warp_stride() { return int64_t(gridDim.x) * blockDim.x / 32; }

// --- AdamW -----------------------------------------------------------------------------------

template <class Io, bool kAmsgrad>
__global__ void adamw_fp32_state_kernel(ParamSpan span, AdamWStreams st, codec::AdamWScalars s) {
  const Io io(span, st.residual);
  float* m = static_cast<float*>(st.m.values);
  float* v = static_cast<float*>(st.v.values);
  float* v_max = static_cast<float*>(st.v_max.values);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < span.count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = io.load(i);
    float unused_max = 0.0f;
    codec::adamw_element<kAmsgrad>(p, io.gradient(i), m[i], v[i],
                                   kAmsgrad ? v_max[i] : unused_max, s);
    io.store(i, p);
  }
}

template <class Io, bool kAmsgrad>
__global__ void adamw_8bit_state_kernel(ParamSpan span, AdamWStreams st, codec::AdamWScalars s) {
  const Io io(span, st.residual);
  auto* m_codes = static_cast<int8_t*>(st.m.values);
  auto* v_codes = static_cast<uint8_t*>(st.v.values);
  auto* v_max_codes = static_cast<uint8_t*>(st.v_max.values);
  const int64_t num_groups = (span.count + kGroupSize - 1) / kGroupSize;
  for (int64_t warp = first_warp(); warp < num_groups; warp += warp_stride()) {
    const GroupLane lane = group_lane(warp, span.count);
    const int64_t i = lane.active ? lane.element : 0;
    const float m_scale = codec::fp16_to_float(st.m.scales[lane.group]);
    const float v_scale = codec::fp16_to_float(st.v.scales[lane.group]);
    float m = lane.active ? codec::decode_moment(m_codes[i], m_scale) : 0.0f;
    float v = lane.active ? codec::decode_second_moment(v_codes[i], v_scale) : 0.0f;
    const float v_denominator =
        lane.active ? codec::decode_second_moment_for_denominator(v_codes[i], v_scale) : 0.0f;
    float v_max = 0.0f;
    float v_max_denominator = 0.0f;
    if constexpr (kAmsgrad) {
      const float scale = codec::fp16_to_float(st.v_max.scales[lane.group]);
      v_max = lane.active ? codec::decode_second_moment(v_max_codes[i], scale) : 0.0f;
      v_max_denominator =
          lane.active ? codec::decode_second_moment_for_denominator(v_max_codes[i], scale) : 0.0f;
    }
    if (lane.active) {
      float p = io.load(i);
      codec::adamw_element<kAmsgrad>(p, io.gradient(i), m, v, v_denominator, v_max,
                                     v_max_denominator, s);
      io.store(i, p);
    }
    // Inactive lanes contribute key 0, which never raises a maximum.
    const uint16_t new_m_scale =
        codec::moment_scale_from_bits(warp_max(lane.active ? codec::moment_order_bits(m) : 0u));
    const uint16_t new_v_scale = codec::second_moment_scale_from_bits(
        warp_max(lane.active ? codec::second_moment_order_bits(v) : 0u));
    uint16_t new_v_max_scale = 0;
    if constexpr (kAmsgrad) {
      new_v_max_scale = codec::second_moment_scale_from_bits(
          warp_max(lane.active ? codec::second_moment_order_bits(v_max) : 0u));
    }
    if (lane.active) {
      m_codes[i] = codec::encode_moment(
          m, codec::scale_reciprocal(codec::fp16_to_float(new_m_scale)));
      v_codes[i] = codec::encode_second_moment(
          v, codec::scale_reciprocal(codec::fp16_to_float(new_v_scale)));
      if constexpr (kAmsgrad) {
        v_max_codes[i] = codec::encode_second_moment(
            v_max, codec::scale_reciprocal(codec::fp16_to_float(new_v_max_scale)));
      }
    }
    // Every lane has read the old scales above; lane 0 alone writes the new ones.
    if (threadIdx.x % kGroupSize == 0) {
      st.m.scales[lane.group] = new_m_scale;
      st.v.scales[lane.group] = new_v_scale;
      if constexpr (kAmsgrad) st.v_max.scales[lane.group] = new_v_max_scale;
    }
  }
}

// --- SGD and Lion: one first moment ----------------------------------------------------------

struct SgdRule {
  using Scalars = codec::SGDScalars;
  __device__ static void apply(float& p, float g, float& m, const Scalars& s) {
    codec::sgd_momentum_element(p, g, m, s);
  }
};

struct LionRule {
  using Scalars = codec::LionScalars;
  __device__ static void apply(float& p, float g, float& m, const Scalars& s) {
    codec::lion_element(p, g, m, s);
  }
};

template <class Io>
__global__ void sgd_stateless_kernel(ParamSpan span, MomentumStreams st, codec::SGDScalars s) {
  const Io io(span, st.residual);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < span.count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = io.load(i);
    codec::sgd_element(p, io.gradient(i), s);
    io.store(i, p);
  }
}

template <class Io, class Rule>
__global__ void momentum_fp32_state_kernel(ParamSpan span, MomentumStreams st,
                                           typename Rule::Scalars s) {
  const Io io(span, st.residual);
  float* m = static_cast<float*>(st.m.values);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < span.count;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = io.load(i);
    Rule::apply(p, io.gradient(i), m[i], s);
    io.store(i, p);
  }
}

template <class Io, class Rule>
__global__ void momentum_8bit_state_kernel(ParamSpan span, MomentumStreams st,
                                           typename Rule::Scalars s) {
  const Io io(span, st.residual);
  auto* codes = static_cast<int8_t*>(st.m.values);
  const int64_t num_groups = (span.count + kGroupSize - 1) / kGroupSize;
  for (int64_t warp = first_warp(); warp < num_groups; warp += warp_stride()) {
    const GroupLane lane = group_lane(warp, span.count);
    const int64_t i = lane.active ? lane.element : 0;
    float m = lane.active
                  ? codec::decode_moment(codes[i], codec::fp16_to_float(st.m.scales[lane.group]))
                  : 0.0f;
    if (lane.active) {
      float p = io.load(i);
      Rule::apply(p, io.gradient(i), m, s);
      io.store(i, p);
    }
    const uint16_t new_scale =
        codec::moment_scale_from_bits(warp_max(lane.active ? codec::moment_order_bits(m) : 0u));
    if (lane.active) {
      codes[i] = codec::encode_moment(m, codec::scale_reciprocal(codec::fp16_to_float(new_scale)));
    }
    if (threadIdx.x % kGroupSize == 0) st.m.scales[lane.group] = new_scale;
  }
}

// --- launch helpers --------------------------------------------------------------------------

unsigned blocks_for(int64_t threads) {
  const int64_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return unsigned(blocks < 1 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

unsigned element_blocks(const ParamSpan& span) { return blocks_for(span.count); }

// Whole warps: one per group, so round the thread count up to groups * 32.
unsigned group_blocks(const ParamSpan& span) {
  return blocks_for((span.count + kGroupSize - 1) / kGroupSize * kGroupSize);
}

// Calls launch.template operator()<Io>() with the parameter access of the span.
template <class Launch>
cudaError_t with_param_io(const ParamSpan& span, const MasterResidual& residual,
                          const Launch& launch) {
  switch (span.type) {
    case ElementType::kFloat32:
      launch.template operator()<Float32Io>();
      break;
    case ElementType::kBFloat16:
      if (residual.bits == 8) {
        launch.template operator()<MasterIo<true, int8_t>>();
      } else if (residual.bits == 16) {
        launch.template operator()<MasterIo<true, int16_t>>();
      } else {
        launch.template operator()<Half16Io<true>>();
      }
      break;
    case ElementType::kFloat16:
      if (residual.bits == 8) {
        launch.template operator()<MasterIo<false, int8_t>>();
      } else if (residual.bits == 16) {
        launch.template operator()<MasterIo<false, int16_t>>();
      } else {
        launch.template operator()<Half16Io<false>>();
      }
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class Rule>
cudaError_t launch_momentum(const ParamSpan& span, const MomentumStreams& st,
                            const typename Rule::Scalars& s, cudaStream_t stream) {
  return with_param_io(span, st.residual, [&]<class Io>() {
    if (st.m.quantized()) {
      momentum_8bit_state_kernel<Io, Rule>
          <<<group_blocks(span), kThreadsPerBlock, 0, stream>>>(span, st, s);
    } else {
      momentum_fp32_state_kernel<Io, Rule>
          <<<element_blocks(span), kThreadsPerBlock, 0, stream>>>(span, st, s);
    }
  });
}

}  // namespace

cudaError_t launch_adamw(const ParamSpan& span, const AdamWStreams& st,
                         const codec::AdamWScalars& s, cudaStream_t stream) {
  if (span.count == 0) return cudaSuccess;
  const bool amsgrad = st.v_max.present();
  return with_param_io(span, st.residual, [&]<class Io>() {
    if (st.m.quantized()) {
      if (amsgrad) {
        adamw_8bit_state_kernel<Io, true><<<group_blocks(span), kThreadsPerBlock, 0, stream>>>(
            span, st, s);
      } else {
        adamw_8bit_state_kernel<Io, false><<<group_blocks(span), kThreadsPerBlock, 0, stream>>>(
            span, st, s);
      }
    } else if (amsgrad) {
      adamw_fp32_state_kernel<Io, true><<<element_blocks(span), kThreadsPerBlock, 0, stream>>>(
          span, st, s);
    } else {
      adamw_fp32_state_kernel<Io, false><<<element_blocks(span), kThreadsPerBlock, 0, stream>>>(
          span, st, s);
    }
  });
}

cudaError_t launch_sgd(const ParamSpan& span, const MomentumStreams& st,
                       const codec::SGDScalars& s, cudaStream_t stream) {
  if (span.count == 0) return cudaSuccess;
  if (!st.m.present()) {
    return with_param_io(span, st.residual, [&]<class Io>() {
      sgd_stateless_kernel<Io><<<element_blocks(span), kThreadsPerBlock, 0, stream>>>(span, st, s);
    });
  }
  return launch_momentum<SgdRule>(span, st, s, stream);
}

cudaError_t launch_lion(const ParamSpan& span, const MomentumStreams& st,
                        const codec::LionScalars& s, cudaStream_t stream) {
  if (span.count == 0) return cudaSuccess;
  return launch_momentum<LionRule>(span, st, s, stream);
}

}  // namespace pagedoptim::kernels::cuda
