// The fused step kernels, compiled once per ISA (see CMakeLists.txt: this file is built
// with -DPO_CPU_ISA=<name> and that ISA's -m flags; dispatch.cpp picks one at run time).
//
// The loops are plain C++ over restrict pointers so that GCC vectorizes them for the ISA
// of the translation unit; the element math is the shared codec/update_rules.h. Branches
// that depend only on hyperparameters (amsgrad, momentum, first step) sit outside the loops.
#include "kernels/cpu/element_access.h"
#include "kernels/cpu/step_kernels.h"

#ifndef PO_CPU_ISA
#error "PO_CPU_ISA must name the ISA this translation unit is compiled for"
#endif

namespace pagedoptim::kernels::PO_CPU_ISA {
namespace {

template <class Access, bool kAmsgrad>
void adamw_loop(const ParamSpan& span, float* PO_RESTRICT m, float* PO_RESTRICT v,
                float* PO_RESTRICT v_max, const codec::AdamWScalars& s) {
  using Storage = typename Access::Storage;
  Storage* PO_RESTRICT param = static_cast<Storage*>(span.param);
  const Storage* PO_RESTRICT grad = static_cast<const Storage*>(span.grad);
  const int64_t n = span.count;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = Access::load(param, i);
    const float g = Access::load(grad, i);
    if constexpr (kAmsgrad) {
      codec::adamw_element<true>(p, g, m[i], v[i], v_max[i], s);
    } else {
      float unused_max = 0.0f;
      codec::adamw_element<false>(p, g, m[i], v[i], unused_max, s);
    }
    Access::store(param, i, p);
  }
}

template <class Access>
void sgd_loop(const ParamSpan& span, float* PO_RESTRICT buffer, const codec::SGDScalars& s) {
  using Storage = typename Access::Storage;
  Storage* PO_RESTRICT param = static_cast<Storage*>(span.param);
  const Storage* PO_RESTRICT grad = static_cast<const Storage*>(span.grad);
  const int64_t n = span.count;
  if (buffer == nullptr) {
#pragma GCC ivdep
    for (int64_t i = 0; i < n; ++i) {
      float p = Access::load(param, i);
      codec::sgd_element(p, Access::load(grad, i), s);
      Access::store(param, i, p);
    }
    return;
  }
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = Access::load(param, i);
    codec::sgd_momentum_element(p, Access::load(grad, i), buffer[i], s);
    Access::store(param, i, p);
  }
}

template <class Access>
void lion_loop(const ParamSpan& span, float* PO_RESTRICT m, const codec::LionScalars& s) {
  using Storage = typename Access::Storage;
  Storage* PO_RESTRICT param = static_cast<Storage*>(span.param);
  const Storage* PO_RESTRICT grad = static_cast<const Storage*>(span.grad);
  const int64_t n = span.count;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float p = Access::load(param, i);
    codec::lion_element(p, Access::load(grad, i), m[i], s);
    Access::store(param, i, p);
  }
}

template <template <class> class Loop, class... Args>
void for_element_type(ElementType type, Args&&... args) {
  switch (type) {
    case ElementType::kFloat32: Loop<Float32Access>::run(args...); return;
    case ElementType::kBFloat16: Loop<BFloat16Access>::run(args...); return;
    case ElementType::kFloat16: Loop<Float16Access>::run(args...); return;
  }
}

template <class Access>
struct AdamWLoop {
  static void run(const ParamSpan& span, float* m, float* v, float* v_max,
                  const codec::AdamWScalars& s) {
    if (v_max != nullptr) {
      adamw_loop<Access, true>(span, m, v, v_max, s);
    } else {
      adamw_loop<Access, false>(span, m, v, nullptr, s);
    }
  }
};

template <class Access>
struct SGDLoop {
  static void run(const ParamSpan& span, float* buffer, const codec::SGDScalars& s) {
    sgd_loop<Access>(span, buffer, s);
  }
};

template <class Access>
struct LionLoop {
  static void run(const ParamSpan& span, float* m, const codec::LionScalars& s) {
    lion_loop<Access>(span, m, s);
  }
};

void adamw_fp32_state(const ParamSpan& span, float* m, float* v, float* v_max,
                      const codec::AdamWScalars& s) {
  for_element_type<AdamWLoop>(span.type, span, m, v, v_max, s);
}

void sgd_fp32_state(const ParamSpan& span, float* buffer, const codec::SGDScalars& s) {
  for_element_type<SGDLoop>(span.type, span, buffer, s);
}

void lion_fp32_state(const ParamSpan& span, float* m, const codec::LionScalars& s) {
  for_element_type<LionLoop>(span.type, span, m, s);
}

}  // namespace

#define PO_STRINGIFY_INNER(x) #x
#define PO_STRINGIFY(x) PO_STRINGIFY_INNER(x)

// extern: a namespace-scope const has internal linkage otherwise, and dispatch.cpp needs it.
extern const CpuKernelTable kTable;
const CpuKernelTable kTable = {
    PO_STRINGIFY(PO_CPU_ISA),
    &adamw_fp32_state,
    &sgd_fp32_state,
    &lion_fp32_state,
};

}  // namespace pagedoptim::kernels::PO_CPU_ISA
