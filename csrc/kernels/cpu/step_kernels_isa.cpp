// The fused step kernels, compiled once per ISA (see CMakeLists.txt: this file is built
// with -DPO_CPU_ISA=<name> and that ISA's -m flags; dispatch.cpp picks one at run time).
//
// Two loop shapes. fp32 state: one plain loop over elements. Companded 8-bit state: a loop
// over groups of kGroupSize elements; each group is decoded into registers-sized local
// arrays, updated, and re-encoded with its new scale before the next group is touched, so
// state memory is read and written once. Full groups take a constant trip count, which
// GCC unrolls and vectorizes completely; only a parameter's last group is partial.
// The element math is the shared codec/update_rules.h; branches that depend only on
// hyperparameters (amsgrad, momentum, first step) sit outside the loops. On AVX2 and AVX-512
// the full 8-bit groups run hand-vectorized (companded_groups.h: the same bits, about twice
// the speed); partial groups, amsgrad and fp16 params keep the loops here.
#include <algorithm>
#include <type_traits>

#include "kernels/cpu/companded_groups.h"
#include "kernels/cpu/element_access.h"
#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/companding.h"

#ifndef PO_CPU_ISA
#error "PO_CPU_ISA must name the ISA this translation unit is compiled for"
#endif

namespace pagedoptim::kernels::PO_CPU_ISA {
namespace {

using codec::AdamWScalars;
using codec::LionScalars;
using codec::SGDScalars;

// Runs body(base, count) for every group of the span from element `begin` (a group
// boundary) on; full groups with a constant count.
template <class Body>
inline void for_each_group(int64_t n, const Body& body, int64_t begin = 0) {
  const int64_t full_end = n / kGroupSize * kGroupSize;
  for (int64_t base = begin; base < full_end; base += kGroupSize) {
    body(base, std::integral_constant<int, kGroupSize>());
  }
  if (full_end < n) body(full_end, int(n - full_end));
}

// ---------------------------------------------------------------------------------------------
// AdamW

// A group of second moments as the state keeps them and as the denominator sees them. The
// two decodes differ only at code 0, whose denominator value is one constant per group, so
// a select replaces the second decode (the same bits as
// codec::decode_second_moment_for_denominator for every code).
template <class Count>
inline void decode_second_moments(const uint8_t* PO_RESTRICT codes, uint16_t scale_bits,
                                  Count count, float* PO_RESTRICT values,
                                  float* PO_RESTRICT denominators) {
  const float scale = codec::fp16_to_float(scale_bits);
  const float code_zero_denominator = codec::decode_second_moment_for_denominator(0, scale);
  for (int i = 0; i < count; ++i) {
    values[i] = codec::decode_second_moment(codes[i], scale);
    denominators[i] = codes[i] == 0 ? code_zero_denominator : values[i];
  }
}

template <class Io, bool kAmsgrad>
void adamw_fp32_state(const ParamSpan& span, const AdamWStreams& st, const AdamWScalars& s) {
  const Io io(span, st.residual);
  float* PO_RESTRICT m = static_cast<float*>(st.m.values);
  float* PO_RESTRICT v = static_cast<float*>(st.v.values);
  float* PO_RESTRICT v_max = static_cast<float*>(st.v_max.values);
  const int64_t n = span.count;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = io.param(i);
    const float g = io.grad(i);
    if constexpr (kAmsgrad) {
      codec::adamw_element<true>(p, g, m[i], v[i], v_max[i], s);
    } else {
      float unused_max = 0.0f;
      codec::adamw_element<false>(p, g, m[i], v[i], unused_max, s);
    }
    io.store(i, p);
  }
}

template <class Io, bool kAmsgrad>
void adamw_8bit_state(const ParamSpan& span, const AdamWStreams& st, const AdamWScalars& s) {
  const Io io(span, st.residual);
  int8_t* PO_RESTRICT m_codes = static_cast<int8_t*>(st.m.values);
  uint8_t* PO_RESTRICT v_codes = static_cast<uint8_t*>(st.v.values);
  uint8_t* PO_RESTRICT v_max_codes = static_cast<uint8_t*>(st.v_max.values);
  // Full groups run hand-vectorized where there is a vector form; the rest below.
  int64_t vectorized_end = 0;
#if defined(PO_SIMD_GROUPS)
  if constexpr (!kAmsgrad) vectorized_end = simd::adamw_full_groups<Io>(span, st, s);
#endif
  for_each_group(span.count, [&](int64_t base, auto count) {
    const int64_t group = base / kGroupSize;
    float m[kGroupSize], v[kGroupSize], v_denominator[kGroupSize];
    float v_max[kGroupSize], v_max_denominator[kGroupSize];
    codec::decode_moment_group(m_codes + base, st.m.scales[group], count, m);
    decode_second_moments(v_codes + base, st.v.scales[group], count, v, v_denominator);
    if constexpr (kAmsgrad) {
      decode_second_moments(v_max_codes + base, st.v_max.scales[group], count, v_max,
                            v_max_denominator);
    }
    // Load, update and store in three loops: each is simple enough for GCC to vectorize,
    // where one loop with a master residual's join and split inside it is not.
    float p[kGroupSize], g[kGroupSize];
    for (int i = 0; i < count; ++i) {
      p[i] = io.param(base + i);
      g[i] = io.grad(base + i);
    }
    for (int i = 0; i < count; ++i) {
      codec::adamw_element<kAmsgrad>(p[i], g[i], m[i], v[i], v_denominator[i], v_max[i],
                                     v_max_denominator[i], s);
    }
    io.store_group(base, p, count);
    st.m.scales[group] = codec::encode_moment_group(m, count, m_codes + base);
    st.v.scales[group] = codec::encode_second_moment_group(v, count, v_codes + base);
    if constexpr (kAmsgrad) {
      st.v_max.scales[group] = codec::encode_second_moment_group(v_max, count, v_max_codes + base);
    }
  }, vectorized_end);
}

template <class Io>
struct AdamWBody {
  static void run(const ParamSpan& span, const AdamWStreams& st, const AdamWScalars& s) {
    const bool amsgrad = st.v_max.present();
    if (st.m.quantized()) {
      amsgrad ? adamw_8bit_state<Io, true>(span, st, s) : adamw_8bit_state<Io, false>(span, st, s);
    } else {
      amsgrad ? adamw_fp32_state<Io, true>(span, st, s) : adamw_fp32_state<Io, false>(span, st, s);
    }
  }
};

void adamw(const ParamSpan& span, const AdamWStreams& st, const AdamWScalars& s) {
  with_param_io<AdamWBody>(span, st.residual, span, st, s);
}

// ---------------------------------------------------------------------------------------------
// SGD

template <class Io>
void sgd_stateless(const ParamSpan& span, const MomentumStreams& st, const SGDScalars& s) {
  const Io io(span, st.residual);
  const int64_t n = span.count;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = io.param(i);
    codec::sgd_element(p, io.grad(i), s);
    io.store(i, p);
  }
}

// SGD's momentum buffer and Lion's first moment are one first-moment stream each, updated
// by an element rule: one pair of loops (fp32 state, 8-bit groups) serves both.
struct SgdRule {
  using Scalars = SGDScalars;
#if defined(PO_SIMD_GROUPS)
  using Vector = simd::SgdMomentumRule;
#endif
  static inline void apply(float& p, float g, float& m, const Scalars& s) {
    codec::sgd_momentum_element(p, g, m, s);
  }
};

struct LionRule {
  using Scalars = LionScalars;
#if defined(PO_SIMD_GROUPS)
  using Vector = simd::LionRule;
#endif
  static inline void apply(float& p, float g, float& m, const Scalars& s) {
    codec::lion_element(p, g, m, s);
  }
};

template <class Io, class Rule>
void momentum_fp32_state(const ParamSpan& span, const MomentumStreams& st,
                         const typename Rule::Scalars& s) {
  const Io io(span, st.residual);
  float* PO_RESTRICT m = static_cast<float*>(st.m.values);
  const int64_t n = span.count;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = io.param(i);
    Rule::apply(p, io.grad(i), m[i], s);
    io.store(i, p);
  }
}

template <class Io, class Rule>
void momentum_8bit_state(const ParamSpan& span, const MomentumStreams& st,
                         const typename Rule::Scalars& s) {
  const Io io(span, st.residual);
  int8_t* PO_RESTRICT codes = static_cast<int8_t*>(st.m.values);
  int64_t vectorized_end = 0;  // as in adamw_8bit_state
#if defined(PO_SIMD_GROUPS)
  vectorized_end = simd::momentum_full_groups<Io, typename Rule::Vector>(span, st, s);
#endif
  for_each_group(span.count, [&](int64_t base, auto count) {
    const int64_t group = base / kGroupSize;
    float m[kGroupSize];
    codec::decode_moment_group(codes + base, st.m.scales[group], count, m);
    float p[kGroupSize], g[kGroupSize];  // three loops, as in adamw_8bit_state
    for (int i = 0; i < count; ++i) {
      p[i] = io.param(base + i);
      g[i] = io.grad(base + i);
    }
    for (int i = 0; i < count; ++i) Rule::apply(p[i], g[i], m[i], s);
    io.store_group(base, p, count);
    st.m.scales[group] = codec::encode_moment_group(m, count, codes + base);
  }, vectorized_end);
}

template <class Io, class Rule>
void momentum_state(const ParamSpan& span, const MomentumStreams& st,
                    const typename Rule::Scalars& s) {
  st.m.quantized() ? momentum_8bit_state<Io, Rule>(span, st, s)
                   : momentum_fp32_state<Io, Rule>(span, st, s);
}

template <class Io>
struct SGDBody {
  static void run(const ParamSpan& span, const MomentumStreams& st, const SGDScalars& s) {
    if (!st.m.present()) {
      sgd_stateless<Io>(span, st, s);
    } else {
      momentum_state<Io, SgdRule>(span, st, s);
    }
  }
};

void sgd(const ParamSpan& span, const MomentumStreams& st, const SGDScalars& s) {
  with_param_io<SGDBody>(span, st.residual, span, st, s);
}

// ---------------------------------------------------------------------------------------------
// Lion

template <class Io>
struct LionBody {
  static void run(const ParamSpan& span, const MomentumStreams& st, const LionScalars& s) {
    momentum_state<Io, LionRule>(span, st, s);
  }
};

void lion(const ParamSpan& span, const MomentumStreams& st, const LionScalars& s) {
  with_param_io<LionBody>(span, st.residual, span, st, s);
}

}  // namespace

#define PO_STRINGIFY_INNER(x) #x
#define PO_STRINGIFY(x) PO_STRINGIFY_INNER(x)

// extern: a namespace-scope const has internal linkage otherwise, and dispatch.cpp needs it.
extern const CpuKernelTable kTable;
const CpuKernelTable kTable = {PO_STRINGIFY(PO_CPU_ISA), &adamw, &sgd, &lion};

}  // namespace pagedoptim::kernels::PO_CPU_ISA
