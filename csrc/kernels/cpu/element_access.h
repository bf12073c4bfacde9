// Loads and stores of parameters and gradients as fp32, per element type and master mode.
//
// A ParamIo wraps the pointers of one span and gives `param(i)`, `grad(i)` and
// `store(i, value)` in fp32, so that one kernel template serves every combination:
//   PlainIo<Float32Access | BFloat16Access | Float16Access>  the parameter is the weight
//   MasterIo<Bf16Master | Fp16Master, int8_t | int16_t>      the weight is the 16-bit
//       parameter plus a residual (codec/master_split.h), joined on load, split on store
// Written so that the loops that call them vectorize: bf16 is integer shifts and a rounding
// add, fp16 uses the F16C conversion instructions when the translation unit is compiled
// with them (GCC then vectorizes _Float16 <-> float casts) and the portable bit-level
// conversion otherwise.
//
// In the namespace of the ISA the translation unit is compiled for (PO_CPU_ISA), as simd.h
// is: these inline functions compiled with -mavx2 are other functions than the baseline's,
// and under one name the linker keeps one copy for every table (Fp16Master::split, compiled
// with VEX encodings, was such a weak definition; scripts/check_isa_objects.py finds them).
#pragma once

#ifndef PO_CPU_ISA
#error "PO_CPU_ISA must name the ISA this translation unit is compiled for"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/codec/master_split.h"

namespace pagedoptim::kernels::PO_CPU_ISA {

struct Float32Access {
  using Storage = float;
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float value) { p[i] = value; }
};

struct BFloat16Access {
  using Storage = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return codec::bf16_to_float(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_bf16(value);
  }
};

#if defined(__F16C__)
struct Float16Access {
  using Storage = _Float16;
  static inline float load(const _Float16* p, int64_t i) { return float(p[i]); }
  static inline void store(_Float16* p, int64_t i, float value) { p[i] = _Float16(value); }
};
#else
struct Float16Access {
  using Storage = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return codec::fp16_to_float(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float value) {
    p[i] = codec::float_to_fp16(value);
  }
};
#endif

template <class Access>
struct PlainIo {
  using Storage = typename Access::Storage;
  Storage* PO_RESTRICT param_ptr;
  const Storage* PO_RESTRICT grad_ptr;

  PlainIo(const ParamSpan& span, const MasterResidual&)
      : param_ptr(static_cast<Storage*>(span.param)),
        grad_ptr(static_cast<const Storage*>(span.grad)) {}
  inline float param(int64_t i) const { return Access::load(param_ptr, i); }
  inline float grad(int64_t i) const { return Access::load(grad_ptr, i); }
  inline void store(int64_t i, float value) const { Access::store(param_ptr, i, value); }
  template <class Count>
  inline void store_group(int64_t base, const float* PO_RESTRICT values, Count count) const {
    for (int i = 0; i < count; ++i) Access::store(param_ptr, base + i, values[i]);
  }
};

struct Bf16Master {
  template <class Residual>
  static inline float join(uint16_t param, Residual residual) {
    return codec::join_master_bf16<Residual>(param, residual);
  }
  template <class Residual>
  static inline void split(float master, uint16_t& param, Residual& residual) {
    codec::split_master_bf16<Residual>(master, param, residual);
  }
  static inline float load_grad(uint16_t g) { return codec::bf16_to_float(g); }
};

struct Fp16Master {
  template <class Residual>
  static inline float join(uint16_t param, Residual residual) {
    return codec::join_master_fp16<Residual>(param, residual);
  }
  template <class Residual>
  static inline void split(float master, uint16_t& param, Residual& residual) {
    codec::split_master_fp16<Residual>(master, param, residual);
  }
  static inline float load_grad(uint16_t g) { return codec::fp16_to_float(g); }
};

template <class Master, class Residual>
struct MasterIo {
  uint16_t* PO_RESTRICT param_ptr;
  Residual* PO_RESTRICT residual_ptr;
  const uint16_t* PO_RESTRICT grad_ptr;

  MasterIo(const ParamSpan& span, const MasterResidual& residual)
      : param_ptr(static_cast<uint16_t*>(span.param)),
        residual_ptr(static_cast<Residual*>(residual.values)),
        grad_ptr(static_cast<const uint16_t*>(span.grad)) {}
  inline float param(int64_t i) const {
    return Master::template join<Residual>(param_ptr[i], residual_ptr[i]);
  }
  inline float grad(int64_t i) const { return Master::load_grad(grad_ptr[i]); }
  inline void store(int64_t i, float value) const {
    Master::template split<Residual>(value, param_ptr[i], residual_ptr[i]);
  }
  // Stores values[0, count) at base. The split goes to local arrays first: an int8 residual
  // store may alias anything as far as GCC knows (restrict on members is not honoured), and
  // that alone keeps the split loop scalar, at about 30 instructions per element.
  template <class Count>
  inline void store_group(int64_t base, const float* PO_RESTRICT values, Count count) const {
    uint16_t params[kGroupSize];
    Residual residuals[kGroupSize];
    for (int i = 0; i < count; ++i) {
      Master::template split<Residual>(values[i], params[i], residuals[i]);
    }
    // count is in (0, kGroupSize]; the clamp tells GCC so.
    const size_t n = size_t(std::clamp(int(count), 0, kGroupSize));
    std::memcpy(param_ptr + base, params, sizeof(uint16_t) * n);
    std::memcpy(residual_ptr + base, residuals, sizeof(Residual) * n);
  }
};

// Calls Body::template run<Io>(args...) with the ParamIo of the span's type and residual.
template <template <class> class Body, class... Args>
inline void with_param_io(const ParamSpan& span, const MasterResidual& residual,
                          Args&&... args) {
  switch (span.type) {
    case ElementType::kFloat32:
      Body<PlainIo<Float32Access>>::run(args...);
      return;
    case ElementType::kBFloat16:
      if (residual.bits == 8) return Body<MasterIo<Bf16Master, int8_t>>::run(args...);
      if (residual.bits == 16) return Body<MasterIo<Bf16Master, int16_t>>::run(args...);
      return Body<PlainIo<BFloat16Access>>::run(args...);
    case ElementType::kFloat16:
      if (residual.bits == 8) return Body<MasterIo<Fp16Master, int8_t>>::run(args...);
      if (residual.bits == 16) return Body<MasterIo<Fp16Master, int16_t>>::run(args...);
      return Body<PlainIo<Float16Access>>::run(args...);
  }
}

}  // namespace pagedoptim::kernels::PO_CPU_ISA
