// Fused CPU step kernels on one contiguous element range of a parameter.
//
// No tensor type crosses this boundary: the step driver fills a ParamSpan (raw pointers to
// the parameter's and gradient's elements) and the state stream pointers of one page
// segment, then calls the kernel of the widest ISA this CPU supports. Each kernel reads the
// gradient, decodes the state, updates state and parameter, re-encodes the state and
// writes both in place: one pass over memory.
#pragma once

#include <cstdint>

#include "pagedoptim/codec/update_rules.h"

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

  bool present() const { return values != nullptr; }
  bool quantized() const { return scales != nullptr; }
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

struct CpuKernelTable {
  const char* isa;  // "avx512", "avx2" or "baseline"
  void (*adamw)(const ParamSpan&, const AdamWStreams&, const codec::AdamWScalars&);
  void (*sgd)(const ParamSpan&, const MomentumStreams&, const codec::SGDScalars&);
  void (*lion)(const ParamSpan&, const MomentumStreams&, const codec::LionScalars&);
};

// The kernels compiled for the widest ISA this CPU supports (decided once, at first call;
// PAGEDOPTIM_CPU_ISA=baseline|avx2|avx512 in the environment caps it, for testing).
const CpuKernelTable& cpu_kernels();

// One table per ISA this binary was compiled for, for tests that compare them.
const CpuKernelTable* cpu_kernels_for_isa(const char* isa);

}  // namespace pagedoptim::kernels
