// SkewAdam's CPU kernels (the math is codec/skewadam_rules.h).
//
// A factored parameter takes two phases per step. factor_statistics runs once per matrix
// (per expert of an [E, rows, cols] tensor) over its whole gradient: it moves the row and
// column running means and turns them into the row and column coefficients, with the
// update clipping folded in; it needs the whole matrix, so it cannot run per page. The
// elementwise kernels then run per chunk of a page segment like the other optimizers',
// reading the coefficients.
#pragma once

#include <cstdint>

#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/skewadam_rules.h"

namespace pagedoptim::kernels {

// One matrix of a factored parameter.
struct FactorStatistics {
  const void* grad;   // [rows, cols] elements of `type`, row-major
  ElementType type;
  int64_t rows, cols;
  float* row_means;   // [rows] running means R, updated in place
  float* col_means;   // [cols] running means C, updated in place
  float* row_coef;    // [rows] out: clip / sqrt(R_i / (mean(R) * bc2))
  float* col_coef;    // [cols] out: 1 / sqrt(C_j); holds the column sums while they add up
  float* col_scratch; // [cols] scratch
};

// The coefficients of a whole factored parameter, [experts * rows] and [experts * cols],
// and where the span's first element sits in it (a multiple of kGroupSize).
struct SkewAdamFactoredStreams {
  MomentStream m;  // backbone momentum; absent in the experts tier
  MasterResidual residual;
  const float* row_coef;
  const float* col_coef;
  int64_t rows, cols;
  int64_t first_element;
};

struct SkewAdamExactStreams {
  MomentStream m;  // absent for 1-D parameters of the experts tier
  MomentStream v;  // always fp32
  MasterResidual residual;
};

struct SkewAdamKernelTable {
  const char* isa;
  void (*factor_statistics)(const FactorStatistics&, const codec::SkewAdamScalars&);
  void (*factored)(const ParamSpan&, const SkewAdamFactoredStreams&,
                   const codec::SkewAdamScalars&);
  void (*exact)(const ParamSpan&, const SkewAdamExactStreams&, const codec::SkewAdamScalars&);
};

// The SkewAdam kernels of the ISA cpu_kernels() chose (so both tables always agree).
const SkewAdamKernelTable& skewadam_cpu_kernels();

// One table per ISA this binary was compiled for; nullptr for others.
const SkewAdamKernelTable* skewadam_kernels_for_isa(const char* isa);

}  // namespace pagedoptim::kernels
