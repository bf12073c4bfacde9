// The step driver end to end on the host store: every ISA's kernels against a scalar
// reference of the same rules, across page boundaries and packed pages, and the stream
// read/write round trip that state_dict() relies on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "device/testing/host_table_runner.h"
#include "isa_test_util.h"
#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/optim/paged_state.h"

namespace pagedoptim::optim {
namespace {

const ParallelFor kSerial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  body(0, n);
};

// Splits the work in two halves on two threads, as at::parallel_for would on 2 cores.
const ParallelFor kTwoThreads = [](int64_t n,
                                   const std::function<void(int64_t, int64_t)>& body) {
  std::thread other([&] { body(n / 2, n); });
  body(0, n / 2);
  other.join();
};

std::unique_ptr<PagedState> make_adamw_state(int64_t page_bytes, bool amsgrad) {
  std::vector<paging::StreamSpec> streams = {{"exp_avg", 128}, {"exp_avg_sq", 128}};
  if (amsgrad) streams.push_back({"max_exp_avg_sq", 128});
  return std::make_unique<PagedState>(OptimizerKind::kAdamW,
                                      std::vector<std::vector<paging::StreamSpec>>{streams},
                                      std::make_unique<paging::HostPageStore>(page_bytes));
}

struct Tensor {
  std::vector<float> param, grad, m, v, v_max;
  float step = 0.0f;
};

TEST(PagedState, AdamWMatchesScalarReferenceAcrossPages) {
  const int64_t sizes[] = {1, 40, 1000, 4097, 33};
  for (bool amsgrad : {false, true}) {
    auto state = make_adamw_state(8192, amsgrad);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::vector<Tensor> tensors;
    std::vector<int32_t> slots;
    for (int64_t n : sizes) {
      Tensor t;
      for (int64_t i = 0; i < n; ++i) t.param.push_back(normal(rng));
      t.grad.resize(size_t(n));
      t.m.assign(size_t(n), 0.0f);
      t.v.assign(size_t(n), 0.0f);
      t.v_max.assign(size_t(n), 0.0f);
      tensors.push_back(t);
      slots.push_back(state->register_param(n));
    }
    std::vector<Tensor> reference = tensors;
    const std::vector<AdamWGroup> groups = {{1e-2, 0.9, 0.999, 1e-8, 0.1, amsgrad, false}};
    for (int step = 0; step < 5; ++step) {
      std::vector<ParamStep> params;
      for (size_t i = 0; i < tensors.size(); ++i) {
        for (auto& g : tensors[i].grad) g = normal(rng);
        reference[i].grad = tensors[i].grad;
        params.push_back(ParamStep{slots[i],
                                   kernels::ParamSpan{tensors[i].param.data(), tensors[i].grad.data(),
                                                      int64_t(tensors[i].param.size()),
                                                      kernels::ElementType::kFloat32},
                                   0, &tensors[i].step});
      }
      state->step_adamw(params, groups, step % 2 ? kTwoThreads : kSerial);
      for (Tensor& r : reference) {
        r.step += 1.0f;
        const codec::AdamWScalars s =
            codec::make_adamw_scalars(1e-2, 0.9, 0.999, 1e-8, 0.1, (long long)(r.step), false);
        for (size_t e = 0; e < r.param.size(); ++e) {
          if (amsgrad) {
            codec::adamw_element<true>(r.param[e], r.grad[e], r.m[e], r.v[e], r.v_max[e], s);
          } else {
            codec::adamw_element<false>(r.param[e], r.grad[e], r.m[e], r.v[e], r.v_max[e], s);
          }
        }
      }
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_EQ(tensors[i].step, 5.0f);
      std::vector<float> m(tensors[i].param.size());
      state->read_stream(slots[i], "exp_avg", m.data());
      for (size_t e = 0; e < m.size(); ++e) {
        // The vector kernels and this scalar loop evaluate the same expression with
        // contraction off, so they agree to the bit.
        ASSERT_EQ(tensors[i].param[e], reference[i].param[e]) << "tensor " << i << " elem " << e;
        ASSERT_EQ(m[e], reference[i].m[e]);
      }
    }
  }
}

// Once per vector ISA; one this CPU cannot run is reported as skipped.
class PagedStateIsa : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { PO_SKIP_UNLESS_ISA_RUNS(GetParam()); }
};

TEST_P(PagedStateIsa, GivesTheBaselinesBits) {
  const kernels::CpuKernelTable& table = *kernels::cpu_kernels_for_isa(GetParam());
  const kernels::CpuKernelTable* baseline = kernels::cpu_kernels_for_isa("baseline");
  ASSERT_NE(baseline, nullptr);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int64_t n = 1000;
  for (kernels::ElementType type : {kernels::ElementType::kFloat32,
                                    kernels::ElementType::kBFloat16,
                                    kernels::ElementType::kFloat16}) {
    std::vector<float> p32(n), g32(n);
    for (auto& x : p32) x = normal(rng);
    for (auto& x : g32) x = normal(rng);
    auto run = [&](const kernels::CpuKernelTable& table) {
      std::vector<uint16_t> p16(n), g16(n);
      std::vector<float> p = p32, m(n, 0.1f), v(n, 0.2f);
      void* param = p.data();
      const void* grad = g32.data();
      if (type != kernels::ElementType::kFloat32) {
        for (int64_t i = 0; i < n; ++i) {
          p16[i] = type == kernels::ElementType::kBFloat16 ? codec::float_to_bf16(p32[i])
                                                          : codec::float_to_fp16(p32[i]);
          g16[i] = type == kernels::ElementType::kBFloat16 ? codec::float_to_bf16(g32[i])
                                                          : codec::float_to_fp16(g32[i]);
        }
        param = p16.data();
        grad = g16.data();
      }
      const auto s = codec::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 3, false);
      kernels::AdamWStreams streams;
      streams.m.values = m.data();
      streams.v.values = v.data();
      table.adamw(kernels::ParamSpan{param, grad, n, type}, streams, s);
      std::vector<uint8_t> bytes(size_t(n) * 4);
      std::memcpy(bytes.data(), param, size_t(n) * (type == kernels::ElementType::kFloat32 ? 4 : 2));
      return bytes;
    };
    EXPECT_EQ(run(table), run(*baseline)) << table.isa << " element type " << int(type);
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, PagedStateIsa, ::testing::Values("avx2", "avx512"),
                         ::pagedoptim::test::isa_param_name);

TEST(PagedState, StreamsRoundTripThroughPages) {
  auto state = make_adamw_state(4096, false);
  const int32_t a = state->register_param(700);
  const int32_t b = state->register_param(5);
  std::vector<float> values(700);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 0.5f;
  state->write_stream(a, "exp_avg_sq", values.data());
  std::vector<float> out(700, -1.0f);
  state->read_stream(a, "exp_avg_sq", out.data());
  EXPECT_EQ(out, values);
  std::vector<float> untouched(5, -1.0f);
  state->read_stream(b, "exp_avg_sq", untouched.data());
  EXPECT_EQ(untouched, std::vector<float>(5, 0.0f));
  EXPECT_EQ(state->stream_bytes(a, "exp_avg"), 700 * 4);
  EXPECT_THROW(state->read_stream(2, "exp_avg", out.data()), std::out_of_range);
  EXPECT_THROW(state->read_stream(a, "momentum_buffer", out.data()), std::out_of_range);
}

// A host store that records which pages are pinned, to see that a byte range touches only
// its own pages, one at a time.
class PinRecordingStore final : public paging::PageStore {
 public:
  explicit PinRecordingStore(int64_t page_bytes) : inner_(page_bytes) {}
  void grow(int32_t num_pages) override { inner_.grow(num_pages); }
  std::byte* pin(int32_t page) override {
    pinned.push_back(page);
    ++held;
    max_held = std::max(max_held, held);
    return inner_.pin(page);
  }
  void unpin(int32_t page, bool dirty) override {
    --held;
    inner_.unpin(page, dirty);
  }
  void plan_copies(const std::vector<int32_t>& pages) override { planned.push_back(pages); }
  int32_t num_pages() const override { return inner_.num_pages(); }
  int64_t page_bytes() const override { return inner_.page_bytes(); }
  int64_t resident_bytes() const override { return inner_.resident_bytes(); }

  std::vector<int32_t> pinned;
  std::vector<std::vector<int32_t>> planned;  // every plan_copies call
  int held = 0;
  int max_held = 0;

 private:
  paging::HostPageStore inner_;
};

// exp_avg_codes (1 B/element) and exp_avg_scales (2 B per group of 32) of Lion over `store`:
// a 4 KiB page holds under 4096 elements, so 10000 elements span 3 pages or more.
PagedState lion_codes_and_scales(std::unique_ptr<paging::PageStore> store) {
  return PagedState(OptimizerKind::kLion,
                    {{{"exp_avg_codes", 32, false}, {"exp_avg_scales", 2, true}}},
                    std::move(store));
}

TEST(PagedState, ByteRangesOfAStreamTouchOnlyTheirPages) {
  auto store = std::make_unique<PinRecordingStore>(4096);
  PinRecordingStore* pins = store.get();
  PagedState state = lion_codes_and_scales(std::move(store));
  const int32_t before = state.register_param(100);  // shares the first page
  const int32_t slot = state.register_param(10000);
  const int64_t total = state.stream_bytes(slot, "exp_avg_codes");
  ASSERT_EQ(total, 10000);
  std::vector<uint8_t> whole(static_cast<size_t>(total));
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = uint8_t(i * 7 + 3);
  // Written in odd-sized ranges that straddle page boundaries, read back in others.
  for (int64_t offset = 0; offset < total; offset += 777) {
    const int64_t bytes = std::min<int64_t>(777, total - offset);
    state.write_stream_range(slot, "exp_avg_codes", offset, bytes, whole.data() + offset);
  }
  std::vector<uint8_t> out(static_cast<size_t>(total), 0);
  state.read_stream(slot, "exp_avg_codes", out.data());
  EXPECT_EQ(out, whole);
  pins->pinned.clear();
  std::vector<uint8_t> part(100);
  state.read_stream_range(slot, "exp_avg_codes", 9000, 100, part.data());
  EXPECT_EQ(part, std::vector<uint8_t>(whole.begin() + 9000, whole.begin() + 9100));
  // Only the page of the stream's last piece: the range's 100 bytes sit at its end (the
  // table may pack that tail into a shared page, so it is asked, not assumed).
  const auto& pieces = state.table().param(slot).pieces;
  ASSERT_GE(pieces.size(), 3u);
  ASSERT_GE(state.table().segment(pieces.back()).count, 1000);
  EXPECT_EQ(pins->pinned, std::vector<int32_t>{pieces.back().page});
  EXPECT_EQ(pins->max_held, 1);
  // Scales: one fp16 per group; a range of them reads as the flat stream does.
  const int64_t scale_bytes = state.stream_bytes(slot, "exp_avg_scales");
  EXPECT_EQ(scale_bytes, (10000 + 31) / 32 * 2);
  std::vector<uint8_t> scales(static_cast<size_t>(scale_bytes));
  std::vector<uint8_t> again(static_cast<size_t>(scale_bytes));
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = uint8_t(i);
  state.write_stream(slot, "exp_avg_scales", scales.data());
  state.read_stream_range(slot, "exp_avg_scales", 0, 250, again.data());
  state.read_stream_range(slot, "exp_avg_scales", 250, scale_bytes - 250, again.data() + 250);
  EXPECT_EQ(again, scales);
  std::vector<uint8_t> untouched(100, 1);
  state.read_stream(before, "exp_avg_codes", untouched.data());
  EXPECT_EQ(untouched, std::vector<uint8_t>(100, 0));
  EXPECT_THROW(state.read_stream_range(slot, "exp_avg_codes", total - 5, 6, out.data()),
               std::out_of_range);
  EXPECT_THROW(state.read_stream_range(slot, "exp_avg_codes", -1, 1, out.data()),
               std::out_of_range);
  EXPECT_NO_THROW(state.read_stream_range(slot, "exp_avg_codes", total, 0, out.data()));
}

// A checkpoint announces its records' ranges before it copies them: the plan the store gets
// is the pages the copies then pin, in the same order, a page pinned again right after
// itself named once (it would not move the plan on), one pinned again later named again.
TEST(PagedState, APlanOfStreamRangesIsThePagesTheirCopiesPin) {
  auto store = std::make_unique<PinRecordingStore>(4096);
  PinRecordingStore* pins = store.get();
  PagedState state = lion_codes_and_scales(std::move(store));
  state.register_param(100);
  const int32_t slot = state.register_param(10000);
  const int64_t codes = state.stream_bytes(slot, "exp_avg_codes");
  const int64_t scales = state.stream_bytes(slot, "exp_avg_scales");
  // Records of 1500 elements: each copies its codes, then its scales, as a checkpoint does.
  std::vector<PagedState::StreamRange> ranges;
  for (int64_t begin = 0; begin < 10000; begin += 1500) {
    const int64_t count = std::min<int64_t>(1500, 10000 - begin);
    ranges.push_back({slot, "exp_avg_codes", begin, count});
    const int64_t first = begin / 32 * 2, last = std::min(scales, (begin + count + 31) / 32 * 2);
    ranges.push_back({slot, "exp_avg_scales", first, last - first});
  }
  ASSERT_EQ(ranges[ranges.size() - 2].offset + ranges[ranges.size() - 2].bytes, codes);
  state.plan_stream_ranges(ranges);
  ASSERT_EQ(pins->planned.size(), 1u);
  pins->pinned.clear();
  std::vector<uint8_t> buffer(static_cast<size_t>(codes));
  for (const PagedState::StreamRange& range : ranges) {
    state.read_stream_range(range.slot, range.stream, range.offset, range.bytes, buffer.data());
  }
  std::vector<int32_t> expected;
  for (int32_t page : pins->pinned) {
    if (expected.empty() || expected.back() != page) expected.push_back(page);
  }
  EXPECT_EQ(pins->planned[0], expected);
  // Codes and scales of one record sit on the same pages, so pages come back: the plan
  // names a page again where the copies return to it after another.
  std::vector<int32_t> distinct = expected;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  EXPECT_GT(expected.size(), distinct.size());
  EXPECT_GE(distinct.size(), 3u);

  // A range outside its stream: nothing is planned, and the error names it.
  pins->planned.clear();
  ranges.push_back({slot, "exp_avg_codes", codes - 5, 6});
  EXPECT_THROW(state.plan_stream_ranges(ranges), std::out_of_range);
  EXPECT_TRUE(pins->planned.empty());
  // An empty list ends the plan.
  state.plan_stream_ranges({});
  ASSERT_EQ(pins->planned.size(), 1u);
  EXPECT_TRUE(pins->planned[0].empty());
}

TEST(PagedState, RejectsMismatchedParams) {
  auto state = make_adamw_state(4096, false);
  const int32_t slot = state->register_param(10);
  std::vector<float> p(11), g(11);
  float step = 0;
  const std::vector<AdamWGroup> groups = {{1e-3, 0.9, 0.999, 1e-8, 0.0, false, false}};
  std::vector<ParamStep> params = {
      {slot, {p.data(), g.data(), 11, kernels::ElementType::kFloat32}, 0, &step}};
  EXPECT_THROW(state->step_adamw(params, groups, kSerial), std::invalid_argument);
  params[0].span.count = 10;
  params[0].group = 1;
  EXPECT_THROW(state->step_adamw(params, groups, kSerial), std::out_of_range);
  const std::vector<AdamWGroup> amsgrad = {{1e-3, 0.9, 0.999, 1e-8, 0.0, true, false}};
  params[0].group = 0;
  EXPECT_THROW(state->step_adamw(params, amsgrad, kSerial), std::invalid_argument);
  EXPECT_EQ(step, 0.0f);  // a rejected step changes nothing
}

// A store that refuses to grow while `full` is set, as a device out of memory or a full
// disk would.
class RefusingStore final : public paging::PageStore {
 public:
  explicit RefusingStore(bool* full) : inner_(8192), full_(full) {}
  void grow(int32_t num_pages) override {
    if (*full_) throw std::runtime_error("out of memory");
    inner_.grow(num_pages);
  }
  std::byte* pin(int32_t page) override { return inner_.pin(page); }
  void unpin(int32_t page, bool dirty) override { inner_.unpin(page, dirty); }
  int32_t num_pages() const override { return inner_.num_pages(); }
  int64_t page_bytes() const override { return inner_.page_bytes(); }
  int64_t resident_bytes() const override { return inner_.resident_bytes(); }

 private:
  paging::HostPageStore inner_;
  bool* full_;
};

TEST(PagedState, FailedGrowthLeavesNoLayoutBehind) {
  bool full = false;
  PagedState state(OptimizerKind::kAdamW,
                   {{{"exp_avg", 128}, {"exp_avg_sq", 128}}},
                   std::make_unique<RefusingStore>(&full));
  EXPECT_EQ(state.register_param(1000), 0);
  const int32_t pages = state.table().num_pages();
  full = true;
  EXPECT_THROW(state.register_param(5000), std::runtime_error);
  EXPECT_EQ(state.table().num_params(), 1);
  EXPECT_EQ(state.table().num_pages(), pages);
  full = false;
  // The retry lays the parameter out afresh, and the store holds exactly the table's pages.
  EXPECT_EQ(state.register_param(5000), 1);
  EXPECT_EQ(state.store().num_pages(), state.table().num_pages());
}


// A host store that pins at most two pages at a time (so a step has several batches) and
// throws at its `fail_at`-th pin from now (-1: never), as a read that keeps failing would.
class FailingPinStore final : public paging::PageStore {
 public:
  explicit FailingPinStore(int64_t page_bytes) : inner_(page_bytes) {}
  void fail_at(int64_t pin) {
    fail_at_ = pin;
    pins_ = 0;
  }
  void grow(int32_t num_pages) override { inner_.grow(num_pages); }
  std::byte* pin(int32_t page) override {
    if (pins_++ == fail_at_) throw std::runtime_error("injected read failure");
    return inner_.pin(page);
  }
  void unpin(int32_t page, bool dirty) override { inner_.unpin(page, dirty); }
  int32_t pin_limit() const override { return 2; }
  int32_t num_pages() const override { return inner_.num_pages(); }
  int64_t page_bytes() const override { return inner_.page_bytes(); }
  int64_t resident_bytes() const override { return inner_.resident_bytes(); }

 private:
  paging::HostPageStore inner_;
  int64_t fail_at_ = -1;
  int64_t pins_ = 0;
};

// One optimizer's params, grads and counters, stepped through a FailingPinStore.
struct JournalRun {
  static constexpr int64_t kSizes[] = {1500, 40, 3000, 700};
  std::unique_ptr<PagedState> state;
  FailingPinStore* store;
  std::vector<std::vector<float>> params, grads;
  std::vector<float> steps;
  std::vector<int32_t> slots;

  JournalRun() {
    auto owned = std::make_unique<FailingPinStore>(4096);
    store = owned.get();
    state = std::make_unique<PagedState>(
        OptimizerKind::kAdamW,
        std::vector<std::vector<paging::StreamSpec>>{{{"exp_avg", 128}, {"exp_avg_sq", 128}}},
        std::move(owned));
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    for (int64_t n : kSizes) {
      params.emplace_back(size_t(n));
      for (float& x : params.back()) x = normal(rng);
      grads.emplace_back(size_t(n));
      slots.push_back(state->register_param(n));
    }
    steps.assign(params.size(), 0.0f);
  }

  void set_grads(int step) {
    std::mt19937 rng(100 + step);
    std::normal_distribution<float> normal;
    for (auto& g : grads) {
      for (float& x : g) x = normal(rng);
    }
  }

  // On the CPU kernels, or through `runner`'s tables (the device path).
  void step(TableRunner* runner = nullptr) {
    std::vector<ParamStep> call;
    for (size_t i = 0; i < params.size(); ++i) {
      call.push_back(ParamStep{slots[i],
                               kernels::ParamSpan{params[i].data(), grads[i].data(),
                                                  int64_t(params[i].size()),
                                                  kernels::ElementType::kFloat32},
                               0, &steps[i]});
    }
    const std::vector<AdamWGroup> groups = {{1e-2, 0.9, 0.999, 1e-8, 0.1, false, false}};
    if (runner != nullptr) {
      state->step_adamw(call, groups, *runner);
    } else {
      state->step_adamw(call, groups, kSerial);
    }
  }

  void expect_same(const JournalRun& other) const {
    EXPECT_EQ(steps, other.steps);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(params[i].data(), other.params[i].data(),
                               params[i].size() * sizeof(float)))
          << "param " << i;
      for (const char* stream : {"exp_avg", "exp_avg_sq"}) {
        std::vector<float> a(params[i].size()), b(params[i].size());
        state->read_stream(slots[i], stream, a.data());
        other.state->read_stream(other.slots[i], stream, b.data());
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
            << stream << " of param " << i;
      }
    }
  }
};

TEST(PagedStateJournal, AStepFailingAtAnyPinIsFinishedExactlyByResuming) {
  JournalRun reference;
  const int32_t pages = reference.state->table().num_pages();
  ASSERT_GE(pages, 8);
  for (int step = 0; step < 4; ++step) {
    reference.set_grads(step);
    reference.step();
  }
  for (int64_t failing_pin = 0; failing_pin < pages; ++failing_pin) {
    JournalRun run;
    for (int step = 0; step < 4; ++step) {
      run.set_grads(step);
      if (step == 1) {  // an odd step: its plan runs backwards
        run.store->fail_at(failing_pin);
        EXPECT_THROW(run.step(), std::runtime_error);
        const auto journal = run.state->interrupted_step();
        ASSERT_TRUE(journal.has_value());
        EXPECT_EQ(journal->pages, pages);
        // Pins fail before their batch runs: whole batches of two are applied.
        EXPECT_EQ(journal->pages_done, failing_pin / 2 * 2);
        EXPECT_TRUE(journal->resumable);
        // A fresh step over it is refused; so is a resume that names other parameters.
        EXPECT_THROW(run.step(), std::logic_error);
        run.store->fail_at(-1);
        run.state->resume_next_step();
        run.step();
        EXPECT_FALSE(run.state->interrupted_step().has_value());
      } else {
        run.step();
      }
    }
    run.expect_same(reference);
  }
}

TEST(PagedStateJournal, AnInterruptAtABatchBoundaryIsFinishedExactlyByResuming) {
  JournalRun reference;
  const int32_t pages = reference.state->table().num_pages();
  for (int step = 0; step < 3; ++step) {
    reference.set_grads(step);
    reference.step();
  }
  for (size_t boundary = 1; boundary < size_t(pages + 1) / 2; ++boundary) {
    JournalRun run;
    run.set_grads(0);
    run.step();
    run.set_grads(1);
    run.state->set_batch_boundary_hook([&](size_t batch) {
      if (batch == boundary) throw std::runtime_error("interrupted");
    });
    EXPECT_THROW(run.step(), std::runtime_error);
    EXPECT_EQ(run.state->interrupted_step()->pages_done, int64_t(boundary * 2));
    run.state->set_batch_boundary_hook(nullptr);
    run.state->resume_next_step();
    run.step();
    run.set_grads(2);
    run.step();
    run.expect_same(reference);
  }
}

// The host emulation of the device tables, whose run() throws at its `fail_at`-th call (a
// failed kernel launch: the batch may be half run).
class FailingRunner final : public TableRunner {
 public:
  explicit FailingRunner(int fail_at = -1) : fail_at_(fail_at) {}
  void prepare_adamw(const std::vector<kernels::ScalarJob>& jobs,
                     const std::vector<AdamWGroup>& groups) override {
    inner_.prepare_adamw(jobs, groups);
  }
  void prepare_sgd(const std::vector<kernels::ScalarJob>& jobs,
                   const std::vector<SGDGroup>& groups) override {
    inner_.prepare_sgd(jobs, groups);
  }
  void prepare_lion(const std::vector<kernels::ScalarJob>& jobs,
                    const std::vector<LionGroup>& groups) override {
    inner_.prepare_lion(jobs, groups);
  }
  void prepare_skewadam(const std::vector<kernels::ScalarJob>& jobs,
                        const std::vector<SkewAdamGroup>& groups) override {
    inner_.prepare_skewadam(jobs, groups);
  }
  void* scratch(int64_t bytes) override { return inner_.scratch(bytes); }
  void copy(void* dst, const void* src, int64_t bytes) override { inner_.copy(dst, src, bytes); }
  void run_statistics(const std::vector<kernels::FactorMatrix>& matrices) override {
    inner_.run_statistics(matrices);
  }
  void run(const TableBatch& batch) override {
    if (runs_++ == fail_at_) throw std::runtime_error("injected launch failure");
    inner_.run(batch);
  }
  bool counters_advanced() const override { return inner_.counters_advanced(); }

 private:
  kernels::emulation::HostTableRunner inner_;
  int fail_at_;
  int runs_ = 0;
};

TEST(PagedStateJournal, ATableStepFailingAtAnyPinIsFinishedExactlyByResuming) {
  JournalRun reference;
  const int32_t pages = reference.state->table().num_pages();
  for (int step = 0; step < 3; ++step) {
    FailingRunner runner;
    reference.set_grads(step);
    reference.step(&runner);
  }
  for (int64_t failing_pin = 0; failing_pin < pages; failing_pin += 3) {
    JournalRun run;
    for (int step = 0; step < 3; ++step) {
      run.set_grads(step);
      FailingRunner runner;
      if (step == 1) {
        run.store->fail_at(failing_pin);
        EXPECT_THROW(run.step(&runner), std::runtime_error);
        EXPECT_EQ(run.state->interrupted_step()->pages_done, failing_pin / 2 * 2);
        run.store->fail_at(-1);
        run.state->resume_next_step();
        FailingRunner retry;
        run.step(&retry);
      } else {
        run.step(&runner);
      }
    }
    run.expect_same(reference);
  }
}

// The CUDA runner launches the scalar preparation (which advances the step counters) with
// the first kernel, and so does the host emulation: a step that fails pinning its first
// batch has changed nothing, and its retry advances the counters once. On a first step a
// retry that took them as advanced would divide by a bias correction of 0: NaN params.
TEST(PagedStateJournal, ATableStepFailingBeforeItsFirstKernelIsRetriedWithItsCountersAdvancedOnce) {
  for (int failing_step = 0; failing_step < 2; ++failing_step) {
    SCOPED_TRACE("failing step " + std::to_string(failing_step));
    JournalRun reference;
    JournalRun run;
    for (int step = 0; step < 3; ++step) {
      FailingRunner reference_runner;
      reference.set_grads(step);
      reference.step(&reference_runner);
      run.set_grads(step);
      FailingRunner runner;
      if (step != failing_step) {
        run.step(&runner);
        continue;
      }
      const std::vector<float> counters = run.steps;
      run.store->fail_at(0);  // the first pin of the step's plan
      EXPECT_THROW(run.step(&runner), std::runtime_error);
      EXPECT_FALSE(runner.counters_advanced());
      EXPECT_EQ(run.steps, counters);
      EXPECT_EQ(run.state->interrupted_step()->pages_done, 0);
      run.store->fail_at(-1);
      run.state->resume_next_step();
      FailingRunner retry;
      run.step(&retry);
      EXPECT_TRUE(retry.counters_advanced());
    }
    run.expect_same(reference);
    for (float p : run.params[0]) ASSERT_TRUE(std::isfinite(p));
  }
}

TEST(PagedStateJournal, ARunnerErrorLeavesTheStepNotResumable) {
  JournalRun run;
  run.set_grads(0);
  FailingRunner failing(1);  // the second batch
  EXPECT_THROW(run.step(&failing), std::runtime_error);
  const auto journal = run.state->interrupted_step();
  ASSERT_TRUE(journal.has_value());
  EXPECT_FALSE(journal->resumable);
  EXPECT_EQ(journal->pages_done, 2);
  run.state->resume_next_step();
  FailingRunner retry;
  EXPECT_THROW(run.step(&retry), std::logic_error);
  run.state->discard_interrupted_step();
  run.step(&retry);
  EXPECT_EQ(run.steps[0], 2.0f);
}

TEST(PagedStateJournal, AResumeMustMatchAndADiscardAcceptsTheHalfStep) {
  JournalRun run;
  run.set_grads(0);
  run.store->fail_at(3);
  EXPECT_THROW(run.step(), std::runtime_error);
  run.store->fail_at(-1);
  // Without a journal there is nothing to resume; with one, other parameters do not match.
  JournalRun other;
  other.state->resume_next_step();
  other.set_grads(0);
  EXPECT_THROW(other.step(), std::logic_error);
  const float step_before = run.steps[0];
  run.slots.pop_back();
  run.params.pop_back();
  run.grads.pop_back();
  run.steps.pop_back();
  run.state->resume_next_step();
  EXPECT_THROW(run.step(), std::invalid_argument);
  EXPECT_EQ(run.steps[0], step_before);  // refused before anything changed
  run.state->discard_interrupted_step();
  EXPECT_FALSE(run.state->interrupted_step().has_value());
  // A resume asked for and never begun (its call failed its checks) goes with the discard.
  run.state->resume_next_step();
  run.state->discard_interrupted_step();
  run.step();  // a new step
  EXPECT_EQ(run.steps[0], step_before + 1.0f);
}

}  // namespace
}  // namespace pagedoptim::optim
