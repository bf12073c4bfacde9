// The pager under injected faults: a full disk, EIO, short transfers and flipped bytes
// end in a clear exception, never in lost or silently wrong state.
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "paging_test_util.h"
#include "pagedoptim/paging/page_errors.h"

namespace pagedoptim::paging {
namespace {

using test::fill_page;
using test::page_matches;
using test::run_step;
using test::ScratchDir;

constexpr int64_t kPageBytes = 8192;
constexpr int32_t kPages = 16;
constexpr int32_t kBudget = 4;

class PagerFaults : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "io_uring" && !test::io_uring_usable()) {
      GTEST_SKIP() << "io_uring is refused here: " << io::probe_io_uring().reason;
    }
    TieredStoreOptions options;
    options.page_bytes = kPageBytes;
    options.cache_bytes = kBudget * kPageBytes;
    options.prefetch = 2;
    store_ = std::make_unique<TieredPageStore>(
        options, test::make_test_tier(GetParam(), kPageBytes, dir_.path(), true));
    store_->grow(kPages);
    plan_.resize(kPages);
    std::iota(plan_.begin(), plan_.end(), 0);
    version_.assign(kPages, 0);
    step();  // every page written once, most of them to the file
    ASSERT_GT(store_->stats().writes, 0);
  }

  // One step over every page, in the driver's alternating order; counts the pages the
  // step's kernel saw.
  int step() {
    std::reverse(plan_.begin(), plan_.end());
    int touched = 0;
    run_step(*store_, plan_, [&](int32_t page, std::byte* bytes) {
      EXPECT_TRUE(page_matches(bytes, kPageBytes, page, version_[size_t(page)])) << page;
      fill_page(bytes, kPageBytes, page, ++version_[size_t(page)]);
      ++touched;
    });
    return touched;
  }

  void set_rules(std::vector<io::FaultRule> rules) {
    ASSERT_NE(store_->tier().fault_injector(), nullptr);
    ASSERT_EQ(store_->tier().fault_injector()->set_rules(std::move(rules)), 0);
  }

  // The pages as a checkpoint reads them: one at a time, off the plan.
  void expect_every_page_intact() {
    for (int32_t p = 0; p < kPages; ++p) {
      const std::byte* bytes = store_->pin(p);
      EXPECT_TRUE(page_matches(bytes, kPageBytes, p, version_[size_t(p)])) << "page " << p;
      store_->unpin(p, false);
    }
  }

  // A failed write-back: the step still runs to its end, then throws; nothing is lost,
  // and once the fault is gone the next step works and the cache returns to its budget.
  void expect_write_fault_keeps_state(io::FaultRule rule, int expected_errno) {
    set_rules({rule});
    int touched = 0;
    try {
      std::reverse(plan_.begin(), plan_.end());
      run_step(*store_, plan_, [&](int32_t page, std::byte* bytes) {
        EXPECT_TRUE(page_matches(bytes, kPageBytes, page, version_[size_t(page)]));
        fill_page(bytes, kPageBytes, page, ++version_[size_t(page)]);
        ++touched;
      });
      FAIL() << "the step should report the failed write-back";
    } catch (const PageIoError& e) {
      EXPECT_EQ(e.error_number(), expected_errno) << e.what();
      EXPECT_NE(std::string(e.what()).find(store_->tier().info().location), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("no optimizer state was lost"), std::string::npos);
    }
    EXPECT_EQ(touched, kPages) << "the whole step ran before the error was thrown";
    PagingStats s = store_->stats();
    EXPECT_GE(s.write_errors, 1);
    EXPECT_GT(s.over_budget_pages, 0);
    expect_every_page_intact();  // a checkpoint can still be taken, with the fault active
    set_rules({});
    EXPECT_EQ(step(), kPages);
    EXPECT_EQ(step(), kPages);
    expect_every_page_intact();
    store_->drain();
    s = store_->stats();
    EXPECT_EQ(s.pending_error, "");
    EXPECT_LE(s.resident_pages, kBudget) << "the cache shrinks back to its budget";
  }

  ScratchDir dir_;
  std::unique_ptr<TieredPageStore> store_;
  std::vector<int32_t> plan_;
  std::vector<int64_t> version_;
};

io::FaultRule rule(io::FaultKind kind, int ops) {
  io::FaultRule r;
  r.kind = int(kind);
  r.ops = ops;
  return r;
}

TEST_P(PagerFaults, FullDiskKeepsDirtyPagesResident) {
  expect_write_fault_keeps_state(rule(io::FaultKind::kEnospc, io::kFaultWrites), ENOSPC);
}

TEST_P(PagerFaults, WriteEioKeepsDirtyPagesResident) {
  io::FaultRule r = rule(io::FaultKind::kEio, io::kFaultWrites);
  r.from_op = 2;  // a few write-backs succeed first
  expect_write_fault_keeps_state(r, EIO);
}

TEST_P(PagerFaults, ShortWriteIsAFailedWriteBack) {
  expect_write_fault_keeps_state(rule(io::FaultKind::kShort, io::kFaultWrites), EIO);
}

TEST_P(PagerFaults, TransientReadErrorIsRetried) {
  io::FaultRule r = rule(io::FaultKind::kEio, io::kFaultReads);
  r.max_fires = 1;
  set_rules({r});
  EXPECT_EQ(step(), kPages);
  EXPECT_EQ(store_->stats().read_retries, 1);
  expect_every_page_intact();
}

TEST_P(PagerFaults, PersistentReadErrorFailsThePinNotTheState) {
  set_rules({rule(io::FaultKind::kEio, io::kFaultReads)});
  try {
    step();
    FAIL() << "expected PageIoError";
  } catch (const PageIoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("3 attempts"), std::string::npos) << e.what();
  }
  EXPECT_GE(store_->stats().read_errors, 1);
  set_rules({});
  expect_every_page_intact();
  EXPECT_EQ(step(), kPages);
}

TEST_P(PagerFaults, ShortReadFailsThePin) {
  set_rules({rule(io::FaultKind::kShort, io::kFaultReads)});
  EXPECT_THROW(step(), PageIoError);
  set_rules({});
  expect_every_page_intact();
}

TEST_P(PagerFaults, FlippedByteOnReadIsACorruptionErrorAndNeverUsed) {
  io::FaultRule r = rule(io::FaultKind::kFlipByte, io::kFaultReads);
  r.flip_at = 100;
  set_rules({r});
  try {
    step();
    FAIL() << "expected PageCorruptionError";
  } catch (const PageCorruptionError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  EXPECT_GE(store_->stats().checksum_errors, 1);
  set_rules({});
  expect_every_page_intact();  // the file was fine; only the transfers were corrupted
}

TEST_P(PagerFaults, PageCorruptedOnDiskIsNeverHandedOut) {
  // The first write-back of the next step reaches the file with one byte flipped.
  io::FaultRule r = rule(io::FaultKind::kFlipByte, io::kFaultWrites);
  r.max_fires = 1;
  set_rules({r});
  EXPECT_EQ(step(), kPages);
  store_->drain();
  set_rules({});
  // Find the page that went bad: every pin of it throws, every other page is intact.
  int corrupt = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    corrupt = 0;
    for (int32_t p = 0; p < kPages; ++p) {
      try {
        const std::byte* bytes = store_->pin(p);
        EXPECT_TRUE(page_matches(bytes, kPageBytes, p, version_[size_t(p)])) << p;
        store_->unpin(p, false);
      } catch (const PageCorruptionError&) {
        ++corrupt;
      }
    }
  }
  EXPECT_EQ(corrupt, 1);
}

INSTANTIATE_TEST_SUITE_P(Backends, PagerFaults, ::testing::Values("posix", "io_uring"),
                         [](const auto& info) { return info.param; });

// A real full disk: a 256 KiB tmpfs cannot take 16 pages of 64 KiB, and grow() says so
// before any step, naming the file. Needs the right to mount (root in a container).
TEST(PagerDiskFull, GrowFailsWithEnospcOnASmallTmpfs) {
  ScratchDir dir;
  if (::mount("tmpfs", dir.path().c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  }
  {
    FileTierOptions options;
    options.dir = dir.path();
    options.page_bytes = 64 << 10;
    options.engine.backend = io::Backend::kPosix;
    auto tier = make_file_tier(options);
    try {
      tier->grow(16);
      FAIL() << "expected ENOSPC";
    } catch (const PageIoError& e) {
      EXPECT_EQ(e.error_number(), ENOSPC);
      EXPECT_NE(std::string(e.what()).find(dir.path()), std::string::npos) << e.what();
    }
    tier->grow(2);  // what fits still works
  }
  ::umount(dir.path().c_str());
}

}  // namespace
}  // namespace pagedoptim::paging
