// The bf16 / fp16 conversions of float_convert.h against independent references: a value
// table of every 16-bit pattern and a nearest-with-ties-to-even search over it, and, where the
// CPU has F16C, the hardware conversion instructions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "pagedoptim/codec/float_convert.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PO_TEST_HAVE_X86 1
#endif

namespace pagedoptim::codec {
namespace {

// Value of an fp16 pattern from its definition, in double; inf/NaN patterns excluded.
double fp16_reference_value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  const double magnitude = exponent == 0 ? std::ldexp(double(mantissa), -24)
                                         : std::ldexp(double(1024 + mantissa), exponent - 25);
  return (h & 0x8000) ? -magnitude : magnitude;
}

bool fp16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Every non-negative finite fp16 value, in pattern order (which is value order), and the value
// the next pattern after 65504 would have if the format had one more binade: the tie point to
// infinity is halfway to it.
struct Fp16Table {
  std::vector<double> values;
  Fp16Table() {
    for (uint32_t h = 0; h <= 0x7bff; ++h) values.push_back(fp16_reference_value(uint16_t(h)));
    values.push_back(65536.0);  // pattern 0x7c00 stands for infinity
  }
};

const Fp16Table& fp16_table() {
  static const Fp16Table table;
  return table;
}

// Round to nearest fp16, ties to the even pattern, by searching the table: obviously correct.
uint16_t fp16_reference_round(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0x7e00;
  const double magnitude = std::fabs(double(f));
  const auto& values = fp16_table().values;
  if (magnitude >= values.back()) return sign | 0x7c00;
  const auto upper = std::lower_bound(values.begin(), values.end(), magnitude);
  uint32_t high = uint32_t(upper - values.begin());
  if (values[high] == magnitude) return uint16_t(sign | high);
  const uint32_t low = high - 1;
  const double below = magnitude - values[low];
  const double above = values[high] - magnitude;
  uint32_t chosen = below < above ? low : high;
  if (below == above) chosen = (low % 2 == 0) ? low : high;
  return uint16_t(sign | chosen);
}

// Random floats with every exponent from far below fp16's subnormals to far above its max.
std::vector<float> random_floats_around_fp16_range(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exponent(-30, 18);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  std::vector<float> out;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t bits = (uint32_t(exponent(rng) + 127) << 23) | mantissa(rng) |
                          ((rng() & 1u) << 31);
    out.push_back(bits_to_float(bits));
  }
  return out;
}

TEST(Fp16ToFloat, ExhaustiveAgainstDefinition) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    const bool negative = (h & 0x8000) != 0;
    if (fp16_is_nan(uint16_t(h))) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
    } else if ((h & 0x7fff) == 0x7c00) {
      EXPECT_TRUE(std::isinf(f) && std::signbit(f) == negative) << std::hex << h;
    } else {
      EXPECT_EQ(double(f), fp16_reference_value(uint16_t(h))) << std::hex << h;
      EXPECT_EQ(std::signbit(f), negative) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(FloatToFp16, ExhaustiveRoundTripOfEveryPattern) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t back = float_to_fp16(fp16_to_float(uint16_t(h)));
    if (fp16_is_nan(uint16_t(h))) {
      EXPECT_TRUE(fp16_is_nan(back)) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

// Midpoints between every two neighbouring fp16 values (the ties), one fp32 step either side
// of them, in both signs: where a rounding bug would show.
TEST(FloatToFp16, MidpointsTiesToEven) {
  const auto& values = fp16_table().values;
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    const float midpoint = float((values[i] + values[i + 1]) / 2);  // exact: 12 bits
    ASSERT_EQ(double(midpoint), (values[i] + values[i + 1]) / 2);
    const uint16_t even = uint16_t(i % 2 == 0 ? i : i + 1);
    for (const float sign : {1.0f, -1.0f}) {
      const uint16_t sign_bit = sign < 0 ? 0x8000 : 0;
      EXPECT_EQ(float_to_fp16(sign * midpoint), uint16_t(sign_bit | even)) << i;
      const float below = std::nextafter(midpoint, 0.0f);
      const float above = std::nextafter(midpoint, INFINITY);
      EXPECT_EQ(float_to_fp16(sign * below), uint16_t(sign_bit | i)) << i;
      EXPECT_EQ(float_to_fp16(sign * above), uint16_t(sign_bit | (i + 1))) << i;
    }
  }
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_fp16(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_fp16(1e30f), 0x7c00);
  EXPECT_EQ(float_to_fp16(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_fp16(-INFINITY), 0xfc00);
}

TEST(FloatToFp16, RandomAgainstTableSearch) {
  for (const float f : random_floats_around_fp16_range(400000, 7)) {
    ASSERT_EQ(float_to_fp16(f), fp16_reference_round(f)) << f;
  }
  // fp32 subnormals and NaNs of every payload, including signalling ones whose payload sits
  // in the bits that rounding drops.
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const float tiny = bits_to_float((rng() & 0x807fffffu));
    ASSERT_EQ(float_to_fp16(tiny), fp16_reference_round(tiny)) << tiny;
    const uint32_t payload = 1u + rng() % 0x7fffffu;
    EXPECT_TRUE(fp16_is_nan(float_to_fp16(bits_to_float(0x7f800000u | payload))));
    EXPECT_TRUE(fp16_is_nan(float_to_fp16(bits_to_float(0xff800000u | payload))));
  }
}

#if PO_TEST_HAVE_X86
__attribute__((target("f16c"))) uint16_t hardware_float_to_fp16(float f) {
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hardware_fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }

TEST(Fp16Conversions, MatchF16cInstructions) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C";
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    if (fp16_is_nan(uint16_t(h))) continue;
    EXPECT_EQ(float_to_bits(fp16_to_float(uint16_t(h))),
              float_to_bits(hardware_fp16_to_float(uint16_t(h))))
        << std::hex << h;
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 1000000; ++i) {
    const float f = bits_to_float(rng());
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_fp16(f), hardware_float_to_fp16(f)) << f;
  }
  for (const float f : random_floats_around_fp16_range(1000000, 5)) {
    ASSERT_EQ(float_to_fp16(f), hardware_float_to_fp16(f)) << f;
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// bf16

// Round to nearest bf16 by comparing the distances to the two candidates in double, ties to
// the even pattern. Pattern 0x7f80 past the largest finite value stands for 2^128 (= inf).
uint16_t bf16_reference_round(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t low = (bits & 0x7fffffffu) >> 16;
  const auto value = [](uint32_t pattern) {
    const int exponent = int(pattern >> 7);
    const int mantissa = int(pattern & 0x7f);
    return exponent == 0 ? std::ldexp(double(mantissa), -133)
                         : std::ldexp(double(128 + mantissa), exponent - 134);
  };
  const double magnitude = std::fabs(double(f));
  const double below = magnitude - value(low);
  const double above = value(low + 1) - magnitude;
  uint32_t chosen = below < above ? low : low + 1;
  if (below == above) chosen = (low % 2 == 0) ? low : low + 1;
  return uint16_t(sign | chosen);
}

TEST(Bf16ToFloat, ExhaustiveIsTheUpperHalf) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    EXPECT_EQ(float_to_bits(bf16_to_float(uint16_t(h))), h << 16);
  }
}

TEST(FloatToBf16, TiesToEvenAtEveryMidpoint) {
  for (uint32_t h = 0; h < 0x7f80; ++h) {
    const uint32_t even = (h % 2 == 0) ? h : h + 1;
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const uint16_t sign_bit = uint16_t(sign >> 16);
      const uint32_t midpoint = sign | (h << 16) | 0x8000u;
      EXPECT_EQ(float_to_bf16(bits_to_float(midpoint)), uint16_t(sign_bit | even)) << h;
      EXPECT_EQ(float_to_bf16(bits_to_float(midpoint - 1)), uint16_t(sign_bit | h)) << h;
      EXPECT_EQ(float_to_bf16(bits_to_float(midpoint + 1)), uint16_t(sign_bit | (h + 1))) << h;
      EXPECT_EQ(float_to_bf16(bits_to_float(sign | (h << 16))), uint16_t(sign_bit | h)) << h;
    }
  }
}

TEST(FloatToBf16, RandomAgainstReferenceAndNaN) {
  std::mt19937 rng(13);
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = rng();
    const float f = bits_to_float(bits);
    const uint16_t rounded = float_to_bf16(f);
    if (std::isnan(f)) {
      // A NaN whose payload lives only in the low 16 bits must not round into an infinity.
      ASSERT_TRUE(std::isnan(bf16_to_float(rounded))) << std::hex << bits;
      ASSERT_EQ(rounded & 0x8000u, (bits >> 16) & 0x8000u);
    } else {
      ASSERT_EQ(rounded, bf16_reference_round(f)) << std::hex << bits;
    }
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_to_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_to_float(0xff80ffffu)))));
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(float_to_bf16(-INFINITY), 0xff80);
  EXPECT_EQ(float_to_bf16(3.4028235e38f), 0x7f80);  // above the last tie: overflows to inf
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
}

}  // namespace
}  // namespace pagedoptim::codec
