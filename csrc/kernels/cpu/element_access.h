// Loads and stores of parameter/gradient elements as fp32, per element type.
//
// Written so that the loops that call them vectorize: the bf16 path is integer shifts and a
// rounding add, the fp16 path uses the F16C conversion instructions when the translation
// unit is compiled with them (GCC then vectorizes _Float16 <-> float casts) and the portable
// bit-level conversion otherwise.
#pragma once

#include <cstdint>

#include "pagedoptim/codec/float_convert.h"

namespace pagedoptim::kernels {

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

}  // namespace pagedoptim::kernels
