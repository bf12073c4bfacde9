// Opening page files: the O_DIRECT probe and its fallback, creation mode, errors.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "io/page_file.h"
#include "test_io_util.h"

namespace pagedoptim::io {
namespace {

using test::AlignedBuffer;
using test::TempDir;

// What the kernel says about O_DIRECT in `dir`, asked directly: open with the flag, then
// one aligned read (the same two steps the probe takes, written independently).
bool kernel_allows_direct(const std::string& dir) {
  const std::string path = dir + "/direct-check";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) {
    ::unlink(path.c_str());
    return false;
  }
  AlignedBuffer block(kDirectAlignment);
  const bool ok = ::pread(fd, block.data(), kDirectAlignment, 0) >= 0;
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

void expect_round_trip(const FileInfo& info) {
  AlignedBuffer out(2 * kDirectAlignment);
  AlignedBuffer in(2 * kDirectAlignment);
  test::fill_page(out.data(), out.size(), 1, 1);
  ASSERT_EQ(::pwrite(info.fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  ASSERT_EQ(::pread(info.fd, in.data(), in.size(), 0), static_cast<ssize_t>(in.size()));
  EXPECT_TRUE(test::page_matches(in.data(), in.size(), 1, 1));
}

// tmpfs refused O_DIRECT with EINVAL before Linux 6.6 and accepts it since; either way the
// probe must report what the kernel does and the file must work.
TEST(PageFile, DevShmReportsWhatTheKernelDoes) {
  if (!test::has_dev_shm()) {
    GTEST_SKIP() << "no writable /dev/shm";
  }
  TempDir dir("/dev/shm");
  ASSERT_TRUE(dir.ok());
  const bool direct = kernel_allows_direct(dir.path());
  FileInfo info;
  ASSERT_EQ(open_page_file(dir.file("pages"), {}, info), 0);
  if (direct) {
    EXPECT_EQ(info.direct, DirectStatus::kDirect);
    EXPECT_EQ(info.direct_errno, 0);
    EXPECT_TRUE(info.direct_reason.empty());
  } else {
    EXPECT_EQ(info.direct, DirectStatus::kBufferedRefused);
    EXPECT_EQ(info.direct_errno, EINVAL);
    EXPECT_FALSE(info.direct_reason.empty());
  }
  expect_round_trip(info);
  EXPECT_EQ(close_page_file(info), 0);
  EXPECT_EQ(info.fd, -1);
}

// A file system that refuses O_DIRECT at open (tmpfs before 6.6, many FUSE file systems),
// played by an open() that fails with EINVAL whenever the flag is present.
int open_refusing_direct(const char* path, int flags, unsigned mode) {
  if (flags & O_DIRECT) {
    errno = EINVAL;
    return -1;
  }
  return ::open(path, flags, static_cast<mode_t>(mode));
}

int open_denied_direct(const char* path, int flags, unsigned mode) {
  if (flags & O_DIRECT) {
    errno = EACCES;
    return -1;
  }
  return ::open(path, flags, static_cast<mode_t>(mode));
}

TEST(PageFile, RefusedDirectFallsBackToBuffered) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  ASSERT_EQ(open_page_file(dir.file("pages"), {}, info, &open_refusing_direct), 0);
  EXPECT_EQ(info.direct, DirectStatus::kBufferedRefused);
  EXPECT_EQ(info.direct_errno, EINVAL);
  EXPECT_FALSE(info.direct_reason.empty());
  EXPECT_TRUE(info.is_open());
  EXPECT_FALSE(info.is_direct());
  expect_round_trip(info);
  close_page_file(info);
}

TEST(PageFile, RequireDirectFailsWhenRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  OpenOptions options;
  options.direct = DirectMode::kRequire;
  EXPECT_EQ(open_page_file(dir.file("pages"), options, info, &open_refusing_direct), -EINVAL);
  EXPECT_FALSE(info.is_open());
}

// Only EINVAL means "no O_DIRECT here"; any other failure is the caller's to see.
TEST(PageFile, OtherOpenErrorsAreReported) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  EXPECT_EQ(open_page_file(dir.file("pages"), {}, info, &open_denied_direct), -EACCES);
  EXPECT_FALSE(info.is_open());
  EXPECT_EQ(open_page_file(dir.file("missing/pages"), {}, info), -ENOENT);
  OpenOptions no_create;
  no_create.create = false;
  EXPECT_EQ(open_page_file(dir.file("absent"), no_create, info), -ENOENT);
}

TEST(PageFile, DirectOffByOption) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  OpenOptions options;
  options.direct = DirectMode::kOff;
  ASSERT_EQ(open_page_file(dir.file("pages"), options, info), 0);
  EXPECT_EQ(info.direct, DirectStatus::kBufferedByOption);
  EXPECT_EQ(info.direct_errno, 0);
  expect_round_trip(info);
  close_page_file(info);
}

TEST(PageFile, CreatedPrivate) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  ASSERT_EQ(open_page_file(dir.file("pages"), {}, info), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(info.fd, &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  close_page_file(info);
}

TEST(PageFile, TruncateOption) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  FileInfo info;
  ASSERT_EQ(open_page_file(dir.file("pages"), {}, info), 0);
  expect_round_trip(info);
  close_page_file(info);
  OpenOptions options;
  options.truncate = true;
  ASSERT_EQ(open_page_file(dir.file("pages"), options, info), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(info.fd, &st), 0);
  EXPECT_EQ(st.st_size, 0);
  close_page_file(info);
}

}  // namespace
}  // namespace pagedoptim::io
