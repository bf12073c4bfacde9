// Fused CPU step kernels on one contiguous element range of a parameter.
//
// No tensor type crosses this boundary: the step driver fills a ParamSpan (raw pointers to
// the parameter's and gradient's elements) and the state stream pointers of one page
// segment (pagedoptim/kernels/step_args.h), then calls the kernel of the widest ISA this
// CPU supports. Each kernel reads the
// gradient, decodes the state, updates state and parameter, re-encodes the state and
// writes both in place: one pass over memory.
#pragma once

#include <cstdint>

#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/kernels/step_args.h"

namespace pagedoptim::kernels {

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

// Whether this CPU can run the kernels of `isa` ("avx512", "avx2" or "baseline"): what the
// choice above asks, and what a test asks before it runs a table.
bool cpu_runs_isa(const char* isa);

}  // namespace pagedoptim::kernels
