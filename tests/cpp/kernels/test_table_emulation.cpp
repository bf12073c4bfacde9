// The CUDA table kernels' bodies, emulated on the host (host_table_runner.h), against the
// CPU kernels: the same PagedState stepped once through the CPU chunk driver and once
// through the table driver must hold the same bytes afterwards (params, every state
// stream, step counters), for every kernel variant, with many parameters packed into
// shared pages at odd group offsets, partial last groups, several batches of pinned pages,
// and several variants in one call.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "device/testing/simulated_device.h"
#include "device/testing/simulated_table_runner.h"
#include "emulation_util.h"
#include "device/testing/host_table_runner.h"
#include "pagedoptim/thread_start.h"
#include "pagedoptim/codec/float_convert.h"
#include "pagedoptim/optim/paged_state.h"
#include "pagedoptim/paging/device_cache_store.h"
#include "pagedoptim/paging/pinned_host_store.h"

namespace pagedoptim::optim {
namespace {

using kernels::ElementType;
using kernels::test::add_moment;
using kernels::emulation::HostTableRunner;
using kernels::test::load_element;
using kernels::test::store_element;

const ParallelFor kSerial = [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  body(0, n);
};

// A host store that lets only `limit` pages be pinned at once, so a step takes several
// batches (and several launches per variant), as it will under a device budget.
class LimitedPinStore final : public paging::PageStore {
 public:
  LimitedPinStore(int64_t page_bytes, int32_t limit)
      : inner_(page_bytes), limit_(limit) {}
  void grow(int32_t num_pages) override { inner_.grow(num_pages); }
  std::byte* pin(int32_t page) override {
    if (++pinned_ > limit_) throw std::logic_error("driver pinned past pin_limit()");
    return inner_.pin(page);
  }
  void unpin(int32_t page, bool dirty) override {
    --pinned_;
    inner_.unpin(page, dirty);
  }
  int32_t pin_limit() const override { return limit_; }
  int32_t num_pages() const override { return inner_.num_pages(); }
  int64_t page_bytes() const override { return inner_.page_bytes(); }
  int64_t resident_bytes() const override { return inner_.resident_bytes(); }

 private:
  paging::HostPageStore inner_;
  int32_t limit_;
  int32_t pinned_ = 0;
};

struct Config {
  OptimizerKind kind = OptimizerKind::kAdamW;
  int state_bits = 8;
  ElementType type = ElementType::kFloat32;  // of the non-fp32 half of the params
  int residual_bits = 0;
  bool amsgrad = false;
  double momentum = 0.9;
  bool nesterov = false;
  int32_t pin_limit = 0;  // 0: every page at once
  bool vector = true;      // let the table driver pick the vector bodies for aligned rows
  // Every fourth param's elements start this many elements past an aligned address (a view
  // at a storage offset), which the vector bodies cannot take.
  int misalign = 0;
  // > 0: the table side pages its state through a device cache of this many pages on the
  // simulated device (pinned host memory below it), its kernels enqueued on a stream.
  int32_t device_budget = 0;
  paging::EvictionPolicy policy = paging::EvictionPolicy::kAuto;

  std::string name() const {
    const char* kinds[] = {"adamw", "sgd", "lion", "skewadam"};
    const char* types[] = {"fp32", "bf16", "fp16"};
    return std::string(kinds[int(kind)]) + "/state" + std::to_string(state_bits) + "/" +
           types[int(type)] + "/residual" + std::to_string(residual_bits) +
           (amsgrad ? "/amsgrad" : "") + "/momentum" + std::to_string(momentum) +
           (nesterov ? "/nesterov" : "") + "/pins" + std::to_string(pin_limit) +
           (vector ? "/vector" : "/scalar") + "/misalign" + std::to_string(misalign) +
           (device_budget > 0 ? "/device" + std::to_string(device_budget) + "/" +
                                    paging::eviction_policy_name(policy)
                              : "");
  }
};

std::vector<std::vector<paging::StreamSpec>> stream_kinds(const Config& c) {
  std::vector<paging::StreamSpec> moments;
  if (c.kind == OptimizerKind::kAdamW) {
    add_moment(moments, "exp_avg", c.state_bits);
    add_moment(moments, "exp_avg_sq", c.state_bits);
    if (c.amsgrad) add_moment(moments, "max_exp_avg_sq", c.state_bits);
  } else if (c.kind == OptimizerKind::kSGD) {
    if (c.momentum != 0.0) add_moment(moments, "momentum_buffer", c.state_bits);
  } else {
    add_moment(moments, "exp_avg", c.state_bits);
  }
  std::vector<paging::StreamSpec> with_residual = moments;
  if (c.residual_bits != 0) {
    with_residual.push_back({"master_residual", int64_t(c.residual_bits / 8) * kGroupSize});
  }
  return {moments, with_residual};
}

// The simulated device a paged table state lives on, and the stream its kernels run on.
struct DeviceRig {
  device::SimulatedDevice device;
  device::Stream compute = device.create_stream();
  ~DeviceRig() { device.destroy_stream(compute); }
};

std::unique_ptr<PagedState> make_state(const Config& c, int64_t page_bytes,
                                       DeviceRig* rig = nullptr) {
  std::unique_ptr<paging::PageStore> store;
  if (rig != nullptr) {
    paging::DeviceCacheOptions options;
    options.page_bytes = page_bytes;
    options.cache_bytes = c.device_budget * page_bytes;
    options.prefetch = 2;
    options.policy = c.policy;
    store = std::make_unique<paging::DeviceCacheStore>(
        rig->device, std::make_unique<paging::PinnedHostStore>(rig->device, page_bytes), options);
  } else if (c.pin_limit > 0) {
    store = std::make_unique<LimitedPinStore>(page_bytes, c.pin_limit);
  } else {
    store = std::make_unique<paging::HostPageStore>(page_bytes);
  }
  return std::make_unique<PagedState>(c.kind, stream_kinds(c), std::move(store));
}

// One parameter in raw bytes (fp32, or bf16/fp16 patterns) with its gradient.
struct Param {
  ElementType type;
  int64_t numel;
  int kind;
  std::vector<uint8_t> values, grad;
  float step = 0.0f;
  int32_t slot = -1;

  void* data() { return values.data(); }
};

// Sizes that pack several params into shared pages at odd group offsets, leave partial last
// groups, and span several pages.
const int64_t kSizes[] = {1000, 33, 1, 4097, 64, 31, 9000, 95};

std::vector<Param> make_params(const Config& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<Param> params;
  for (size_t i = 0; i < std::size(kSizes); ++i) {
    Param p;
    // Every other parameter has the config's dtype, so fp32 and 16-bit variants meet in
    // one call, as a model's fp32 norms and bf16 weights do.
    p.type = i % 2 == 0 ? c.type : ElementType::kFloat32;
    p.numel = kSizes[i];
    p.kind = (p.type != ElementType::kFloat32 && c.residual_bits != 0) ? 1 : 0;
    const size_t element_bytes = p.type == ElementType::kFloat32 ? 4 : 2;
    p.values.resize(size_t(p.numel) * element_bytes);
    p.grad.resize(size_t(p.numel) * element_bytes);
    // Magnitudes that differ by 100x inside groups: the companded codes' hard case.
    for (int64_t e = 0; e < p.numel; ++e) {
      store_element(p.values, p.type, e, normal(rng) * (e % 7 == 0 ? 10.0f : 0.1f));
    }
    params.push_back(std::move(p));
  }
  return params;
}

void new_gradients(std::vector<Param>& params, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (Param& p : params) {
    for (int64_t e = 0; e < p.numel; ++e) {
      store_element(p.grad, p.type, e, normal(rng) * (e % 5 == 0 ? 1.0f : 1e-2f));
    }
  }
}

std::vector<ParamStep> param_steps(std::vector<Param>& params) {
  std::vector<ParamStep> steps;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    steps.push_back(ParamStep{p.slot, kernels::ParamSpan{p.data(), p.grad.data(), p.numel, p.type},
                              int32_t(i % 2), &p.step});
  }
  return steps;
}

void register_all(PagedState& state, std::vector<Param>& params, const Config& c) {
  const auto kinds = stream_kinds(c);
  for (Param& p : params) {
    p.slot = kinds[size_t(p.kind)].empty() ? -1 : state.register_param(p.numel, p.kind);
  }
}

// Runs one step of the config through `state`, on the CPU kernels or through `runner`.
// Copies of the params and grads of `params` whose first element sits `misalign` elements
// past an aligned address (still aligned for its own type, as a tensor view is), for every
// fourth param; copied back by the destructor.
class MisalignedCopies {
 public:
  MisalignedCopies(std::vector<Param>& params, int misalign_elements) : params_(params) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (misalign_elements == 0 || i % 4 != 0) continue;
      Param& p = params[i];
      const int misalign = misalign_elements * (p.type == ElementType::kFloat32 ? 4 : 2);
      buffers_.push_back({i, std::vector<uint8_t>(p.values.size() + size_t(misalign)),
                          std::vector<uint8_t>(p.grad.size() + size_t(misalign)), misalign});
      Buffer& b = buffers_.back();
      std::memcpy(b.values.data() + misalign, p.values.data(), p.values.size());
      std::memcpy(b.grad.data() + misalign, p.grad.data(), p.grad.size());
    }
  }
  ~MisalignedCopies() {
    for (Buffer& b : buffers_) {
      Param& p = params_[b.param];
      std::memcpy(p.values.data(), b.values.data() + b.misalign, p.values.size());
    }
  }
  // Where param i's elements and gradient are for this step.
  std::pair<void*, const void*> of(size_t i) {
    for (Buffer& b : buffers_) {
      if (b.param == i) return {b.values.data() + b.misalign, b.grad.data() + b.misalign};
    }
    return {params_[i].values.data(), params_[i].grad.data()};
  }

 private:
  struct Buffer {
    size_t param;
    std::vector<uint8_t> values, grad;
    int misalign;
  };
  std::vector<Param>& params_;
  std::vector<Buffer> buffers_;
};

void step(const Config& c, PagedState& state, std::vector<Param>& params,
          TableRunner* runner) {
  MisalignedCopies copies(params, runner != nullptr ? c.misalign : 0);
  std::vector<ParamStep> steps = param_steps(params);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto [values, grad] = copies.of(i);
    steps[i].span.param = values;
    steps[i].span.grad = grad;
  }
  state.set_vector_loads(c.vector);
  if (c.kind == OptimizerKind::kAdamW) {
    const std::vector<AdamWGroup> groups = {{1e-2, 0.9, 0.999, 1e-8, 0.1, c.amsgrad, false},
                                            {3e-3, 0.8, 0.99, 1e-6, 0.0, c.amsgrad, true}};
    runner ? state.step_adamw(steps, groups, *runner) : state.step_adamw(steps, groups, kSerial);
  } else if (c.kind == OptimizerKind::kSGD) {
    const std::vector<SGDGroup> groups = {{1e-2, c.momentum, 0.0, 1e-2, c.nesterov, false},
                                          {5e-3, c.momentum, c.nesterov ? 0.0 : 0.3, 0.0,
                                           c.nesterov, true}};
    runner ? state.step_sgd(steps, groups, *runner) : state.step_sgd(steps, groups, kSerial);
  } else {
    const std::vector<LionGroup> groups = {{1e-3, 0.9, 0.99, 0.1, false},
                                           {3e-4, 0.95, 0.98, 0.0, true}};
    runner ? state.step_lion(steps, groups, *runner) : state.step_lion(steps, groups, kSerial);
  }
}

void expect_same_params(const Param& cpu, const Param& table, const std::string& where) {
  kernels::test::expect_same_elements(cpu.values, table.values, cpu.type, cpu.numel, where);
}

void expect_same_state(const Config& c, PagedState& cpu, PagedState& table,
                       const std::vector<Param>& cpu_params,
                       const std::vector<Param>& table_params, const std::string& where) {
  const auto kinds = stream_kinds(c);
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    const std::string at = where + " param " + std::to_string(i);
    ASSERT_EQ(cpu_params[i].step, table_params[i].step) << at;
    expect_same_params(cpu_params[i], table_params[i], at);
    if (cpu_params[i].slot < 0) continue;
    for (const paging::StreamSpec& spec : kinds[size_t(cpu_params[i].kind)]) {
      const int64_t bytes = cpu.stream_bytes(cpu_params[i].slot, spec.name);
      std::vector<uint8_t> a(static_cast<size_t>(bytes)), b(static_cast<size_t>(bytes));
      cpu.read_stream(cpu_params[i].slot, spec.name, a.data());
      table.read_stream(table_params[i].slot, spec.name, b.data());
      ASSERT_EQ(a, b) << at << " stream " << spec.name;
    }
  }
}

void check_config(const Config& c, int steps = 2) {
  SCOPED_TRACE(c.name());
  const int64_t page_bytes = 8192;
  std::unique_ptr<DeviceRig> rig = c.device_budget > 0 ? std::make_unique<DeviceRig>() : nullptr;
  auto cpu = make_state(c, page_bytes);
  auto table = make_state(c, page_bytes, rig.get());
  auto* device_store = dynamic_cast<paging::DeviceCacheStore*>(&table->store());
  std::vector<Param> cpu_params = make_params(c, 11);
  std::vector<Param> table_params = make_params(c, 11);
  register_all(*cpu, cpu_params, c);
  register_all(*table, table_params, c);
  for (int s = 0; s < steps; ++s) {
    new_gradients(cpu_params, 100 + s);
    new_gradients(table_params, 100 + s);
    step(c, *cpu, cpu_params, nullptr);
    if (device_store != nullptr) {
      device_store->begin_use(rig->compute);
      {
        device::SimulatedTableRunner runner(rig->device, rig->compute);
        step(c, *table, table_params, &runner);
      }  // waits for the stream: the params are read below
      device_store->end_use();
    } else {
      HostTableRunner runner;
      step(c, *table, table_params, &runner);
    }
    expect_same_state(c, *cpu, *table, cpu_params, table_params, "step " + std::to_string(s));
  }
  if (device_store != nullptr) {
    device_store->drain();
    const paging::DeviceCacheStats stats = device_store->stats();
    EXPECT_LE(stats.peak_resident_pages, c.device_budget);
    if (table->table().num_pages() > c.device_budget) EXPECT_GT(stats.write_backs, 0);
  }
}

std::vector<Config> all_variants() {
  std::vector<Config> configs;
  const ElementType types[] = {ElementType::kFloat32, ElementType::kBFloat16,
                               ElementType::kFloat16};
  for (ElementType type : types) {
    for (int residual : {0, 8, 16}) {
      if (type == ElementType::kFloat32 && residual != 0) continue;
      for (int bits : {32, 8}) {
        for (bool amsgrad : {false, true}) {
          Config c;
          c.kind = OptimizerKind::kAdamW;
          c.type = type;
          c.residual_bits = residual;
          c.state_bits = bits;
          c.amsgrad = amsgrad;
          configs.push_back(c);
        }
        for (double momentum : {0.0, 0.9}) {
          Config c;
          c.kind = OptimizerKind::kSGD;
          c.type = type;
          c.residual_bits = residual;
          c.state_bits = bits;
          c.momentum = momentum;
          c.nesterov = momentum != 0.0 && residual == 8;
          configs.push_back(c);
        }
        Config c;
        c.kind = OptimizerKind::kLion;
        c.type = type;
        c.residual_bits = residual;
        c.state_bits = bits;
        configs.push_back(c);
      }
    }
  }
  return configs;
}

// A lane thread that cannot start (EAGAIN under load): the grid throws, no lane ran its body
// (a warp missing a lane would wait at its first exchange forever), every started lane is
// joined, and the next grid runs whole.
TEST(TableEmulation, AGridWhoseLaneCannotStartThrowsWithNoLaneRun) {
  std::atomic<int> ran{0};
  auto body = [&](const kernels::emulation::HostLane& lane) {
    float all[kGroupSize];
    lane.gather(float(lane.lane()), all);  // every lane of the warp meets here
    ran.fetch_add(1);
  };
  pagedoptim::testing::fail_thread_start(kGroupSize + 7);  // in the second warp
  EXPECT_THROW(kernels::emulation::emulate_grid(2, body), std::system_error);
  pagedoptim::testing::fail_thread_start(0);
  EXPECT_EQ(ran.load(), 0);
  kernels::emulation::emulate_grid(2, body);
  EXPECT_EQ(ran.load(), 2 * kGroupSize);
}

TEST(TableEmulation, EveryVariantMatchesTheCpuKernelsByteForByte) {
  for (Config c : all_variants()) {
    check_config(c);
    if (c.state_bits == 8 && !(c.kind == OptimizerKind::kSGD && c.momentum == 0.0)) {
      c.vector = false;  // the one-element-per-lane bodies, which misaligned rows take
      check_config(c);
    }
  }
}

TEST(TableEmulation, MisalignedParamsTakeTheScalarBodiesInTheSameCall) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSGD, OptimizerKind::kLion}) {
    for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16}) {
      Config c;
      c.kind = kind;
      c.type = type;
      c.residual_bits = type == ElementType::kFloat32 ? 0 : 16;
      c.misalign = 1;
      check_config(c);
    }
  }
}

TEST(TableEmulation, SeveralBatchesOfPinnedPagesMatchOneBatch) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSGD, OptimizerKind::kLion}) {
    Config c;
    c.kind = kind;
    c.type = ElementType::kBFloat16;
    c.residual_bits = 8;
    c.pin_limit = 3;
    check_config(c, 3);
  }
}

TEST(TableEmulation, OneLaunchPerVariantAndBatch) {
  Config c;
  c.type = ElementType::kBFloat16;
  c.residual_bits = 8;
  auto state = make_state(c, 8192);
  std::vector<Param> params = make_params(c, 3);
  register_all(*state, params, c);
  new_gradients(params, 4);
  HostTableRunner runner;
  step(c, *state, params, &runner);
  // bf16 params with a residual and fp32 params: two variants, every page pinned at once.
  EXPECT_EQ(runner.batches(), 1);
  EXPECT_EQ(runner.launches(), 2);

  // Misaligned bf16 params take the scalar body: a third launch in the same call.
  c.misalign = 1;
  new_gradients(params, 5);
  HostTableRunner mixed;
  step(c, *state, params, &mixed);
  EXPECT_EQ(mixed.launches(), 3);
  EXPECT_GE(runner.rows(), int64_t(std::size(kSizes)));
}

TEST(TableEmulation, NanGroupsAgreeInNanness) {
  Config c;
  c.type = ElementType::kBFloat16;
  c.residual_bits = 16;
  auto cpu = make_state(c, 8192);
  auto table = make_state(c, 8192);
  std::vector<Param> cpu_params = make_params(c, 5);
  std::vector<Param> table_params = make_params(c, 5);
  register_all(*cpu, cpu_params, c);
  register_all(*table, table_params, c);
  for (int s = 0; s < 2; ++s) {
    new_gradients(cpu_params, 7 + s);
    new_gradients(table_params, 7 + s);
    for (auto* params : {&cpu_params, &table_params}) {
      store_element((*params)[0].grad, (*params)[0].type, 40, NAN);
      store_element((*params)[3].grad, (*params)[3].type, 4096, INFINITY);
    }
    HostTableRunner runner;
    step(c, *cpu, cpu_params, nullptr);
    step(c, *table, table_params, &runner);
    expect_same_state(c, *cpu, *table, cpu_params, table_params, "nan step");
  }
}

TEST(TableEmulation, FoundInfSkipsTheWholeStep) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSGD, OptimizerKind::kLion}) {
    Config c;
    c.kind = kind;
    auto state = make_state(c, 8192);
    std::vector<Param> params = make_params(c, 9);
    register_all(*state, params, c);
    new_gradients(params, 10);
    HostTableRunner first;
    step(c, *state, params, &first);
    const std::vector<Param> before = params;
    const float found_inf = 1.0f;
    HostTableRunner skipping(2, &found_inf);
    new_gradients(params, 11);
    step(c, *state, params, &skipping);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].step, before[i].step);
      EXPECT_EQ(params[i].values, before[i].values);
    }
    // The state is unchanged too: stepping again with the same gradients from the same
    // state gives the same result as a reference that never saw the skipped step.
    auto reference = make_state(c, 8192);
    std::vector<Param> reference_params = make_params(c, 9);
    register_all(*reference, reference_params, c);
    new_gradients(reference_params, 10);
    HostTableRunner ref_first;
    step(c, *reference, reference_params, &ref_first);
    new_gradients(reference_params, 11);
    HostTableRunner ref_second;
    step(c, *reference, reference_params, &ref_second);
    HostTableRunner second;
    step(c, *state, params, &second);
    expect_same_state(c, *reference, *state, reference_params, params, "after skip");
  }
}

TEST(TableEmulation, GradScaleDividesGradientsFirst) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSGD, OptimizerKind::kLion}) {
    Config c;
    c.kind = kind;
    c.type = ElementType::kFloat32;
    auto cpu = make_state(c, 8192);
    auto table = make_state(c, 8192);
    std::vector<Param> cpu_params = make_params(c, 21);
    std::vector<Param> table_params = make_params(c, 21);
    register_all(*cpu, cpu_params, c);
    register_all(*table, table_params, c);
    const float scale = 65536.0f * 3.0f;  // not a power of two: the division rounds
    new_gradients(cpu_params, 22);
    new_gradients(table_params, 22);
    for (size_t i = 0; i < table_params.size(); ++i) {
      for (int64_t e = 0; e < table_params[i].numel; ++e) {
        const float g = load_element(cpu_params[i].grad, ElementType::kFloat32, e) * scale;
        store_element(table_params[i].grad, ElementType::kFloat32, e, g);
        store_element(cpu_params[i].grad, ElementType::kFloat32, e, g / scale);
      }
    }
    HostTableRunner runner(2, nullptr, &scale);
    step(c, *cpu, cpu_params, nullptr);
    step(c, *table, table_params, &runner);
    expect_same_state(c, *cpu, *table, cpu_params, table_params, "grad scale");
  }
}

// Paging never changes results: the table kernels stepping state that moves between a
// small device cache and pinned host memory, on streams that complete in random order,
// give the bytes the CPU kernels give on resident state, step after step.
TEST(TableEmulation, StatePagedThroughADeviceCacheMatchesResidentState) {
  std::vector<Config> configs;
  Config adamw8;
  adamw8.type = ElementType::kBFloat16;
  adamw8.residual_bits = 8;
  configs.push_back(adamw8);
  Config adamw32;
  adamw32.state_bits = 32;
  adamw32.amsgrad = true;
  configs.push_back(adamw32);
  Config sgd;
  sgd.kind = OptimizerKind::kSGD;
  sgd.type = ElementType::kFloat16;
  sgd.residual_bits = 16;
  sgd.nesterov = true;
  configs.push_back(sgd);
  Config lion;
  lion.kind = OptimizerKind::kLion;
  lion.type = ElementType::kBFloat16;
  configs.push_back(lion);
  for (Config c : configs) {
    for (int32_t budget : {1, 2, 3, 64}) {
      for (paging::EvictionPolicy policy : {paging::EvictionPolicy::kLru,
                                            paging::EvictionPolicy::kPlan}) {
        c.device_budget = budget;
        c.policy = policy;
        check_config(c, 3);
      }
    }
  }
}

}  // namespace
}  // namespace pagedoptim::optim
