// What the thread-safety contract allows, exercised: submitting and reaping from different
// threads, several of each, and blocking transfers alongside the queue. Built with
// -DPAGEDOPTIM_SANITIZE=thread these are the data-race checks of the engines.
#include <atomic>
#include <cerrno>
#include <mutex>
#include <thread>

#include "test_io_util.h"

namespace pagedoptim::io {
namespace {

using test::AlignedBuffer;
using test::TempDir;

constexpr uint32_t kPageBytes = 4096;

int64_t offset_of(size_t page) {
  return static_cast<int64_t>(page) * kPageBytes;
}

// Collects completions from any number of reaping threads until `expected` have arrived.
class Collector {
 public:
  explicit Collector(size_t expected) : seen_(expected, 0), expected_(expected) {}

  void reap_until_done(IoEngine& engine) {
    std::vector<IoCompletion> batch(8);
    while (count_.load(std::memory_order_acquire) < expected_) {
      const int n = engine.wait(batch, std::chrono::milliseconds(20));
      if (n == 0) {
        // Nothing in flight yet: the submitters are behind.
        std::this_thread::yield();
        continue;
      }
      if (n == -ETIME) {
        continue;
      }
      ASSERT_GT(n, 0);
      std::lock_guard<std::mutex> lock(mutex_);
      for (int i = 0; i < n; ++i) {
        ASSERT_LT(batch[i].tag, expected_);
        ++seen_[batch[i].tag];
        results_.push_back(batch[i]);
      }
      count_.fetch_add(static_cast<size_t>(n), std::memory_order_acq_rel);
    }
  }

  void expect_each_once() const {
    for (size_t t = 0; t < expected_; ++t) {
      EXPECT_EQ(seen_[t], 1) << "tag " << t;
    }
  }
  const std::vector<IoCompletion>& results() const { return results_; }

 private:
  std::mutex mutex_;
  std::vector<int> seen_;
  std::vector<IoCompletion> results_;
  const size_t expected_;
  std::atomic<size_t> count_{0};
};

class Concurrency : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    PO_SKIP_IF_REFUSED(GetParam());
    ASSERT_TRUE(dir_.ok());
  }
  TempDir dir_;
};

TEST_P(Concurrency, SubmittersAndReapersOnDifferentThreads) {
  auto engine = test::make_engine(GetParam(), 8);
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(engine->open(dir_.file("pages")), 0);
  constexpr size_t kSubmitters = 3;
  constexpr size_t kPerSubmitter = 150;
  constexpr size_t kTotal = kSubmitters * kPerSubmitter;
  AlignedBuffer host(kTotal * kPageBytes);
  for (size_t p = 0; p < kTotal; ++p) {
    test::fill_page(host.page(p, kPageBytes), kPageBytes, p, 5);
  }
  Collector collector(kTotal);
  std::vector<std::thread> threads;
  for (size_t s = 0; s < kSubmitters; ++s) {
    threads.emplace_back([&, s] {
      // Batches of 1 to 7 requests, pages interleaved between submitters.
      size_t i = 0;
      size_t size = 1;
      while (i < kPerSubmitter) {
        std::vector<IoRequest> batch;
        for (size_t k = 0; k < size && i < kPerSubmitter; ++k, ++i) {
          const size_t page = i * kSubmitters + s;
          char* src = host.page(page, kPageBytes);
          batch.push_back(IoRequest::write(src, kPageBytes, offset_of(page), page));
        }
        EXPECT_EQ(engine->submit(batch), static_cast<int>(batch.size()));
        size = size % 7 + 1;
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&] { collector.reap_until_done(*engine); });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  collector.expect_each_once();
  for (const IoCompletion& c : collector.results()) {
    EXPECT_EQ(c.result, kPageBytes);
  }
  EXPECT_EQ(engine->in_flight(), 0);
  AlignedBuffer back(kTotal * kPageBytes);
  ASSERT_EQ(engine->read_page(back.data(), back.size(), 0), static_cast<int64_t>(back.size()));
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.size()), 0);
}

// Blocking read_page/write_page never touch the queue, so threads using them run beside a
// submitter/reaper pair without stealing its completions.
TEST_P(Concurrency, BlockingTransfersBesideTheQueue) {
  auto engine = test::make_engine(GetParam(), 4);
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(engine->open(dir_.file("pages")), 0);
  constexpr size_t kQueued = 200;
  constexpr size_t kBlockingThreads = 2;
  constexpr size_t kBlockingPages = 40;
  AlignedBuffer host(kQueued * kPageBytes);
  for (size_t p = 0; p < kQueued; ++p) {
    test::fill_page(host.page(p, kPageBytes), kPageBytes, p, 7);
  }
  Collector collector(kQueued);
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    for (size_t p = 0; p < kQueued; p += 10) {
      std::vector<IoRequest> batch;
      for (size_t q = p; q < p + 10; ++q) {
        batch.push_back(IoRequest::write(host.page(q, kPageBytes), kPageBytes, offset_of(q), q));
      }
      EXPECT_EQ(engine->submit(batch), 10);
    }
  });
  threads.emplace_back([&] { collector.reap_until_done(*engine); });
  for (size_t t = 0; t < kBlockingThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer page(kPageBytes);
      for (size_t i = 0; i < kBlockingPages; ++i) {
        const size_t id = kQueued + t * kBlockingPages + i;
        test::fill_page(page.data(), kPageBytes, id, 8);
        EXPECT_EQ(engine->write_page(page.data(), kPageBytes, offset_of(id)), kPageBytes);
        std::memset(page.data(), 0, kPageBytes);
        EXPECT_EQ(engine->read_page(page.data(), kPageBytes, offset_of(id)), kPageBytes);
        EXPECT_TRUE(test::page_matches(page.data(), kPageBytes, id, 8));
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  collector.expect_each_once();
  EXPECT_EQ(engine->in_flight(), 0);
}

// Injected failures are queued inside the decorator; a thread already blocked in wait()
// must still receive them, as well as the inner engine's completions.
TEST_P(Concurrency, InjectedFailuresReachAnotherThreadsWait) {
  auto engine = make_fault_injecting_engine(test::make_engine(GetParam(), 4));
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(engine->open(dir_.file("pages")), 0);
  FaultRule eio;
  eio.kind = static_cast<int>(FaultKind::kEio);
  eio.every_nth = 3;
  ASSERT_EQ(engine->set_rules({eio}), 0);
  constexpr size_t kTotal = 120;
  AlignedBuffer host(kTotal * kPageBytes);
  Collector collector(kTotal);
  std::thread reaper([&] { collector.reap_until_done(*engine); });
  std::thread submitter([&] {
    for (size_t p = 0; p < kTotal; ++p) {
      const IoRequest w = IoRequest::write(host.page(p, kPageBytes), kPageBytes, offset_of(p), p);
      EXPECT_EQ(engine->submit({&w, 1}), 1);
    }
  });
  submitter.join();
  reaper.join();
  collector.expect_each_once();
  size_t failed = 0;
  for (const IoCompletion& c : collector.results()) {
    if (c.result == -EIO) {
      ++failed;
    } else {
      EXPECT_EQ(c.result, kPageBytes);
    }
  }
  EXPECT_EQ(failed, kTotal / 3);
}

// Two engines on one page file, one per thread (the pattern the pager's prefetch and
// write-back workers can use), see each other's data once it is written.
TEST_P(Concurrency, OneEnginePerThreadOnOneFile) {
  constexpr size_t kPages = 64;
  auto writer = test::make_engine(GetParam(), 4);
  auto reader = test::make_engine(GetParam(), 4);
  ASSERT_NE(writer, nullptr);
  ASSERT_NE(reader, nullptr);
  ASSERT_EQ(writer->open(dir_.file("pages")), 0);
  ASSERT_EQ(reader->open(dir_.file("pages")), 0);
  AlignedBuffer out(kPages * kPageBytes);
  AlignedBuffer in(kPages * kPageBytes);
  std::atomic<size_t> written{0};
  std::thread w([&] {
    for (size_t p = 0; p < kPages; ++p) {
      test::fill_page(out.page(p, kPageBytes), kPageBytes, p, 4);
      const IoRequest r = IoRequest::write(out.page(p, kPageBytes), kPageBytes, offset_of(p), p);
      ASSERT_EQ(writer->submit({&r, 1}), 1);
      ASSERT_EQ(test::reap(*writer, 1)[0].result, kPageBytes);
      written.store(p + 1, std::memory_order_release);
    }
  });
  std::thread r([&] {
    for (size_t p = 0; p < kPages; ++p) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (written.load(std::memory_order_acquire) <= p) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "writer stalled at page " << p;
        std::this_thread::yield();
      }
      const IoRequest q = IoRequest::read(in.page(p, kPageBytes), kPageBytes, offset_of(p), p);
      ASSERT_EQ(reader->submit({&q, 1}), 1);
      ASSERT_EQ(test::reap(*reader, 1)[0].result, kPageBytes);
      EXPECT_TRUE(test::page_matches(in.page(p, kPageBytes), kPageBytes, p, 4)) << "page " << p;
    }
  });
  w.join();
  r.join();
}

INSTANTIATE_TEST_SUITE_P(Backends, Concurrency,
                         ::testing::Values(Backend::kPosix, Backend::kIoUring),
                         test::backend_param_name);

}  // namespace
}  // namespace pagedoptim::io
