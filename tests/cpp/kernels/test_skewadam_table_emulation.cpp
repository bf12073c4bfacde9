// SkewAdam's table kernels (statistics and elementwise), emulated on the host, against its
// CPU kernels: one PagedState stepped through the CPU driver and one through the table
// driver hold the same bytes after every step (params, momentum, exact second moments,
// factor streams, residuals, step counters) for every tier form, param dtype, momentum
// format and residual width. The factored shapes include rows shorter than 16 columns and
// a factor stream that spans two pages.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "emulation_util.h"
#include "device/testing/host_table_runner.h"
#include "pagedoptim/optim/paged_state.h"

namespace pagedoptim::optim {
namespace {

using kernels::ElementType;
using kernels::test::add_moment;
using kernels::emulation::HostTableRunner;
using kernels::test::load_element;
using kernels::test::store_element;

const ParallelFor kSerial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  body(0, n);
};

constexpr char kFactors[] = "exp_avg_sq_factors";

struct Config {
  ElementType type = ElementType::kFloat32;
  int residual_bits = 0;
  int state_bits = 8;

  std::string name() const {
    const char* types[] = {"fp32", "bf16", "fp16"};
    return std::string(types[int(type)]) + "/residual" + std::to_string(residual_bits) +
           "/state" + std::to_string(state_bits);
  }
};

// Kinds: 0 factored with momentum, 1 factored without (the residual alone, or nothing),
// 2 exact with momentum, 3 exact without, 4 the factors; +5 for the same with a residual.
enum Kind { kFactoredMomentum, kFactoredOnly, kExactMomentum, kExactOnly, kFactorStream };
constexpr int kResidualOffset = 5;

std::vector<std::vector<paging::StreamSpec>> kinds_of(const Config& c) {
  std::vector<std::vector<paging::StreamSpec>> kinds(2 * kResidualOffset);
  for (int r = 0; r < 2; ++r) {
    auto& factored_m = kinds[size_t(r * kResidualOffset + kFactoredMomentum)];
    auto& exact_m = kinds[size_t(r * kResidualOffset + kExactMomentum)];
    auto& exact = kinds[size_t(r * kResidualOffset + kExactOnly)];
    add_moment(factored_m, "exp_avg", c.state_bits);
    add_moment(exact_m, "exp_avg", c.state_bits);
    exact_m.push_back({"exp_avg_sq", 4 * kGroupSize});
    exact.push_back({"exp_avg_sq", 4 * kGroupSize});
    if (r == 1 && c.residual_bits != 0) {
      for (int k : {kFactoredMomentum, kFactoredOnly, kExactMomentum, kExactOnly}) {
        kinds[size_t(kResidualOffset + k)].push_back(
            {"master_residual", int64_t(c.residual_bits / 8) * kGroupSize});
      }
    }
  }
  kinds[kFactorStream].push_back({kFactors, 4 * kGroupSize});
  return kinds;
}

struct Param {
  int64_t experts, rows, cols;
  bool factored, momentum;
  ElementType type = ElementType::kFloat32;
  std::vector<uint8_t> values, grad;
  int kind = -1;
  int32_t slot = -1, factor_slot = -1;
  float step = 0.0f;

  int64_t numel() const { return experts * rows * cols; }
};

std::vector<Param> make_params(const Config& c, PagedState& state, uint32_t seed) {
  std::vector<Param> params = {
      {1, 70, 50, true, true},    // spans pages
      {3, 9, 21, true, false},    // experts: factors only (or a residual)
      {1, 1, 37, false, true},    // a 1-D backbone param: exact with momentum
      {1, 1, 100, false, false},  // a router-like param: exact without momentum
      {1, 4, 1100, true, true},   // a factor stream that spans two pages; a 12-column tail
      {2, 5, 13, true, false},
  };
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    p.type = i % 2 == 0 ? c.type : ElementType::kFloat32;
    const bool residual = p.type != ElementType::kFloat32 && c.residual_bits != 0;
    const int form = p.factored ? (p.momentum ? kFactoredMomentum : kFactoredOnly)
                                : (p.momentum ? kExactMomentum : kExactOnly);
    p.kind = form + (residual ? kResidualOffset : 0);
    const size_t width = p.type == ElementType::kFloat32 ? 4 : 2;
    p.values.resize(size_t(p.numel()) * width);
    p.grad.resize(size_t(p.numel()) * width);
    for (int64_t e = 0; e < p.numel(); ++e) store_element(p.values, p.type, e, normal(rng));
    if (!kinds_of(c)[size_t(p.kind)].empty()) p.slot = state.register_param(p.numel(), p.kind);
    if (p.factored) {
      p.factor_slot = state.register_param(p.experts * (p.rows + p.cols), kFactorStream);
    }
  }
  return params;
}

// Columns 100x apart in scale and every 7th row zero, as the CPU statistics tests use.
void new_gradients(std::vector<Param>& params, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (Param& p : params) {
    for (int64_t e = 0; e < p.numel(); ++e) {
      const int64_t row = e / p.cols;
      const float scale = (e % p.cols) % 3 == 0 ? 1.0f : 1e-2f;
      store_element(p.grad, p.type, e, row % 7 == 3 ? 0.0f : normal(rng) * scale);
    }
  }
}

void step(PagedState& state, std::vector<Param>& params, TableRunner* runner) {
  std::vector<SkewAdamParamStep> steps;
  for (Param& p : params) {
    steps.push_back(SkewAdamParamStep{
        ParamStep{p.slot, kernels::ParamSpan{p.values.data(), p.grad.data(), p.numel(), p.type},
                  int32_t(p.factored ? 0 : 1), &p.step},
        p.factor_slot, p.experts, p.rows, p.cols, p.momentum});
  }
  const std::vector<SkewAdamGroup> groups = {{1e-2, 0.9, 0.999, 1e-30, 0.1},
                                             {3e-3, 0.8, 0.99, 1e-16, 0.0}};
  runner ? state.step_skewadam(steps, groups, *runner)
         : state.step_skewadam(steps, groups, kSerial);
}

void expect_same(const Config& c, PagedState& cpu, PagedState& table,
                 const std::vector<Param>& a, const std::vector<Param>& b, const std::string& where) {
  const auto kinds = kinds_of(c);
  auto same_stream = [&](int32_t slot_a, int32_t slot_b, const std::string& name,
                         const std::string& at) {
    const int64_t bytes = cpu.stream_bytes(slot_a, name);
    std::vector<uint8_t> x(static_cast<size_t>(bytes)), y(static_cast<size_t>(bytes));
    cpu.read_stream(slot_a, name, x.data());
    table.read_stream(slot_b, name, y.data());
    ASSERT_EQ(x, y) << at << " stream " << name;
  };
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string at = where + " param " + std::to_string(i);
    ASSERT_EQ(a[i].step, b[i].step) << at;
    kernels::test::expect_same_elements(a[i].values, b[i].values, a[i].type, a[i].numel(), at);
    if (a[i].slot >= 0) {
      for (const paging::StreamSpec& spec : kinds[size_t(a[i].kind)]) {
        same_stream(a[i].slot, b[i].slot, spec.name, at);
      }
    }
    if (a[i].factor_slot >= 0) same_stream(a[i].factor_slot, b[i].factor_slot, kFactors, at);
  }
}

void check_config(const Config& c) {
  SCOPED_TRACE(c.name());
  constexpr int64_t kPageBytes = 4096;
  PagedState cpu(OptimizerKind::kSkewAdam, kinds_of(c),
                 std::make_unique<paging::HostPageStore>(kPageBytes));
  PagedState table(OptimizerKind::kSkewAdam, kinds_of(c),
                   std::make_unique<paging::HostPageStore>(kPageBytes));
  std::vector<Param> a = make_params(c, cpu, 3);
  std::vector<Param> b = make_params(c, table, 3);
  for (int s = 0; s < 3; ++s) {
    new_gradients(a, 40 + s);
    new_gradients(b, 40 + s);
    HostTableRunner runner;
    step(cpu, a, nullptr);
    step(table, b, &runner);
    expect_same(c, cpu, table, a, b, "step " + std::to_string(s));
  }
}

TEST(SkewAdamTableEmulation, EveryFormMatchesTheCpuKernelsByteForByte) {
  for (ElementType type :
       {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    for (int residual : {0, 8, 16}) {
      if (type == ElementType::kFloat32 && residual != 0) continue;
      for (int bits : {32, 8}) check_config(Config{type, residual, bits});
    }
  }
}

TEST(SkewAdamTableEmulation, StatisticsRunAsFourLaunchesForAllMatrices) {
  Config c;
  PagedState state(OptimizerKind::kSkewAdam, kinds_of(c),
                   std::make_unique<paging::HostPageStore>(4096));
  std::vector<Param> params = make_params(c, state, 8);
  new_gradients(params, 9);
  HostTableRunner runner;
  step(state, params, &runner);
  // 4 statistics launches for the 8 matrices of 4 factored params, then one elementwise
  // launch per variant: factored +momentum (8-bit), factored without (unpaged), exact
  // +momentum, exact without.
  EXPECT_EQ(runner.launches(), 4 + 4);
}

}  // namespace
}  // namespace pagedoptim::optim
