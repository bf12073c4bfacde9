// Work tables: how one kernel launch steps many page segments of many parameters.
//
// The device step driver (csrc/optim/table_step.cpp) turns the pages pinned for a batch
// into rows, one per (parameter, page segment), and sorts them by kernel variant. Each
// variant's rows run in one launch: the kernel cuts every row into units of kGroupSize
// elements (one warp each; a row's last unit may be partial), numbers the units of all rows
// of the table consecutively (`first_unit`), and every warp finds the row of its unit by a
// binary search. The same structs feed the host emulation of the kernel bodies in the CPU
// tests. Raw pointers and sizes only: nvcc and g++ compile this header alike.
#pragma once

#include <cstdint>

#include "pagedoptim/kernels/step_args.h"

namespace pagedoptim::kernels {

enum class StepAlgorithm : uint8_t {
  kAdamW = 0,
  kSGD = 1,
  kLion = 2,
  kSkewAdamFactored = 3,  // second moment from the step's row and column coefficients
  kSkewAdamExact = 4,     // fp32 exact second moment in moments[1]
};

// How a variant keeps its per-element state.
enum class StateFormat : uint8_t {
  kNone = 0,        // plain SGD without momentum: no state streams
  kFloat32 = 1,     // fp32 moments
  kCompanded8 = 2,  // int8/uint8 codes + one fp16 scale per group
};

// Everything that selects a kernel instantiation. Rows of one variant share one launch.
struct StepVariant {
  StepAlgorithm algorithm = StepAlgorithm::kAdamW;
  ElementType type = ElementType::kFloat32;
  uint8_t residual_bits = 0;  // 0, 8 or 16 (bf16/fp16 params only)
  // The first moment's format (AdamW: all its moments). SkewAdam's exact second moment is
  // always fp32; kNone: no momentum.
  StateFormat state = StateFormat::kFloat32;
  bool amsgrad = false;       // AdamW only: a third moment, max_exp_avg_sq
  // 8-bit state only: every row's pointers are aligned for four elements per access, so
  // the vector body runs it (four elements per lane, eight lanes per group).
  bool vector = false;

  PO_HOST_DEVICE bool operator==(const StepVariant& o) const {
    return algorithm == o.algorithm && type == o.type && residual_bits == o.residual_bits &&
           state == o.state && amsgrad == o.amsgrad && vector == o.vector;
  }
  // A dense key, for ordering and grouping rows on the host.
  int key() const {
    return (((((int(algorithm) * 4 + int(type)) * 32 + residual_bits) * 4 + int(state)) * 2 +
             int(amsgrad)) * 2) + int(vector);
  }
};

// One page segment of one parameter: its elements of the parameter and gradient, and of
// every state stream, all starting at the segment's first element (a group boundary).
struct StepRow {
  void* param = nullptr;
  const void* grad = nullptr;
  // AdamW: m, v, v_max; SGD (momentum buffer) and Lion (exp_avg): m only. fp32 values, or
  // int8 (m) / uint8 (v, v_max) codes with one fp16 scale per group.
  void* moments[3] = {nullptr, nullptr, nullptr};
  uint16_t* scales[3] = {nullptr, nullptr, nullptr};
  void* residual = nullptr;  // master residual, int8 or int16 per residual_bits
  // SkewAdam's factored rows: this step's coefficients of the whole parameter,
  // [experts * rows] and [experts * cols], and where the row's first element sits in it.
  const float* row_coef = nullptr;
  const float* col_coef = nullptr;
  int64_t rows = 0, cols = 0, first_element = 0;
  int64_t count = 0;         // elements
  int64_t first_unit = 0;    // units of the rows before this one in its table
  int32_t scalars = 0;       // index into the launch's per-parameter scalars
  int32_t reserved = 0;
};

// Units (groups of kGroupSize elements, the last one of a row possibly partial) of a row.
PO_HOST_DEVICE int64_t units_of(int64_t count) { return (count + kGroupSize - 1) / kGroupSize; }

// A launch: the rows of one variant, and the step-wide inputs every row shares.
struct StepTable {
  StepVariant variant;
  const StepRow* rows = nullptr;  // device memory on the device, host memory when emulated
  int32_t num_rows = 0;
  int64_t num_units = 0;          // rows[last].first_unit + units_of(rows[last].count)
  // Per parameter of the call, indexed by StepRow::scalars: codec::AdamWScalars,
  // SGDScalars or LionScalars according to variant.algorithm.
  const void* scalars = nullptr;
  // AMP (torch's GradScaler protocol): when found_inf is given and nonzero the whole step is
  // skipped, state and params untouched; when grad_scale is given every gradient element is
  // divided by it first. Both are device scalars, read by the kernel: no host sync.
  const float* found_inf = nullptr;
  const float* grad_scale = nullptr;
};

// One matrix of a SkewAdam factored parameter (one expert of an [E, rows, cols] tensor), for
// the statistics kernels: they move its running means (in a contiguous copy of the factor
// stream) and compute this step's coefficients, in exactly the CPU kernel's order of
// summation, so that both backends produce the same bits.
struct FactorMatrix {
  const void* grad = nullptr;  // [rows, cols] elements of `type`, row-major
  ElementType type = ElementType::kFloat32;
  int64_t rows = 0, cols = 0;
  float* row_means = nullptr;  // [rows], updated in place
  float* col_means = nullptr;  // [cols], updated in place
  float* row_coef = nullptr;   // [rows] out
  float* col_coef = nullptr;   // [cols] out
  double* col_terms = nullptr; // [cols] scratch: each column's share of the update's sum of squares
  float* norm_and_clip = nullptr;  // [2] scratch: 1 / (mean(R) * bc2), then the clip factor
  int64_t first_row = 0;       // rows of the matrices before this one (prefix, for the row kernel)
  int64_t first_col = 0;       // columns of the matrices before this one
  int32_t scalars = 0;         // index into the SkewAdamScalars of the call
  int32_t reserved = 0;
};

// The step counter and group of one parameter of the call: the input of the scalar
// preparation that runs before the tables (on the device, next to the counters).
struct ScalarJob {
  float* step = nullptr;  // incremented unless found_inf is set or `advanced`
  int32_t group = 0;      // index into the call's group hyperparameters
  int32_t advanced = 0;   // 1: a resumed step; the counter already holds this step's count
};

// Index of the row that holds `unit`: the last row whose first_unit <= unit.
PO_HOST_DEVICE int32_t find_row(const StepRow* rows, int32_t num_rows, int64_t unit) {
  int32_t low = 0;
  int32_t high = num_rows - 1;
  while (low < high) {
    const int32_t middle = low + (high - low + 1) / 2;
    if (rows[middle].first_unit <= unit) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

}  // namespace pagedoptim::kernels
