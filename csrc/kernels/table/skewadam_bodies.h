// SkewAdam's table kernel bodies (the math is codec/skewadam_rules.h): the element rules of
// its two second-moment forms, which run in the generic first-moment bodies of
// step_bodies.h, and the four statistics bodies that turn each factored matrix's gradient
// into this step's row and column coefficients.
//
// The statistics sum in exactly the order of the CPU kernel (csrc/kernels/cpu/
// skewadam_kernels_isa.cpp), which is what makes the two backends agree bit for bit:
//   row sums     16 partial sums per row, lane l taking columns l, l + 16, ... in order and
//                lane 0 the columns past the last full 16 after its own; then the 16
//                partials added in lane order. Half a warp per row.
//   column sums  sequential over the rows, one thread per column (also the weighted sums
//                that give the update's RMS in the same pass).
//   the norm     the row means and the column terms summed in double, in order, by one
//                thread per matrix.
//   row coefs    one thread per row.
#pragma once

#include <cstdint>

#include "kernels/table/lane_loops.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/skewadam_rules.h"
#include "pagedoptim/kernels/step_table.h"
#include "pagedoptim/optim/groups.h"

namespace pagedoptim::kernels::table {

// --- elementwise -------------------------------------------------------------------------------

// u = g * row_coef * col_coef of the row's element i (the row may start anywhere inside the
// parameter; its coefficients cover the whole parameter).
PO_HOST_DEVICE float skewadam_direction(const StepRow& row, int64_t i, float grad) {
  const int64_t element = row.first_element + i;
  const int64_t matrix_row = element / row.cols;  // over all experts
  const int64_t col = element - matrix_row * row.cols;
  const int64_t expert = matrix_row / row.rows;
  return codec::skewadam_factored_direction(grad, row.row_coef[matrix_row],
                                            row.col_coef[expert * row.cols + col]);
}

struct SkewAdamFactoredRule {
  using Scalars = codec::SkewAdamScalars;
  PO_HOST_DEVICE static void apply(float& p, float g, float& m, const Scalars& s,
                                   const StepRow& row, int64_t i) {
    codec::skewadam_factored_element<true>(p, skewadam_direction(row, i, g), m, s);
  }
  PO_HOST_DEVICE static void apply_stateless(float& p, float g, const Scalars& s,
                                             const StepRow& row, int64_t i) {
    float no_momentum = 0.0f;
    codec::skewadam_factored_element<false>(p, skewadam_direction(row, i, g), no_momentum, s);
  }
};

struct SkewAdamExactRule {
  using Scalars = codec::SkewAdamScalars;
  PO_HOST_DEVICE static void apply(float& p, float g, float& m, const Scalars& s,
                                   const StepRow& row, int64_t i) {
    codec::skewadam_exact_element<true>(p, g, m, static_cast<float*>(row.moments[1])[i], s);
  }
  PO_HOST_DEVICE static void apply_stateless(float& p, float g, const Scalars& s,
                                             const StepRow& row, int64_t i) {
    float no_momentum = 0.0f;
    codec::skewadam_exact_element<false>(p, g, no_momentum,
                                         static_cast<float*>(row.moments[1])[i], s);
  }
};

// --- statistics ----------------------------------------------------------------------------------

// The matrices of one step's factored parameters, with the prefix counts the kernels search.
struct FactorTable {
  const FactorMatrix* matrices = nullptr;
  int32_t num_matrices = 0;
  int64_t total_rows = 0;
  int64_t total_cols = 0;
  const codec::SkewAdamScalars* scalars = nullptr;
};

PO_HOST_DEVICE float load_gradient(const void* grad, ElementType type, int64_t i) {
  switch (type) {
    case ElementType::kFloat32: return static_cast<const float*>(grad)[i];
    case ElementType::kBFloat16: return codec::bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
    case ElementType::kFloat16: return codec::fp16_to_float(static_cast<const uint16_t*>(grad)[i]);
  }
  return 0.0f;
}

// The matrix holding global row (kRows) or column (!kRows) `index`.
template <bool kRows>
PO_HOST_DEVICE const FactorMatrix& matrix_of(const FactorTable& t, int64_t index) {
  int32_t low = 0;
  int32_t high = t.num_matrices - 1;
  while (low < high) {
    const int32_t middle = low + (high - low + 1) / 2;
    const int64_t first = kRows ? t.matrices[middle].first_row : t.matrices[middle].first_col;
    if (first <= index) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return t.matrices[low];
}

constexpr int kRowLanes = 16;  // the CPU kernel's partial sums per row

// 1. New row means R_i. Half a warp per row.
struct FactorRowsBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const FactorTable& t, const Lane& lane) {
    const int half = lane.lane() / kRowLanes;
    const int l = lane.lane() % kRowLanes;
    for (int64_t pair = lane.first_warp(); pair * 2 < t.total_rows; pair += lane.warp_stride()) {
      const int64_t global_row = pair * 2 + half;
      const bool active = global_row < t.total_rows;
      const FactorMatrix* m = active ? &matrix_of<true>(t, global_row) : nullptr;
      float partial = 0.0f;
      if (active) {
        const codec::SkewAdamScalars& s = t.scalars[m->scalars];
        const int64_t first = (global_row - m->first_row) * m->cols;
        const int64_t full = m->cols / kRowLanes * kRowLanes;
        for (int64_t j = l; j < full; j += kRowLanes) {
          partial += codec::skewadam_squared_grad(load_gradient(m->grad, m->type, first + j), s);
        }
        if (l == 0) {
          for (int64_t j = full; j < m->cols; ++j) {
            partial += codec::skewadam_squared_grad(load_gradient(m->grad, m->type, first + j), s);
          }
        }
      }
      // Every lane takes part in the exchange; lane 0 of each half adds its 16 partials in
      // lane order, as the CPU adds its lanes.
      float partials[kGroupSize];
      lane.gather(partial, partials);
      // Both halves' sums with constant indices (registers, not a local array), then the
      // lane's own.
      float sums[2] = {0.0f, 0.0f};
      for (int k = 0; k < kRowLanes; ++k) {
        sums[0] += partials[k];
        sums[1] += partials[kRowLanes + k];
      }
      const float row_sum = half == 0 ? sums[0] : sums[1];
      if (active && l == 0) {
        const codec::SkewAdamScalars& s = t.scalars[m->scalars];
        float& mean = m->row_means[global_row - m->first_row];
        mean = codec::skewadam_running_mean(mean, row_sum / float(m->cols), s);
      }
    }
  }
};

// 2. New column means C_j, the column coefficients, and each column's term of the update's
// sum of squares. One thread per column, down the rows in order.
struct FactorColumnsBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const FactorTable& t, const Lane& lane) {
    const int64_t stride = lane.warp_stride() * kGroupSize;
    for (int64_t c = lane.first_warp() * kGroupSize + lane.lane(); c < t.total_cols; c += stride) {
      const FactorMatrix& m = matrix_of<false>(t, c);
      const codec::SkewAdamScalars& s = t.scalars[m.scalars];
      const int64_t j = c - m.first_col;
      float col_sum = 0.0f;
      float weighted = 0.0f;
      for (int64_t i = 0; i < m.rows; ++i) {
        const float g = load_gradient(m.grad, m.type, i * m.cols + j);
        col_sum += codec::skewadam_squared_grad(g, s);
        const float inverse_row_mean = 1.0f / m.row_means[i];
        weighted += g * g * inverse_row_mean;
      }
      const float mean = codec::skewadam_running_mean(m.col_means[j], col_sum / float(m.rows), s);
      m.col_means[j] = mean;
      m.col_coef[j] = codec::skewadam_col_coefficient(mean);
      m.col_terms[j] = double(weighted) / double(mean);
    }
  }
};

// 3. Per matrix: 1 / (mean(R) * bc2) and the clip factor. One thread per matrix.
struct FactorNormBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const FactorTable& t, const Lane& lane) {
    const int64_t stride = lane.warp_stride() * kGroupSize;
    for (int64_t x = lane.first_warp() * kGroupSize + lane.lane(); x < t.num_matrices;
         x += stride) {
      const FactorMatrix& m = t.matrices[x];
      const codec::SkewAdamScalars& s = t.scalars[m.scalars];
      double row_mean_sum = 0.0;
      for (int64_t i = 0; i < m.rows; ++i) row_mean_sum += double(m.row_means[i]);
      const float inverse_norm = codec::skewadam_inverse_norm(row_mean_sum, m.rows, s);
      double sum_of_squares = 0.0;
      for (int64_t j = 0; j < m.cols; ++j) sum_of_squares += m.col_terms[j];
      sum_of_squares /= double(inverse_norm);
      m.norm_and_clip[0] = inverse_norm;
      m.norm_and_clip[1] =
          codec::skewadam_clip_factor(sum_of_squares, double(m.rows) * double(m.cols));
    }
  }
};

// 4. The row coefficients, with the clip folded in. One thread per row.
struct FactorRowCoefficientsBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const FactorTable& t, const Lane& lane) {
    const int64_t stride = lane.warp_stride() * kGroupSize;
    for (int64_t r = lane.first_warp() * kGroupSize + lane.lane(); r < t.total_rows; r += stride) {
      const FactorMatrix& m = matrix_of<true>(t, r);
      const int64_t i = r - m.first_row;
      m.row_coef[i] =
          codec::skewadam_row_coefficient(m.row_means[i], m.norm_and_clip[0]) * m.norm_and_clip[1];
    }
  }
};

// The statistics bodies in the order they must run (each needs the previous one's output
// for all rows or columns of its matrix).
template <class Visit>
void visit_statistics_bodies(Visit&& visit) {
  visit.template operator()<FactorRowsBody>();
  visit.template operator()<FactorColumnsBody>();
  visit.template operator()<FactorNormBody>();
  visit.template operator()<FactorRowCoefficientsBody>();
}

PO_HOST_DEVICE void prepare_skewadam_scalars(const ScalarJob& job, const optim::SkewAdamGroup& g,
                                             codec::SkewAdamScalars& out) {
  if (job.advanced == 0) *job.step += 1.0f;
  out = codec::make_skewadam_scalars(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
                                     (long long)(*job.step));
}

}  // namespace pagedoptim::kernels::table
