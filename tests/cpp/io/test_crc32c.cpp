#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "pagedoptim/io/crc32c.h"

namespace pagedoptim::io {
namespace {

using CrcFn = uint32_t (*)(const void*, size_t, uint32_t);

struct Implementation {
  const char* name;
  CrcFn fn;
};

std::vector<Implementation> implementations() {
  std::vector<Implementation> impls{{"dispatch", &crc32c}, {"portable", &crc32c_portable}};
  if (crc32c_hardware_available()) {
    impls.push_back({"hardware", &crc32c_hardware});
  }
  return impls;
}

// Check values from the CRC catalogue and RFC 3720 (iSCSI) appendix B.4.
TEST(Crc32c, KnownVectors) {
  std::vector<unsigned char> zeros(32, 0x00);
  std::vector<unsigned char> ones(32, 0xFF);
  std::vector<unsigned char> up(32);
  std::vector<unsigned char> down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<unsigned char>(i);
    down[i] = static_cast<unsigned char>(31 - i);
  }
  const std::string digits = "123456789";
  for (const Implementation& impl : implementations()) {
    SCOPED_TRACE(impl.name);
    EXPECT_EQ(impl.fn(digits.data(), digits.size(), 0), 0xE3069283u);
    EXPECT_EQ(impl.fn(nullptr, 0, 0), 0u);
    EXPECT_EQ(impl.fn(zeros.data(), zeros.size(), 0), 0x8A9136AAu);
    EXPECT_EQ(impl.fn(ones.data(), ones.size(), 0), 0x62A8AB43u);
    EXPECT_EQ(impl.fn(up.data(), up.size(), 0), 0x46DD794Eu);
    EXPECT_EQ(impl.fn(down.data(), down.size(), 0), 0x113FDB5Cu);
  }
}

TEST(Crc32c, HardwareMatchesPortableOnRandomData) {
  if (!crc32c_hardware_available()) {
    GTEST_SKIP() << "this CPU has no SSE4.2 crc32 instruction";
  }
  std::mt19937_64 rng(42);
  std::vector<unsigned char> data((1 << 20) + 64);
  for (auto& b : data) {
    b = static_cast<unsigned char>(rng());
  }
  // Every length up to a few interleaved blocks (all tails and block boundaries), at every
  // misalignment of the start within a word.
  for (size_t start = 0; start < 8; ++start) {
    for (size_t len = 0; len <= 3 * 512 * 2 + 17; ++len) {
      ASSERT_EQ(crc32c_hardware(data.data() + start, len, 0),
                crc32c_portable(data.data() + start, len, 0))
          << "start " << start << " length " << len;
    }
  }
  std::uniform_int_distribution<size_t> length(0, 1 << 20);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t start = rng() % 64;
    const size_t len = length(rng);
    const auto seed = static_cast<uint32_t>(rng());
    ASSERT_EQ(crc32c_hardware(data.data() + start, len, seed),
              crc32c_portable(data.data() + start, len, seed))
        << "start " << start << " length " << len;
  }
  EXPECT_EQ(crc32c(data.data(), data.size()), crc32c_portable(data.data(), data.size()));
}

TEST(Crc32c, ContinuationEqualsWhole) {
  std::mt19937 rng(7);
  std::vector<unsigned char> data(10000);
  for (auto& b : data) {
    b = static_cast<unsigned char>(rng());
  }
  for (const Implementation& impl : implementations()) {
    SCOPED_TRACE(impl.name);
    const uint32_t whole = impl.fn(data.data(), data.size(), 0);
    for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{1536}, size_t{4096}, size_t{9999}}) {
      const uint32_t head = impl.fn(data.data(), cut, 0);
      EXPECT_EQ(impl.fn(data.data() + cut, data.size() - cut, head), whole) << "cut " << cut;
    }
  }
}

// A CRC detects every single-bit error; the page checksum relies on it to catch a flipped
// byte from the disk.
TEST(Crc32c, EverySingleBitFlipInAPageIsDetected) {
  std::vector<unsigned char> page(4096);
  std::mt19937 rng(3);
  for (auto& b : page) {
    b = static_cast<unsigned char>(rng());
  }
  const uint32_t good = crc32c(page.data(), page.size());
  for (size_t byte = 0; byte < page.size(); byte += 13) {
    for (int bit = 0; bit < 8; ++bit) {
      page[byte] ^= static_cast<unsigned char>(1u << bit);
      ASSERT_NE(crc32c(page.data(), page.size()), good) << "byte " << byte << " bit " << bit;
      page[byte] ^= static_cast<unsigned char>(1u << bit);
    }
  }
}

}  // namespace
}  // namespace pagedoptim::io
