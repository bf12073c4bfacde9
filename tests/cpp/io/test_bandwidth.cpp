// measure_sequential_bandwidth() runs end to end; the figures themselves are for the
// benchmarks, which print them.
#include <dirent.h>

#include <cerrno>

#include "test_io_util.h"

namespace pagedoptim::io {
namespace {

size_t entries(const std::string& dir) {
  size_t n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      n += e->d_name[0] != '.';
    }
    ::closedir(d);
  }
  return n;
}

class Bandwidth : public ::testing::TestWithParam<Backend> {};

TEST_P(Bandwidth, SmallRunOnDiskAndShm) {
  PO_SKIP_IF_REFUSED(GetParam());
  std::vector<std::string> bases{test::tmp_base()};
  if (test::has_dev_shm()) {
    bases.push_back("/dev/shm");
  }
  for (const std::string& base : bases) {
    SCOPED_TRACE(base);
    test::TempDir dir(base);
    ASSERT_TRUE(dir.ok());
    BandwidthOptions options;
    options.dir = dir.path();
    options.file_bytes = (8 << 20) + 12345;
    options.block_bytes = 1 << 20;
    options.queue_depth = 4;
    options.backend = GetParam();
    const BandwidthResult r = measure_sequential_bandwidth(options);
    ASSERT_EQ(r.error, 0);
    EXPECT_EQ(r.backend, GetParam());
    EXPECT_EQ(r.bytes, 8 << 20);
    EXPECT_GT(r.write_gb_per_s, 0.0);
    EXPECT_GT(r.read_gb_per_s, 0.0);
    EXPECT_GT(r.mixed_gb_per_s, 0.0);
    EXPECT_NE(r.direct, DirectStatus::kClosed);
    EXPECT_EQ(entries(dir.path()), 0u) << "the scratch file must be gone";
  }
}

// The mixed pass reads the first half while it overwrites the second, so it moves an even
// number of blocks: with five, two are read and two written, and the fifth is left alone.
TEST_P(Bandwidth, MixedPassMovesAnEvenNumberOfBlocksAndLeavesNoFile) {
  PO_SKIP_IF_REFUSED(GetParam());
  test::TempDir dir;
  ASSERT_TRUE(dir.ok());
  BandwidthOptions options;
  options.dir = dir.path();
  options.file_bytes = 5 << 20;
  options.block_bytes = 1 << 20;
  options.queue_depth = 3;  // odd, so reads and writes take turns in the same slots
  options.backend = GetParam();
  const BandwidthResult r = measure_sequential_bandwidth(options);
  ASSERT_EQ(r.error, 0);
  EXPECT_EQ(r.bytes, 5 << 20);
  EXPECT_EQ(r.mixed_bytes, 4 << 20);
  EXPECT_GT(r.mixed_seconds, 0.0);
  EXPECT_GT(r.mixed_gb_per_s, 0.0);
  EXPECT_EQ(entries(dir.path()), 0u) << "the scratch file must be gone";
}

TEST_P(Bandwidth, SmallestFileIsTwoBlocks) {
  PO_SKIP_IF_REFUSED(GetParam());
  test::TempDir dir;
  ASSERT_TRUE(dir.ok());
  BandwidthOptions options;
  options.dir = dir.path();
  options.file_bytes = 2 << 20;
  options.block_bytes = 1 << 20;
  options.queue_depth = 1;
  options.backend = GetParam();
  const BandwidthResult r = measure_sequential_bandwidth(options);
  ASSERT_EQ(r.error, 0);
  EXPECT_EQ(r.mixed_bytes, 2 << 20);
  EXPECT_GT(r.mixed_gb_per_s, 0.0);
  EXPECT_EQ(entries(dir.path()), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, Bandwidth, ::testing::Values(Backend::kPosix, Backend::kIoUring),
                         test::backend_param_name);

TEST(BandwidthOptions, BadOptionsAreRefused) {
  BandwidthOptions options;
  options.dir = test::tmp_base();
  options.block_bytes = 1000;
  EXPECT_EQ(measure_sequential_bandwidth(options).error, -EINVAL);
  options.block_bytes = 1 << 20;
  options.file_bytes = 4096;
  EXPECT_EQ(measure_sequential_bandwidth(options).error, -EINVAL);
  options.file_bytes = (2 << 20) - 1;  // one whole block: nothing to read beside the write
  EXPECT_EQ(measure_sequential_bandwidth(options).error, -EINVAL);
  options.file_bytes = 2 << 20;
  options.queue_depth = 0;
  EXPECT_EQ(measure_sequential_bandwidth(options).error, -EINVAL);
  options.queue_depth = 2;
  options.dir = "/nonexistent-pagedoptim-dir";
  EXPECT_EQ(measure_sequential_bandwidth(options).error, -ENOENT);
}

}  // namespace
}  // namespace pagedoptim::io
