// Master-weight split (master_split.h): bf16 / fp16 parameter + int8 / int16 residual.
// The reconstruction error is checked against u / (4K), where u is the spacing of the 16-bit
// grid between w' and its neighbour on the side of w, computed here independently from the
// format's definition, plus one fp32 ulp for computing the rebuilt value in fp32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/master_split.h"

namespace pagedoptim::codec {
namespace {

struct Bf16 {
  static constexpr int kMantissaBits = 7;
  static constexpr int kMinExponent = -133;  // exponent of the subnormal spacing
  static uint16_t round(float f) { return float_to_bf16(f); }
  static float value(uint16_t h) { return bf16_to_float(h); }
  template <typename R>
  static void split(float w, uint16_t& p, R& r) { split_master_bf16(w, p, r); }
  template <typename R>
  static float join(uint16_t p, R r) { return join_master_bf16(p, r); }
};

struct Fp16 {
  static constexpr int kMantissaBits = 10;
  static constexpr int kMinExponent = -24;
  static uint16_t round(float f) { return float_to_fp16(f); }
  static float value(uint16_t h) { return fp16_to_float(h); }
  template <typename R>
  static void split(float w, uint16_t& p, R& r) { split_master_fp16(w, p, r); }
  template <typename R>
  static float join(uint16_t p, R r) { return join_master_fp16(p, r); }
};

// Magnitude of a 16-bit pattern from the format's definition, extended past the largest finite
// value (the all-ones exponent read as one more binade) so the last finite value has a
// neighbour to measure the spacing against.
template <typename Format>
double magnitude_of(uint32_t magnitude_pattern) {
  constexpr int m = Format::kMantissaBits;
  const int exponent = int(magnitude_pattern >> m);
  const int mantissa = int(magnitude_pattern & ((1u << m) - 1));
  return exponent == 0
             ? std::ldexp(double(mantissa), Format::kMinExponent)
             : std::ldexp(double((1 << m) + mantissa), Format::kMinExponent - 1 + exponent);
}

// Spacing between w' (pattern p) and its neighbour on the side of w.
template <typename Format>
double side_spacing(uint16_t p, float w) {
  const uint32_t magnitude = p & 0x7fffu;
  const double rounded = magnitude_of<Format>(magnitude);
  // w == w' (or w' = 0) measures against the neighbour above; the residual is then 0 anyway.
  const bool larger_magnitude = std::fabs(double(w)) >= rounded || magnitude == 0;
  const uint32_t neighbour = larger_magnitude ? magnitude + 1 : magnitude - 1;
  return std::fabs(magnitude_of<Format>(neighbour) - rounded);
}

double fp32_ulp(double magnitude) {
  const float f = float(std::fabs(magnitude));
  return double(std::nextafter(f, INFINITY)) - double(f);
}

bool is_finite_pattern(uint16_t p, bool bf16) {
  return bf16 ? (p & 0x7f80u) != 0x7f80u : (p & 0x7c00u) != 0x7c00u;
}

template <typename Format, typename Residual>
void check_split(float w, bool bf16) {
  constexpr double kScale = ResidualTraits<Residual>::kScale;
  uint16_t p;
  Residual r;
  Format::split(w, p, r);
  const float rebuilt = Format::join(p, r);
  ASSERT_EQ(p, Format::round(w)) << "parameter must be round-to-nearest-even of " << w;
  if (!is_finite_pattern(p, bf16)) {
    ASSERT_EQ(r, 0) << w;
    ASSERT_EQ(float_to_bits(rebuilt), float_to_bits(Format::value(p))) << w;
    return;
  }
  ASSERT_LE(std::abs(int(r)), int(kScale));
  const double difference = double(w) - double(Format::value(p));
  ASSERT_TRUE(r == 0 || (r > 0) == (difference > 0)) << w;  // r points from w' towards w
  const double error = std::fabs(double(rebuilt) - double(w));
  const double bound = side_spacing<Format>(p, w) / (4 * kScale) +
                       fp32_ulp(std::max(std::fabs(double(w)), std::fabs(double(rebuilt))));
  ASSERT_LE(error, bound) << "w " << w << " p " << std::hex << p << std::dec
                                       << " r " << int(r) << " rebuilt " << rebuilt;
}

// Inputs where a split goes wrong if it is going to: random patterns of every exponent, values
// a few fp32 steps either side of powers of two, of rounding midpoints and of the largest
// finite value, subnormals, and zeros.
std::vector<float> hard_inputs(bool bf16, uint32_t seed) {
  std::vector<float> out;
  std::mt19937 rng(seed);
  const int min_exponent = bf16 ? -133 : -25;
  const int max_exponent = bf16 ? 127 : 16;
  const int mantissa_drop = bf16 ? 16 : 13;  // fp32 bits below the 16-bit format's mantissa
  for (int i = 0; i < 300000; ++i) {
    const int exponent = std::uniform_int_distribution<int>(min_exponent - 4, max_exponent)(rng);
    const float mantissa = std::uniform_real_distribution<float>(1.0f, 2.0f)(rng);
    const float magnitude = std::ldexp(mantissa, exponent);
    out.push_back((rng() & 1u) ? -magnitude : magnitude);
  }
  if (bf16) {
    for (int i = 0; i < 300000; ++i) {
      const float f = bits_to_float(rng());
      if (!std::isnan(f)) out.push_back(f);
    }
  }
  // `pattern + steps` fp32 steps away from a non-negative pattern, both signs.
  const auto push_offset = [&out](uint32_t pattern, int64_t steps) {
    const int64_t moved = int64_t(pattern) + steps;
    if (moved < 0 || moved >= 0x7f800000) return;
    out.push_back(bits_to_float(uint32_t(moved)));
    out.push_back(-bits_to_float(uint32_t(moved)));
  };
  for (int exponent = min_exponent; exponent <= max_exponent; ++exponent) {
    const uint32_t power = float_to_bits(std::ldexp(1.0f, exponent));
    for (int k = -40; k <= 40; ++k) {
      push_offset(power, k);
      // Far enough to cross the 16-bit format's midpoints below and above the power of two.
      push_offset(power, int64_t(k) << (mantissa_drop - 4));
    }
    // A midpoint of the 16-bit grid inside this binade, and its fp32 neighbours.
    const uint32_t midpoint = power + (5u << mantissa_drop) + (1u << (mantissa_drop - 1));
    for (int k = -3; k <= 3; ++k) push_offset(midpoint, k);
  }
  // fp32 subnormals of both signs.
  for (int i = 0; i < 20000; ++i) out.push_back(bits_to_float(rng() & 0x807fffffu));
  const float largest = bf16 ? bf16_to_float(0x7f7f) : 65504.0f;
  for (int k = -70000; k <= 70000; k += 7) push_offset(float_to_bits(largest), k);
  for (const float special : {0.0f, -0.0f, 3.4028235e38f, -3.4028235e38f, 65519.996f, 65520.0f}) {
    out.push_back(special);
  }
  return out;
}

TEST(MasterSplitBf16, Int8ErrorBound) {
  for (const float w : hard_inputs(true, 1)) check_split<Bf16, int8_t>(w, true);
}

TEST(MasterSplitBf16, Int16ErrorBound) {
  for (const float w : hard_inputs(true, 2)) check_split<Bf16, int16_t>(w, true);
}

TEST(MasterSplitFp16, Int8ErrorBound) {
  for (const float w : hard_inputs(false, 3)) check_split<Fp16, int8_t>(w, false);
}

TEST(MasterSplitFp16, Int16ErrorBound) {
  for (const float w : hard_inputs(false, 4)) check_split<Fp16, int16_t>(w, false);
}

// The side-dependent spacing is what makes the bound hold below a power of two: there the
// whole residual range covers the finer half-spacing.
TEST(MasterSplitBf16, BelowAPowerOfTwoUsesTheFinerSpacing) {
  const float power = 8.0f;  // bf16 spacing 2^-4 above, 2^-5 below
  const float w = power - 0.3f * (0.03125f / 2);  // 0.3 of the lower half-spacing below
  uint16_t p;
  int8_t r;
  split_master_bf16(w, p, r);
  EXPECT_EQ(bf16_to_float(p), power);
  EXPECT_EQ(r, -38);  // round(-0.3 * 127); the upper spacing would have given -19
  EXPECT_NEAR(join_master_bf16(p, r), w, 0.03125 / (4 * 127.0) + 1e-6);
}

// bf16 + int16: the residual step is ~ one fp32 ulp, so the master is back within one ulp.
TEST(MasterSplitBf16, Int16IsWithinOneFp32Ulp) {
  for (const float w : hard_inputs(true, 5)) {
    uint16_t p;
    int16_t r;
    split_master_bf16(w, p, r);
    if (!is_finite_pattern(p, true)) continue;
    const float rebuilt = join_master_bf16(p, r);
    ASSERT_LE(std::fabs(double(rebuilt) - double(w)), fp32_ulp(std::fabs(double(w)))) << w;
  }
}

// fp16 + int16 in fp16's normal range: the residual step (u / 65534) is finer than fp32's, so
// the master comes back bit for bit.
TEST(MasterSplitFp16, Int16IsExactInTheNormalRange) {
  for (const float w : hard_inputs(false, 6)) {
    uint16_t p;
    int16_t r;
    split_master_fp16(w, p, r);
    const bool normal = std::fabs(fp16_to_float(p)) >= std::ldexp(1.0f, -14);
    if (!is_finite_pattern(p, false) || !normal) continue;
    ASSERT_EQ(float_to_bits(join_master_fp16(p, r)), float_to_bits(w)) << w;
  }
}

// A step that leaves the weight unchanged must not move it: rebuild, split, rebuild again gives
// the same fp32 value for any stored pair.
template <typename Format, typename Residual>
void check_resplit_is_stable(bool bf16, uint32_t seed) {
  constexpr int kScale = int(ResidualTraits<Residual>::kScale);
  std::mt19937 rng(seed);
  for (int i = 0; i < 500000; ++i) {
    const uint16_t p = uint16_t(rng());
    if (!is_finite_pattern(p, bf16)) continue;
    const Residual r = Residual(std::uniform_int_distribution<int>(-kScale, kScale)(rng));
    const float rebuilt = Format::join(p, r);
    uint16_t p2;
    Residual r2;
    Format::split(rebuilt, p2, r2);
    ASSERT_EQ(float_to_bits(Format::join(p2, r2)), float_to_bits(rebuilt))
        << std::hex << p << std::dec << " r " << int(r);
  }
}

TEST(MasterSplit, ResplitIsStable) {
  check_resplit_is_stable<Bf16, int8_t>(true, 7);
  check_resplit_is_stable<Bf16, int16_t>(true, 8);
  check_resplit_is_stable<Fp16, int8_t>(false, 9);
  check_resplit_is_stable<Fp16, int16_t>(false, 10);
}

TEST(MasterSplit, NonFiniteAndOverflow) {
  for (const float w : {INFINITY, -INFINITY, NAN, 3.4e38f, -3.4e38f}) {
    uint16_t p;
    int8_t r;
    split_master_bf16(w, p, r);
    EXPECT_EQ(r, 0);
    const float rebuilt = join_master_bf16(p, r);
    EXPECT_FALSE(std::isfinite(rebuilt)) << w;
    EXPECT_EQ(std::isnan(rebuilt), std::isnan(w));
  }
  for (const float w : {INFINITY, -INFINITY, NAN, 65520.0f, -1e6f}) {
    uint16_t p;
    int16_t r;
    split_master_fp16(w, p, r);
    EXPECT_EQ(r, 0);
    const float rebuilt = join_master_fp16(p, r);
    EXPECT_FALSE(std::isfinite(rebuilt)) << w;
    EXPECT_EQ(std::isnan(rebuilt), std::isnan(w));
  }
  // A residual never turns an inf or NaN parameter finite.
  EXPECT_TRUE(std::isinf(join_master_bf16(uint16_t(0x7f80), int8_t(-127))));
  EXPECT_TRUE(std::isnan(join_master_bf16(uint16_t(0x7fc0), int8_t(5))));
  EXPECT_TRUE(std::isinf(join_master_fp16(uint16_t(0xfc00), int16_t(300))));
  EXPECT_TRUE(std::isnan(join_master_fp16(uint16_t(0x7e00), int16_t(-300))));
}

TEST(MasterSplit, Zeros) {
  for (const float zero : {0.0f, -0.0f}) {
    uint16_t p;
    int8_t r;
    split_master_bf16(zero, p, r);
    EXPECT_EQ(r, 0);
    EXPECT_EQ(float_to_bits(join_master_bf16(p, r)), float_to_bits(zero));
    split_master_fp16(zero, p, r);
    EXPECT_EQ(r, 0);
    EXPECT_EQ(float_to_bits(join_master_fp16(p, r)), float_to_bits(zero));
  }
}

}  // namespace
}  // namespace pagedoptim::codec
