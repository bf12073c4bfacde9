// SkewAdam's step driver, PagedState::step_skewadam (the math is codec/skewadam_rules.h).
//
// One call, two phases. Phase 1 reads each factored parameter's row and column running
// means out of their pages (a few KiB per matrix), runs the statistics kernel on every
// matrix in parallel (each needs its whole gradient: the row and column means, the mean of
// the row means and the update's RMS are reductions over it) and writes the means back.
// The coefficients it produces stay in memory for phase 2, the elementwise pass over the
// pages of the per-element state, cut into chunks like the other optimizers'. Parameters
// without per-element state (fp32 experts: factors only) are updated in phase 1 instead,
// each matrix straight after its statistics, while its gradient is in cache.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/skewadam_kernels.h"
#include "pagedoptim/optim/paged_state.h"

namespace pagedoptim::optim {
namespace {

constexpr char kFactorStream[] = "exp_avg_sq_factors";

int64_t bytes_per_element(kernels::ElementType type) {
  return type == kernels::ElementType::kFloat32 ? 4 : 2;
}

// Elements [first, first + count) of a parameter and its gradient.
kernels::ParamSpan sub_span(const kernels::ParamSpan& whole, int64_t first, int64_t count) {
  const int64_t offset = first * bytes_per_element(whole.type);
  return kernels::ParamSpan{static_cast<char*>(whole.param) + offset,
                            static_cast<const char*>(whole.grad) + offset, count, whole.type};
}

std::string describe(size_t index) { return "SkewAdam parameter " + std::to_string(index); }

}  // namespace

void PagedState::check_skewadam_params(const std::vector<SkewAdamParamStep>& params,
                                       const std::vector<SkewAdamGroup>& groups) const {
  for (size_t i = 0; i < params.size(); ++i) {
    const SkewAdamParamStep& p = params[i];
    const bool factored = p.factor_slot >= 0;
    if (factored) {
      if (p.experts <= 0 || p.rows <= 0 || p.cols <= 0 ||
          p.experts * p.rows * p.cols != p.step.span.count) {
        throw std::invalid_argument(describe(i) + ": factored shape [" +
                                    std::to_string(p.experts) + ", " + std::to_string(p.rows) +
                                    ", " + std::to_string(p.cols) + "] does not hold its " +
                                    std::to_string(p.step.span.count) + " elements");
      }
      if (p.factor_slot >= table_.num_params()) {
        throw std::out_of_range(describe(i) + ": factor slot " + std::to_string(p.factor_slot) +
                                " is not registered");
      }
      const paging::ParamLayout& layout = table_.param(p.factor_slot);
      if (kind_streams_[size_t(layout.kind)].factors < 0 ||
          layout.numel != p.experts * (p.rows + p.cols)) {
        throw std::invalid_argument(describe(i) + ": factor slot " +
                                    std::to_string(p.factor_slot) + " must hold " +
                                    std::to_string(p.experts * (p.rows + p.cols)) +
                                    " elements of exp_avg_sq_factors");
      }
    }
    if (p.step.slot < 0) {
      if (p.step.group < 0 || size_t(p.step.group) >= groups.size()) {
        throw std::out_of_range("group index " + std::to_string(p.step.group) + " out of range");
      }
      if (p.step.step == nullptr) throw std::invalid_argument("step counter must not be null");
      if (!factored || p.momentum) {
        throw std::invalid_argument(describe(i) + ": only a factored parameter without "
                                    "momentum can do without per-element state");
      }
      continue;
    }
    check_param(p.step, groups.size());
    const KindStreams& k = kind_streams_[size_t(table_.param(p.step.slot).kind)];
    if (p.momentum != (k.m.values >= 0)) {
      throw std::invalid_argument(describe(i) + ": momentum=" + std::to_string(p.momentum) +
                                  " does not match its state's exp_avg stream");
    }
    if (!factored && (k.v.values < 0 || k.v.scales >= 0)) {
      throw std::invalid_argument(describe(i) + ": an exact second moment needs an fp32 "
                                  "exp_avg_sq stream");
    }
  }

}

void PagedState::step_skewadam(const std::vector<SkewAdamParamStep>& params,
                               const std::vector<SkewAdamGroup>& groups,
                               const ParallelFor& parallel_for) {
  check_skewadam_params(params, groups);
  std::vector<ParamStep> steps;
  steps.reserve(params.size());
  for (const SkewAdamParamStep& p : params) steps.push_back(p.step);
  // A resumed step finds its counters advanced already.
  const bool resuming = begin_step(StepCall::kSkewAdam, steps);
  std::vector<codec::SkewAdamScalars> scalars;
  scalars.reserve(params.size());
  for (const SkewAdamParamStep& p : params) {
    const SkewAdamGroup& g = groups[size_t(p.step.group)];
    if (!resuming) *p.step.step += 1.0f;
    scalars.push_back(codec::make_skewadam_scalars(g.lr, g.beta1, g.beta2, g.eps,
                                                   g.weight_decay, (long long)(*p.step.step)));
  }
  const kernels::SkewAdamKernelTable& kernel = kernels::skewadam_cpu_kernels();

  // What the factored kernel gets for elements from `first` of parameter i, whose
  // coefficients are at `coef`.
  auto factored_streams = [&](size_t i, const float* coef, kernels::MomentStream m,
                              kernels::MasterResidual residual, int64_t first) {
    const SkewAdamParamStep& p = params[i];
    return kernels::SkewAdamFactoredStreams{m,      residual, coef, coef + p.experts * p.rows,
                                            p.rows, p.cols,   first};
  };

  // Phase 1. factors[i] and coefficients[i] are laid out alike: [experts * rows] row
  // values, then [experts * cols] column values. They stay in the journal until the step
  // is done: the new means reach their pages only after phase 2, so every step that raises
  // before that leaves the old means in the pages and the new ones here.
  //
  // A parameter without per-element state (fp32 experts: factors only) gets its update here
  // too, matrix by matrix right after the matrix's statistics: its gradient (1 MiB for an
  // expert of 1024 x 256) is then still in cache, where phase 2 would read it from memory a
  // second time. Nothing between the first update and the move of the factors into the
  // journal raises, so a resumed step that finds the factors journaled finds these updates
  // done, and one that does not finds none of them.
  std::vector<std::vector<float>>& factors = journal_->factors;
  std::vector<std::vector<float>>& coefficients = journal_->coefficients;
  if (factors.empty()) {
    struct Matrix {
      size_t param;
      int64_t expert;
    };
    std::vector<std::vector<float>> new_factors(params.size());
    std::vector<std::vector<float>> new_coefficients(params.size());
    std::vector<std::vector<float>> scratch(params.size());  // [experts * cols]
    std::vector<Matrix> matrices;
    for (size_t i = 0; i < params.size(); ++i) {
      const SkewAdamParamStep& p = params[i];
      if (p.factor_slot < 0) continue;
      new_factors[i].resize(size_t(p.experts * (p.rows + p.cols)));
      new_coefficients[i].resize(new_factors[i].size());
      scratch[i].resize(size_t(p.experts * p.cols));
      read_stream(p.factor_slot, kFactorStream, new_factors[i].data());
      for (int64_t e = 0; e < p.experts; ++e) matrices.push_back(Matrix{i, e});
    }
    parallel_for(int64_t(matrices.size()), [&](int64_t first, int64_t last) {
      for (int64_t m = first; m < last; ++m) {
        const Matrix& matrix = matrices[size_t(m)];
        const SkewAdamParamStep& p = params[matrix.param];
        const int64_t all_rows = p.experts * p.rows;
        const int64_t first_element = matrix.expert * p.rows * p.cols;
        float* state = new_factors[matrix.param].data();
        float* coef = new_coefficients[matrix.param].data();
        const kernels::FactorStatistics f{
            static_cast<const char*>(p.step.span.grad) +
                first_element * bytes_per_element(p.step.span.type),
            p.step.span.type,
            p.rows,
            p.cols,
            state + matrix.expert * p.rows,
            state + all_rows + matrix.expert * p.cols,
            coef + matrix.expert * p.rows,
            coef + all_rows + matrix.expert * p.cols,
            scratch[matrix.param].data() + matrix.expert * p.cols};
        kernel.factor_statistics(f, scalars[matrix.param]);
        if (p.step.slot < 0) {
          kernel.factored(sub_span(p.step.span, first_element, p.rows * p.cols),
                          factored_streams(matrix.param, coef, kernels::MomentStream{},
                                           kernels::MasterResidual{}, first_element),
                          scalars[matrix.param]);
        }
      }
    });
    factors = std::move(new_factors);
    coefficients = std::move(new_coefficients);
  }

  // Phase 2: the pages of the parameters with per-element state.
  std::vector<ParamStep> paged;
  std::vector<size_t> paged_index;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].step.slot >= 0) {
      paged.push_back(params[i].step);
      paged_index.push_back(i);
    }
  }
  if (!paged.empty()) {
    for_each_chunk_of(
        paged, parallel_for,
        [&](size_t q, const paging::Segment& segment, std::byte* page, int64_t begin,
            int64_t count) {
          const size_t i = paged_index[q];
          const SkewAdamParamStep& p = params[i];
          const int kind = table_.param(p.step.slot).kind;
          const KindStreams& k = kind_streams_[size_t(kind)];
          const int64_t first = segment.param_offset + begin;
          const kernels::ParamSpan span = sub_span(p.step.span, first, count);
          const kernels::MasterResidual residual = residual_ptr(kind, page, segment, begin);
          kernels::MomentStream m;
          if (p.momentum) m = moment_ptr(kind, k.m, page, segment, begin);
          if (p.factor_slot >= 0) {
            kernel.factored(span, factored_streams(i, coefficients[i].data(), m, residual, first),
                            scalars[i]);
          } else {
            const kernels::MomentStream v{stream_ptr(kind, k.v.values, page, segment, begin),
                                          nullptr};
            kernel.exact(span, kernels::SkewAdamExactStreams{m, v, residual}, scalars[i]);
          }
        });
  }

  // The new running means, parameter by parameter; one whose write raised is written again
  // whole by the resumed step (the same bytes).
  size_t factored = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].factor_slot < 0) continue;
    if (factored++ < journal_->factors_written) continue;
    write_stream(params[i].factor_slot, kFactorStream, factors[i].data());
    ++journal_->factors_written;
  }
  finish_step();
}

}  // namespace pagedoptim::optim
