// The engines' contract: round trips through every combination of backend, O_DIRECT mode,
// file system and buffer registration; batches beyond the queue depth; errors.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>
#include <tuple>

#include "pagedoptim/io/crc32c.h"
#include "pagedoptim/thread_start.h"
#include "test_io_util.h"

namespace pagedoptim::io {
namespace {

using test::AlignedBuffer;
using test::TempDir;

// Whether the kernel will pin `bytes` for io_uring registered buffers for this process.
bool can_pin(size_t bytes) {
  rlimit limit{};
  return ::geteuid() == 0 ||
         (::getrlimit(RLIMIT_MEMLOCK, &limit) == 0 &&
          (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= 2 * bytes));
}

enum class Location { kTmp, kShm };
enum class Buffers { kPlain, kRegistered };

using MatrixParam = std::tuple<Backend, DirectMode, Location, Buffers>;

class RoundTrip : public ::testing::TestWithParam<MatrixParam> {};

// Many pages through one engine: a first generation written in one batch larger than the
// queue depth, half of them overwritten, everything read back (in reverse file order) and
// compared byte for byte and by crc32c.
TEST_P(RoundTrip, ManyPages) {
  const auto [backend, direct, location, buffers] = GetParam();
  PO_SKIP_IF_REFUSED(backend);
  if (location == Location::kShm && !test::has_dev_shm()) {
    GTEST_SKIP() << "no writable /dev/shm";
  }
  TempDir dir(location == Location::kShm ? "/dev/shm" : test::tmp_base());
  ASSERT_TRUE(dir.ok());

  constexpr uint32_t kQueueDepth = 8;
  constexpr size_t kPages = 160;
  constexpr uint32_t kPageBytes = 16 << 10;
  auto engine = test::make_engine(backend, kQueueDepth);
  ASSERT_NE(engine, nullptr);
  OpenOptions options;
  options.direct = direct;
  ASSERT_EQ(engine->open(dir.file("pages"), options), 0);
  if (direct == DirectMode::kOff) {
    EXPECT_EQ(engine->file().direct, DirectStatus::kBufferedByOption);
  } else {
    EXPECT_NE(engine->file().direct, DirectStatus::kBufferedByOption);
  }

  AlignedBuffer host(kPages * kPageBytes);
  if (buffers == Buffers::kRegistered) {
    std::vector<iovec> slots(kPages);
    for (size_t i = 0; i < kPages; ++i) {
      slots[i] = iovec{host.page(i, kPageBytes), kPageBytes};
    }
    ASSERT_EQ(engine->register_buffers(slots), 0);
    if (backend == Backend::kIoUring && can_pin(host.size())) {
      EXPECT_TRUE(engine->fixed_buffers_in_kernel());
    }
  }
  auto offset_of = [](size_t page) { return static_cast<int64_t>(kPages - 1 - page) * kPageBytes; };
  auto request = [&](OpKind op, size_t page) {
    const int64_t offset = offset_of(page);
    if (buffers == Buffers::kRegistered) {
      const auto index = static_cast<int32_t>(page);
      return op == OpKind::kRead ? IoRequest::read_fixed(index, kPageBytes, offset, page)
                                 : IoRequest::write_fixed(index, kPageBytes, offset, page);
    }
    char* slot = host.page(page, kPageBytes);
    return op == OpKind::kRead ? IoRequest::read(slot, kPageBytes, offset, page)
                               : IoRequest::write(slot, kPageBytes, offset, page);
  };
  auto run_batch = [&](OpKind op, const std::vector<size_t>& pages) {
    std::vector<IoRequest> batch;
    for (size_t p : pages) {
      batch.push_back(request(op, p));
    }
    ASSERT_EQ(engine->submit(batch), static_cast<int>(batch.size()));
    const auto done = test::reap(*engine, batch.size());
    std::set<uint64_t> tags;
    for (const IoCompletion& c : done) {
      EXPECT_EQ(c.result, kPageBytes) << "page " << c.tag;
      tags.insert(c.tag);
    }
    EXPECT_EQ(tags, std::set<uint64_t>(pages.begin(), pages.end()));
    EXPECT_EQ(engine->in_flight(), 0);
  };

  std::vector<size_t> all(kPages);
  std::vector<size_t> odd;
  std::vector<uint32_t> crcs(kPages);
  for (size_t p = 0; p < kPages; ++p) {
    all[p] = p;
    test::fill_page(host.page(p, kPageBytes), kPageBytes, p, 1);
    if (p % 2 == 1) {
      odd.push_back(p);
    }
  }
  run_batch(OpKind::kWrite, all);
  for (size_t p : odd) {
    test::fill_page(host.page(p, kPageBytes), kPageBytes, p, 2);
  }
  run_batch(OpKind::kWrite, odd);
  for (size_t p = 0; p < kPages; ++p) {
    crcs[p] = crc32c(host.page(p, kPageBytes), kPageBytes);
  }
  std::memset(host.data(), 0, host.size());
  std::reverse(all.begin(), all.end());
  run_batch(OpKind::kRead, all);
  for (size_t p = 0; p < kPages; ++p) {
    EXPECT_TRUE(test::page_matches(host.page(p, kPageBytes), kPageBytes, p, p % 2 == 1 ? 2 : 1))
        << "page " << p;
    EXPECT_EQ(crc32c(host.page(p, kPageBytes), kPageBytes), crcs[p]) << "page " << p;
  }

  // The blocking path sees the same file.
  AlignedBuffer one(kPageBytes);
  ASSERT_EQ(engine->read_page(one.data(), kPageBytes, offset_of(7)), kPageBytes);
  EXPECT_TRUE(test::page_matches(one.data(), kPageBytes, 7, 2));
  test::fill_page(one.data(), kPageBytes, 7, 3);
  ASSERT_EQ(engine->write_page(one.data(), kPageBytes, offset_of(7)), kPageBytes);
  run_batch(OpKind::kRead, {7});
  EXPECT_TRUE(test::page_matches(host.page(7, kPageBytes), kPageBytes, 7, 3));

  EXPECT_EQ(engine->sync(), 0);
  if (buffers == Buffers::kRegistered) {
    EXPECT_EQ(engine->unregister_buffers(), 0);
  }
  EXPECT_EQ(engine->close(), 0);
  EXPECT_FALSE(engine->file().is_open());
}

std::string matrix_name(const ::testing::TestParamInfo<MatrixParam>& info) {
  const auto [backend, direct, location, buffers] = info.param;
  return std::string(test::short_name(backend)) +
         (direct == DirectMode::kAuto ? "_DirectAuto" : "_Buffered") +
         (location == Location::kTmp ? "_Tmp" : "_Shm") +
         (buffers == Buffers::kRegistered ? "_Registered" : "_Plain");
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, RoundTrip,
    ::testing::Combine(::testing::Values(Backend::kPosix, Backend::kIoUring),
                       ::testing::Values(DirectMode::kAuto, DirectMode::kOff),
                       ::testing::Values(Location::kTmp, Location::kShm),
                       ::testing::Values(Buffers::kPlain, Buffers::kRegistered)),
    matrix_name);

// The API's edges, per backend.
class Engine : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    PO_SKIP_IF_REFUSED(GetParam());
    ASSERT_TRUE(dir_.ok());
    engine_ = test::make_engine(GetParam(), 4);
    ASSERT_NE(engine_, nullptr);
  }
  void open() { ASSERT_EQ(engine_->open(dir_.file("pages")), 0); }

  TempDir dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_P(Engine, QueueDepthOneStillTakesLargeBatches) {
  engine_ = test::make_engine(GetParam(), 1);
  ASSERT_NE(engine_, nullptr);
  EXPECT_EQ(engine_->queue_depth(), 1u);
  open();
  constexpr size_t kPages = 300;
  AlignedBuffer host(kPages * kDirectAlignment);
  std::vector<IoRequest> batch;
  for (size_t p = 0; p < kPages; ++p) {
    test::fill_page(host.page(p, kDirectAlignment), kDirectAlignment, p, 9);
    batch.push_back(IoRequest::write(host.page(p, kDirectAlignment), kDirectAlignment,
                                     static_cast<int64_t>(p) * kDirectAlignment, p));
  }
  ASSERT_EQ(engine_->submit(batch), static_cast<int>(kPages));
  EXPECT_EQ(engine_->in_flight(), static_cast<int64_t>(kPages));
  for (const IoCompletion& c : test::reap(*engine_, kPages)) {
    EXPECT_EQ(c.result, kDirectAlignment);
  }
  for (size_t p = 0; p < kPages; p += 37) {
    AlignedBuffer one(kDirectAlignment);
    const int64_t offset = static_cast<int64_t>(p) * kDirectAlignment;
    ASSERT_EQ(engine_->read_page(one.data(), kDirectAlignment, offset), kDirectAlignment);
    EXPECT_TRUE(test::page_matches(one.data(), kDirectAlignment, p, 9));
  }
}

TEST_P(Engine, NoFileOpen) {
  AlignedBuffer buf(kDirectAlignment);
  const IoRequest r = IoRequest::read(buf.data(), kDirectAlignment, 0, 1);
  EXPECT_EQ(engine_->submit({&r, 1}), -EBADF);
  EXPECT_EQ(engine_->read_page(buf.data(), kDirectAlignment, 0), -EBADF);
  EXPECT_EQ(engine_->write_page(buf.data(), kDirectAlignment, 0), -EBADF);
  EXPECT_EQ(engine_->sync(), -EBADF);
  EXPECT_EQ(engine_->reserve(kDirectAlignment), -EBADF);
  EXPECT_EQ(engine_->in_flight(), 0);
  EXPECT_EQ(engine_->close(), 0);
}

TEST_P(Engine, InvalidBatchIsRejectedWhole) {
  open();
  AlignedBuffer buf(4 * kDirectAlignment);
  std::vector<IoRequest> batch{IoRequest::write(buf.data(), kDirectAlignment, 0, 1),
                               IoRequest::write(buf.data(), 0, kDirectAlignment, 2)};
  EXPECT_EQ(engine_->submit(batch), -EINVAL);
  batch[1] = IoRequest::write(buf.data(), kDirectAlignment, -4096, 2);
  EXPECT_EQ(engine_->submit(batch), -EINVAL);
  batch[1] = IoRequest::write(nullptr, kDirectAlignment, 0, 2);
  EXPECT_EQ(engine_->submit(batch), -EINVAL);
  batch[1] = IoRequest::write_fixed(0, kDirectAlignment, 0, 2);  // nothing registered
  EXPECT_EQ(engine_->submit(batch), -EINVAL);
  EXPECT_EQ(engine_->in_flight(), 0);
  IoCompletion c;
  EXPECT_EQ(engine_->poll({&c, 1}), 0);
}

TEST_P(Engine, MisalignedRequestsFailOnDirectFiles) {
  open();
  if (!engine_->file().is_direct()) {
    GTEST_SKIP() << "the file system under " << test::tmp_base() << " refuses O_DIRECT";
  }
  AlignedBuffer buf(3 * kDirectAlignment);
  const IoRequest bad_length = IoRequest::write(buf.data(), 1000, 0, 1);
  const IoRequest bad_offset = IoRequest::write(buf.data(), kDirectAlignment, 512, 1);
  const IoRequest bad_address = IoRequest::write(buf.data() + 8, kDirectAlignment, 0, 1);
  EXPECT_EQ(engine_->submit({&bad_length, 1}), -EINVAL);
  EXPECT_EQ(engine_->submit({&bad_offset, 1}), -EINVAL);
  EXPECT_EQ(engine_->submit({&bad_address, 1}), -EINVAL);
  EXPECT_EQ(engine_->write_page(buf.data() + 8, kDirectAlignment, 0), -EINVAL);
  EXPECT_EQ(engine_->in_flight(), 0);
}

TEST_P(Engine, RegisteredBufferBounds) {
  open();
  AlignedBuffer host(4 * kDirectAlignment);
  const iovec slots[2] = {{host.data(), 2 * kDirectAlignment},
                          {host.data() + 2 * kDirectAlignment, 2 * kDirectAlignment}};
  ASSERT_EQ(engine_->register_buffers(slots), 0);
  // Inside slot 1, at its second page: accepted.
  test::fill_page(host.page(3, kDirectAlignment), kDirectAlignment, 3, 1);
  const IoRequest inside =
      IoRequest::write_fixed(1, kDirectAlignment, 0, 1, host.page(3, kDirectAlignment));
  ASSERT_EQ(engine_->submit({&inside, 1}), 1);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kDirectAlignment);
  // Running past the end of slot 0, or outside it, or an unknown index: refused.
  const IoRequest past_end =
      IoRequest::write_fixed(0, kDirectAlignment, 0, 2, host.data() + 2 * kDirectAlignment);
  const IoRequest too_long = IoRequest::write_fixed(0, 3 * kDirectAlignment, 0, 2);
  const IoRequest unknown = IoRequest::write_fixed(2, kDirectAlignment, 0, 2);
  const IoRequest negative = IoRequest::write_fixed(-2, kDirectAlignment, 0, 2, host.data());
  for (const IoRequest& r : {past_end, too_long, unknown, negative}) {
    EXPECT_EQ(engine_->submit({&r, 1}), -EINVAL);
  }
  // Null buffer with an index means the slot's start.
  const IoRequest start = IoRequest::read_fixed(0, kDirectAlignment, 0, 3);
  ASSERT_EQ(engine_->submit({&start, 1}), 1);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kDirectAlignment);
  EXPECT_TRUE(test::page_matches(host.data(), kDirectAlignment, 3, 1));

  const iovec empty{nullptr, 0};
  EXPECT_EQ(engine_->register_buffers({&empty, 1}), -EINVAL);
  EXPECT_EQ(engine_->register_buffers({}), -EINVAL);
  EXPECT_EQ(engine_->unregister_buffers(), 0);
  EXPECT_EQ(engine_->submit({&start, 1}), -EINVAL);
}

// The kernel refuses to register a buffer over 1 GiB (as it refuses more than RLIMIT_MEMLOCK
// for unprivileged users); index-based requests must then still work, as plain requests.
// The mapping is reserved address space only: nothing is touched beyond the first page.
TEST_P(Engine, RegisteredBuffersTheKernelRefuses) {
  open();
  constexpr size_t kHuge = size_t{2} << 30;
  void* region = ::mmap(nullptr, kHuge, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(region, MAP_FAILED);
  const iovec slot{region, kHuge};
  ASSERT_EQ(engine_->register_buffers({&slot, 1}), 0);
  EXPECT_FALSE(engine_->fixed_buffers_in_kernel());
  test::fill_page(region, kDirectAlignment, 11, 1);
  const IoRequest w = IoRequest::write_fixed(0, kDirectAlignment, 0, 1);
  ASSERT_EQ(engine_->submit({&w, 1}), 1);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kDirectAlignment);
  AlignedBuffer back(kDirectAlignment);
  ASSERT_EQ(engine_->read_page(back.data(), kDirectAlignment, 0), kDirectAlignment);
  EXPECT_TRUE(test::page_matches(back.data(), kDirectAlignment, 11, 1));
  EXPECT_EQ(engine_->unregister_buffers(), 0);
  ::munmap(region, kHuge);
}

TEST_P(Engine, ReadsStopAtEndOfFile) {
  open();
  AlignedBuffer buf(4 * kDirectAlignment);
  test::fill_page(buf.data(), 2 * kDirectAlignment, 0, 1);
  ASSERT_EQ(engine_->write_page(buf.data(), 2 * kDirectAlignment, 0), 2 * kDirectAlignment);
  const IoRequest reads[2] = {
      IoRequest::read(buf.data(), 4 * kDirectAlignment, 0, 1),
      IoRequest::read(buf.data(), kDirectAlignment, 8 * kDirectAlignment, 2)};
  ASSERT_EQ(engine_->submit(reads), 2);
  for (const IoCompletion& c : test::reap(*engine_, 2)) {
    EXPECT_EQ(c.result, c.tag == 1 ? 2 * kDirectAlignment : 0) << "tag " << c.tag;
  }
  EXPECT_EQ(engine_->read_page(buf.data(), 4 * kDirectAlignment, 0), 2 * kDirectAlignment);
}

TEST_P(Engine, BusyWhileRequestsAreInFlight) {
  open();
  AlignedBuffer buf(kDirectAlignment);
  const IoRequest w = IoRequest::write(buf.data(), kDirectAlignment, 0, 1);
  ASSERT_EQ(engine_->submit({&w, 1}), 1);
  // Not reaped yet, so in flight whether or not the device has finished.
  const iovec slot{buf.data(), kDirectAlignment};
  EXPECT_EQ(engine_->close(), -EBUSY);
  EXPECT_EQ(engine_->open(dir_.file("other")), -EBUSY);
  EXPECT_EQ(engine_->register_buffers({&slot, 1}), -EBUSY);
  EXPECT_EQ(engine_->unregister_buffers(), -EBUSY);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kDirectAlignment);
  EXPECT_EQ(engine_->close(), 0);
  EXPECT_EQ(engine_->open(dir_.file("other")), 0);
  EXPECT_EQ(engine_->open(dir_.file("other")), -EBUSY);
}

TEST_P(Engine, WaitWhenIdle) {
  open();
  IoCompletion c;
  EXPECT_EQ(engine_->wait({&c, 1}), 0);
  EXPECT_EQ(engine_->wait({&c, 1}, std::chrono::milliseconds(10)), 0);
  EXPECT_EQ(engine_->wait({}), -EINVAL);
  EXPECT_EQ(engine_->poll({&c, 1}), 0);
}

TEST_P(Engine, ReserveAndSync) {
  open();
  EXPECT_EQ(engine_->reserve(-1), -EINVAL);
  ASSERT_EQ(engine_->reserve(64 * kDirectAlignment), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(engine_->file().fd, &st), 0);
  EXPECT_GE(st.st_size, 64 * kDirectAlignment);
  EXPECT_EQ(engine_->sync(), 0);
}

// The destructor must not return while the kernel can still write into the buffers the
// caller frees next (AddressSanitizer would see it).
TEST_P(Engine, DestroyWithRequestsInFlight) {
  open();
  constexpr size_t kPages = 64;
  auto host = std::make_unique<AlignedBuffer>(kPages * kDirectAlignment);
  std::vector<IoRequest> batch;
  for (size_t p = 0; p < kPages; ++p) {
    batch.push_back(IoRequest::write(host->page(p, kDirectAlignment), kDirectAlignment,
                                     static_cast<int64_t>(p) * kDirectAlignment, p));
  }
  ASSERT_EQ(engine_->submit(batch), static_cast<int>(kPages));
  for (IoRequest& r : batch) {
    r.op = OpKind::kRead;
  }
  ASSERT_EQ(engine_->submit(batch), static_cast<int>(kPages));
  engine_.reset();
  host.reset();
}

INSTANTIATE_TEST_SUITE_P(Backends, Engine, ::testing::Values(Backend::kPosix, Backend::kIoUring),
                         test::backend_param_name);

// A worker thread that cannot start: no engine (EAGAIN), the workers already started
// joined, the process alive; the next engine starts.
TEST(Factory, PosixWorkerThatCannotStartIsEagainWithTheOthersJoined) {
  EngineOptions options;
  options.backend = Backend::kPosix;
  options.queue_depth = 16;
  options.posix_threads = 4;
  pagedoptim::testing::fail_thread_start(3);
  int err = 0;
  EXPECT_EQ(make_io_engine(options, &err), nullptr);
  EXPECT_EQ(err, -EAGAIN);
  pagedoptim::testing::fail_thread_start(0);
  EXPECT_NE(make_io_engine(options, &err), nullptr);
}

TEST(Factory, PosixOnRequest) {
  auto engine = test::make_engine(Backend::kPosix, 16);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), Backend::kPosix);
  EXPECT_TRUE(engine->fallback_reason().empty());
  EXPECT_FALSE(engine->fixed_buffers_in_kernel());
}

TEST(Factory, AutoFollowsTheProbe) {
  const IoUringSupport& probe = probe_io_uring();
  EXPECT_EQ(probe.available, probe.error == 0);
  EXPECT_EQ(probe.available, probe.reason.empty());
  auto engine = test::make_engine(Backend::kAuto, 16);
  ASSERT_NE(engine, nullptr);
  if (probe.available) {
    EXPECT_EQ(engine->backend(), Backend::kIoUring);
    EXPECT_TRUE(engine->fallback_reason().empty());
  } else {
    EXPECT_EQ(engine->backend(), Backend::kPosix);
    EXPECT_FALSE(engine->fallback_reason().empty());
  }
}

TEST(Factory, ExplicitIoUringFailsWhenRefused) {
  const IoUringSupport& probe = probe_io_uring();
  EngineOptions options;
  options.backend = Backend::kIoUring;
  int err = 1;
  auto engine = make_io_engine(options, &err);
  if (probe.available) {
    ASSERT_NE(engine, nullptr);
    EXPECT_EQ(err, 0);
    EXPECT_EQ(engine->backend(), Backend::kIoUring);
  } else {
    EXPECT_EQ(engine, nullptr);
    EXPECT_EQ(err, probe.error);
  }
}

TEST(Factory, RejectsBadOptions) {
  for (Backend backend : {Backend::kAuto, Backend::kPosix, Backend::kIoUring}) {
    EngineOptions options;
    options.backend = backend;
    int err = 0;
    options.queue_depth = 0;
    EXPECT_EQ(make_io_engine(options, &err), nullptr);
    EXPECT_EQ(err, -EINVAL);
    options.queue_depth = kMaxQueueDepth + 1;
    EXPECT_EQ(make_io_engine(options, &err), nullptr);
    EXPECT_EQ(err, -EINVAL);
    options.queue_depth = 4;
    options.posix_threads = 0;
    EXPECT_EQ(make_io_engine(options, &err), nullptr);
    EXPECT_EQ(err, -EINVAL);
  }
  EngineOptions bogus;
  bogus.backend = static_cast<Backend>(7);
  int err = 0;
  EXPECT_EQ(make_io_engine(bogus, &err), nullptr);
  EXPECT_EQ(err, -EINVAL);
}

}  // namespace
}  // namespace pagedoptim::io
