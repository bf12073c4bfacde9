// The loop skeleton every table kernel body shares: which unit a warp works on, which row
// and element a lane gets, and the step-wide AMP inputs. The `Lane` concept is described in
// step_bodies.h.
#pragma once

#include <cstdint>

#include "pagedoptim/kernels/step_table.h"

namespace pagedoptim::kernels::table {

// --- step-wide inputs --------------------------------------------------------------------------

// GradScaler found an inf or NaN in some gradient: the step does nothing at all.
PO_HOST_DEVICE bool step_skipped(const StepTable& t) {
  return t.found_inf != nullptr && *t.found_inf != 0.0f;
}

// Gradients as GradScaler left them, divided by its scale when it handed one over (torch's
// fused optimizers divide the same way, before anything else touches the gradient).
struct GradUnscale {
  float scale = 1.0f;
  bool on = false;
  PO_HOST_DEVICE float operator()(float grad) const { return on ? grad / scale : grad; }
};

PO_HOST_DEVICE GradUnscale grad_unscale(const StepTable& t) {
  return t.grad_scale != nullptr ? GradUnscale{*t.grad_scale, true} : GradUnscale{};
}

// The lane's element of a unit: its row, the unit's group inside the row, the element, and
// whether the element exists (the last group of a row may be partial).
struct UnitLane {
  const StepRow* row;
  int64_t group;
  int64_t element;  // inside the row; a valid index (the group's first) for inactive lanes
  bool active;
};

template <class Lane>
PO_HOST_DEVICE UnitLane unit_lane(const StepTable& t, int64_t unit, const Lane& lane) {
  const StepRow* row = &t.rows[find_row(t.rows, t.num_rows, unit)];
  const int64_t group = unit - row->first_unit;
  const int64_t element = group * kGroupSize + lane.lane();
  const bool active = element < row->count;
  return UnitLane{row, group, active ? element : group * kGroupSize, active};
}

// Calls apply(row, element, unscale) for every element of the table, one lane per element:
// the loop of the bodies whose lanes never talk to each other (fp32 state, no state).
template <class Lane, class Apply>
PO_HOST_DEVICE void for_each_element(const StepTable& t, const Lane& lane, const Apply& apply) {
  if (step_skipped(t)) return;
  const GradUnscale unscale = grad_unscale(t);
  for (int64_t unit = lane.first_warp(); unit < t.num_units; unit += lane.warp_stride()) {
    const UnitLane u = unit_lane(t, unit, lane);
    if (u.active) apply(*u.row, u.element, unscale);
  }
}

}  // namespace pagedoptim::kernels::table
