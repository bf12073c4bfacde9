// The device page cache on the simulated device: streams are worker threads that complete
// every operation after a random delay, so any missing wait between a kernel, a load and a
// write-back shows up as wrong bytes here (and as a data race under TSan).
//
// The "kernel" of these tests rewrites every word of a page as a function of its old value
// and the step, enqueued on the compute stream like a real launch. A host model applies the
// same function in the same order; after every run each page must equal the model, bit for
// bit, for every policy, budget, prefetch depth and home (pinned host memory, the NVMe page
// file behind pinned bounce buffers).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "device/testing/simulated_device.h"
#include "pagedoptim/paging/device_cache_store.h"
#include "pagedoptim/paging/page_errors.h"
#include "pagedoptim/paging/pinned_host_store.h"
#include "paging_test_util.h"

namespace pagedoptim::paging {
namespace {

using device::SimulatedDevice;
using device::SimulatedDeviceOptions;
using test::ScratchDir;

constexpr int64_t kPageBytes = 8192;
constexpr size_t kWords = size_t(kPageBytes / 8);

uint64_t rewrite(uint64_t word, int32_t page, uint64_t salt) {
  return (word ^ salt) * 0x9E3779B97F4A7C15ull + uint64_t(page) + (word >> 31);
}

void rewrite_page(uint64_t* words, int32_t page, uint64_t salt) {
  for (size_t i = 0; i < kWords; ++i) words[i] = rewrite(words[i], page, salt + i);
}

// The home below the cache: pinned host slabs, or a page file behind a tiered store whose
// slots are pinned memory of the same device.
std::unique_ptr<PageStore> make_home(const std::string& kind, device::Device& device,
                                     const std::string& dir, int32_t prefetch,
                                     bool inject_faults = false) {
  if (kind == "host") return std::make_unique<PinnedHostStore>(device, kPageBytes);
  TieredStoreOptions options;
  options.page_bytes = kPageBytes;
  options.cache_bytes = 4 * kPageBytes;  // few bounce buffers: the home pages too
  options.prefetch = prefetch;
  options.slots.allocate = [&device](int64_t bytes) { return device.allocate_host(bytes); };
  options.slots.release = [&device](void* memory) { device.release_host(memory); };
  return std::make_unique<TieredPageStore>(
      options, test::make_test_tier("posix", kPageBytes, dir, inject_faults));
}

struct Case {
  std::string home;
  EvictionPolicy policy;
  int32_t budget;
  int32_t prefetch;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.home + "_" + eviction_policy_name(c.policy) + "_budget" + std::to_string(c.budget) +
         "_prefetch" + std::to_string(c.prefetch);
}

class DeviceCacheProperty : public ::testing::TestWithParam<Case> {
 protected:
  static constexpr int32_t kPages = 12;

  void SetUp() override {
    SimulatedDeviceOptions options;
    options.max_delay_us = 30;
    options.seed = 7 + uint64_t(GetParam().budget) * 31 + uint64_t(GetParam().prefetch);
    device_ = std::make_unique<SimulatedDevice>(options);
    compute_ = device_->create_stream();
    DeviceCacheOptions cache;
    cache.page_bytes = kPageBytes;
    cache.cache_bytes = GetParam().budget * kPageBytes;
    cache.prefetch = GetParam().prefetch;
    cache.policy = GetParam().policy;
    store_ = std::make_unique<DeviceCacheStore>(
        *device_, make_home(GetParam().home, *device_, dir_.path(), GetParam().prefetch), cache);
    store_->grow(kPages);
    model_.assign(kPages, std::vector<uint64_t>(kWords, 0));
  }

  void TearDown() override {
    store_.reset();  // before the device whose streams it uses
    device_->destroy_stream(compute_);
    // Whatever the store took from the device (slabs, pinned buffers, copy streams,
    // events), it gave back: what leaks here would leak per optimizer on a GPU.
    const auto usage = device_->usage();
    EXPECT_EQ(usage.device_bytes, 0);
    EXPECT_EQ(usage.host_bytes, 0);
    EXPECT_EQ(usage.device_allocations, 0);
    EXPECT_EQ(usage.host_allocations, 0);
    EXPECT_EQ(usage.streams, 0);
    EXPECT_EQ(usage.events, 0);
  }

  // One step over `plan`: batches of pin_limit() pages, a kernel per page on the compute
  // stream, as the table driver does it. With `read_some`, every third visit only reads
  // its page (a kernel that checks it against the model) and unpins it clean.
  void step(const std::vector<int32_t>& plan, uint64_t salt, bool read_some = false) {
    store_->begin_use(compute_);
    store_->plan(plan);
    const size_t batch = size_t(std::max(1, store_->pin_limit()));
    std::vector<std::byte*> bytes(plan.size());
    for (size_t begin = 0; begin < plan.size(); begin += batch) {
      const size_t end = std::min(plan.size(), begin + batch);
      size_t pinned = begin;
      try {
        for (; pinned < end; ++pinned) bytes[pinned] = store_->pin(plan[pinned]);
      } catch (...) {
        for (size_t i = begin; i < pinned; ++i) store_->unpin(plan[i], false);
        throw;
      }
      std::vector<bool> wrote(end - begin);
      for (size_t i = begin; i < end; ++i) {
        const int32_t page = plan[i];
        auto* words = reinterpret_cast<uint64_t*>(bytes[i]);
        wrote[i - begin] = !read_some || i % 3 != 1;
        if (wrote[i - begin]) {
          const uint64_t page_salt = salt * 1000003u + uint64_t(page) + i;
          device_->launch(compute_, [words, page, page_salt] { rewrite_page(words, page, page_salt); });
          rewrite_page(model_[size_t(page)].data(), page, page_salt);
        } else {
          std::vector<uint64_t> expected = model_[size_t(page)];
          device_->launch(compute_, [this, words, page, expected] {
            if (std::memcmp(words, expected.data(), kPageBytes) != 0) ++stale_reads_;
          });
        }
      }
      for (size_t i = begin; i < end; ++i) store_->unpin(plan[i], wrote[i - begin]);
    }
    store_->end_use();
  }

  void expect_matches_model() {
    store_->drain();
    device_->synchronize_stream(compute_);
    EXPECT_EQ(stale_reads_.load(), 0) << "a kernel read a page before its bytes arrived";
    std::vector<uint64_t> words(kWords);
    for (int32_t page = 0; page < kPages; ++page) {
      store_->read_bytes(page, 0, words.data(), kPageBytes);
      ASSERT_EQ(std::memcmp(words.data(), model_[size_t(page)].data(), kPageBytes), 0)
          << "page " << page;
    }
  }

  ScratchDir dir_;
  std::unique_ptr<SimulatedDevice> device_;
  device::Stream compute_ = nullptr;
  std::unique_ptr<DeviceCacheStore> store_;
  std::vector<std::vector<uint64_t>> model_;
  std::atomic<int> stale_reads_{0};
};

TEST_P(DeviceCacheProperty, StepsEqualTheHostModelBitForBit) {
  // The driver's scan order alternates every step; some steps take a random subset (params
  // without a gradient), and some come back to pages they evicted moments ago (small
  // params sharing pages, stepped one at a time under gradient release), while the
  // write-back of the first visit may still be on its way home.
  std::vector<int32_t> plan(kPages);
  std::iota(plan.begin(), plan.end(), 0);
  std::mt19937 random(uint32_t(GetParam().budget * 13 + GetParam().prefetch));
  for (uint64_t s = 1; s <= 9; ++s) {
    std::reverse(plan.begin(), plan.end());
    std::vector<int32_t> this_step = plan;
    if (s % 3 == 0) {
      std::shuffle(this_step.begin(), this_step.end(), random);
      this_step.resize(size_t(kPages / 2));
    } else if (s % 3 == 2) {
      this_step.clear();
      for (int32_t page = 0; page + 2 < kPages; page += 3) {
        for (int32_t again : {page, page + 1, page + 2, page, page + 1, page + 2}) {
          this_step.push_back(again);
        }
      }
    }
    step(this_step, s, /*read_some=*/s % 3 == 2 || s % 4 == 0);
  }
  expect_matches_model();
  const DeviceCacheStats stats = store_->stats();
  EXPECT_LE(stats.peak_resident_pages, GetParam().budget);
  EXPECT_EQ(stats.over_budget_pages, 0);
  if (GetParam().budget < kPages) {
    EXPECT_GT(stats.write_backs, 0);
    EXPECT_EQ(stats.bytes_to_host, stats.write_backs * kPageBytes);
  }
  EXPECT_EQ(stats.bytes_to_device, stats.loads * kPageBytes);
}

TEST_P(DeviceCacheProperty, StateDictWritesLandInPlace) {
  std::vector<int32_t> plan(kPages);
  std::iota(plan.begin(), plan.end(), 0);
  step(plan, 1);
  // write_bytes to a few pages (resident or not), then step on: the kernels see them.
  std::vector<uint64_t> words(kWords);
  for (int32_t page : {0, kPages / 2, kPages - 1}) {
    for (size_t i = 0; i < kWords; ++i) words[i] = uint64_t(page) * 77 + i;
    store_->write_bytes(page, 0, words.data(), kPageBytes);
    model_[size_t(page)] = words;
  }
  std::reverse(plan.begin(), plan.end());
  step(plan, 2);
  expect_matches_model();
}

// torch's current stream is CUDA's default stream, a null handle, unless the user chose
// another: the cache takes it as it takes any stream, and a switch to a side stream and
// back orders the new stream's work after the pages' uses on the old one.
TEST_P(DeviceCacheProperty, DefaultStreamThenASideStreamThenTheDefaultAgain) {
  const device::Stream side = compute_;
  std::vector<int32_t> plan(kPages);
  std::iota(plan.begin(), plan.end(), 0);
  for (uint64_t s = 1; s <= 6; ++s) {
    compute_ = s % 3 == 2 ? side : nullptr;  // default, side, default, default, side, default
    std::reverse(plan.begin(), plan.end());
    step(plan, s, /*read_some=*/s % 2 == 0);
  }
  device_->synchronize_stream(nullptr);
  compute_ = side;
  expect_matches_model();
}

std::vector<Case> property_cases() {
  std::vector<Case> cases;
  for (const std::string home : {"host", "nvme"}) {
    for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kPlan,
                                  EvictionPolicy::kAuto}) {
      for (int32_t budget : {1, 2, 5, 12}) {
        for (int32_t prefetch : {0, 3}) cases.push_back(Case{home, policy, budget, prefetch});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Budgets, DeviceCacheProperty, ::testing::ValuesIn(property_cases()),
                         case_name);

// Gradient release: one plan per parameter. After one round the store knows the order and
// prefetches the next parameter's pages ahead of its call, with the same bytes as before.
// Neighbouring parameters share a page (a parameter's last page holds the next one's first
// elements), and the driver's scan direction alternates between calls.
TEST(DeviceCacheStore, LearnsTheGradientReleaseOrderAndStaysExact) {
  SimulatedDevice device;
  device::Stream compute = device.create_stream();
  {
    DeviceCacheOptions options;
    options.page_bytes = kPageBytes;
    options.cache_bytes = 6 * kPageBytes;
    options.prefetch = 2;
    DeviceCacheStore store(device, std::make_unique<PinnedHostStore>(device, kPageBytes), options);
    constexpr int32_t kParams = 8;
    constexpr int32_t kPages = 2 * kParams + 1;
    store.grow(kPages);
    std::vector<std::vector<uint64_t>> model(kPages, std::vector<uint64_t>(kWords, 0));
    store.begin_use(compute);
    int calls = 0;
    for (uint64_t round = 1; round <= 4; ++round) {
      // Backward visits parameters last to first; each spans three pages, sharing its
      // first with the previous parameter and its last with the next.
      for (int32_t param = kParams - 1; param >= 0; --param) {
        std::vector<int32_t> plan = {2 * param, 2 * param + 1, 2 * param + 2};
        if (calls++ % 2 == 1) std::reverse(plan.begin(), plan.end());
        test::run_step(store, plan, [&](int32_t page, std::byte* bytes) {
          auto* words = reinterpret_cast<uint64_t*>(bytes);
          const uint64_t salt = round * 131 + uint64_t(page);
          device.launch(compute, [words, page, salt] { rewrite_page(words, page, salt); });
          rewrite_page(model[size_t(page)].data(), page, salt);
        });
      }
    }
    store.end_use();
    store.drain();
    const DeviceCacheStats stats = store.stats();
    EXPECT_EQ(stats.learned_order_pages, kPages);
    // Rounds after the first find most pages on their way already.
    EXPECT_GT(stats.prefetch_hits, kPages);
    std::vector<uint64_t> words(kWords);
    for (int32_t page = 0; page < kPages; ++page) {
      store.read_bytes(page, 0, words.data(), kPageBytes);
      EXPECT_EQ(std::memcmp(words.data(), model[size_t(page)].data(), kPageBytes), 0) << page;
    }
  }
  device.destroy_stream(compute);
}

TEST(DeviceCacheStore, RejectsACacheSmallerThanOnePage) {
  SimulatedDevice device;
  DeviceCacheOptions options;
  options.page_bytes = kPageBytes;
  options.cache_bytes = kPageBytes - 1;
  try {
    DeviceCacheStore store(device, std::make_unique<PinnedHostStore>(device, kPageBytes), options);
    FAIL() << "a cache of less than one page was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cache_bytes"), std::string::npos) << e.what();
  }
}

TEST(DeviceCacheStore, PinnedMemoryRefusedNamesTheBytesAndSuggestsNvme) {
  SimulatedDeviceOptions device_options;
  device_options.host_memory_limit = 4 * kPageBytes;
  SimulatedDevice device(device_options);
  PinnedHostStore home(device, kPageBytes);
  home.grow(3);
  try {
    home.grow(8);
    FAIL() << "pinned memory past the limit was handed out";
  } catch (const device::MemoryRefused& e) {
    EXPECT_TRUE(e.host());
    EXPECT_EQ(e.bytes(), 5 * kPageBytes);
    const std::string what = e.what();
    EXPECT_NE(what.find(std::to_string(5 * kPageBytes)), std::string::npos) << what;
    EXPECT_NE(what.find("offload='nvme'"), std::string::npos) << what;
  }
  EXPECT_EQ(home.num_pages(), 3);  // the failed growth left nothing behind
}

// Less device memory than the budget: the cache works within the slots it got.
TEST(DeviceCacheStore, DeviceMemoryShortOfTheBudgetShrinksTheCache) {
  SimulatedDeviceOptions device_options;
  device_options.device_memory_limit = 2 * kPageBytes;
  SimulatedDevice device(device_options);
  device::Stream compute = device.create_stream();
  {
    DeviceCacheOptions options;
    options.page_bytes = kPageBytes;
    options.cache_bytes = 6 * kPageBytes;
    options.prefetch = 0;
    DeviceCacheStore store(device, std::make_unique<PinnedHostStore>(device, kPageBytes), options);
    store.grow(6);
    store.begin_use(compute);
    for (int32_t page = 0; page < 6; ++page) {
      std::byte* bytes = store.pin(page);
      device.launch(compute, [bytes, page] { std::memset(bytes, page + 1, kPageBytes); });
      store.unpin(page, true);
    }
    store.end_use();
    store.drain();
    EXPECT_EQ(store.resident_bytes(), 2 * kPageBytes);
    EXPECT_EQ(store.pin_limit(), 1);  // half of the slots it got, not of the budget
    std::vector<unsigned char> bytes(kPageBytes);
    for (int32_t page = 0; page < 6; ++page) {
      store.read_bytes(page, 0, bytes.data(), kPageBytes);
      EXPECT_EQ(bytes[0], page + 1);
      EXPECT_EQ(bytes[kPageBytes - 1], page + 1);
    }
  }
  device.destroy_stream(compute);
}

// The page file below the cache fails: reads (EIO, flipped bytes) fail the pin that needs
// the page, write-backs fail the step at its end; in every case no state is lost, and once
// the fault is gone the same store goes on and matches the model.
class DeviceCacheFaults : public DeviceCacheProperty {
 protected:
  void SetUp() override {
    SimulatedDeviceOptions options;
    options.max_delay_us = 20;
    device_ = std::make_unique<SimulatedDevice>(options);
    compute_ = device_->create_stream();
    DeviceCacheOptions cache;
    cache.page_bytes = kPageBytes;
    cache.cache_bytes = 3 * kPageBytes;
    cache.prefetch = 1;
    auto home = make_home("nvme", *device_, dir_.path(), 1, /*inject_faults=*/true);
    tiered_ = static_cast<TieredPageStore*>(home.get());
    store_ = std::make_unique<DeviceCacheStore>(*device_, std::move(home), cache);
    store_->grow(kPages);
    model_.assign(kPages, std::vector<uint64_t>(kWords, 0));
    plan_.resize(kPages);
    std::iota(plan_.begin(), plan_.end(), 0);
    // Two clean steps: every page has been written to the file.
    step(plan_, 1);
    std::reverse(plan_.begin(), plan_.end());
    step(plan_, 2);
    store_->drain();
    tiered_->drain();
  }

  void set_rules(std::vector<io::FaultRule> rules) {
    ASSERT_EQ(tiered_->tier().fault_injector()->set_rules(std::move(rules)), 0);
  }

  // A step whose pins may fail: the model follows only the pages whose kernel ran.
  template <class Error>
  void expect_failing_step(uint64_t salt) {
    std::reverse(plan_.begin(), plan_.end());
    EXPECT_THROW(
        {
          try {
            step(plan_, salt);
          } catch (...) {
            store_->end_use();
            throw;
          }
        },
        Error);
  }

  TieredPageStore* tiered_ = nullptr;
  std::vector<int32_t> plan_;
};

TEST_F(DeviceCacheFaults, ReadErrorFailsThePinAndLosesNothing) {
  io::FaultRule rule;
  rule.kind = int(io::FaultKind::kEio);
  rule.ops = io::kFaultReads;
  set_rules({rule});
  expect_failing_step<PageIoError>(3);
  set_rules({});
  std::reverse(plan_.begin(), plan_.end());
  step(plan_, 4);
  expect_matches_model();
}

TEST_F(DeviceCacheFaults, ChecksumErrorFailsThePinAndLosesNothing) {
  io::FaultRule rule;
  rule.kind = int(io::FaultKind::kFlipByte);
  rule.ops = io::kFaultReads;
  rule.flip_at = 100;
  set_rules({rule});
  expect_failing_step<PageCorruptionError>(3);
  set_rules({});
  std::reverse(plan_.begin(), plan_.end());
  step(plan_, 4);
  expect_matches_model();
}

TEST_F(DeviceCacheFaults, WriteErrorIsThrownAndLosesNothing) {
  io::FaultRule rule;
  rule.kind = int(io::FaultKind::kEnospc);
  rule.ops = io::kFaultWrites;
  set_rules({rule});
  std::reverse(plan_.begin(), plan_.end());
  // The step runs to its end (every page stepped); its error comes at the end of a later
  // plan or at drain(), once the retirer has met it.
  bool thrown = false;
  try {
    step(plan_, 3);
    store_->drain();
  } catch (const PageIoError& e) {
    thrown = true;
    EXPECT_EQ(e.error_number(), ENOSPC);
  }
  EXPECT_TRUE(thrown);
  // The page file failed, not the state: every page reads back as the model says.
  store_->drain();
  expect_matches_model();
  set_rules({});
  std::reverse(plan_.begin(), plan_.end());
  step(plan_, 4);
  expect_matches_model();
}

}  // namespace
}  // namespace pagedoptim::paging
