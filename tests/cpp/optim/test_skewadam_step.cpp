// SkewAdam's statistics kernel and step driver against a scalar reference that sums in
// double: the per-ISA kernels (baseline and the one chosen here), a factored parameter that
// spans several pages (segments start mid-row), an [E, rows, cols] expert tensor with no
// per-element state, and an exact 1-D parameter, in one call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "isa_test_util.h"
#include "kernels/cpu/skewadam_kernels.h"
#include "pagedoptim/optim/paged_state.h"

namespace pagedoptim::optim {
namespace {

const ParallelFor kSerial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  body(0, n);
};

constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-30, kWd = 0.1;

// Reference of one matrix: updates row/col means, returns the clipped directions u.
std::vector<double> reference_directions(const float* grad, int64_t rows, int64_t cols,
                                         std::vector<double>& row, std::vector<double>& col,
                                         long step) {
  const double bc2 = 1.0 - std::pow(kBeta2, double(step));
  double row_sum = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    double sum = 0.0;
    for (int64_t j = 0; j < cols; ++j) sum += double(grad[i * cols + j]) * grad[i * cols + j] + kEps;
    row[size_t(i)] = kBeta2 * row[size_t(i)] + (1 - kBeta2) * sum / double(cols);
    row_sum += row[size_t(i)];
  }
  for (int64_t j = 0; j < cols; ++j) {
    double sum = 0.0;
    for (int64_t i = 0; i < rows; ++i) sum += double(grad[i * cols + j]) * grad[i * cols + j] + kEps;
    col[size_t(j)] = kBeta2 * col[size_t(j)] + (1 - kBeta2) * sum / double(rows);
  }
  const double norm = row_sum / double(rows) * bc2;
  std::vector<double> u(size_t(rows * cols));
  double squares = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      u[size_t(i * cols + j)] = grad[i * cols + j] / std::sqrt(row[size_t(i)] * col[size_t(j)] / norm);
      squares += u[size_t(i * cols + j)] * u[size_t(i * cols + j)];
    }
  }
  const double rms = std::sqrt(squares / double(rows * cols));
  if (rms > 1.0) {
    for (double& x : u) x /= rms;
  }
  return u;
}

std::vector<float> random_grad(int64_t n, std::mt19937& rng, int64_t cols) {
  std::normal_distribution<float> normal;
  std::vector<float> g(static_cast<size_t>(n));
  // Columns 100x apart in scale, and every 7th row all zero.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = i / cols;
    g[size_t(i)] = row % 7 == 3 ? 0.0f : normal(rng) * std::pow(10.0f, -2.0f * float(i % cols) / float(cols));
  }
  return g;
}

// Once per ISA; one this CPU cannot run is reported as skipped.
class SkewAdamKernels : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { PO_SKIP_UNLESS_ISA_RUNS(GetParam()); }
};

TEST_P(SkewAdamKernels, StatisticsMatchDoubleReference) {
  const char* isa = GetParam();
  const kernels::SkewAdamKernelTable* table = kernels::skewadam_kernels_for_isa(isa);
  std::mt19937 rng(5);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {5, 13}, {33, 47}, {64, 16}}) {
    std::vector<float> row(size_t(rows), 0.0f), col(size_t(cols), 0.0f);
    std::vector<double> ref_row(size_t(rows), 0.0), ref_col(size_t(cols), 0.0);
    std::vector<float> row_coef(static_cast<size_t>(rows)), col_coef(static_cast<size_t>(cols));
    std::vector<float> scratch(static_cast<size_t>(cols));
    for (long step = 1; step <= 3; ++step) {
      const std::vector<float> grad = random_grad(rows * cols, rng, cols);
      const codec::SkewAdamScalars s =
          codec::make_skewadam_scalars(kLr, kBeta1, kBeta2, kEps, kWd, step);
      table->factor_statistics(kernels::FactorStatistics{grad.data(), kernels::ElementType::kFloat32,
                                                         rows, cols, row.data(), col.data(),
                                                         row_coef.data(), col_coef.data(),
                                                         scratch.data()},
                               s);
      const std::vector<double> u = reference_directions(grad.data(), rows, cols, ref_row,
                                                         ref_col, step);
      for (int64_t i = 0; i < rows; ++i) {
        EXPECT_NEAR(row[size_t(i)], ref_row[size_t(i)], 1e-5 * ref_row[size_t(i)]) << isa;
        for (int64_t j = 0; j < cols; ++j) {
          const double ours = double(grad[size_t(i * cols + j)]) * row_coef[size_t(i)] *
                              col_coef[size_t(j)];
          EXPECT_NEAR(ours, u[size_t(i * cols + j)], 1e-5) << isa << " " << rows << "x" << cols;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, SkewAdamKernels, ::testing::Values("baseline", "avx2", "avx512"),
                         ::pagedoptim::test::isa_param_name);

TEST(SkewAdamStep, DriverMatchesReferenceAcrossPagesAndTiers) {
  // Kinds: 0 fp32 momentum (factored backbone), 1 none (fp32 experts), 2 fp32 momentum +
  // exact v (1-D backbone), 3 the factors.
  std::vector<std::vector<paging::StreamSpec>> kinds = {
      {{"exp_avg", 128}}, {}, {{"exp_avg", 128}, {"exp_avg_sq", 128}},
      {{"exp_avg_sq_factors", 128}}};
  PagedState state(OptimizerKind::kSkewAdam, kinds,
                   std::make_unique<paging::HostPageStore>(4096));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;

  struct Param {
    int64_t experts, rows, cols;
    bool factored, momentum;
    std::vector<float> value, m, v;
    std::vector<std::vector<double>> row, col;  // per expert
    int32_t slot = -1, factor_slot = -1;
    float step = 0.0f;
  };
  std::vector<Param> params = {
      {1, 70, 50, true, true, {}, {}, {}, {}, {}},  // 3500 elements: 4 pages of 1024
      {3, 9, 21, true, false, {}, {}, {}, {}, {}},
      {1, 1, 37, false, true, {}, {}, {}, {}, {}},
  };
  for (Param& p : params) {
    const int64_t n = p.experts * p.rows * p.cols;
    for (int64_t i = 0; i < n; ++i) p.value.push_back(normal(rng));
    p.m.assign(size_t(n), 0.0f);
    p.v.assign(size_t(n), 0.0f);
    p.row.assign(size_t(p.experts), std::vector<double>(size_t(p.rows), 0.0));
    p.col.assign(size_t(p.experts), std::vector<double>(size_t(p.cols), 0.0));
    if (p.momentum) p.slot = state.register_param(n, p.factored ? 0 : 2);
    if (p.factored) p.factor_slot = state.register_param(p.experts * (p.rows + p.cols), 3);
  }
  std::vector<Param> ours = params;
  const std::vector<SkewAdamGroup> groups = {{kLr, kBeta1, kBeta2, kEps, kWd}};
  for (long step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> grads;
    std::vector<SkewAdamParamStep> steps;
    for (Param& p : ours) {
      grads.push_back(random_grad(int64_t(p.value.size()), rng, p.cols));
      steps.push_back(SkewAdamParamStep{
          ParamStep{p.slot,
                    kernels::ParamSpan{p.value.data(), grads.back().data(), int64_t(p.value.size()),
                                       kernels::ElementType::kFloat32},
                    0, &p.step},
          p.factor_slot, p.experts, p.rows, p.cols, p.momentum});
    }
    state.step_skewadam(steps, groups, kSerial);

    const double bc1 = 1.0 - std::pow(kBeta1, double(step));
    const double bc2 = 1.0 - std::pow(kBeta2, double(step));
    for (size_t q = 0; q < params.size(); ++q) {
      Param& p = params[q];
      const std::vector<float>& g = grads[q];
      std::vector<double> u(p.value.size());
      if (p.factored) {
        const int64_t matrix = p.rows * p.cols;
        for (int64_t e = 0; e < p.experts; ++e) {
          const std::vector<double> ue = reference_directions(
              g.data() + e * matrix, p.rows, p.cols, p.row[size_t(e)], p.col[size_t(e)], step);
          std::copy(ue.begin(), ue.end(), u.begin() + e * matrix);
        }
      }
      for (size_t i = 0; i < p.value.size(); ++i) {
        double w = double(p.value[i]) * (1.0 - kLr * kWd);
        if (p.factored) {
          if (p.momentum) {
            p.m[i] = float(kBeta1 * p.m[i] + (1 - kBeta1) * u[i]);
            w -= kLr / bc1 * p.m[i];
          } else {
            w -= kLr * u[i];
          }
        } else {
          p.v[i] = float(kBeta2 * p.v[i] + (1 - kBeta2) * (double(g[i]) * g[i] + kEps));
          p.m[i] = float(kBeta1 * p.m[i] + (1 - kBeta1) * g[i]);
          w -= kLr / bc1 * p.m[i] / std::sqrt(p.v[i] / bc2);
        }
        p.value[i] = float(w);
      }
    }
  }
  for (size_t q = 0; q < params.size(); ++q) {
    EXPECT_EQ(ours[q].step, 3.0f);
    for (size_t i = 0; i < params[q].value.size(); ++i) {
      EXPECT_NEAR(ours[q].value[i], params[q].value[i], 1e-5) << "param " << q << " element " << i;
    }
    if (params[q].factored) {
      std::vector<float> factors(size_t(params[q].experts * (params[q].rows + params[q].cols)));
      state.read_stream(ours[q].factor_slot, "exp_avg_sq_factors", factors.data());
      const int64_t rows = params[q].rows;
      EXPECT_NEAR(factors[1], params[q].row[0][1], 1e-5 * params[q].row[0][1]);
      EXPECT_NEAR(factors[size_t(params[q].experts * rows)], params[q].col[0][0],
                  1e-5 * params[q].col[0][0]);
    }
  }
}

TEST(SkewAdamStep, RejectsInconsistentLayouts) {
  std::vector<std::vector<paging::StreamSpec>> kinds = {{{"exp_avg_sq_factors", 128}}};
  PagedState state(OptimizerKind::kSkewAdam, kinds, std::make_unique<paging::HostPageStore>(4096));
  const int32_t factor_slot = state.register_param(2 * (3 + 4));
  std::vector<float> value(24), grad(24);
  float step = 0.0f;
  const std::vector<SkewAdamGroup> groups = {{kLr, kBeta1, kBeta2, kEps, kWd}};
  auto call = [&](int64_t experts, int64_t rows, int64_t cols, bool momentum) {
    state.step_skewadam(
        {SkewAdamParamStep{ParamStep{-1,
                                     kernels::ParamSpan{value.data(), grad.data(), 24,
                                                        kernels::ElementType::kFloat32},
                                     0, &step},
                           factor_slot, experts, rows, cols, momentum}},
        groups, kSerial);
  };
  EXPECT_THROW(call(2, 3, 5, false), std::invalid_argument);  // shape does not hold 24
  EXPECT_THROW(call(1, 4, 6, false), std::invalid_argument);  // factor slot of another size
  EXPECT_THROW(call(2, 3, 4, true), std::invalid_argument);   // momentum needs a slot
  EXPECT_NO_THROW(call(2, 3, 4, false));
  EXPECT_EQ(step, 1.0f);
}

}  // namespace
}  // namespace pagedoptim::optim
