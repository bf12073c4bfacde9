// The bodies of the table kernels: one warp per unit of kGroupSize elements, one lane per
// element, over every row of a StepTable (pagedoptim/kernels/step_table.h).
//
// Written once, __host__ __device__, over a `Lane` that supplies what a body needs of the
// hardware:
//   int lane() const                  this thread's lane in its warp, 0..31
//   int64_t first_warp() const        this warp's index in the grid
//   int64_t warp_stride() const       warps in the grid
//   uint32_t warp_max(uint32_t) const the maximum over the warp's 32 lanes; every lane calls it
//   uint32_t group_max(uint32_t, int width) const  the maximum over each aligned run of
//                                     `width` lanes (a power of two); every lane calls it
//   void gather(float, float* all) const  every lane's value, all[lane]; every lane calls it
// The CUDA wrappers (csrc/kernels/cuda/table_kernels.cu) pass one built on threadIdx and
// __shfl_xor_sync; the CPU tests pass a host emulation that runs each lane as a thread, so
// the very code that runs on the GPU is compared byte for byte with the CPU kernels.
//
// Whole warps walk the units together (a unit index is uniform across the warp): the
// companded formats reduce a new scale over the 32 lanes of a group, so lanes past the end
// of a row stay in the loop and contribute a key that never raises the maximum.
#pragma once

#include <cstdint>

#include "kernels/table/lane_loops.h"
#include "kernels/table/param_io.h"
#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/kernels/step_table.h"
#include "pagedoptim/optim/groups.h"

namespace pagedoptim::kernels::table {

// --- AdamW ---------------------------------------------------------------------------------------

template <class Io, bool kAmsgrad>
struct AdamWFloat32Body {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    const auto* all_scalars = static_cast<const codec::AdamWScalars*>(t.scalars);
    for_each_element(t, lane, [&](const StepRow& row, int64_t i, const GradUnscale& unscale) {
      const Io io(row);
      float* m = static_cast<float*>(row.moments[0]);
      float* v = static_cast<float*>(row.moments[1]);
      float unused_max = 0.0f;
      float& v_max = kAmsgrad ? static_cast<float*>(row.moments[2])[i] : unused_max;
      float p = io.load(i);
      codec::adamw_element<kAmsgrad>(p, unscale(io.gradient(i)), m[i], v[i], v_max,
                                     all_scalars[row.scalars]);
      io.store(i, p);
    });
  }
};

template <class Io, bool kAmsgrad>
struct AdamWCompandedBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    if (step_skipped(t)) return;
    const GradUnscale unscale = grad_unscale(t);
    const auto* all_scalars = static_cast<const codec::AdamWScalars*>(t.scalars);
    for (int64_t unit = lane.first_warp(); unit < t.num_units; unit += lane.warp_stride()) {
      const UnitLane u = unit_lane(t, unit, lane);
      const StepRow& row = *u.row;
      const int64_t i = u.element;
      const int64_t g = u.group;
      auto* m_codes = static_cast<int8_t*>(row.moments[0]);
      auto* v_codes = static_cast<uint8_t*>(row.moments[1]);
      auto* v_max_codes = static_cast<uint8_t*>(row.moments[2]);
      const float v_scale = codec::fp16_to_float(row.scales[1][g]);
      float m = u.active ? codec::decode_moment(m_codes[i], codec::fp16_to_float(row.scales[0][g]))
                         : 0.0f;
      float v = u.active ? codec::decode_second_moment(v_codes[i], v_scale) : 0.0f;
      const float v_denominator =
          u.active ? codec::decode_second_moment_for_denominator(v_codes[i], v_scale) : 0.0f;
      float v_max = 0.0f;
      float v_max_denominator = 0.0f;
      if constexpr (kAmsgrad) {
        const float scale = codec::fp16_to_float(row.scales[2][g]);
        v_max = u.active ? codec::decode_second_moment(v_max_codes[i], scale) : 0.0f;
        v_max_denominator =
            u.active ? codec::decode_second_moment_for_denominator(v_max_codes[i], scale) : 0.0f;
      }
      if (u.active) {
        const Io io(row);
        float p = io.load(i);
        codec::adamw_element<kAmsgrad>(p, unscale(io.gradient(i)), m, v, v_denominator, v_max,
                                       v_max_denominator, all_scalars[row.scalars]);
        io.store(i, p);
      }
      // Every lane has read the old scales above and passes through warp_max before lane 0
      // writes the new ones below.
      const uint16_t m_scale = codec::moment_scale_from_bits(
          lane.warp_max(u.active ? codec::moment_order_bits(m) : 0u));
      const uint16_t new_v_scale = codec::second_moment_scale_from_bits(
          lane.warp_max(u.active ? codec::second_moment_order_bits(v) : 0u));
      uint16_t v_max_scale = 0;
      if constexpr (kAmsgrad) {
        v_max_scale = codec::second_moment_scale_from_bits(
            lane.warp_max(u.active ? codec::second_moment_order_bits(v_max) : 0u));
      }
      if (u.active) {
        m_codes[i] =
            codec::encode_moment(m, codec::scale_reciprocal(codec::fp16_to_float(m_scale)));
        v_codes[i] = codec::encode_second_moment(
            v, codec::scale_reciprocal(codec::fp16_to_float(new_v_scale)));
        if constexpr (kAmsgrad) {
          v_max_codes[i] = codec::encode_second_moment(
              v_max, codec::scale_reciprocal(codec::fp16_to_float(v_max_scale)));
        }
      }
      if (lane.lane() == 0) {
        row.scales[0][g] = m_scale;
        row.scales[1][g] = new_v_scale;
        if constexpr (kAmsgrad) row.scales[2][g] = v_max_scale;
      }
    }
  }
};

// --- One first-moment stream, updated by an element rule --------------------------------------
//
// SGD's momentum buffer, Lion's first moment and SkewAdam's momentum share one pair of
// bodies (fp32 state, 8-bit groups), and the momentum-free forms one stateless body. A rule
// gets the element's row and index too, for state beyond the first moment (SkewAdam's exact
// second moment, its factored coefficients):
//   apply(p, g, m, scalars, row, i)          with momentum
//   apply_stateless(p, g, scalars, row, i)   without

struct SgdRule {
  using Scalars = codec::SGDScalars;
  PO_HOST_DEVICE static void apply(float& p, float g, float& m, const Scalars& s,
                                   const StepRow&, int64_t) {
    codec::sgd_momentum_element(p, g, m, s);
  }
  PO_HOST_DEVICE static void apply_stateless(float& p, float g, const Scalars& s, const StepRow&,
                                             int64_t) {
    codec::sgd_element(p, g, s);
  }
};

struct LionRule {
  using Scalars = codec::LionScalars;
  PO_HOST_DEVICE static void apply(float& p, float g, float& m, const Scalars& s,
                                   const StepRow&, int64_t) {
    codec::lion_element(p, g, m, s);
  }
};

template <class Io, class Rule>
struct StatelessBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    const auto* all_scalars = static_cast<const typename Rule::Scalars*>(t.scalars);
    for_each_element(t, lane, [&](const StepRow& row, int64_t i, const GradUnscale& unscale) {
      const Io io(row);
      float p = io.load(i);
      Rule::apply_stateless(p, unscale(io.gradient(i)), all_scalars[row.scalars], row, i);
      io.store(i, p);
    });
  }
};

template <class Io, class Rule>
struct MomentumFloat32Body {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    const auto* all_scalars = static_cast<const typename Rule::Scalars*>(t.scalars);
    for_each_element(t, lane, [&](const StepRow& row, int64_t i, const GradUnscale& unscale) {
      const Io io(row);
      float p = io.load(i);
      Rule::apply(p, unscale(io.gradient(i)), static_cast<float*>(row.moments[0])[i],
                  all_scalars[row.scalars], row, i);
      io.store(i, p);
    });
  }
};

template <class Io, class Rule>
struct MomentumCompandedBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    if (step_skipped(t)) return;
    const GradUnscale unscale = grad_unscale(t);
    const auto* all_scalars = static_cast<const typename Rule::Scalars*>(t.scalars);
    for (int64_t unit = lane.first_warp(); unit < t.num_units; unit += lane.warp_stride()) {
      const UnitLane u = unit_lane(t, unit, lane);
      const StepRow& row = *u.row;
      auto* codes = static_cast<int8_t*>(row.moments[0]);
      float m = u.active ? codec::decode_moment(codes[u.element],
                                                codec::fp16_to_float(row.scales[0][u.group]))
                         : 0.0f;
      if (u.active) {
        const Io io(row);
        float p = io.load(u.element);
        Rule::apply(p, unscale(io.gradient(u.element)), m, all_scalars[row.scalars], row,
                    u.element);
        io.store(u.element, p);
      }
      const uint16_t scale = codec::moment_scale_from_bits(
          lane.warp_max(u.active ? codec::moment_order_bits(m) : 0u));
      if (u.active) {
        codes[u.element] =
            codec::encode_moment(m, codec::scale_reciprocal(codec::fp16_to_float(scale)));
      }
      if (lane.lane() == 0) row.scales[0][u.group] = scale;
    }
  }
};

// --- per-parameter scalars -------------------------------------------------------------------
//
// One call per parameter, before the tables run: advances the step counter (unless GradScaler
// skips the step, or the step resumes one that advanced it already) and hoists the
// parameter's scalars with the shared make_*_scalars, so both backends feed identical
// scalars to identical element math.

PO_HOST_DEVICE void prepare_adamw_scalars(const ScalarJob& job, const optim::AdamWGroup& g,
                                          codec::AdamWScalars& out) {
  if (job.advanced == 0) *job.step += 1.0f;
  out = codec::make_adamw_scalars(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
                                  (long long)(*job.step), g.maximize);
}

PO_HOST_DEVICE void prepare_sgd_scalars(const ScalarJob& job, const optim::SGDGroup& g,
                                        codec::SGDScalars& out) {
  const bool first_step = *job.step == (job.advanced != 0 ? 1.0f : 0.0f);
  if (job.advanced == 0) *job.step += 1.0f;
  out = codec::make_sgd_scalars(g.lr, g.momentum, g.dampening, g.weight_decay, g.nesterov,
                                g.maximize, first_step);
}

PO_HOST_DEVICE void prepare_lion_scalars(const ScalarJob& job, const optim::LionGroup& g,
                                         codec::LionScalars& out) {
  if (job.advanced == 0) *job.step += 1.0f;
  out = codec::make_lion_scalars(g.lr, g.beta1, g.beta2, g.weight_decay, g.maximize);
}

}  // namespace pagedoptim::kernels::table
