// bf16 / fp16 <-> fp32 conversions on raw 16-bit patterns.
//
// Kernels see parameters and gradients as raw pointers, so the 16-bit formats travel as
// uint16_t. These conversions are written with integer operations only (no intrinsics) so
// that GCC vectorizes them with whatever ISA the translation unit is compiled for, and nvcc
// compiles the same code. Rounding is round-to-nearest-even, as torch's casts do.
#pragma once

#include <cstdint>
#include <cstring>

#include "pagedoptim/common.h"

namespace pagedoptim::codec {

PO_HOST_DEVICE float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

PO_HOST_DEVICE uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

PO_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN instead of rounding into an infinity.
PO_HOST_DEVICE uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  const uint16_t rounded = uint16_t((bits + rounding_bias) >> 16);
  return is_nan ? uint16_t((bits >> 16) | 0x40u) : rounded;
}

// IEEE binary16 -> binary32, exact for every input (normals, subnormals, inf, NaN).
PO_HOST_DEVICE float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // inf / NaN
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {  // zero / subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// binary32 -> binary16 with round-to-nearest-even, overflow to inf, gradual underflow.
PO_HOST_DEVICE uint16_t float_to_fp16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (abs_bits >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero): scale so that one fp16 subnormal ulp (2^-24) becomes 1.0
    // and let the fp32 adder round to nearest even for us.
    const float scaled = bits_to_float(abs_bits) * 16777216.0f;  // 2^24
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;    // rint for |x| < 2^23
    return uint16_t(sign | uint32_t(rounded));
  }
  const uint32_t rounding_bias = 0xfffu + ((abs_bits >> 13) & 1u);
  return uint16_t(sign | ((abs_bits - (112u << 23) + rounding_bias) >> 13));
}

}  // namespace pagedoptim::codec
