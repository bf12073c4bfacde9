// Helpers of the host-emulation tests: parameters as raw bytes of any element type, stream
// sets, and the byte-for-byte comparison that lets NaNs differ only in their payload.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/kernels/step_args.h"
#include "pagedoptim/paging/page_geometry.h"

namespace pagedoptim::kernels::test {

inline void add_moment(std::vector<paging::StreamSpec>& streams, const std::string& name, int bits) {
  if (bits == 32) {
    streams.push_back({name, 4 * kGroupSize});
  } else {
    streams.push_back({name + "_codes", kGroupSize});
    streams.push_back({name + "_scales", 2, /*per_group=*/true});
  }
}

inline void store_element(std::vector<uint8_t>& bytes, ElementType type, int64_t i, float value) {
  if (type == ElementType::kFloat32) {
    std::memcpy(bytes.data() + 4 * i, &value, 4);
    return;
  }
  const uint16_t h = type == ElementType::kBFloat16 ? codec::float_to_bf16(value)
                                                    : codec::float_to_fp16(value);
  std::memcpy(bytes.data() + 2 * i, &h, 2);
}

inline float load_element(const std::vector<uint8_t>& bytes, ElementType type, int64_t i) {
  if (type == ElementType::kFloat32) {
    float value;
    std::memcpy(&value, bytes.data() + 4 * i, 4);
    return value;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return type == ElementType::kBFloat16 ? codec::bf16_to_float(h) : codec::fp16_to_float(h);
}

// Same bytes, except that a NaN only has to be a NaN (its payload bits are not part of the
// contract for params whose group held a NaN).
inline void expect_same_elements(const std::vector<uint8_t>& cpu, const std::vector<uint8_t>& table,
                                 ElementType type, int64_t numel, const std::string& where) {
  const size_t width = type == ElementType::kFloat32 ? 4 : 2;
  for (int64_t e = 0; e < numel; ++e) {
    const float a = load_element(cpu, type, e);
    const float b = load_element(table, type, e);
    if (std::isnan(a) || std::isnan(b)) {
      ASSERT_TRUE(std::isnan(a) && std::isnan(b)) << where << " element " << e;
      continue;
    }
    ASSERT_EQ(std::memcmp(cpu.data() + e * width, table.data() + e * width, width), 0)
        << where << " element " << e << ": cpu " << a << ", table " << b;
  }
}

}  // namespace pagedoptim::kernels::test
