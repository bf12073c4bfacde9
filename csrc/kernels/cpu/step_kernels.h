// Fused CPU step kernels on one contiguous element range of a parameter.
//
// No tensor type crosses this boundary: the step driver fills a ParamSpan (raw pointers to
// the parameter's and gradient's elements) and the state stream pointers of one page
// segment, then calls the kernel of the widest ISA this CPU supports. Each kernel reads the
// gradient, updates state and parameter in one pass, and writes both in place.
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

struct CpuKernelTable {
  const char* isa;  // "avx512", "avx2" or "baseline"
  // v_max is nullptr unless amsgrad is on.
  void (*adamw_fp32_state)(const ParamSpan&, float* m, float* v, float* v_max,
                           const codec::AdamWScalars&);
  // buffer is nullptr when momentum == 0 (plain SGD keeps no state).
  void (*sgd_fp32_state)(const ParamSpan&, float* buffer, const codec::SGDScalars&);
  void (*lion_fp32_state)(const ParamSpan&, float* m, const codec::LionScalars&);
};

// The kernels compiled for the widest ISA this CPU supports (decided once, at first call;
// PAGEDOPTIM_CPU_ISA=baseline|avx2|avx512 in the environment caps it, for testing).
const CpuKernelTable& cpu_kernels();

// One table per ISA this binary was compiled for, for tests that compare them.
const CpuKernelTable* cpu_kernels_for_isa(const char* isa);

}  // namespace pagedoptim::kernels
