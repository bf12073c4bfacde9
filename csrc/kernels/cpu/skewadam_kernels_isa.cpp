// SkewAdam's CPU kernels, compiled once per ISA like step_kernels_isa.cpp (this file is built
// with -DPO_CPU_ISA=<name> and that ISA's -m flags; skewadam_dispatch.cpp picks the table).
//
// Row sums accumulate in kLanes independent fp32 partial sums: the loop over a row's lanes is
// then plain elementwise work that GCC vectorizes without -ffast-math. The statistics take
// one pass over the gradient (the update's RMS comes from per-column sums, see
// factor_statistics_typed), as reading a large gradient twice costs more than the math.
// The elementwise kernels walk their span in groups of kGroupSize (the 8-bit momentum's
// quantization groups); a group may cross rows, so its directions are filled row run by row
// run, each run a vectorizable loop with one row coefficient. On AVX2 and AVX-512 the full
// groups of the experts tier (no momentum) instead go a vector at a time through
// companded_groups.h's parameter types (factored_groups); its tail and every other variant
// take the row-run loop.
#include <algorithm>
#include <type_traits>

#include "kernels/cpu/companded_groups.h"
#include "kernels/cpu/element_access.h"
#include "kernels/cpu/skewadam_kernels.h"
#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/skewadam_rules.h"

#ifndef PO_CPU_ISA
#error "PO_CPU_ISA must name the ISA this translation unit is compiled for"
#endif

namespace pagedoptim::kernels::PO_CPU_ISA {
namespace {

using codec::SkewAdamScalars;

constexpr int kLanes = 16;

#if defined(PO_SIMD_GROUPS)
// A row's statistics on AVX2 / AVX-512 (simd.h): the loops below with the same operations in
// the same order, so the same bits. GCC's own vectorization of them ran at 1.5-2 cycles per
// element, against well under one for these.
inline simd::F load_row(const float* p) { return simd::Ops::load(p); }
inline simd::F load_row(const uint16_t* p) { return simd::load_bf16(p); }
template <class Access>
constexpr bool kVectorRows =
    std::is_same_v<Access, Float32Access> || std::is_same_v<Access, BFloat16Access>;
#endif

// ---------------------------------------------------------------------------------------------
// Phase 1: row and column statistics of one matrix.

template <class Access>
void factor_statistics_typed(const FactorStatistics& f, const SkewAdamScalars& s) {
  using Storage = typename Access::Storage;
  const Storage* PO_RESTRICT grad = static_cast<const Storage*>(f.grad);
  const int64_t rows = f.rows;
  const int64_t cols = f.cols;
  const int64_t full_cols = cols / kLanes * kLanes;
  float* PO_RESTRICT col_sums = f.col_coef;
  // weighted_j = sum_i g_ij^2 / R_i, so that the update's sum of squares,
  // sum_ij g_ij^2 a_i^2 b_j^2 with a_i^2 = 1 / (R_i * inverse_norm) and b_j^2 = 1 / C_j,
  // is sum_j weighted_j / C_j / inverse_norm: known after this one pass over the gradient.
  // R_i depends on row i alone, so the second loop over a row reads it back from L1.
  float* PO_RESTRICT weighted = f.col_scratch;
  std::fill(col_sums, col_sums + cols, 0.0f);
  std::fill(weighted, weighted + cols, 0.0f);

  double row_mean_sum = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const Storage* PO_RESTRICT row = grad + i * cols;
    float lanes[kLanes] = {};
#if defined(PO_SIMD_GROUPS)
    if constexpr (kVectorRows<Access>) {
      using simd::Ops;
      constexpr int kVectors = kLanes / simd::kLanes;
      simd::F partial[kVectors];
      for (auto& p : partial) p = Ops::splat(0.0f);
      const simd::F eps = Ops::splat(s.eps);
      for (int64_t j = 0; j < full_cols; j += kLanes) {
        for (int v = 0; v < kVectors; ++v) {
          const int64_t c = j + v * simd::kLanes;
          const simd::F g = load_row(row + c);
          const simd::F squared = Ops::add(Ops::mul(g, g), eps);  // skewadam_squared_grad
          Ops::store(col_sums + c, Ops::add(Ops::load(col_sums + c), squared));
          partial[v] = Ops::add(partial[v], squared);
        }
      }
      for (int v = 0; v < kVectors; ++v) Ops::store(lanes + v * simd::kLanes, partial[v]);
    } else
#endif
    {
      for (int64_t j = 0; j < full_cols; j += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const float squared = codec::skewadam_squared_grad(Access::load(row, j + l), s);
          col_sums[j + l] += squared;
          lanes[l] += squared;
        }
      }
    }
    for (int64_t j = full_cols; j < cols; ++j) {
      const float squared = codec::skewadam_squared_grad(Access::load(row, j), s);
      col_sums[j] += squared;
      lanes[0] += squared;
    }
    float row_sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) row_sum += lanes[l];
    const float row_mean = codec::skewadam_running_mean(f.row_means[i], row_sum / float(cols), s);
    f.row_means[i] = row_mean;
    row_mean_sum += double(row_mean);
    const float inverse_row_mean = 1.0f / row_mean;
    int64_t weighted_end = 0;
#if defined(PO_SIMD_GROUPS)
    if constexpr (kVectorRows<Access>) {
      using simd::Ops;
      const simd::F inverse = Ops::splat(inverse_row_mean);
      for (; weighted_end + simd::kLanes <= cols; weighted_end += simd::kLanes) {
        const simd::F g = load_row(row + weighted_end);
        Ops::store(weighted + weighted_end, Ops::add(Ops::load(weighted + weighted_end),
                                                     Ops::mul(Ops::mul(g, g), inverse)));
      }
    }
#endif
    for (int64_t j = weighted_end; j < cols; ++j) {
      const float g = Access::load(row, j);
      weighted[j] += g * g * inverse_row_mean;
    }
  }

  const float inverse_norm = codec::skewadam_inverse_norm(row_mean_sum, long(rows), s);
  double sum_of_squares = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    f.col_means[j] = codec::skewadam_running_mean(f.col_means[j], col_sums[j] / float(rows), s);
    f.col_coef[j] = codec::skewadam_col_coefficient(f.col_means[j]);
    sum_of_squares += double(weighted[j]) / double(f.col_means[j]);
  }
  sum_of_squares /= double(inverse_norm);
  // Clip folded into the row coefficients.
  const float clip = codec::skewadam_clip_factor(sum_of_squares, double(rows) * double(cols));
  for (int64_t i = 0; i < rows; ++i) {
    f.row_coef[i] = codec::skewadam_row_coefficient(f.row_means[i], inverse_norm) * clip;
  }
}

void factor_statistics(const FactorStatistics& f, const SkewAdamScalars& s) {
  switch (f.type) {
    case ElementType::kFloat32: return factor_statistics_typed<Float32Access>(f, s);
    case ElementType::kBFloat16: return factor_statistics_typed<BFloat16Access>(f, s);
    case ElementType::kFloat16: return factor_statistics_typed<Float16Access>(f, s);
  }
}

// ---------------------------------------------------------------------------------------------
// Phase 2: elementwise updates.

// The span's momentum for one group: decoded into `local` (8-bit) or the fp32 state itself.
template <bool kQuantized>
inline float* load_momentum(const MomentStream& m, int64_t base, int count, float* local) {
  if constexpr (kQuantized) {
    codec::decode_moment_group(static_cast<int8_t*>(m.values) + base, m.scales[base / kGroupSize],
                               count, local);
    return local;
  } else {
    return static_cast<float*>(m.values) + base;
  }
}

template <bool kQuantized>
inline void store_momentum(const MomentStream& m, int64_t base, int count, const float* values) {
  if constexpr (kQuantized) {
    m.scales[base / kGroupSize] =
        codec::encode_moment_group(values, count, static_cast<int8_t*>(m.values) + base);
  }
}

#if defined(PO_SIMD_GROUPS)
// Full groups [0, groups) of a factored parameter without momentum (the experts tier, most of
// a MoE model's weights): codec::skewadam_factored_direction and skewadam_factored_element a
// vector at a time, in the batches of companded_groups.h's parameter types (which join and
// split bf16 masters). A group inside one row takes the row's coefficient as a splat and its
// column coefficients as a load; one that crosses a row's end (rows that are not a multiple of
// a group, or a span that starts inside one) first copies each lane's two coefficients into
// arrays. Each lane computes (g * row) * col, then p * decay + (-lr) * u, as the scalar code.
template <class Params>
void factored_groups(const Params io, int64_t groups, const SkewAdamFactoredStreams& st,
                     const SkewAdamScalars& scalars) {
  using simd::F;
  using simd::Ops;
  constexpr int kVectors = simd::kVectorsPerGroup;
  const F decay = Ops::splat(scalars.decay), neg_lr = Ops::splat(-scalars.lr);
  const float* PO_RESTRICT row_coefs = st.row_coef;
  const float* PO_RESTRICT col_coefs = st.col_coef;
  const int64_t rows = st.rows, cols = st.cols;
  // Cursor of the group's first element: its row over all experts and its column.
  int64_t row = st.first_element / cols;
  int64_t col = st.first_element - row * cols;
  alignas(64) float staging[simd::kBatchGroups * kGroupSize];
  for (int64_t first = 0; first < groups; first += simd::kBatchGroups) {
    const int batch = int(std::min<int64_t>(simd::kBatchGroups, groups - first));
    const auto batch_io = io.begin_batch(first * kGroupSize, batch, staging);
    for (int b = 0; b < batch; ++b) {
      const int64_t base = (first + b) * kGroupSize;
      simd::GroupF params;
      const auto update = [&](int k, F row_coef, F col_coef) {
        const int64_t i = base + k * simd::kLanes;
        const F direction = Ops::mul(Ops::mul(batch_io.load_grad(i), row_coef), col_coef);
        params[k] = Ops::add(Ops::mul(batch_io.load_param(i), decay), Ops::mul(neg_lr, direction));
      };
      if (col + kGroupSize <= cols) {
        const F row_coef = Ops::splat(row_coefs[row]);
        const float* PO_RESTRICT col_coef = col_coefs + (row / rows) * cols + col;
        for (int k = 0; k < kVectors; ++k) {
          update(k, row_coef, Ops::load(col_coef + k * simd::kLanes));
        }
        col += kGroupSize;
        if (col == cols) {
          col = 0;
          ++row;
        }
      } else {
        alignas(64) float row_lanes[kGroupSize], col_lanes[kGroupSize];
        for (int t = 0; t < kGroupSize; ++t) {
          row_lanes[t] = row_coefs[row];
          col_lanes[t] = col_coefs[(row / rows) * cols + col];
          if (++col == cols) {
            col = 0;
            ++row;
          }
        }
        for (int k = 0; k < kVectors; ++k) {
          update(k, Ops::load(row_lanes + k * simd::kLanes),
                 Ops::load(col_lanes + k * simd::kLanes));
        }
      }
      batch_io.store_params(base, params);
    }
    io.end_batch(first * kGroupSize, batch, staging);
  }
}
#endif

template <class Io, bool kMomentum, bool kQuantized>
void factored_state(const ParamSpan& span, const SkewAdamFactoredStreams& st,
                    const SkewAdamScalars& s) {
  const Io io(span, st.residual);
  const int64_t n = span.count;
  int64_t start = 0;
#if defined(PO_SIMD_GROUPS)
  if constexpr (!kMomentum && simd::VectorParams<Io>::kAvailable) {
    const int64_t groups = n / kGroupSize;
    factored_groups(typename simd::VectorParams<Io>::Type(span, st.residual), groups, st, s);
    start = groups * kGroupSize;
  }
#endif
  // Cursor of the element at `base`: its row over all experts (expert * rows + row) and column.
  int64_t row = (st.first_element + start) / st.cols;
  int64_t col = (st.first_element + start) - row * st.cols;
  for (int64_t base = start; base < n; base += kGroupSize) {
    const int count = int(std::min<int64_t>(kGroupSize, n - base));
    float u[kGroupSize];
    for (int k = 0; k < count;) {
      const int run = int(std::min<int64_t>(count - k, st.cols - col));
      const float row_coef = st.row_coef[row];
      const float* PO_RESTRICT col_coef = st.col_coef + (row / st.rows) * st.cols + col;
      for (int t = 0; t < run; ++t) {
        u[k + t] = codec::skewadam_factored_direction(io.grad(base + k + t), row_coef, col_coef[t]);
      }
      k += run;
      col += run;
      if (col == st.cols) {
        col = 0;
        ++row;
      }
    }
    float local[kGroupSize];
    float* m = local;
    if constexpr (kMomentum) m = load_momentum<kQuantized>(st.m, base, count, local);
    for (int i = 0; i < count; ++i) {
      float p = io.param(base + i);
      codec::skewadam_factored_element<kMomentum>(p, u[i], m[i], s);
      io.store(base + i, p);
    }
    if constexpr (kMomentum) store_momentum<kQuantized>(st.m, base, count, m);
  }
}

template <class Io>
struct FactoredBody {
  static void run(const ParamSpan& span, const SkewAdamFactoredStreams& st,
                  const SkewAdamScalars& s) {
    if (!st.m.present()) return factored_state<Io, false, false>(span, st, s);
    if (st.m.quantized()) return factored_state<Io, true, true>(span, st, s);
    factored_state<Io, true, false>(span, st, s);
  }
};

void factored(const ParamSpan& span, const SkewAdamFactoredStreams& st,
              const SkewAdamScalars& s) {
  with_param_io<FactoredBody>(span, st.residual, span, st, s);
}

template <class Io, bool kMomentum, bool kQuantized>
void exact_state(const ParamSpan& span, const SkewAdamExactStreams& st,
                 const SkewAdamScalars& s) {
  const Io io(span, st.residual);
  float* PO_RESTRICT v = static_cast<float*>(st.v.values);
  const int64_t n = span.count;
  for (int64_t base = 0; base < n; base += kGroupSize) {
    const int count = int(std::min<int64_t>(kGroupSize, n - base));
    float local[kGroupSize];
    float* m = local;
    if constexpr (kMomentum) m = load_momentum<kQuantized>(st.m, base, count, local);
    for (int i = 0; i < count; ++i) {
      float p = io.param(base + i);
      codec::skewadam_exact_element<kMomentum>(p, io.grad(base + i), m[i], v[base + i], s);
      io.store(base + i, p);
    }
    if constexpr (kMomentum) store_momentum<kQuantized>(st.m, base, count, m);
  }
}

template <class Io>
struct ExactBody {
  static void run(const ParamSpan& span, const SkewAdamExactStreams& st,
                  const SkewAdamScalars& s) {
    if (!st.m.present()) return exact_state<Io, false, false>(span, st, s);
    if (st.m.quantized()) return exact_state<Io, true, true>(span, st, s);
    exact_state<Io, true, false>(span, st, s);
  }
};

void exact(const ParamSpan& span, const SkewAdamExactStreams& st, const SkewAdamScalars& s) {
  with_param_io<ExactBody>(span, st.residual, span, st, s);
}

}  // namespace

#define PO_SKEWADAM_STRINGIFY_INNER(x) #x
#define PO_SKEWADAM_STRINGIFY(x) PO_SKEWADAM_STRINGIFY_INNER(x)

// extern: a namespace-scope const has internal linkage otherwise, and the dispatch needs it.
extern const SkewAdamKernelTable kSkewAdamTable;
const SkewAdamKernelTable kSkewAdamTable = {PO_SKEWADAM_STRINGIFY(PO_CPU_ISA), &factor_statistics,
                                            &factored, &exact};

}  // namespace pagedoptim::kernels::PO_CPU_ISA
