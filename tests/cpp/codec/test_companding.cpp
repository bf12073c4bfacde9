// Companded 8-bit moments (companding.h): round-trip error bounds derived from the code
// spacing, the fp16 scale, partial / zero / subnormal / saturated groups, the non-finite
// policy, and the AdamW denominator floor that keeps updates bounded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "pagedoptim/codec/companding.h"

namespace pagedoptim::codec {
namespace {

int group_count(size_t n) { return int((n + kGroupSize - 1) / kGroupSize); }
int group_length(size_t n, int group) {
  return int(std::min<size_t>(kGroupSize, n - size_t(group) * kGroupSize));
}

struct EncodedMoments {
  std::vector<int8_t> codes;
  std::vector<uint16_t> scales;
};

EncodedMoments encode_moments(const std::vector<float>& values) {
  EncodedMoments out{std::vector<int8_t>(values.size()), {}};
  for (int g = 0; g < group_count(values.size()); ++g) {
    const size_t begin = size_t(g) * kGroupSize;
    out.scales.push_back(encode_moment_group(values.data() + begin, group_length(values.size(), g),
                                             out.codes.data() + begin));
  }
  return out;
}

std::vector<float> decode_moments(const EncodedMoments& encoded) {
  std::vector<float> out(encoded.codes.size());
  for (int g = 0; g < group_count(out.size()); ++g) {
    const size_t begin = size_t(g) * kGroupSize;
    decode_moment_group(encoded.codes.data() + begin, encoded.scales[size_t(g)],
                        group_length(out.size(), g), out.data() + begin);
  }
  return out;
}

struct EncodedSecondMoments {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales;
};

EncodedSecondMoments encode_second_moments(const std::vector<float>& values) {
  EncodedSecondMoments out{std::vector<uint8_t>(values.size()), {}};
  for (int g = 0; g < group_count(values.size()); ++g) {
    const size_t begin = size_t(g) * kGroupSize;
    out.scales.push_back(encode_second_moment_group(
        values.data() + begin, group_length(values.size(), g), out.codes.data() + begin));
  }
  return out;
}

std::vector<float> decode_second_moments(const EncodedSecondMoments& encoded) {
  std::vector<float> out(encoded.codes.size());
  for (int g = 0; g < group_count(out.size()); ++g) {
    const size_t begin = size_t(g) * kGroupSize;
    decode_second_moment_group(encoded.codes.data() + begin, encoded.scales[size_t(g)],
                               group_length(out.size(), g), out.data() + begin);
  }
  return out;
}

// Largest error a first moment may come back with: half a code step in z = 2x / (1 + |x|),
// mapped back through dx/dz = 2 / (2 - |z|)^2 at the steep end of the half step, times the
// scale. The slack covers the fp32 roundings of encode and decode (a few ulps of the scale).
double moment_error_bound(double value, double scale) {
  if (scale == 0.0) return 0.0;
  const double x = std::fabs(value) / scale;
  const double z = 2.0 * x / (1.0 + x);
  const double half_step = 0.5 / 127.0;
  const double steep = std::min(z + half_step, 1.0);
  return scale * (half_step * 2.0 / ((2.0 - steep) * (2.0 - steep)) + 1e-6);
}

// Largest error of sqrt(v): half a linear code step of the scale, plus fp32 rounding slack.
double second_moment_root_error_bound(double scale) { return scale * (0.5 / 255.0 + 1e-6); }

void expect_moment_round_trip(const std::vector<float>& values, const char* what) {
  const EncodedMoments encoded = encode_moments(values);
  const std::vector<float> decoded = decode_moments(encoded);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t scale_bits = encoded.scales[i / kGroupSize];
    const double scale = fp16_to_float(scale_bits);
    ASSERT_TRUE(std::isfinite(decoded[i])) << what << " element " << i;
    ASSERT_LE(std::fabs(double(decoded[i]) - double(values[i])),
              moment_error_bound(values[i], scale))
        << what << " element " << i << " value " << values[i] << " scale " << scale;
    ASSERT_GE(scale, std::fabs(double(values[i]))) << what << " element " << i;
  }
}

void expect_second_moment_round_trip(const std::vector<float>& values, const char* what) {
  const EncodedSecondMoments encoded = encode_second_moments(values);
  const std::vector<float> decoded = decode_second_moments(encoded);
  for (size_t i = 0; i < values.size(); ++i) {
    const double scale = fp16_to_float(encoded.scales[i / kGroupSize]);
    ASSERT_TRUE(std::isfinite(decoded[i]) && decoded[i] >= 0.0f) << what << " element " << i;
    ASSERT_LE(std::fabs(std::sqrt(double(decoded[i])) - std::sqrt(double(values[i]))),
              second_moment_root_error_bound(scale))
        << what << " element " << i << " value " << values[i] << " scale " << scale;
    ASSERT_GE(scale, std::sqrt(double(values[i]))) << what << " element " << i;
  }
}

std::vector<float> draw_values(size_t n, uint32_t seed,
                               const std::function<float(std::mt19937&)>& draw) {
  std::mt19937 rng(seed);
  std::vector<float> out(n);
  for (float& value : out) value = draw(rng);
  return out;
}

// Magnitudes log-uniform over 1e-8..1e2 with random signs: ten decades inside every group.
float heavy_tailed(std::mt19937& rng) {
  const float magnitude = std::pow(10.0f, std::uniform_real_distribution<float>(-8.0f, 2.0f)(rng));
  return (rng() & 1u) ? -magnitude : magnitude;
}

constexpr size_t kElements = kGroupSize * 4096 + 7;  // a partial last group of 7

// ---------------------------------------------------------------------------------------------
// Scales

TEST(CompandingScale, RoundsUpToFp16) {
  std::mt19937 rng(1);
  for (int i = 0; i < 200000; ++i) {
    const float exponent = std::uniform_real_distribution<float>(-30.0f, 16.0f)(rng);
    const float magnitude = std::pow(2.0f, exponent);
    const uint16_t scale_bits = fp16_scale_at_least(magnitude);
    const float scale = fp16_to_float(scale_bits);
    if (magnitude > 65504.0f) {
      ASSERT_EQ(scale_bits, kScaleSaturated);
      continue;
    }
    ASSERT_GE(scale, magnitude);
    if (scale_bits > 0) {
      // No fp16 below the chosen one is still >= magnitude.
      ASSERT_LT(fp16_to_float(uint16_t(scale_bits - 1)), magnitude) << magnitude;
    }
  }
  EXPECT_EQ(fp16_scale_at_least(0.0f), 0);
  EXPECT_EQ(fp16_scale_at_least(1.0f), 0x3c00);     // exactly representable: kept
  EXPECT_EQ(fp16_scale_at_least(1.0001f), 0x3c01);  // nearest would round down to 1.0
  EXPECT_EQ(fp16_scale_at_least(65504.0f), kScaleSaturated);
  EXPECT_EQ(fp16_scale_at_least(1e-30f), 0x0001);   // below fp16: the smallest subnormal
  EXPECT_EQ(fp16_scale_at_least(INFINITY), kScaleNaN);
  EXPECT_EQ(fp16_scale_at_least(NAN), kScaleNaN);
  EXPECT_EQ(scale_reciprocal(0.0f), 0.0f);
  EXPECT_EQ(scale_reciprocal(NAN), 0.0f);
  EXPECT_EQ(scale_reciprocal(0.5f), 2.0f);
}

// ---------------------------------------------------------------------------------------------
// First moments

TEST(MomentCodec, EveryCodeRoundTrips) {
  for (const float scale : {1.0f, 0.001f, 3.14159f, 65504.0f, 5.9604645e-08f}) {
    const float inverse = scale_reciprocal(scale);
    for (int q = -127; q <= 127; ++q) {
      ASSERT_EQ(encode_moment(decode_moment(int8_t(q), scale), inverse), q) << scale;
    }
  }
  EXPECT_EQ(decode_moment(127, 2.0f), 2.0f);  // the group's absmax decodes exactly
  EXPECT_EQ(decode_moment(0, 2.0f), 0.0f);
}

TEST(MomentCodec, SignSymmetricAndMonotonic) {
  int previous = -128;
  for (float x = -1.0f; x <= 1.0f; x += 1.0f / 4096) {
    const int code = encode_moment(x, 1.0f);
    ASSERT_EQ(encode_moment(-x, 1.0f), -code) << x;
    ASSERT_GE(code, previous) << x;
    previous = code;
  }
}

TEST(MomentCodec, RoundTripUniform) {
  expect_moment_round_trip(draw_values(kElements, 2, [](std::mt19937& rng) {
                             return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
                           }),
                           "uniform");
}

TEST(MomentCodec, RoundTripNormal) {
  expect_moment_round_trip(draw_values(kElements, 3, [](std::mt19937& rng) {
                             return 1e-3f * std::normal_distribution<float>()(rng);
                           }),
                           "normal");
}

TEST(MomentCodec, RoundTripHeavyTailed) {
  expect_moment_round_trip(draw_values(kElements, 4, heavy_tailed), "heavy-tailed");
}

TEST(MomentCodec, AbsmaxGetsTheLastCode) {
  std::vector<float> values = draw_values(kGroupSize, 5, [](std::mt19937& rng) {
    return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  });
  values[9] = -1.7f;  // not an fp16: the scale rounds up past it, the code still saturates
  const EncodedMoments encoded = encode_moments(values);
  EXPECT_EQ(encoded.codes[9], -127);
  EXPECT_GE(fp16_to_float(encoded.scales[0]), 1.7f);
}

TEST(MomentCodec, ZeroGroupsAndSubnormals) {
  std::vector<float> values(kGroupSize * 3 + 5, 0.0f);
  values[1] = -0.0f;
  // Group 1: fp32 subnormals; group 2: subnormals next to a normal value.
  for (int i = 0; i < kGroupSize; ++i) {
    values[size_t(kGroupSize + i)] = bits_to_float(uint32_t(i * 0x3fff + 1) | ((i & 1u) << 31));
    values[size_t(2 * kGroupSize + i)] = bits_to_float(uint32_t(i * 0x1234 + 1));
  }
  values[2 * kGroupSize + 3] = 0.25f;
  const EncodedMoments encoded = encode_moments(values);
  EXPECT_EQ(encoded.scales[0], 0);
  EXPECT_EQ(encoded.scales[3], 0);  // the all-zero partial last group
  EXPECT_EQ(encoded.scales[1], 0x0001);
  const std::vector<float> decoded = decode_moments(encoded);
  for (int i = 0; i < kGroupSize; ++i) {
    EXPECT_EQ(decoded[size_t(i)], 0.0f);
    EXPECT_EQ(encoded.codes[size_t(i)], 0);
  }
  expect_moment_round_trip(values, "zero and subnormal");
}

TEST(MomentCodec, PartialGroupIgnoresWhatFollows) {
  // The last group's codes depend only on its own `count` elements.
  std::vector<float> values = draw_values(kGroupSize, 6, heavy_tailed);
  std::vector<float> padded = values;
  padded.resize(kGroupSize * 2);
  padded[kGroupSize - 1 + 1] = 1e4f;  // beyond the partial group of kGroupSize - 1
  int8_t codes_a[kGroupSize], codes_b[kGroupSize];
  const uint16_t scale_a = encode_moment_group(values.data(), kGroupSize - 1, codes_a);
  const uint16_t scale_b = encode_moment_group(padded.data(), kGroupSize - 1, codes_b);
  EXPECT_EQ(scale_a, scale_b);
  for (int i = 0; i < kGroupSize - 1; ++i) EXPECT_EQ(codes_a[i], codes_b[i]);
}

TEST(MomentCodec, SaturatesAboveFp16Range) {
  std::vector<float> values(kGroupSize, 1.0f);
  values[0] = 1e6f;
  values[1] = -7e4f;
  const EncodedMoments encoded = encode_moments(values);
  EXPECT_EQ(encoded.scales[0], kScaleSaturated);
  EXPECT_EQ(encoded.codes[0], 127);
  EXPECT_EQ(encoded.codes[1], -127);
  const std::vector<float> decoded = decode_moments(encoded);
  EXPECT_EQ(decoded[0], 65504.0f);
  EXPECT_EQ(decoded[1], -65504.0f);
  EXPECT_NEAR(decoded[2], 1.0f, moment_error_bound(1.0, 65504.0));
}

// ---------------------------------------------------------------------------------------------
// Second moments

TEST(SecondMomentCodec, EveryCodeRoundTrips) {
  for (const float scale : {1.0f, 0.001f, 3.14159f, 65504.0f, 5.9604645e-08f}) {
    const float inverse = scale_reciprocal(scale);
    for (int q = 0; q <= 255; ++q) {
      ASSERT_EQ(encode_second_moment(decode_second_moment(uint8_t(q), scale), inverse), q)
          << scale;
    }
  }
  EXPECT_EQ(decode_second_moment(255, 2.0f), 4.0f);
}

TEST(SecondMomentCodec, RoundTripDistributions) {
  const auto squared = [](const std::vector<float>& values) {
    std::vector<float> out;
    for (const float value : values) out.push_back(value * value);
    return out;
  };
  expect_second_moment_round_trip(squared(draw_values(kElements, 7, [](std::mt19937& rng) {
                                    return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
                                  })),
                                  "uniform");
  expect_second_moment_round_trip(squared(draw_values(kElements, 8, [](std::mt19937& rng) {
                                    return 1e-3f * std::normal_distribution<float>()(rng);
                                  })),
                                  "normal");
  // v from 1e-16 to 1e4 inside every group.
  expect_second_moment_round_trip(squared(draw_values(kElements, 9, heavy_tailed)), "heavy-tailed");
}

TEST(SecondMomentCodec, ZeroSubnormalPartialAndSaturated) {
  std::vector<float> values(kGroupSize * 3 + 9, 0.0f);
  values[3] = -0.0f;  // -0 is a valid zero, not a negative moment
  for (int i = 0; i < kGroupSize; ++i) {
    values[size_t(kGroupSize + i)] = bits_to_float(uint32_t(i * 977 + 1));
  }
  values[2 * kGroupSize] = 1e12f;  // sqrt = 1e6 > 65504
  values[2 * kGroupSize + 1] = 4.0f;
  const EncodedSecondMoments encoded = encode_second_moments(values);
  EXPECT_EQ(encoded.scales[0], 0);
  EXPECT_EQ(encoded.scales[3], 0);
  EXPECT_EQ(encoded.scales[2], kScaleSaturated);
  EXPECT_EQ(encoded.codes[size_t(2 * kGroupSize)], 255);
  const std::vector<float> decoded = decode_second_moments(encoded);
  for (int i = 0; i < kGroupSize; ++i) EXPECT_EQ(decoded[size_t(i)], 0.0f);
  EXPECT_FLOAT_EQ(decoded[size_t(2 * kGroupSize)], 65504.0f * 65504.0f);
  values[2 * kGroupSize] = 0.0f;  // the rest obeys the usual bound
  expect_second_moment_round_trip(values, "zero, subnormal, partial");
}

// ---------------------------------------------------------------------------------------------
// Non-finite policy: a group with inf or NaN (or a negative v) decodes to NaN everywhere; the
// other groups are untouched.

TEST(NonFinitePolicy, PoisonsExactlyTheGroup) {
  const size_t n = kGroupSize * 3 + 11;
  for (const float bad : {NAN, -NAN, INFINITY, -INFINITY}) {
    for (const size_t position : {size_t(kGroupSize + 5), size_t(3 * kGroupSize + 10)}) {
      std::vector<float> values = draw_values(n, 10, heavy_tailed);
      values[position] = bad;
      const EncodedMoments encoded = encode_moments(values);
      const std::vector<float> decoded = decode_moments(encoded);
      std::vector<float> v_values(n);
      for (size_t i = 0; i < n; ++i) v_values[i] = values[i] * values[i];
      v_values[position] = std::fabs(bad);
      const EncodedSecondMoments v_encoded = encode_second_moments(v_values);
      const std::vector<float> v_decoded = decode_second_moments(v_encoded);
      const size_t bad_group = position / kGroupSize;
      EXPECT_EQ(encoded.scales[bad_group], kScaleNaN);
      EXPECT_EQ(v_encoded.scales[bad_group], kScaleNaN);
      for (size_t i = 0; i < n; ++i) {
        if (i / kGroupSize == bad_group) {
          EXPECT_TRUE(std::isnan(decoded[i])) << i;
          EXPECT_TRUE(std::isnan(v_decoded[i])) << i;
          const float scale = fp16_to_float(v_encoded.scales[bad_group]);
          EXPECT_TRUE(std::isnan(decode_second_moment_for_denominator(v_encoded.codes[i], scale)));
        } else {
          EXPECT_LE(std::fabs(double(decoded[i]) - double(values[i])),
                    moment_error_bound(values[i], fp16_to_float(encoded.scales[i / kGroupSize])));
          EXPECT_TRUE(std::isfinite(v_decoded[i]));
        }
      }
    }
  }
}

TEST(NonFinitePolicy, NegativeSecondMomentIsInvalid) {
  std::vector<float> values(kGroupSize, 1.0f);
  values[4] = -1e-30f;
  uint8_t codes[kGroupSize];
  EXPECT_EQ(encode_second_moment_group(values.data(), kGroupSize, codes), kScaleNaN);
}

TEST(NonFinitePolicy, NaNStaysSticky) {
  // Decoding a poisoned group and encoding it again poisons it again: the NaN cannot be
  // averaged away by later steps, as in torch.
  std::vector<float> values = draw_values(kGroupSize, 12, heavy_tailed);
  values[0] = NAN;
  EncodedMoments encoded = encode_moments(values);
  for (int step = 0; step < 3; ++step) {
    std::vector<float> decoded = decode_moments(encoded);
    for (float& value : decoded) value = 0.9f * value + 0.1f;
    encoded = encode_moments(decoded);
    EXPECT_EQ(encoded.scales[0], kScaleNaN);
  }
}

// ---------------------------------------------------------------------------------------------
// The AdamW denominator floor: the fix for the known failure of the companded format, where
// sqrt(v) of a small element decodes to 0 while its m does not (docs/compression.md).

TEST(DenominatorFloor, OnlyCodeZeroChanges) {
  for (const float scale : {1.0f, 3e-5f, 65504.0f}) {
    for (int q = 1; q <= 255; ++q) {
      EXPECT_EQ(float_to_bits(decode_second_moment_for_denominator(uint8_t(q), scale)),
                float_to_bits(decode_second_moment(uint8_t(q), scale)));
    }
    const float top = 0.5f / 255.0f * scale;
    EXPECT_FLOAT_EQ(decode_second_moment_for_denominator(0, scale), top * top);
  }
  EXPECT_EQ(decode_second_moment_for_denominator(0, 0.0f), 0.0f);
  EXPECT_TRUE(std::isnan(decode_second_moment_for_denominator(0, NAN)));
}

// AdamW on companded states, as the 8-bit kernel runs it; returns the normalized updates
// m_hat / (sqrt(v_hat) + eps) of every step.
struct CompandedAdamW {
  static constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f;
  explicit CompandedAdamW(size_t n, bool floor)
      : floor_(floor), m_codes(n), v_codes(n), m_scales(size_t(group_count(n))),
        v_scales(size_t(group_count(n))) {}

  std::vector<float> step(const std::vector<float>& grad) {
    ++t_;
    const float bias_correction1 = 1.0f - std::pow(kBeta1, float(t_));
    const float bias_correction2_sqrt = std::sqrt(1.0f - std::pow(kBeta2, float(t_)));
    std::vector<float> update(grad.size());
    for (int g = 0; g < group_count(grad.size()); ++g) {
      const size_t begin = size_t(g) * kGroupSize;
      const int count = group_length(grad.size(), g);
      const float m_scale = fp16_to_float(m_scales[size_t(g)]);
      const float v_scale = fp16_to_float(v_scales[size_t(g)]);
      float m[kGroupSize], v[kGroupSize];
      for (int i = 0; i < count; ++i) {
        const size_t k = begin + size_t(i);
        const float gk = grad[k];
        m[i] = kBeta1 * decode_moment(m_codes[k], m_scale) + (1.0f - kBeta1) * gk;
        v[i] = kBeta2 * decode_second_moment(v_codes[k], v_scale) + (1.0f - kBeta2) * gk * gk;
        const float v_denom =
            floor_ ? kBeta2 * decode_second_moment_for_denominator(v_codes[k], v_scale) +
                         (1.0f - kBeta2) * gk * gk
                   : v[i];
        update[k] = m[i] / bias_correction1 / (std::sqrt(v_denom) / bias_correction2_sqrt + kEps);
      }
      m_scales[size_t(g)] = encode_moment_group(m, count, m_codes.data() + begin);
      v_scales[size_t(g)] = encode_second_moment_group(v, count, v_codes.data() + begin);
    }
    return update;
  }

  bool floor_;
  long t_ = 0;
  std::vector<int8_t> m_codes;
  std::vector<uint8_t> v_codes;
  std::vector<uint16_t> m_scales, v_scales;
};

// Exact AdamW bounds its normalized update: with m = sum (1-b1) b1^k g_k and
// v = sum (1-b2) b2^k g_k^2, Cauchy-Schwarz gives m^2 <= C v with
// C = (1-b1)^2 / ((1-b2) (1 - b1^2/b2)), and bias correction only lowers the ratio
// (sqrt(1-b2^t) <= 1-b1^t). For a code-0 v the floored denominator is at least
// sqrt(b2) * s/510, while |m| of such an element is at most sqrt(C) * s/510 plus m's own half
// code step; this puts the floored update within about 2 sqrt(C) (14.5 for 0.9 / 0.999).
double exact_adamw_update_bound() {
  const double b1 = CompandedAdamW::kBeta1, b2 = CompandedAdamW::kBeta2;
  return std::sqrt((1 - b1) * (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)));
}

double max_abs(const std::vector<float>& values) {
  double largest = 0;
  for (const float value : values) largest = std::max(largest, double(std::fabs(value)));
  return largest;
}

// The documented failure, deterministic: in one group a large gradient that flips sign every
// step (so its m is small but its v large) and a small element with a steady gradient that
// then stops (a sparse row). The small element's v codes to 0, its m does not, and without the
// floor its update becomes m / eps.
TEST(DenominatorFloor, BoundsTheKnownFailure) {
  double worst[2] = {0, 0};
  for (const bool floor : {false, true}) {
    CompandedAdamW optimizer(kGroupSize, floor);
    std::vector<float> grad(kGroupSize, 0.0f);
    for (int step = 0; step < 300; ++step) {
      grad[0] = (step % 2 == 0) ? 1.0f : -1.0f;
      grad[1] = step < 200 ? 1e-3f : 0.0f;
      worst[floor] = std::max(worst[floor], max_abs(optimizer.step(grad)));
    }
  }
  EXPECT_GT(worst[0], 1e3) << "the scenario no longer reproduces the failure";
  EXPECT_LE(worst[1], 2 * exact_adamw_update_bound());
}

// Random heavy-tailed groups (gradient magnitudes 1e-8..1e2 in every group), half the elements
// with a steady sign, 30% of the gradients present each step.
TEST(DenominatorFloor, BoundsHeavyTailedSparseUpdates) {
  const size_t n = kGroupSize * 256 + 13;
  std::mt19937 rng(21);
  std::vector<float> magnitude(n), bias(n);
  for (size_t i = 0; i < n; ++i) {
    magnitude[i] = std::pow(10.0f, std::uniform_real_distribution<float>(-8.0f, 2.0f)(rng));
    bias[i] = (rng() & 1u) ? 0.0f : ((rng() & 1u) ? 1.0f : -1.0f);
  }
  CompandedAdamW plain(n, false), floored(n, true);
  double worst_plain = 0, worst_floored = 0;
  std::normal_distribution<float> noise;
  std::vector<float> grad(n);
  for (int step = 0; step < 200; ++step) {
    for (size_t i = 0; i < n; ++i) {
      const bool present = std::uniform_real_distribution<float>()(rng) < 0.3f;
      grad[i] = present ? magnitude[i] * (bias[i] + noise(rng)) : 0.0f;
    }
    worst_plain = std::max(worst_plain, max_abs(plain.step(grad)));
    worst_floored = std::max(worst_floored, max_abs(floored.step(grad)));
  }
  EXPECT_GT(worst_plain, 1e3);
  EXPECT_LE(worst_floored, 2 * exact_adamw_update_bound());
}

}  // namespace
}  // namespace pagedoptim::codec
