// The vector bodies of the 8-bit (companded) state: four consecutive elements per lane,
// eight lanes per group of 32, four groups per warp and iteration.
//
// Same element math and same group scales as the one-element-per-lane bodies of
// step_bodies.h, so the same bytes; what changes is the memory access: a lane moves its
// codes, params, gradients and residuals with one 4-, 8- or 16-byte access each instead of
// four 1- or 2-byte ones, and a group's scale is reduced over 8 lanes (3 shuffles) after
// each lane took the maximum of its own four elements. The driver picks these bodies only
// for tables whose rows are all aligned for it (StepVariant::vector).
#pragma once

#include <cstdint>

#include "kernels/table/lane_loops.h"
#include "kernels/table/param_io.h"
#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/kernels/step_table.h"

namespace pagedoptim::kernels::table {

constexpr int kLanesPerGroup = kGroupSize / kVectorWidth;    // 8
constexpr int kGroupsPerWarp = kGroupSize / kLanesPerGroup;  // 4

// The lane's four elements of a group: its row (null past the table's last group), the
// group inside the row, the first element, and how many of the four exist.
struct VectorLane {
  const StepRow* row;
  int64_t group;
  int64_t first;
  int active;
};

template <class Lane>
PO_HOST_DEVICE VectorLane vector_lane(const StepTable& t, int64_t warp_unit, const Lane& lane) {
  const int64_t unit = warp_unit * kGroupsPerWarp + lane.lane() / kLanesPerGroup;
  if (unit >= t.num_units) return VectorLane{nullptr, 0, 0, 0};
  const StepRow* row = &t.rows[find_row(t.rows, t.num_rows, unit)];
  const int64_t group = unit - row->first_unit;
  const int64_t first = group * kGroupSize + (lane.lane() % kLanesPerGroup) * kVectorWidth;
  const int64_t left = row->count - first;
  const int active = left <= 0 ? 0 : (left >= kVectorWidth ? kVectorWidth : int(left));
  return VectorLane{row, group, first, active};
}

// Warp iterations over a table: each covers kGroupsPerWarp units; uniform across the warp.
PO_HOST_DEVICE int64_t vector_iterations(const StepTable& t) {
  return (t.num_units + kGroupsPerWarp - 1) / kGroupsPerWarp;
}

PO_HOST_DEVICE uint32_t larger(uint32_t a, uint32_t b) { return a > b ? a : b; }

template <class Io, bool kAmsgrad>
struct AdamWCompandedVectorBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    if (step_skipped(t)) return;
    const GradUnscale unscale = grad_unscale(t);
    const auto* all_scalars = static_cast<const codec::AdamWScalars*>(t.scalars);
    const int64_t iterations = vector_iterations(t);
    for (int64_t w = lane.first_warp(); w < iterations; w += lane.warp_stride()) {
      const VectorLane u = vector_lane(t, w, lane);
      float m[kVectorWidth] = {}, v[kVectorWidth] = {}, v_max[kVectorWidth] = {};
      uint32_t m_key = 0, v_key = 0, v_max_key = 0;
      if (u.active > 0) {
        const StepRow& row = *u.row;
        int8_t m_codes[kVectorWidth];
        uint8_t v_codes[kVectorWidth], v_max_codes[kVectorWidth];
        load_vector(static_cast<const int8_t*>(row.moments[0]), u.first, u.active, m_codes);
        load_vector(static_cast<const uint8_t*>(row.moments[1]), u.first, u.active, v_codes);
        const float m_scale = codec::fp16_to_float(row.scales[0][u.group]);
        const float v_scale = codec::fp16_to_float(row.scales[1][u.group]);
        float v_denominator[kVectorWidth], v_max_denominator[kVectorWidth] = {};
        for (int k = 0; k < kVectorWidth; ++k) {
          if (k >= u.active) continue;
          m[k] = codec::decode_moment(m_codes[k], m_scale);
          v[k] = codec::decode_second_moment(v_codes[k], v_scale);
          v_denominator[k] = codec::decode_second_moment_for_denominator(v_codes[k], v_scale);
        }
        if constexpr (kAmsgrad) {
          load_vector(static_cast<const uint8_t*>(row.moments[2]), u.first, u.active,
                      v_max_codes);
          const float scale = codec::fp16_to_float(row.scales[2][u.group]);
          for (int k = 0; k < kVectorWidth; ++k) {
            if (k >= u.active) continue;
            v_max[k] = codec::decode_second_moment(v_max_codes[k], scale);
            v_max_denominator[k] =
                codec::decode_second_moment_for_denominator(v_max_codes[k], scale);
          }
        }
        const Io io(row);
        float p[kVectorWidth], g[kVectorWidth];
        io.load_vector(u.first, u.active, p);
        io.gradient_vector(u.first, u.active, g);
        const codec::AdamWScalars& s = all_scalars[row.scalars];
        for (int k = 0; k < kVectorWidth; ++k) {
          if (k >= u.active) continue;
          codec::adamw_element<kAmsgrad>(p[k], unscale(g[k]), m[k], v[k], v_denominator[k],
                                         v_max[k], v_max_denominator[k], s);
          m_key = larger(m_key, codec::moment_order_bits(m[k]));
          v_key = larger(v_key, codec::second_moment_order_bits(v[k]));
          if constexpr (kAmsgrad) {
            v_max_key = larger(v_max_key, codec::second_moment_order_bits(v_max[k]));
          }
        }
        io.store_vector(u.first, u.active, p);
      }
      // Every lane of the group has read the old scales above and passes through group_max
      // before the group's first lane writes the new ones below.
      const uint16_t m_scale =
          codec::moment_scale_from_bits(lane.group_max(m_key, kLanesPerGroup));
      const uint16_t v_scale =
          codec::second_moment_scale_from_bits(lane.group_max(v_key, kLanesPerGroup));
      uint16_t v_max_scale = 0;
      if constexpr (kAmsgrad) {
        v_max_scale =
            codec::second_moment_scale_from_bits(lane.group_max(v_max_key, kLanesPerGroup));
      }
      if (u.active > 0) {
        const StepRow& row = *u.row;
        const float m_inverse = codec::scale_reciprocal(codec::fp16_to_float(m_scale));
        const float v_inverse = codec::scale_reciprocal(codec::fp16_to_float(v_scale));
        int8_t m_codes[kVectorWidth] = {};
        uint8_t v_codes[kVectorWidth] = {};
        for (int k = 0; k < kVectorWidth; ++k) {
          if (k >= u.active) continue;
          m_codes[k] = codec::encode_moment(m[k], m_inverse);
          v_codes[k] = codec::encode_second_moment(v[k], v_inverse);
        }
        store_vector(static_cast<int8_t*>(row.moments[0]), u.first, u.active, m_codes);
        store_vector(static_cast<uint8_t*>(row.moments[1]), u.first, u.active, v_codes);
        if constexpr (kAmsgrad) {
          const float inverse = codec::scale_reciprocal(codec::fp16_to_float(v_max_scale));
          uint8_t codes[kVectorWidth] = {};
          for (int k = 0; k < kVectorWidth; ++k) {
            if (k >= u.active) continue;
            codes[k] = codec::encode_second_moment(v_max[k], inverse);
          }
          store_vector(static_cast<uint8_t*>(row.moments[2]), u.first, u.active, codes);
        }
      }
      if (u.row != nullptr && lane.lane() % kLanesPerGroup == 0) {
        u.row->scales[0][u.group] = m_scale;
        u.row->scales[1][u.group] = v_scale;
        if constexpr (kAmsgrad) u.row->scales[2][u.group] = v_max_scale;
      }
    }
  }
};

// The vector form of MomentumCompandedBody (step_bodies.h): one companded first moment,
// updated by an element rule.
template <class Io, class Rule>
struct MomentumCompandedVectorBody {
  template <class Lane>
  PO_HOST_DEVICE static void run(const StepTable& t, const Lane& lane) {
    if (step_skipped(t)) return;
    const GradUnscale unscale = grad_unscale(t);
    const auto* all_scalars = static_cast<const typename Rule::Scalars*>(t.scalars);
    const int64_t iterations = vector_iterations(t);
    for (int64_t w = lane.first_warp(); w < iterations; w += lane.warp_stride()) {
      const VectorLane u = vector_lane(t, w, lane);
      float m[kVectorWidth] = {};
      uint32_t key = 0;
      if (u.active > 0) {
        const StepRow& row = *u.row;
        int8_t codes[kVectorWidth];
        load_vector(static_cast<const int8_t*>(row.moments[0]), u.first, u.active, codes);
        const float scale = codec::fp16_to_float(row.scales[0][u.group]);
        const Io io(row);
        float p[kVectorWidth], g[kVectorWidth];
        io.load_vector(u.first, u.active, p);
        io.gradient_vector(u.first, u.active, g);
        const auto& s = all_scalars[row.scalars];
        for (int k = 0; k < kVectorWidth; ++k) {
          if (k >= u.active) continue;
          m[k] = codec::decode_moment(codes[k], scale);
          Rule::apply(p[k], unscale(g[k]), m[k], s, row, u.first + k);
          key = larger(key, codec::moment_order_bits(m[k]));
        }
        io.store_vector(u.first, u.active, p);
      }
      const uint16_t scale = codec::moment_scale_from_bits(lane.group_max(key, kLanesPerGroup));
      if (u.active > 0) {
        const float inverse = codec::scale_reciprocal(codec::fp16_to_float(scale));
        int8_t codes[kVectorWidth] = {};
        for (int k = 0; k < kVectorWidth; ++k) {
          if (k < u.active) codes[k] = codec::encode_moment(m[k], inverse);
        }
        store_vector(static_cast<int8_t*>(u.row->moments[0]), u.first, u.active, codes);
      }
      if (u.row != nullptr && lane.lane() % kLanesPerGroup == 0) {
        u.row->scales[0][u.group] = scale;
      }
    }
  }
};

}  // namespace pagedoptim::kernels::table
