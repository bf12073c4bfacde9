// The arguments of a fused step kernel on one page segment, shared by the CPU and CUDA
// kernels: raw pointers and sizes only, no tensor type, so nvcc and g++ both compile it
// and the step driver fills it once at the boundary.
#pragma once

#include <cstdint>

#include "pagedoptim/common.h"

namespace pagedoptim::kernels {

// Parameter and gradient element types. A gradient always has its parameter's dtype (torch
// enforces that), so one tag describes both.
enum class ElementType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct ParamSpan {
  void* param;       // [count] elements of `type`, updated in place
  const void* grad;  // [count] elements of `type`
  int64_t count;
  ElementType type;
};

// One moment of the state for the elements of a span. fp32 state: `values` is float[count]
// and `scales` is null. Companded 8-bit state: `values` is int8[count] (first moments) or
// uint8[count] (second moments, codes of sqrt(v)) and `scales` holds one fp16 pattern per
// group of kGroupSize elements. The span starts on a group boundary.
struct MomentStream {
  void* values = nullptr;
  uint16_t* scales = nullptr;

  PO_HOST_DEVICE bool present() const { return values != nullptr; }
  PO_HOST_DEVICE bool quantized() const { return scales != nullptr; }
};

// The master-weight residual of a bf16/fp16 parameter (codec/master_split.h): int8[count]
// (master_bits=24) or int16[count] (master_bits=32); absent for fp32 params.
struct MasterResidual {
  void* values = nullptr;
  int bits = 0;  // 0 (none), 8 or 16
};

struct AdamWStreams {
  MomentStream m, v, v_max;  // v_max present only with amsgrad
  MasterResidual residual;
};

// SGD's momentum buffer (absent when momentum == 0) or Lion's first moment.
struct MomentumStreams {
  MomentStream m;
  MasterResidual residual;
};

}  // namespace pagedoptim::kernels
