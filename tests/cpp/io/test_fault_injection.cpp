// The fault-injecting decorator: each fault does what it says, rules fire when they say,
// and a corrupted page is visible to a crc32c check.
#include <cerrno>
#include <map>

#include "pagedoptim/io/crc32c.h"
#include "test_io_util.h"

namespace pagedoptim::io {
namespace {

using test::AlignedBuffer;
using test::TempDir;

constexpr size_t kPages = 8;
constexpr uint32_t kPageBytes = 16 << 10;
// The completion result of a whole page (signed, to compare with -errno results).
constexpr int64_t kFull = kPageBytes;

int64_t offset_of(size_t page) {
  return static_cast<int64_t>(page) * kPageBytes;
}

FaultRule rule(FaultKind kind, int ops) {
  FaultRule r;
  r.kind = static_cast<int>(kind);
  r.ops = ops;
  return r;
}

class Faults : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    PO_SKIP_IF_REFUSED(GetParam());
    ASSERT_TRUE(dir_.ok());
    engine_ = make_fault_injecting_engine(test::make_engine(GetParam(), 4));
    ASSERT_NE(engine_, nullptr);
    ASSERT_EQ(engine_->open(dir_.file("pages")), 0);
    // Generation 1 of every page, written without faults.
    for (size_t p = 0; p < kPages; ++p) {
      test::fill_page(host_.page(p, kPageBytes), kPageBytes, p, 1);
    }
    const auto all = static_cast<int64_t>(host_.size());
    ASSERT_EQ(engine_->write_page(host_.data(), host_.size(), 0), all);
  }

  // Submits one request per page, all in one batch; returns result by page.
  std::map<size_t, int64_t> batch(OpKind op) {
    std::vector<IoRequest> requests;
    for (size_t p = 0; p < kPages; ++p) {
      char* slot = host_.page(p, kPageBytes);
      requests.push_back(op == OpKind::kRead
                             ? IoRequest::read(slot, kPageBytes, offset_of(p), p)
                             : IoRequest::write(slot, kPageBytes, offset_of(p), p));
    }
    EXPECT_EQ(engine_->submit(requests), static_cast<int>(kPages));
    std::map<size_t, int64_t> results;
    for (const IoCompletion& c : test::reap(*engine_, kPages)) {
      results[c.tag] = c.result;
    }
    EXPECT_EQ(engine_->in_flight(), 0);
    return results;
  }

  // Generation of each page on disk, read through the inner engine (no faults).
  int generation_on_disk(size_t page) {
    AlignedBuffer one(kPageBytes);
    EXPECT_EQ(engine_->inner().read_page(one.data(), kPageBytes, offset_of(page)), kPageBytes);
    for (int g = 1; g <= 2; ++g) {
      if (test::page_matches(one.data(), kPageBytes, page, static_cast<uint64_t>(g))) {
        return g;
      }
    }
    return 0;
  }

  void fill_generation(uint64_t generation) {
    for (size_t p = 0; p < kPages; ++p) {
      test::fill_page(host_.page(p, kPageBytes), kPageBytes, p, generation);
    }
  }

  TempDir dir_;
  AlignedBuffer host_{kPages * kPageBytes};
  std::unique_ptr<FaultInjectingEngine> engine_;
};

TEST_P(Faults, EnospcOnWritesFromTheFourthOn) {
  FaultRule r = rule(FaultKind::kEnospc, kFaultWrites);
  r.from_op = 3;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  fill_generation(2);
  const auto results = batch(OpKind::kWrite);
  for (size_t p = 0; p < kPages; ++p) {
    EXPECT_EQ(results.at(p), p < 3 ? kFull : -ENOSPC) << "page " << p;
    // A failed write leaves the previous generation intact on disk.
    EXPECT_EQ(generation_on_disk(p), p < 3 ? 2 : 1) << "page " << p;
  }
  EXPECT_EQ(engine_->fire_counts(), std::vector<int64_t>{5});
}

TEST_P(Faults, EioOnEverySecondRead) {
  FaultRule r = rule(FaultKind::kEio, kFaultReads);
  r.every_nth = 2;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  std::memset(host_.data(), 0, host_.size());
  const auto results = batch(OpKind::kRead);
  for (size_t p = 0; p < kPages; ++p) {
    const char* page = host_.page(p, kPageBytes);
    if (p % 2 == 1) {
      EXPECT_EQ(results.at(p), -EIO) << "page " << p;
      // Poisoned, so using it anyway cannot pass a checksum.
      EXPECT_EQ(static_cast<unsigned char>(page[0]), 0xA5);
      EXPECT_EQ(static_cast<unsigned char>(page[kPageBytes - 1]), 0xA5);
    } else {
      EXPECT_EQ(results.at(p), kPageBytes) << "page " << p;
      EXPECT_TRUE(test::page_matches(page, kPageBytes, p, 1)) << "page " << p;
    }
  }
  EXPECT_EQ(engine_->fire_counts(), std::vector<int64_t>{4});
}

TEST_P(Faults, EioOnWriteLeavesTheFileAlone) {
  ASSERT_EQ(engine_->set_rules({rule(FaultKind::kEio, kFaultWrites)}), 0);
  fill_generation(2);
  for (const auto& [page, result] : batch(OpKind::kWrite)) {
    EXPECT_EQ(result, -EIO);
    EXPECT_EQ(generation_on_disk(page), 1);
  }
}

TEST_P(Faults, ShortWriteTearsThePage) {
  FaultRule r = rule(FaultKind::kShort, kFaultWrites);
  r.max_fires = 1;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  fill_generation(2);
  const uint32_t crc_new = crc32c(host_.page(0, kPageBytes), kPageBytes);
  const auto results = batch(OpKind::kWrite);
  EXPECT_EQ(results.at(0), kPageBytes / 2);
  for (size_t p = 1; p < kPages; ++p) {
    EXPECT_EQ(results.at(p), kPageBytes);
  }
  // Half new, half old: neither generation's checksum matches.
  AlignedBuffer one(kPageBytes);
  ASSERT_EQ(engine_->read_page(one.data(), kPageBytes, 0), kPageBytes);
  EXPECT_NE(crc32c(one.data(), kPageBytes), crc_new);
  EXPECT_TRUE(test::page_matches(one.data(), kPageBytes / 2, 0, 2));
  AlignedBuffer old(kPageBytes);
  test::fill_page(old.data(), kPageBytes, 0, 1);
  constexpr size_t kHalf = kPageBytes / 2;
  EXPECT_EQ(std::memcmp(one.data() + kHalf, old.data() + kHalf, kHalf), 0);
}

TEST_P(Faults, ShortReadReportsWhatMoved) {
  FaultRule r = rule(FaultKind::kShort, kFaultReads);
  r.short_bytes = 4096;
  r.offset_begin = offset_of(2);
  r.offset_end = offset_of(3);
  ASSERT_EQ(engine_->set_rules({r}), 0);
  const auto results = batch(OpKind::kRead);
  for (size_t p = 0; p < kPages; ++p) {
    EXPECT_EQ(results.at(p), p == 2 ? int64_t{4096} : kFull) << "page " << p;
  }
}

TEST_P(Faults, FlippedByteOnReadIsCaughtByCrc32c) {
  FaultRule r = rule(FaultKind::kFlipByte, kFaultReads);
  r.flip_at = 100;
  r.flip_mask = 0x10;
  r.max_fires = 1;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  AlignedBuffer expected(kPageBytes);
  test::fill_page(expected.data(), kPageBytes, 0, 1);
  const uint32_t stored = crc32c(expected.data(), kPageBytes);

  AlignedBuffer one(kPageBytes);
  const IoRequest read = IoRequest::read(one.data(), kPageBytes, 0, 42);
  ASSERT_EQ(engine_->submit({&read, 1}), 1);
  const auto done = test::reap(*engine_, 1);
  EXPECT_EQ(done[0].tag, 42u);
  EXPECT_EQ(done[0].result, kPageBytes);
  EXPECT_NE(crc32c(one.data(), kPageBytes), stored);
  EXPECT_EQ(one.data()[100] ^ expected.data()[100], 0x10);
  one.data()[100] = expected.data()[100];
  EXPECT_EQ(std::memcmp(one.data(), expected.data(), kPageBytes), 0);
  // Once only: a retry reads the good page.
  ASSERT_EQ(engine_->read_page(one.data(), kPageBytes, 0), kPageBytes);
  EXPECT_EQ(crc32c(one.data(), kPageBytes), stored);
}

TEST_P(Faults, FlippedByteOnWriteCorruptsTheFileNotTheCaller) {
  FaultRule r = rule(FaultKind::kFlipByte, kFaultWrites);
  r.flip_at = kPageBytes + 5;  // modulo the length: byte 5
  ASSERT_EQ(engine_->set_rules({r}), 0);
  AlignedBuffer page(kPageBytes);
  test::fill_page(page.data(), kPageBytes, 3, 2);
  const uint32_t crc = crc32c(page.data(), kPageBytes);
  const IoRequest write = IoRequest::write(page.data(), kPageBytes, offset_of(3), 3);
  ASSERT_EQ(engine_->submit({&write, 1}), 1);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kPageBytes);
  EXPECT_EQ(crc32c(page.data(), kPageBytes), crc);
  AlignedBuffer back(kPageBytes);
  ASSERT_EQ(engine_->inner().read_page(back.data(), kPageBytes, offset_of(3)), kPageBytes);
  EXPECT_NE(crc32c(back.data(), kPageBytes), crc);
  EXPECT_EQ(back.data()[5] ^ page.data()[5], 0x01);
}

TEST_P(Faults, OnlyTheFifthWrite) {
  FaultRule r = rule(FaultKind::kEio, kFaultWrites);
  r.from_op = 4;
  r.max_fires = 1;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  const auto results = batch(OpKind::kWrite);
  for (size_t p = 0; p < kPages; ++p) {
    EXPECT_EQ(results.at(p), p == 4 ? -EIO : kFull) << "page " << p;
  }
}

TEST_P(Faults, FirstFiringRuleDecidesAndAllMatchingRulesCount) {
  FaultRule eio = rule(FaultKind::kEio, kFaultReads);
  eio.every_nth = 4;
  FaultRule flip = rule(FaultKind::kFlipByte, kFaultReads);
  flip.every_nth = 2;
  ASSERT_EQ(engine_->set_rules({eio, flip}), 0);
  const auto results = batch(OpKind::kRead);
  for (size_t p = 0; p < kPages; ++p) {
    const bool eio_fires = (p + 1) % 4 == 0;
    const bool flip_fires = !eio_fires && (p + 1) % 2 == 0;
    EXPECT_EQ(results.at(p), eio_fires ? -EIO : kFull) << "page " << p;
    if (!eio_fires) {
      const bool intact = test::page_matches(host_.page(p, kPageBytes), kPageBytes, p, 1);
      EXPECT_EQ(intact, !flip_fires) << "page " << p;
    }
  }
  EXPECT_EQ(engine_->fire_counts(), (std::vector<int64_t>{2, 2}));
}

TEST_P(Faults, BlockingTransfersAreInjectedToo) {
  FaultRule enospc = rule(FaultKind::kEnospc, kFaultWrites);
  enospc.max_fires = 1;
  FaultRule eio = rule(FaultKind::kEio, kFaultReads);
  eio.max_fires = 1;
  FaultRule torn = rule(FaultKind::kShort, kFaultWrites);
  torn.from_op = 1;
  torn.max_fires = 1;
  FaultRule flip = rule(FaultKind::kFlipByte, kFaultReads);
  flip.from_op = 1;
  flip.max_fires = 1;
  ASSERT_EQ(engine_->set_rules({enospc, eio, torn, flip}), 0);
  AlignedBuffer page(kPageBytes);
  test::fill_page(page.data(), kPageBytes, 1, 2);
  EXPECT_EQ(engine_->write_page(page.data(), kPageBytes, offset_of(1)), -ENOSPC);
  EXPECT_EQ(generation_on_disk(1), 1);
  EXPECT_EQ(engine_->write_page(page.data(), kPageBytes, offset_of(1)), kPageBytes / 2);
  EXPECT_EQ(engine_->write_page(page.data(), kPageBytes, offset_of(1)), kPageBytes);
  EXPECT_EQ(engine_->read_page(page.data(), kPageBytes, offset_of(1)), -EIO);
  EXPECT_EQ(engine_->read_page(page.data(), kPageBytes, offset_of(1)), kPageBytes);
  EXPECT_FALSE(test::page_matches(page.data(), kPageBytes, 1, 2));
  EXPECT_EQ(engine_->read_page(page.data(), kPageBytes, offset_of(1)), kPageBytes);
  EXPECT_TRUE(test::page_matches(page.data(), kPageBytes, 1, 2));
  EXPECT_EQ(engine_->fire_counts(), (std::vector<int64_t>{1, 1, 1, 1}));
}

// A batch the engine refuses must not move the rules on: the faults land on the same
// requests when the caller resubmits correctly.
TEST_P(Faults, RejectedBatchLeavesRulesUntouched) {
  FaultRule r = rule(FaultKind::kEio, kFaultWrites);
  r.from_op = 1;
  r.max_fires = 1;
  ASSERT_EQ(engine_->set_rules({r}), 0);
  const IoRequest bad[2] = {IoRequest::write(host_.data(), kPageBytes, 0, 0),
                            IoRequest::write(host_.data(), 0, 0, 1)};
  EXPECT_EQ(engine_->submit(bad), -EINVAL);
  EXPECT_EQ(engine_->in_flight(), 0);
  EXPECT_EQ(engine_->fire_counts(), std::vector<int64_t>{0});
  const auto results = batch(OpKind::kWrite);
  EXPECT_EQ(results.at(0), kPageBytes);
  EXPECT_EQ(results.at(1), -EIO);
}

TEST_P(Faults, RegisteredBuffersAndFlippedWrites) {
  std::vector<iovec> slots(kPages);
  for (size_t p = 0; p < kPages; ++p) {
    slots[p] = iovec{host_.page(p, kPageBytes), kPageBytes};
  }
  ASSERT_EQ(engine_->register_buffers(slots), 0);
  ASSERT_EQ(engine_->set_rules({rule(FaultKind::kFlipByte, kFaultWrites)}), 0);
  fill_generation(2);
  const IoRequest w = IoRequest::write_fixed(6, kPageBytes, offset_of(6), 6);
  ASSERT_EQ(engine_->submit({&w, 1}), 1);
  EXPECT_EQ(test::reap(*engine_, 1)[0].result, kPageBytes);
  EXPECT_TRUE(test::page_matches(host_.page(6, kPageBytes), kPageBytes, 6, 2));
  EXPECT_EQ(generation_on_disk(6), 0);
  EXPECT_EQ(engine_->unregister_buffers(), 0);
}

TEST_P(Faults, ForwardsWhatTheInnerEngineReports) {
  IoEngine& inner = engine_->inner();
  EXPECT_EQ(engine_->backend(), inner.backend());
  EXPECT_EQ(engine_->queue_depth(), inner.queue_depth());
  EXPECT_EQ(engine_->fallback_reason(), inner.fallback_reason());
  EXPECT_EQ(&engine_->file(), &inner.file());
  EXPECT_EQ(engine_->sync(), 0);
  EXPECT_EQ(engine_->close(), 0);
  EXPECT_FALSE(inner.file().is_open());
}

INSTANTIATE_TEST_SUITE_P(Backends, Faults, ::testing::Values(Backend::kPosix, Backend::kIoUring),
                         test::backend_param_name);

TEST(FaultRules, InvalidRulesAreRefused) {
  auto engine = make_fault_injecting_engine(test::make_engine(Backend::kPosix, 2));
  ASSERT_NE(engine, nullptr);
  std::vector<FaultRule> bad(8, rule(FaultKind::kEio, kFaultReads));
  bad[0].kind = 0;
  bad[1].kind = 5;
  bad[2].ops = 0;
  bad[3].ops = 4;
  bad[4].every_nth = -1;
  bad[5].flip_mask = 0;
  bad[6].offset_begin = 8192;
  bad[6].offset_end = 4096;
  bad[7].max_fires = -2;
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_EQ(engine->set_rules({bad[i]}), -EINVAL) << "rule " << i;
    auto inner = test::make_engine(Backend::kPosix, 2);
    EXPECT_EQ(make_fault_injecting_engine(std::move(inner), {bad[i]}), nullptr);
  }
  EXPECT_EQ(make_fault_injecting_engine(nullptr), nullptr);
  EXPECT_EQ(engine->set_rules({}), 0);
  EXPECT_TRUE(engine->fire_counts().empty());
}

}  // namespace
}  // namespace pagedoptim::io
