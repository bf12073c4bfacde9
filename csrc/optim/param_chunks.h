// The parameter and gradient elements that go with a piece of a page segment, shared by the
// CPU chunk driver (paged_state.cpp) and the table driver (table_step.cpp).
#pragma once

#include <cstdint>

#include "pagedoptim/kernels/step_args.h"
#include "pagedoptim/paging/page_table.h"

namespace pagedoptim::optim {

inline int64_t element_size(kernels::ElementType type) {
  return type == kernels::ElementType::kFloat32 ? 4 : 2;
}

// Elements [begin, begin + count) of `segment`, in the parameter and its gradient.
inline kernels::ParamSpan chunk_span(const kernels::ParamSpan& whole,
                                     const paging::Segment& segment, int64_t begin,
                                     int64_t count) {
  const int64_t offset = (segment.param_offset + begin) * element_size(whole.type);
  return kernels::ParamSpan{static_cast<char*>(whole.param) + offset,
                            static_cast<const char*>(whole.grad) + offset, count, whole.type};
}

}  // namespace pagedoptim::optim
