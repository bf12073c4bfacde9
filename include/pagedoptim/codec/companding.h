// Companded 8-bit optimizer moments: kGroupSize elements share one fp16 scale.
//
// First moments (AdamW m, SGD momentum, Lion m), int8 code q in [-127, 127]:
//   s = the group's absmax, x = m / s in [-1, 1],   q = round(127 * 2x / (1 + |x|))
//   decode: z = q / 127,  x = z / (2 - |z|) = q / (254 - |q|),  m = x * s
// The companding map spends the codes where a moment's values are: the step of x is 1/254
// next to 0 and 2/127 next to |x| = 1, against 1/127 everywhere for a linear code. A decoded
// value is within half a step of the input: with h = 0.5/127 and z the unrounded code / 127,
// |x' - x| <= h * 2 / (2 - min(|z| + h, 1))^2 (dx/dz = 2 / (2 - |z|)^2 grows with |z|).
//
// AdamW second moments v >= 0, uint8 code q in [0, 255] of sqrt(v), linear:
//   s = the group's max of sqrt(v),  q = round(255 * sqrt(v) / s),  decode v = (q/255 * s)^2
// so |sqrt(v') - sqrt(v)| <= 0.5 * s / 255.
//
// Scales. The scale is stored as an fp16 bit pattern, rounded up from the fp32 absmax (to
// the smallest fp16 >= absmax): rounding to nearest could land below the absmax and push the
// largest elements past the last code. The fp16 range bounds what a group can represent:
//   - absmax above 65504 (the largest finite fp16): the scale saturates at 65504 and the
//     codes saturate at +-127 / 255. Finite moments that large come only from gradients of
//     1e4..1e5 and more; AdamW's update m / sqrt(v) saturates in both and stays about +-1.
//   - absmax below 2^-24 (the smallest fp16 subnormal), fp32 subnormals included: the scale
//     rounds up to 2^-24 and such values decode to 0 or to a coarse code (a first moment of
//     1e-9 as the group's absmax gets code 4 of 127). An all-zero group has scale 0, codes 0
//     and decodes to 0.
//
// Non-finite input policy: if any element of a group is inf or NaN (a gradient overflowed),
// or a second moment is negative, the group's scale is the fp16 NaN and every element of the
// group decodes to NaN, for the first moment and the second alike (a NaN scale propagates
// through the multiplications, q = 0 included). NaN therefore stays visible in the state and
// reaches the parameter; it is never turned into a finite value, and it is sticky like
// torch's (the next encode of the NaN moments yields a NaN scale again). Unlike torch, the
// NaN spreads from the offending element to its whole group of 32: the codes have no NaN of
// their own, and the scale is the one place a group can carry it. An inf input also becomes
// NaN; torch's AdamW turns an inf gradient into a NaN parameter as well (inf / inf).
//
// AdamW denominators (the failure this format is known for). When magnitudes inside a group
// differ by 100x and more, a small element's sqrt(v) is below half a code (s / 510) and its
// code is 0, while its first moment, coded against a different scale and finer near 0, keeps
// a nonzero code. Decoding v as 0 then makes m / (sqrt(v) + eps) as large as m / eps. Code 0
// only says that sqrt(v) lies in [0, s / 510); an underestimated denominator makes the update
// unboundedly large, an overestimated one only shrinks it, so the denominator takes the top
// of that interval: decode_second_moment_for_denominator(). The state itself keeps the plain
// decode_second_moment(): the floor would otherwise feed into the moving average and, once a
// re-encode rounds it up to code 1, stay there. docs/compression.md has the measurements.
//
// Every function here is inline and branch-free in its per-element part so that GCC
// vectorizes loops over it (sqrtf needs -fno-math-errno) and nvcc compiles the same code.
// The rounding and NaN handling rely on IEEE arithmetic: do not compile them with
// -ffast-math, -ffinite-math-only or -fassociative-math (nvcc: no --use_fast_math).
#pragma once

#include <cmath>
#include <cstdint>

#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/common.h"

namespace pagedoptim::codec {

constexpr float kMomentCodeMax = 127.0f;
constexpr float kSecondMomentCodeMax = 255.0f;

// fp16 bit patterns of the two special scales.
constexpr uint16_t kScaleNaN = 0x7e00u;
constexpr uint16_t kScaleSaturated = 0x7bffu;  // 65504
constexpr uint32_t kFp16MaxAsFloatBits = 0x477fe000u;  // 65504.0f

// Round to the nearest integer, ties to even, for |x| < 2^22: adding 1.5 * 2^23 moves x to a
// binade whose spacing is 1, so the fp32 adder does the rounding. rintf would be a library
// call, which does not vectorize, on x86 without SSE4.1 (the baseline kernels' ISA).
PO_HOST_DEVICE float round_half_even(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (x + kShift) - kShift;
}

// a * b rounded to fp32 on its own. Where a product reaches the addition of round_half_even,
// nvcc (default --fmad=true) could fuse the two into one fma that rounds once, while the CPU
// kernels (built with -ffp-contract=off) round twice, and the codes would differ at
// near-ties. Pinning the product keeps the codes of CPU and CUDA bit-identical.
PO_HOST_DEVICE float multiply_rounded(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// fp16 pattern of the smallest fp16 value >= magnitude (magnitude >= 0). Inf and NaN give the
// NaN scale (the non-finite policy), finite values above 65504 saturate.
PO_HOST_DEVICE uint16_t fp16_scale_at_least(float magnitude) {
  const uint32_t bits = float_to_bits(magnitude) & 0x7fffffffu;
  if (bits >= 0x7f800000u) return kScaleNaN;
  if (bits > kFp16MaxAsFloatBits) return kScaleSaturated;
  const float positive = bits_to_float(bits);
  const uint16_t nearest = float_to_fp16(positive);
  // Positive fp16 patterns order like their values, so +1 is the next fp16 up; 65504 itself
  // is representable, so this never steps past it.
  return uint16_t(nearest + uint16_t(fp16_to_float(nearest) < positive));
}

// 1 / scale, or 0 for a zero scale so that an all-zero group encodes to codes 0 (not NaN from
// 0 * inf). A NaN scale also gives 0; its codes do not matter, the scale carries the NaN.
PO_HOST_DEVICE float scale_reciprocal(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// ---------------------------------------------------------------------------------------------
// First moments: signed, companded int8.

// `inverse_scale` is scale_reciprocal() of the group's decoded fp16 scale. The clamps keep the
// code defined for any input (a NaN gives +127; the group's NaN scale carries the NaN).
PO_HOST_DEVICE int8_t encode_moment(float value, float inverse_scale) {
  const float x = value * inverse_scale;
  float code = (2.0f * kMomentCodeMax) * x / (1.0f + fabsf(x));
  code = code < kMomentCodeMax ? code : kMomentCodeMax;
  code = code > -kMomentCodeMax ? code : -kMomentCodeMax;
  return int8_t(int32_t(round_half_even(code)));
}

// constexpr so that the CPU kernels' decode table (kernels/cpu/companded_groups.h) is this
// function's values computed by the compiler, not by code run when the library loads. |q| is
// written out because fabsf is not constexpr before C++23; negating a float converted from an
// int8 is exact, so the value is the same.
PO_HOST_DEVICE constexpr float decode_moment(int8_t code, float scale) {
  // z / (2 - |z|) with z = q / 127 is q / (254 - |q|): one correctly rounded division.
  const float q = float(code);
  const float magnitude = code < 0 ? -q : q;
  return q / (2.0f * kMomentCodeMax - magnitude) * scale;
}

// Largest |value| of the group as an fp32 pattern: non-negative floats order like their bit
// patterns, and inf/NaN patterns sort above every finite one, so one integer max finds both
// the absmax and any non-finite element (and vectorizes without caring about NaN semantics).
// The per-element key of that maximum; a CUDA warp reduces it across its lanes.
PO_HOST_DEVICE uint32_t moment_order_bits(float value) {
  return float_to_bits(value) & 0x7fffffffu;
}

PO_HOST_DEVICE uint32_t moment_absmax_bits(const float* PO_RESTRICT values, int count) {
  uint32_t largest = 0;
  for (int i = 0; i < count; ++i) {
    const uint32_t magnitude = moment_order_bits(values[i]);
    largest = magnitude > largest ? magnitude : largest;
  }
  return largest;
}

// fp16 scale pattern of a group whose largest moment_order_bits() is `largest`.
PO_HOST_DEVICE uint16_t moment_scale_from_bits(uint32_t largest) {
  return fp16_scale_at_least(bits_to_float(largest));
}

// fp16 scale pattern of a group of `count` <= kGroupSize first moments.
PO_HOST_DEVICE uint16_t moment_group_scale(const float* PO_RESTRICT values, int count) {
  return moment_scale_from_bits(moment_absmax_bits(values, count));
}

// Encodes `count` <= kGroupSize values (a partial last group has count < kGroupSize) into
// codes[0, count) and returns the group's fp16 scale pattern.
PO_HOST_DEVICE uint16_t encode_moment_group(const float* PO_RESTRICT values, int count,
                                            int8_t* PO_RESTRICT codes) {
  const uint16_t scale = moment_group_scale(values, count);
  const float inverse_scale = scale_reciprocal(fp16_to_float(scale));
  for (int i = 0; i < count; ++i) codes[i] = encode_moment(values[i], inverse_scale);
  return scale;
}

PO_HOST_DEVICE void decode_moment_group(const int8_t* PO_RESTRICT codes, uint16_t scale,
                                        int count, float* PO_RESTRICT values) {
  const float decoded_scale = fp16_to_float(scale);
  for (int i = 0; i < count; ++i) values[i] = decode_moment(codes[i], decoded_scale);
}

// ---------------------------------------------------------------------------------------------
// Second moments: uint8 code of sqrt(v), linear.

// `inverse_scale` is scale_reciprocal() of the group's decoded fp16 scale (a scale of sqrt(v)).
PO_HOST_DEVICE uint8_t encode_second_moment(float value, float inverse_scale) {
  float code = multiply_rounded(sqrtf(value) * inverse_scale, kSecondMomentCodeMax);
  code = code < kSecondMomentCodeMax ? code : kSecondMomentCodeMax;
  code = code > 0.0f ? code : 0.0f;
  return uint8_t(int32_t(round_half_even(code)));
}

// sqrt(v) of a code. q * (s / 255) can round one fp32 ulp above s at q = 255; capping the
// root at s keeps decode -> encode idempotent (s is an fp16 value, so s * s is exact in fp32
// and sqrt gives s back, whose fp16 scale is s again). The select keeps a NaN scale NaN.
PO_HOST_DEVICE float second_moment_root(float code, float scale) {
  const float root = code * (scale * (1.0f / kSecondMomentCodeMax));
  return root < scale ? root : scale;
}

PO_HOST_DEVICE float decode_second_moment(uint8_t code, float scale) {
  const float root = second_moment_root(float(code), scale);
  return root * root;
}

// The second moment to put under the square root of AdamW's denominator (and only there):
// equal to decode_second_moment() for codes >= 1; code 0 decodes to the top of its interval,
// (0.5/255 * s)^2, instead of 0. Call pattern of the AdamW kernel, per element:
//   v_state = beta2 * decode_second_moment(q, s) + (1 - beta2) * g * g;  // re-encoded
//   v_denom = beta2 * decode_second_moment_for_denominator(q, s) + (1 - beta2) * g * g;
//   denom   = sqrtf(v_denom) + eps * sqrt(1 - beta2^t);   (see AdamWScalars)
// A NaN scale gives NaN, as the plain decode does.
PO_HOST_DEVICE float decode_second_moment_for_denominator(uint8_t code, float scale) {
  float q = float(code);
  q = q > 0.5f ? q : 0.5f;
  const float root = second_moment_root(q, scale);
  return root * root;
}

// Largest second moment of the group as an fp32 pattern, ordered as in moment_absmax_bits,
// or 0xffffffff (above inf, so it reaches the NaN scale with inf and NaN) when the group holds
// a negative value. -0.0 counts as 0. Two plain reductions, so that the loop vectorizes.
PO_HOST_DEVICE uint32_t second_moment_max_bits(const float* PO_RESTRICT values, int count) {
  uint32_t largest = 0;
  uint32_t negative = 0;
  for (int i = 0; i < count; ++i) {
    const uint32_t bits = float_to_bits(values[i]);
    const uint32_t magnitude = bits & 0x7fffffffu;
    largest = magnitude > largest ? magnitude : largest;
    negative |= uint32_t(bits > 0x80000000u);
  }
  return negative ? 0xffffffffu : largest;
}

// The per-element key of that maximum (a negative value maps above every other key); a
// CUDA warp reduces it across its lanes.
PO_HOST_DEVICE uint32_t second_moment_order_bits(float value) {
  const uint32_t bits = float_to_bits(value);
  return bits > 0x80000000u ? 0xffffffffu : bits & 0x7fffffffu;
}

// fp16 scale pattern (a scale of sqrt(v)) of a group whose largest key is `largest`.
PO_HOST_DEVICE uint16_t second_moment_scale_from_bits(uint32_t largest) {
  if (largest >= 0x7f800000u) return kScaleNaN;  // inf, NaN or a negative value
  return fp16_scale_at_least(sqrtf(bits_to_float(largest)));
}

// fp16 scale pattern (a scale of sqrt(v)) of a group of `count` <= kGroupSize second moments.
PO_HOST_DEVICE uint16_t second_moment_group_scale(const float* PO_RESTRICT values, int count) {
  return second_moment_scale_from_bits(second_moment_max_bits(values, count));
}

PO_HOST_DEVICE uint16_t encode_second_moment_group(const float* PO_RESTRICT values, int count,
                                                   uint8_t* PO_RESTRICT codes) {
  const uint16_t scale = second_moment_group_scale(values, count);
  const float inverse_scale = scale_reciprocal(fp16_to_float(scale));
  for (int i = 0; i < count; ++i) codes[i] = encode_second_moment(values[i], inverse_scale);
  return scale;
}

PO_HOST_DEVICE void decode_second_moment_group(const uint8_t* PO_RESTRICT codes, uint16_t scale,
                                               int count, float* PO_RESTRICT values) {
  const float decoded_scale = fp16_to_float(scale);
  for (int i = 0; i < count; ++i) values[i] = decode_second_moment(codes[i], decoded_scale);
}

}  // namespace pagedoptim::codec
