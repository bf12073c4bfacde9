// The one place that maps a StepVariant to the kernel body that runs it. The CUDA launcher
// instantiates a __global__ per body through it, the host emulation runs the same body.
#pragma once

#include "kernels/table/param_io.h"
#include "kernels/table/skewadam_bodies.h"
#include "kernels/table/step_bodies.h"
#include "kernels/table/vector_bodies.h"

namespace pagedoptim::kernels::table {

// Calls visit.template operator()<Body>() with the first-moment body of `Rule` for the
// variant's state format (none, fp32, 8-bit).
template <class Io, class Rule, class Visit>
void visit_first_moment_body(StateFormat state, bool vector, Visit&& visit) {
  switch (state) {
    case StateFormat::kNone: visit.template operator()<StatelessBody<Io, Rule>>(); return;
    case StateFormat::kFloat32: visit.template operator()<MomentumFloat32Body<Io, Rule>>(); return;
    case StateFormat::kCompanded8:
      vector ? visit.template operator()<MomentumCompandedVectorBody<Io, Rule>>()
             : visit.template operator()<MomentumCompandedBody<Io, Rule>>();
      return;
  }
}

// Calls visit.template operator()<Body>() with the body of the variant; false when no body
// exists for it (the driver never builds such a variant; the launchers report it).
template <class Visit>
bool visit_step_body(const StepVariant& v, Visit&& visit) {
  if (v.amsgrad && v.algorithm != StepAlgorithm::kAdamW) return false;
  if (v.vector && v.state != StateFormat::kCompanded8) return false;
  bool known = true;
  const bool io_known = visit_param_io(v, [&]<class Io>() {
    switch (v.algorithm) {
      case StepAlgorithm::kAdamW:
        if (v.state == StateFormat::kCompanded8 && v.vector) {
          v.amsgrad ? visit.template operator()<AdamWCompandedVectorBody<Io, true>>()
                    : visit.template operator()<AdamWCompandedVectorBody<Io, false>>();
        } else if (v.state == StateFormat::kCompanded8) {
          v.amsgrad ? visit.template operator()<AdamWCompandedBody<Io, true>>()
                    : visit.template operator()<AdamWCompandedBody<Io, false>>();
        } else if (v.state == StateFormat::kFloat32) {
          v.amsgrad ? visit.template operator()<AdamWFloat32Body<Io, true>>()
                    : visit.template operator()<AdamWFloat32Body<Io, false>>();
        } else {
          known = false;
        }
        return;
      case StepAlgorithm::kSGD:
        visit_first_moment_body<Io, SgdRule>(v.state, v.vector, visit);
        return;
      case StepAlgorithm::kLion:
        // Lion always keeps its first moment: no stateless form.
        if (v.state == StateFormat::kFloat32) {
          visit.template operator()<MomentumFloat32Body<Io, LionRule>>();
        } else if (v.state == StateFormat::kCompanded8) {
          v.vector ? visit.template operator()<MomentumCompandedVectorBody<Io, LionRule>>()
                   : visit.template operator()<MomentumCompandedBody<Io, LionRule>>();
        } else {
          known = false;
        }
        return;
      case StepAlgorithm::kSkewAdamFactored:
        visit_first_moment_body<Io, SkewAdamFactoredRule>(v.state, v.vector, visit);
        return;
      case StepAlgorithm::kSkewAdamExact:
        visit_first_moment_body<Io, SkewAdamExactRule>(v.state, v.vector, visit);
        return;
    }
    known = false;
  });
  return io_known && known;
}

}  // namespace pagedoptim::kernels::table
