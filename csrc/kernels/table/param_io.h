// Parameter and gradient access of the table kernels, per element type and master mode:
// `load(i)` gives the fp32 weight (the 16-bit parameter joined with its master residual
// when there is one), `gradient(i)` the fp32 gradient, `store(i, w)` writes the weight back
// (split again into parameter and residual). __host__ __device__, so the CUDA kernels and
// their host emulation share them; the arithmetic is the shared codec's, which is what makes
// CUDA and CPU results agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/master_split.h"
#include "pagedoptim/kernels/step_table.h"

namespace pagedoptim::kernels::table {

// Elements a lane of the vector bodies owns: four consecutive ones, loaded and stored with
// one 4-, 8- or 16-byte access each when all four exist (the driver only hands such bodies
// rows whose pointers are aligned for it), element by element in a row's partial last group.
constexpr int kVectorWidth = 4;

template <class T>
PO_HOST_DEVICE void load_vector(const T* data, int64_t first, int active, T (&out)[kVectorWidth]) {
  if (active == kVectorWidth) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 1) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(data + first);
      for (int k = 0; k < kVectorWidth; ++k) out[k] = T(uint8_t(word >> (8 * k)));
    } else if constexpr (sizeof(T) == 2) {
      const uint2 words = *reinterpret_cast<const uint2*>(data + first);
      const uint32_t halves[2] = {words.x, words.y};
      for (int k = 0; k < kVectorWidth; ++k) {
        out[k] = T(uint16_t(halves[k / 2] >> (16 * (k % 2))));
      }
    } else {
      const uint4 words = *reinterpret_cast<const uint4*>(data + first);
      const uint32_t all[4] = {words.x, words.y, words.z, words.w};
      for (int k = 0; k < kVectorWidth; ++k) memcpy(&out[k], &all[k], sizeof(T));
    }
#else
    memcpy(out, data + first, sizeof(out));
#endif
    return;
  }
  for (int k = 0; k < kVectorWidth; ++k) {
    if (k < active) out[k] = data[first + k];
  }
}

template <class T>
PO_HOST_DEVICE void store_vector(T* data, int64_t first, int active, const T (&in)[kVectorWidth]) {
  if (active == kVectorWidth) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 1) {
      uint32_t word = 0;
      for (int k = 0; k < kVectorWidth; ++k) word |= uint32_t(uint8_t(in[k])) << (8 * k);
      *reinterpret_cast<uint32_t*>(data + first) = word;
    } else if constexpr (sizeof(T) == 2) {
      uint32_t halves[2] = {0, 0};
      for (int k = 0; k < kVectorWidth; ++k) {
        halves[k / 2] |= uint32_t(uint16_t(in[k])) << (16 * (k % 2));
      }
      *reinterpret_cast<uint2*>(data + first) = make_uint2(halves[0], halves[1]);
    } else {
      uint32_t all[4];
      for (int k = 0; k < kVectorWidth; ++k) memcpy(&all[k], &in[k], sizeof(T));
      *reinterpret_cast<uint4*>(data + first) = make_uint4(all[0], all[1], all[2], all[3]);
    }
#else
    memcpy(data + first, in, sizeof(in));
#endif
    return;
  }
  for (int k = 0; k < kVectorWidth; ++k) {
    if (k < active) data[first + k] = in[k];
  }
}

// Whether `pointer` may be accessed kVectorWidth elements of `element_bytes` at a time.
inline bool vector_aligned(const void* pointer, int64_t element_bytes) {
  return pointer == nullptr ||
         reinterpret_cast<uintptr_t>(pointer) % uintptr_t(kVectorWidth * element_bytes) == 0;
}

struct Float32Io {
  float* param;
  const float* grad;
  PO_HOST_DEVICE explicit Float32Io(const StepRow& row)
      : param(static_cast<float*>(row.param)), grad(static_cast<const float*>(row.grad)) {}
  PO_HOST_DEVICE float load(int64_t i) const { return param[i]; }
  PO_HOST_DEVICE float gradient(int64_t i) const { return grad[i]; }
  PO_HOST_DEVICE void store(int64_t i, float value) const { param[i] = value; }

  PO_HOST_DEVICE void load_vector(int64_t first, int active, float (&out)[kVectorWidth]) const {
    table::load_vector(param, first, active, out);
  }
  PO_HOST_DEVICE void gradient_vector(int64_t first, int active,
                                      float (&out)[kVectorWidth]) const {
    table::load_vector(grad, first, active, out);
  }
  PO_HOST_DEVICE void store_vector(int64_t first, int active,
                                   const float (&in)[kVectorWidth]) const {
    table::store_vector(param, first, active, in);
  }
};

template <bool kBf16>
PO_HOST_DEVICE float half_to_float(uint16_t h) {
  return kBf16 ? codec::bf16_to_float(h) : codec::fp16_to_float(h);
}

// Four bf16 or fp16 elements (fewer in a partial group) as fp32.
template <bool kBf16>
PO_HOST_DEVICE void load_half_vector(const uint16_t* data, int64_t first, int active,
                                     float (&out)[kVectorWidth]) {
  uint16_t bits[kVectorWidth];
  load_vector(data, first, active, bits);
  for (int k = 0; k < kVectorWidth; ++k) {
    if (k < active) out[k] = half_to_float<kBf16>(bits[k]);
  }
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

  PO_HOST_DEVICE void load_vector(int64_t first, int active, float (&out)[kVectorWidth]) const {
    load_half_vector<kBf16>(param, first, active, out);
  }
  PO_HOST_DEVICE void gradient_vector(int64_t first, int active,
                                      float (&out)[kVectorWidth]) const {
    load_half_vector<kBf16>(grad, first, active, out);
  }
  PO_HOST_DEVICE void store_vector(int64_t first, int active,
                                   const float (&in)[kVectorWidth]) const {
    uint16_t bits[kVectorWidth] = {};
    for (int k = 0; k < kVectorWidth; ++k) {
      if (k >= active) continue;
      bits[k] = kBf16 ? codec::float_to_bf16(in[k]) : codec::float_to_fp16(in[k]);
    }
    table::store_vector(param, first, active, bits);
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

  // The fp32 master weight of a 16-bit parameter and its residual, and back.
  PO_HOST_DEVICE static float join(uint16_t bits, Residual part) {
    if constexpr (kBf16) {
      return codec::join_master_bf16<Residual>(bits, part);
    } else {
      return codec::join_master_fp16<Residual>(bits, part);
    }
  }
  PO_HOST_DEVICE static void split(float value, uint16_t& bits, Residual& part) {
    if constexpr (kBf16) {
      codec::split_master_bf16<Residual>(value, bits, part);
    } else {
      codec::split_master_fp16<Residual>(value, bits, part);
    }
  }

  PO_HOST_DEVICE float load(int64_t i) const { return join(param[i], residual[i]); }
  PO_HOST_DEVICE float gradient(int64_t i) const { return half_to_float<kBf16>(grad[i]); }
  PO_HOST_DEVICE void store(int64_t i, float value) const { split(value, param[i], residual[i]); }

  PO_HOST_DEVICE void load_vector(int64_t first, int active, float (&out)[kVectorWidth]) const {
    uint16_t bits[kVectorWidth];
    Residual parts[kVectorWidth];
    table::load_vector(param, first, active, bits);
    table::load_vector(residual, first, active, parts);
    for (int k = 0; k < kVectorWidth; ++k) {
      if (k < active) out[k] = join(bits[k], parts[k]);
    }
  }
  PO_HOST_DEVICE void gradient_vector(int64_t first, int active,
                                      float (&out)[kVectorWidth]) const {
    load_half_vector<kBf16>(grad, first, active, out);
  }
  PO_HOST_DEVICE void store_vector(int64_t first, int active,
                                   const float (&in)[kVectorWidth]) const {
    uint16_t bits[kVectorWidth] = {};
    Residual parts[kVectorWidth] = {};
    for (int k = 0; k < kVectorWidth; ++k) {
      if (k < active) split(in[k], bits[k], parts[k]);
    }
    table::store_vector(param, first, active, bits);
    table::store_vector(residual, first, active, parts);
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
