// Master weights of bf16 / fp16 parameters as the parameter itself plus an integer residual.
//
// The optimizer keeps no fp32 copy of a 16-bit parameter (DESIGN.md section 5). An fp32
// master value w is stored as
//   w' = round_to_nearest_even(w)                          the parameter the model sees
//   r  = round(clamp((w - w') / (u / 2), -1, 1) * K)       K = 127 (int8, master_bits=24)
//                                                            or 32767 (int16, master_bits=32)
// and rebuilt as w = w' + r / K * u / 2.
//
// u is the spacing of the 16-bit grid between w' and its neighbour on the side of w. It is the
// usual ulp(w') (the spacing above |w'|) except when |w'| is a power of two and w lies towards
// zero: there the grid below is twice as fine. Rounding to nearest puts w within u / 2 of w' on
// either side, so this choice spends the whole residual range on both sides; the spacing
// above would leave half the codes unused below a power of two and double the error there.
// The side is the sign of w - w', which r carries, so nothing else is stored (r = 0 makes the
// side irrelevant). In the subnormal range and at the smallest normal the spacing is the same
// on both sides, and at zero it is the subnormal spacing.
//
// Error bound: |rebuilt - w| <= u / (4K) in exact arithmetic, plus at most one fp32 ulp of the
// rebuilt value for computing it in fp32 (rounding the correction and the sum). For K = 127
// that is far below u / (4K). For bf16 with K = 32767 the residual step, u / 65534, is about
// one fp32 ulp and the master comes back within one fp32 ulp; fp16 with K = 32767 has a
// residual step finer than fp32's and, in fp16's normal range, comes back bit for bit. Rebuilding,
// splitting and rebuilding again returns the same fp32 value, so a step that leaves a weight
// unchanged does not drift it.
//
// Non-finite values: an inf or NaN master gives w' = inf / NaN and r = 0; a finite master beyond
// the 16-bit range rounds to w' = inf, as torch's cast does, with r = 0. The rebuilt value is
// then w' itself, so inf and NaN stay visible and a residual never turns them into a finite
// number.
//
// bf16 is handled in the integer domain: w' is w's fp32 pattern rounded at bit 16, and the
// fp32 patterns of w and w' (same sign) differ by (w - w') / (u / 2) * 2^15 exactly, across a
// power of two and through the subnormals too, because fp32's spacing changes at the same
// binades as bf16's. No division, and exact. fp16's subnormal range (below 2^-14) lies inside
// fp32's normal range, so fp16 uses the float formula with u built from w's exponent field.
//
// Inline and branch-free per element, for GCC's vectorizer and for nvcc.
#pragma once

#include <cstdint>

#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/common.h"

namespace pagedoptim::codec {

// K of the residual formula, per residual type.
template <typename Residual>
struct ResidualTraits;

template <>
struct ResidualTraits<int8_t> {
  static constexpr float kScale = 127.0f;
};

template <>
struct ResidualTraits<int16_t> {
  static constexpr float kScale = 32767.0f;
};

// ---------------------------------------------------------------------------------------------
// bf16

// Writes w' = bf16(master) to `param` and the residual of master - w' to `residual`.
template <typename Residual>
PO_HOST_DEVICE void split_master_bf16(float master, uint16_t& param, Residual& residual) {
  constexpr float kScale = ResidualTraits<Residual>::kScale;
  const uint16_t rounded = float_to_bf16(master);
  const uint32_t master_bits = float_to_bits(master);
  const uint32_t rounded_magnitude = (uint32_t(rounded) << 16) & 0x7fffffffu;
  // The magnitudes' patterns differ by |w - w'| in fp32 steps of the side of w, and half a
  // bf16 step on that side is 2^15 of them.
  const int32_t offset = int32_t(master_bits & 0x7fffffffu) - int32_t(rounded_magnitude);
  const float magnitude_ratio = float(offset) * (1.0f / 32768.0f);
  // Towards larger magnitude is towards larger value for w >= 0 and smaller for w < 0.
  float ratio = bits_to_float(float_to_bits(magnitude_ratio) ^ (master_bits & 0x80000000u));
  ratio = ratio < 1.0f ? ratio : 1.0f;
  ratio = ratio > -1.0f ? ratio : -1.0f;
  const float code = round_half_even(multiply_rounded(ratio, kScale));
  const bool finite = rounded_magnitude < 0x7f800000u;
  param = rounded;
  residual = Residual(int32_t(finite ? code : 0.0f));
}

// Rebuilds the fp32 master from the bf16 parameter pattern and its residual.
template <typename Residual>
PO_HOST_DEVICE float join_master_bf16(uint16_t param, Residual residual) {
  constexpr float kScale = ResidualTraits<Residual>::kScale;
  const uint32_t bits = uint32_t(param) << 16;
  const uint32_t sign = bits & 0x80000000u;
  const int32_t magnitude = int32_t(bits & 0x7fffffffu);
  // The residual in fp32 steps of the side it points to, signed as a change of magnitude.
  const float value_steps = multiply_rounded(float(residual), 32768.0f / kScale);
  const float magnitude_steps = bits_to_float(float_to_bits(value_steps) ^ sign);
  int32_t rebuilt = magnitude + int32_t(round_half_even(magnitude_steps));
  // Only a residual that split_master_bf16 never writes (one pointing below zero) lands here.
  rebuilt = rebuilt > 0 ? rebuilt : 0;
  const bool finite = magnitude < 0x7f800000;
  return bits_to_float(finite ? (sign | uint32_t(rebuilt)) : bits);
}

// ---------------------------------------------------------------------------------------------
// fp16

// Half the fp16 spacing next to |w'| (pattern `param`), on the side towards zero or away from
// it, as an fp32 power of two; `inverse` gets its reciprocal, exact as well.
PO_HOST_DEVICE float fp16_half_spacing(uint16_t param, bool toward_zero, float& inverse) {
  const uint32_t exponent = (uint32_t(param) >> 10) & 0x1fu;
  const uint32_t mantissa = uint32_t(param) & 0x3ffu;
  // Subnormals (exponent 0) share the spacing of the lowest binade: 2^(1 - 15 - 10).
  const uint32_t binade = exponent > 1u ? exponent : 1u;
  const uint32_t finer = uint32_t(toward_zero && mantissa == 0u && exponent > 1u);
  // The spacing above |w'| is 2^(binade - 25); half of it has fp32 exponent field
  // binade - 26 + 127. Both stay normal fp32 for every binade 1..31.
  const uint32_t half_field = binade + 101u - finer;
  inverse = bits_to_float((254u - half_field) << 23);
  return bits_to_float(half_field << 23);
}

// Writes w' = fp16(master) to `param` and the residual of master - w' to `residual`.
template <typename Residual>
PO_HOST_DEVICE void split_master_fp16(float master, uint16_t& param, Residual& residual) {
  constexpr float kScale = ResidualTraits<Residual>::kScale;
  const uint16_t rounded = float_to_fp16(master);
  const float rounded_value = fp16_to_float(rounded);
  // Exact (Sterbenz): w' is within a factor of 2 of w, or w' = 0 and the difference is w.
  const float difference = master - rounded_value;
  const bool toward_zero =
      ((float_to_bits(difference) ^ float_to_bits(rounded_value)) & 0x80000000u) != 0u;
  float inverse_half_spacing;
  fp16_half_spacing(rounded, toward_zero, inverse_half_spacing);
  float ratio = difference * inverse_half_spacing;  // exact: a power-of-two scaling
  ratio = ratio < 1.0f ? ratio : 1.0f;
  ratio = ratio > -1.0f ? ratio : -1.0f;
  const float code = round_half_even(multiply_rounded(ratio, kScale));
  const bool finite = (rounded & 0x7c00u) != 0x7c00u;
  param = rounded;
  residual = Residual(int32_t(finite ? code : 0.0f));
}

// Rebuilds the fp32 master from the fp16 parameter pattern and its residual.
template <typename Residual>
PO_HOST_DEVICE float join_master_fp16(uint16_t param, Residual residual) {
  constexpr float kScale = ResidualTraits<Residual>::kScale;
  const float rounded_value = fp16_to_float(param);
  const bool toward_zero = (residual < 0) != ((param & 0x8000u) != 0u);
  float unused_inverse;
  const float half_spacing = fp16_half_spacing(param, toward_zero, unused_inverse);
  const float correction = multiply_rounded(float(residual) * (1.0f / kScale), half_spacing);
  const float rebuilt = rounded_value + correction;
  // r = 0 returns w' itself, which keeps the sign of a -0 parameter (-0 + 0 would be +0).
  const bool keep_rounded = (param & 0x7c00u) == 0x7c00u || residual == 0;
  return keep_rounded ? rounded_value : rebuilt;
}

}  // namespace pagedoptim::codec
