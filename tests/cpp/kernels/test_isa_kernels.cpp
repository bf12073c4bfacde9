// Every ISA's step kernels against the baseline ISA's, byte for byte.
//
// The AVX2 and AVX-512 tables run hand-vectorized full groups (csrc/kernels/cpu/
// companded_groups.h) where the baseline runs the generic loops that the CUDA emulation and
// exactness suites compare with the CUDA kernels and reference.py; equal bytes here carry
// those contracts over. The inputs are built to reach every branch of the codec: groups of
// zeros, NaN and inf gradients, magnitudes at the fp16 scale's ends and across 1e6 inside a
// group, random codes under random, zero, NaN and saturated scales; partial groups and
// misaligned pointers; every element type, residual width and hyperparameter branch.
#include <gtest/gtest.h>
#include <xmmintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "emulation_util.h"
#include "isa_test_util.h"
#include "kernels/cpu/skewadam_kernels.h"
#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/update_rules.h"

namespace pagedoptim::kernels {
namespace {

// Every test below runs once per vector ISA (Isa/IsaKernels.*/avx2, .../avx512). An ISA this
// binary has no kernels for, or this CPU cannot run, is reported as skipped with the reason:
// passing would say its kernels were compared when they were not.
class IsaKernels : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { PO_SKIP_UNLESS_ISA_RUNS(GetParam()); }
  const CpuKernelTable& table() const { return *cpu_kernels_for_isa(GetParam()); }
  // Built wherever the step kernels are (SetUp skipped the test otherwise).
  const SkewAdamKernelTable& skewadam_table() const { return *skewadam_kernels_for_isa(GetParam()); }
};

enum class Optimizer { kAdamW, kSgd, kLion };

struct Case {
  Optimizer optimizer;
  ElementType type;
  int residual_bits;  // 0, 8 or 16 (16-bit params only)
  int state_bits;     // 8 or 32
  bool amsgrad = false;
  bool maximize = false;
  double beta1 = 0.9;  // below 0.5 takes lerp's other branch
  double weight_decay = 0.01;
  bool nesterov = false;
  int64_t count = 0;
  int misalign = 0;  // elements the param and grad pointers are moved by
  bool minus_128_codes = false;  // int8 codes of -128: never written, refused on load
  std::string name() const {
    return "optimizer " + std::to_string(int(optimizer)) + " type " + std::to_string(int(type)) +
           " residual " + std::to_string(residual_bits) + " state " + std::to_string(state_bits) +
           " amsgrad " + std::to_string(amsgrad) + " maximize " + std::to_string(maximize) +
           " beta1 " + std::to_string(beta1) + " nesterov " + std::to_string(nesterov) +
           " count " + std::to_string(count) + " misalign " + std::to_string(misalign);
  }
};

// One moment stream as bytes: fp32 values, or codes plus one fp16 scale per group.
struct Stream {
  std::vector<uint8_t> values;
  std::vector<uint16_t> scales;
  MomentStream view() {
    MomentStream s;
    s.values = values.data();
    s.scales = scales.empty() ? nullptr : scales.data();
    return s;
  }
  bool operator==(const Stream&) const = default;
};

struct State {
  std::vector<uint8_t> param, grad, residual;
  Stream m, v, v_max;
  bool operator==(const State&) const = default;
};

float special_value(std::mt19937& rng, int kind) {
  std::normal_distribution<float> normal;
  switch (kind) {
    case 0: return 0.0f;
    case 1: return std::numeric_limits<float>::quiet_NaN();
    case 2: return std::numeric_limits<float>::infinity();
    case 3: return normal(rng) * 1e30f;
    case 4: return normal(rng) * 1e-30f;
    case 5: return normal(rng) * (rng() % 2 ? 1e-6f : 1.0f);
    case 6: return -0.0f;
    case 7: return normal(rng) * 1e-39f;  // fp32 subnormals: moments below every fp16
    default: return normal(rng) * 3e4f;  // near the fp16 scale's top
  }
}

// 16-bit param patterns at the edges of their format: the smallest and largest subnormal,
// the smallest normal and the largest finite, then the specials 0, inf and NaN. The master
// join has a short form for groups of finite nonzero params only; groups of the first four
// reach its lower and upper edges, a group with one special among them its check, and groups
// of any edge the general join.
enum class Edges { kFiniteNonzero, kSpecial, kAny };

uint16_t edge_pattern(std::mt19937& rng, ElementType type, Edges edges) {
  constexpr uint16_t kBf16Edges[] = {0x0001, 0x007f, 0x0080, 0x7f7f, 0x0000, 0x7f80, 0x7fc0};
  constexpr uint16_t kFp16Edges[] = {0x0001, 0x03ff, 0x0400, 0x7bff, 0x0000, 0x7c00, 0x7e00};
  const uint16_t* patterns = type == ElementType::kBFloat16 ? kBf16Edges : kFp16Edges;
  const uint32_t pick = edges == Edges::kFiniteNonzero ? rng() % 4
                        : edges == Edges::kSpecial     ? 4 + rng() % 3
                                                       : rng() % 7;
  return uint16_t(patterns[pick] | (rng() % 2 ? 0x8000 : 0x0000));
}

State make_state(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t n = c.count;
  const int width = c.type == ElementType::kFloat32 ? 4 : 2;
  State st;
  st.param.resize(size_t((n + c.misalign) * width));
  st.grad.resize(st.param.size());
  const int64_t groups = (n + kGroupSize - 1) / kGroupSize;
  std::vector<int> group_kind(static_cast<size_t>(groups));
  for (auto& kind : group_kind) kind = rng() % 3 == 0 ? int(rng() % 11) : -1;
  for (int64_t i = 0; i < n; ++i) {
    const int kind = group_kind[size_t(i / kGroupSize)];
    float p = normal(rng);
    float g = normal(rng) * 1e-2f;
    // A special group has one special gradient (NaN, inf: the whole group turns NaN) or is
    // all special (zeros, huge, tiny, mixed magnitudes).
    if (kind == 1 || kind == 2) {
      if (i % kGroupSize == 7) g = special_value(rng, kind);
    } else if (kind == 9) {
      // Parameters at the top of bf16's range: with their residuals, masters on both sides
      // of 0x7f7f8000, the pattern from which bf16 rounding gives inf.
      p = (rng() % 2 ? 1.0f : -1.0f) * (rng() % 2 ? 3.3895314e38f : 3.3762342e38f);
    } else if (kind == 10) {
      // 16-bit params at their format's edges (below, after the parameter is stored).
    } else if (kind >= 0) {
      g = special_value(rng, kind);
      if (kind == 0) p = 0.0f;
    }
    test::store_element(st.param, c.type, i + c.misalign, p);
    test::store_element(st.grad, c.type, i + c.misalign, g);
    // Edge groups take turns: finite nonzero edges among ordinary params, the same with one
    // special in lane 5, or an edge in every lane.
    if (kind == 10 && width == 2) {
      const int64_t turn = (i / kGroupSize) % 3;
      const Edges edges = turn == 2 ? Edges::kAny
                          : turn == 1 && i % kGroupSize == 5 ? Edges::kSpecial
                                                              : Edges::kFiniteNonzero;
      if (edges != Edges::kFiniteNonzero || rng() % 2 == 0) {
        const uint16_t pattern = edge_pattern(rng, c.type, edges);
        std::memcpy(st.param.data() + 2 * (i + c.misalign), &pattern, 2);
      }
    }
  }
  if (c.residual_bits) {
    st.residual.resize(size_t(n * c.residual_bits / 8));
    for (auto& b : st.residual) b = uint8_t(rng());
    if (c.residual_bits == 8) {  // split never writes -128, load_state_dict refuses it
      for (auto& b : st.residual) b = b == 0x80 ? 0x81 : b;
    }
    // At the top of bf16's range, residuals near the largest push the masters to the
    // pattern that rounds to inf and just below it. Edge patterns get residuals at the
    // ends of [-K, K] (what load_state_dict admits), 0 and one step either side of it.
    for (int64_t i = 0; i < n; ++i) {
      const int kind = group_kind[size_t(i / kGroupSize)];
      if (kind != 9 && kind != 10) continue;
      const int32_t top = c.residual_bits == 8 ? 127 : 32767;
      const int32_t edge_residuals[] = {top, -top, 0, 1, -1};
      const int32_t r = kind == 9 ? top - int32_t(rng() % (c.residual_bits == 8 ? 4 : 64))
                                  : edge_residuals[rng() % 5];
      if (c.residual_bits == 8) {
        st.residual[size_t(i)] = uint8_t(int8_t(r));
      } else {
        const int16_t r16 = int16_t(r);
        std::memcpy(st.residual.data() + 2 * i, &r16, 2);
      }
    }
  }
  auto fill = [&](Stream& s, bool signed_codes) {
    if (c.state_bits == 32) {
      s.values.resize(size_t(n * 4));
      for (int64_t i = 0; i < n; ++i) {
        const float x = signed_codes ? normal(rng) * 1e-2f : std::fabs(normal(rng)) * 1e-4f;
        std::memcpy(s.values.data() + 4 * i, &x, 4);
      }
      return;
    }
    s.values.resize(size_t(n));
    for (auto& b : s.values) b = uint8_t(rng());
    if (signed_codes && !c.minus_128_codes) {
      for (auto& b : s.values) b = b == 0x80 ? 0x81 : b;  // codes are in [-127, 127]
    }
    s.scales.resize(size_t(groups));
    for (auto& scale : s.scales) {
      const uint32_t pick = rng() % 10;
      scale = pick == 0   ? uint16_t(0)
              : pick == 1 ? uint16_t(0x7e00)  // NaN
              : pick == 2 ? uint16_t(0x7bff)  // 65504
              : pick == 3 ? uint16_t(1)       // the smallest subnormal
                          : uint16_t(0x1000 + rng() % 0x3000);
    }
  };
  fill(st.m, true);
  if (c.optimizer == Optimizer::kAdamW) {
    fill(st.v, false);
    if (c.amsgrad) fill(st.v_max, false);
  }
  return st;
}

void run(const CpuKernelTable& table, const Case& c, State& st, int step) {
  const int width = c.type == ElementType::kFloat32 ? 4 : 2;
  const ParamSpan span{st.param.data() + c.misalign * width, st.grad.data() + c.misalign * width,
                       c.count, c.type};
  MasterResidual residual;
  residual.values = st.residual.empty() ? nullptr : st.residual.data();
  residual.bits = c.residual_bits;
  switch (c.optimizer) {
    case Optimizer::kAdamW: {
      AdamWStreams streams;
      streams.m = st.m.view();
      streams.v = st.v.view();
      if (c.amsgrad) streams.v_max = st.v_max.view();
      streams.residual = residual;
      table.adamw(span, streams,
                  codec::make_adamw_scalars(1e-3, c.beta1, 0.999, 1e-8, c.weight_decay, step,
                                            c.maximize));
      return;
    }
    case Optimizer::kSgd: {
      MomentumStreams streams;
      streams.m = st.m.view();
      streams.residual = residual;
      table.sgd(span, streams,
                codec::make_sgd_scalars(1e-2, 0.9, c.nesterov ? 0.0 : 0.1, c.weight_decay,
                                        c.nesterov, c.maximize, step == 1));
      return;
    }
    case Optimizer::kLion: {
      MomentumStreams streams;
      streams.m = st.m.view();
      streams.residual = residual;
      table.lion(span, streams,
                 codec::make_lion_scalars(1e-4, c.beta1, 0.99, c.weight_decay, c.maximize));
      return;
    }
  }
}

// `bytes` (elements of `width` bytes, floats of `type`) with every NaN replaced by one
// pattern. Which NaN comes out of an operation whose operands are both NaN is not part of
// the contract: IEEE 754 leaves it open (the result is one of them), x86 returns the first
// source operand, and compilers commute a vector + or * at will -- the same AVX2 source
// gave a master param +NaN in the plain build and -NaN under ASan (param + update, both
// NaN). Everything else is compared bit for bit, and a NaN still has to be a NaN.
std::vector<uint8_t> with_nans_as_one(std::vector<uint8_t> bytes, ElementType type) {
  const size_t width = type == ElementType::kFloat32 ? 4 : 2;
  for (size_t at = 0; at + width <= bytes.size(); at += width) {
    if (width == 4) {
      uint32_t bits;
      std::memcpy(&bits, bytes.data() + at, 4);
      if ((bits & 0x7fffffffu) > 0x7f800000u) bits = 0x7fc00000u;
      std::memcpy(bytes.data() + at, &bits, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + at, 2);
      const uint16_t inf = type == ElementType::kBFloat16 ? 0x7f80 : 0x7c00;
      if ((bits & 0x7fffu) > inf) bits = type == ElementType::kBFloat16 ? 0x7fc0 : 0x7e00;
      std::memcpy(bytes.data() + at, &bits, 2);
    }
  }
  return bytes;
}

// What the contract fixes of a state: every byte, NaNs aside (with_nans_as_one). Codes,
// scales and residuals are integers and compare as they are; fp32 moments are floats.
State comparable(State state, const Case& c) {
  state.param = with_nans_as_one(std::move(state.param), c.type);
  if (c.state_bits == 32) {
    for (Stream* stream : {&state.m, &state.v, &state.v_max}) {
      stream->values = with_nans_as_one(std::move(stream->values), ElementType::kFloat32);
    }
  }
  return state;
}

void expect_same_bits(const CpuKernelTable& table, const Case& c, uint32_t seed) {
  const CpuKernelTable* baseline = cpu_kernels_for_isa("baseline");
  ASSERT_NE(baseline, nullptr);
  State expected_state = make_state(c, seed);
  State actual_state = expected_state;
  for (int step = 1; step <= 3; ++step) {
    run(*baseline, c, expected_state, step);
    run(table, c, actual_state, step);
    const State expected = comparable(expected_state, c), actual = comparable(actual_state, c);
    ASSERT_EQ(actual.param, expected.param) << table.isa << " step " << step << " " << c.name();
    ASSERT_EQ(actual.residual, expected.residual) << table.isa << " step " << step << " " << c.name();
    ASSERT_EQ(actual.m, expected.m) << table.isa << " step " << step << " " << c.name();
    ASSERT_EQ(actual.v, expected.v) << table.isa << " step " << step << " " << c.name();
    ASSERT_EQ(actual.v_max, expected.v_max) << table.isa << " step " << step << " " << c.name();
  }
}

struct ParamForm {
  ElementType type;
  int residual_bits;
};
constexpr ParamForm kParamForms[] = {
    {ElementType::kFloat32, 0},  {ElementType::kBFloat16, 0}, {ElementType::kBFloat16, 8},
    {ElementType::kBFloat16, 16}, {ElementType::kFloat16, 0}, {ElementType::kFloat16, 8},
};
// 9000 elements are 281 groups: two full batches of AVX-512's 128 groups and a partial one.
constexpr int64_t kCounts[] = {1, 31, 32, 33, 96, 1000, 4099, 9000};

TEST(IsaMachine, RunsAVectorIsa) {
  // On x86 every CI machine has AVX2; without it every comparison below would be skipped.
#if defined(__x86_64__)
  EXPECT_TRUE(cpu_runs_isa("avx2"));
#endif
}

TEST_P(IsaKernels, AdamWMatchesTheBaselineByteForByte) {
  uint32_t seed = 1;
  for (const ParamForm form : kParamForms) {
    for (int state_bits : {8, 32}) {
      for (int64_t count : kCounts) {
        for (int variant = 0; variant < 4; ++variant) {
          Case c{Optimizer::kAdamW, form.type, form.residual_bits, state_bits};
          c.count = count;
          c.amsgrad = variant == 1;
          c.maximize = variant == 2;
          c.beta1 = variant == 3 ? 0.3 : 0.9;
          c.weight_decay = variant == 3 ? 0.0 : 0.01;
          c.misalign = count % 2 == 1 ? 1 : 0;
          expect_same_bits(table(), c, seed++);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST_P(IsaKernels, SgdAndLionMatchTheBaselineByteForByte) {
  uint32_t seed = 1000;
  for (const ParamForm form : kParamForms) {
    for (int state_bits : {8, 32}) {
      for (int64_t count : kCounts) {
        for (int variant = 0; variant < 3; ++variant) {
          for (Optimizer optimizer : {Optimizer::kSgd, Optimizer::kLion}) {
            Case c{optimizer, form.type, form.residual_bits, state_bits};
            c.count = count;
            c.nesterov = variant == 1;
            c.maximize = variant == 2;
            c.beta1 = variant == 2 ? 0.3 : 0.9;
            c.misalign = count % 2 == 1 ? 1 : 0;
            expect_same_bits(table(), c, seed++);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Many seeds of the shape the vector path serves most (full groups, bf16 with an 8-bit
// residual and fp32 params), so that rare roundings (a code or residual at a tie) are met.
TEST_P(IsaKernels, ManySeedsOfTheDefaultFormsMatch) {
  for (uint32_t seed = 0; seed < 40; ++seed) {
    for (const ParamForm form : {ParamForm{ElementType::kFloat32, 0},
                                 ParamForm{ElementType::kBFloat16, 8}}) {
      for (Optimizer optimizer : {Optimizer::kAdamW, Optimizer::kSgd, Optimizer::kLion}) {
        Case c{optimizer, form.type, form.residual_bits, 8};
        c.count = 64 * kGroupSize;
        expect_same_bits(table(), c, 5000 + seed);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A code of -128 is outside what encode writes and what load_state_dict accepts, but the
// kernels still decode it as the codec does (AVX-512 reads the decode from a 128-entry
// table, where -128 is a case of its own).
TEST_P(IsaKernels, CodeMinus128DecodesAsTheBaselineDoes) {
  for (const ParamForm form : {ParamForm{ElementType::kFloat32, 0},
                               ParamForm{ElementType::kBFloat16, 8}}) {
    for (Optimizer optimizer : {Optimizer::kAdamW, Optimizer::kSgd, Optimizer::kLion}) {
      Case c{optimizer, form.type, form.residual_bits, 8};
      c.count = 64 * kGroupSize;
      c.minus_128_codes = true;
      expect_same_bits(table(), c, 7000);
      if (HasFatalFailure()) return;
    }
  }
}

// SkewAdam's statistics: the running means, both coefficients and the per-column weighted
// sums the clip is computed from (left in col_scratch), for fp32 and bf16 gradients, row
// lengths with and without a tail, heavy-tailed rows (so that the clip acts) and zero rows.
TEST_P(IsaKernels, SkewAdamStatisticsMatchTheBaselineByteForByte) {
  const SkewAdamKernelTable* baseline = skewadam_kernels_for_isa("baseline");
  ASSERT_NE(baseline, nullptr);
  std::mt19937 rng(77);
  std::normal_distribution<float> normal;
  const SkewAdamKernelTable& table = skewadam_table();
  for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 16}, {5, 37}, {64, 256}, {17, 1000}}) {
      const int64_t n = rows * cols;
      std::vector<uint8_t> grad(size_t(n) * (type == ElementType::kFloat32 ? 4 : 2));
      struct Outputs {
        std::vector<float> row_means, col_means, row_coef, col_coef, scratch;
        bool operator==(const Outputs&) const = default;
      };
      const auto fresh = [&] {
        return Outputs{std::vector<float>(size_t(rows)), std::vector<float>(size_t(cols)),
                       std::vector<float>(size_t(rows)), std::vector<float>(size_t(cols)),
                       std::vector<float>(size_t(cols))};
      };
      Outputs expected = fresh(), actual = fresh();
      for (int step = 1; step <= 3; ++step) {
        for (int64_t i = 0; i < n; ++i) {
          const float heavy = std::pow(normal(rng), 3.0f);
          test::store_element(grad, type, i, (i / cols) % 7 == 3 ? 0.0f : heavy * 1e-3f);
        }
        const auto s = codec::make_skewadam_scalars(1e-3, 0.9, 0.999, 1e-30, 0.01, step);
        const auto run = [&](const SkewAdamKernelTable& table, Outputs& o) {
          table.factor_statistics(FactorStatistics{grad.data(), type, rows, cols, o.row_means.data(),
                                                   o.col_means.data(), o.row_coef.data(),
                                                   o.col_coef.data(), o.scratch.data()},
                                  s);
        };
        run(*baseline, expected);
        run(table, actual);
        ASSERT_EQ(actual, expected) << table.isa << " " << rows << "x" << cols << " type "
                                    << int(type) << " step " << step;
      }
    }
  }
}

// SkewAdam's factored update without momentum (the experts tier), whose full groups have a
// vector form: every param form with its residual, the special values of make_state, several
// experts (each with its column coefficients), rows shorter than a group, longer and not a
// multiple of it, and spans that start inside a row.
TEST_P(IsaKernels, SkewAdamFactoredUpdateMatchesTheBaselineByteForByte) {
  const SkewAdamKernelTable* baseline = skewadam_kernels_for_isa("baseline");
  ASSERT_NE(baseline, nullptr);
  std::mt19937 rng(91);
  std::uniform_real_distribution<float> coefficient(0.05f, 20.0f);
  uint32_t seed = 500;
  const SkewAdamKernelTable& table = skewadam_table();
  for (const ParamForm form : kParamForms) {
    for (auto [experts, rows, cols] : {std::tuple<int64_t, int64_t, int64_t>{1, 3, 16},
                                       {2, 5, 37}, {3, 4, 64}, {2, 3, 1000}}) {
      const int64_t total = experts * rows * cols;
      for (const int64_t first_element : {int64_t(0), int64_t(7), 2 * cols + 3}) {
        Case c{Optimizer::kAdamW, form.type, form.residual_bits, 8};
        c.count = total - first_element;
        std::vector<float> row_coef(size_t(experts * rows)), col_coef(size_t(experts * cols));
        for (float& x : row_coef) x = rng() % 9 == 0 ? 0.0f : coefficient(rng);
        for (float& x : col_coef) x = coefficient(rng);
        State expected_state = make_state(c, seed++);
        State actual_state = expected_state;
        const auto run = [&](const SkewAdamKernelTable& t, State& st, int step) {
          const ParamSpan span{st.param.data(), st.grad.data(), c.count, c.type};
          SkewAdamFactoredStreams streams;
          streams.residual.values = st.residual.empty() ? nullptr : st.residual.data();
          streams.residual.bits = c.residual_bits;
          streams.row_coef = row_coef.data();
          streams.col_coef = col_coef.data();
          streams.rows = rows;
          streams.cols = cols;
          streams.first_element = first_element;
          t.factored(span, streams,
                     codec::make_skewadam_scalars(1e-3, 0.9, 0.999, 1e-30, 0.01, step));
        };
        for (int step = 1; step <= 2; ++step) {
          run(*baseline, expected_state, step);
          run(table, actual_state, step);
          const State expected = comparable(expected_state, c);
          const State actual = comparable(actual_state, c);
          ASSERT_EQ(actual.param, expected.param)
              << table.isa << " " << experts << "x" << rows << "x" << cols << " from "
              << first_element << " step " << step << " " << c.name();
          ASSERT_EQ(actual.residual, expected.residual)
              << table.isa << " " << experts << "x" << rows << "x" << cols << " from "
              << first_element << " step " << step << " " << c.name();
        }
      }
    }
  }
}

// torch.set_flush_denormal(True) sets FTZ and DAZ for the process; the F16C conversions and
// the portable ones must still agree on the scales of groups of subnormal moments.
TEST_P(IsaKernels, FlushToZeroModeMatchesToo) {
  const unsigned int saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ | DAZ
  for (uint32_t seed = 0; seed < 10; ++seed) {
    for (const ParamForm form : kParamForms) {
      for (Optimizer optimizer : {Optimizer::kAdamW, Optimizer::kSgd, Optimizer::kLion}) {
        Case c{optimizer, form.type, form.residual_bits, 8};
        c.count = 16 * kGroupSize + 5;
        expect_same_bits(table(), c, 9000 + seed);
        if (HasFatalFailure()) break;
      }
    }
  }
  _mm_setcsr(saved);
}

INSTANTIATE_TEST_SUITE_P(Isa, IsaKernels, ::testing::Values("avx2", "avx512"),
                         ::pagedoptim::test::isa_param_name);

}  // namespace
}  // namespace pagedoptim::kernels
