// Parameter and gradient access of the table kernels, per element type and master mode:
// `load(i)` gives the fp32 weight (the 16-bit parameter joined with its master residual
// when there is one), `gradient(i)` the fp32 gradient, `store(i, w)` writes the weight back
// (split again into parameter and residual). __host__ __device__, so the CUDA kernels and
// their host emulation share them; the arithmetic is the shared codec's, which is what makes
// CUDA and CPU results agree bit for bit.
#pragma once

#include <cstdint>

#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/master_split.h"
#include "pagedoptim/kernels/step_table.h"

namespace pagedoptim::kernels::table {

struct Float32Io {
  float* param;
  const float* grad;
  PO_HOST_DEVICE explicit Float32Io(const StepRow& row)
      : param(static_cast<float*>(row.param)), grad(static_cast<const float*>(row.grad)) {}
  PO_HOST_DEVICE float load(int64_t i) const { return param[i]; }
  PO_HOST_DEVICE float gradient(int64_t i) const { return grad[i]; }
  PO_HOST_DEVICE void store(int64_t i, float value) const { param[i] = value; }
};

template <bool kBf16>
PO_HOST_DEVICE float half_to_float(uint16_t h) {
  return kBf16 ? codec::bf16_to_float(h) : codec::fp16_to_float(h);
}

// A bf16 or fp16 parameter that is its own weight (master_bits=None).
template <bool kBf16>
struct Half16Io {
  uint16_t* param;
  const uint16_t* grad;
  PO_HOST_DEVICE explicit Half16Io(const StepRow& row)
      : param(static_cast<uint16_t*>(row.param)), grad(static_cast<const uint16_t*>(row.grad)) {}
  PO_HOST_DEVICE float load(int64_t i) const { return half_to_float<kBf16>(param[i]); }
  PO_HOST_DEVICE float gradient(int64_t i) const { return half_to_float<kBf16>(grad[i]); }
  PO_HOST_DEVICE void store(int64_t i, float value) const {
    param[i] = kBf16 ? codec::float_to_bf16(value) : codec::float_to_fp16(value);
  }
};

// A bf16 or fp16 parameter plus its int8/int16 master residual (codec/master_split.h).
template <bool kBf16, class Residual>
struct MasterIo {
  uint16_t* param;
  Residual* residual;
  const uint16_t* grad;
  PO_HOST_DEVICE explicit MasterIo(const StepRow& row)
      : param(static_cast<uint16_t*>(row.param)),
        residual(static_cast<Residual*>(row.residual)),
        grad(static_cast<const uint16_t*>(row.grad)) {}
  PO_HOST_DEVICE float load(int64_t i) const {
    if constexpr (kBf16) {
      return codec::join_master_bf16<Residual>(param[i], residual[i]);
    } else {
      return codec::join_master_fp16<Residual>(param[i], residual[i]);
    }
  }
  PO_HOST_DEVICE float gradient(int64_t i) const { return half_to_float<kBf16>(grad[i]); }
  PO_HOST_DEVICE void store(int64_t i, float value) const {
    if constexpr (kBf16) {
      codec::split_master_bf16<Residual>(value, param[i], residual[i]);
    } else {
      codec::split_master_fp16<Residual>(value, param[i], residual[i]);
    }
  }
};

// Calls visit.template operator()<Io>() with the access of the variant's parameters;
// false for a combination no kernel exists for.
template <class Visit>
bool visit_param_io(const StepVariant& variant, Visit&& visit) {
  switch (variant.type) {
    case ElementType::kFloat32:
      if (variant.residual_bits != 0) return false;
      visit.template operator()<Float32Io>();
      return true;
    case ElementType::kBFloat16:
      if (variant.residual_bits == 8) {
        visit.template operator()<MasterIo<true, int8_t>>();
      } else if (variant.residual_bits == 16) {
        visit.template operator()<MasterIo<true, int16_t>>();
      } else if (variant.residual_bits == 0) {
        visit.template operator()<Half16Io<true>>();
      } else {
        return false;
      }
      return true;
    case ElementType::kFloat16:
      if (variant.residual_bits == 8) {
        visit.template operator()<MasterIo<false, int8_t>>();
      } else if (variant.residual_bits == 16) {
        visit.template operator()<MasterIo<false, int16_t>>();
      } else if (variant.residual_bits == 0) {
        visit.template operator()<Half16Io<false>>();
      } else {
        return false;
      }
      return true;
  }
  return false;
}

}  // namespace pagedoptim::kernels::table
