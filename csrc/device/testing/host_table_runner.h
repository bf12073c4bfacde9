// Host emulation of the CUDA table kernels: the kernels of the simulated device
// (simulated_table_runner.h) and of the CPU tests.
//
// The kernel bodies (csrc/kernels/table/step_bodies.h) are compiled here for the host and
// run with a warp shim: each lane of an emulated warp is a thread of its own, and the warp
// reduction is an exchange between the 32 threads at a barrier, so the bodies run with the
// same concurrency between lanes (and, with several warps, between warps) that they have on
// the GPU. Under TSan that checks the lane protocol too (lane 0 rewriting a group's scale
// after every lane has read it). The per-parameter scalars are prepared on the host by the
// same function the CUDA scalar kernel calls.
#pragma once

#include <barrier>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/table/visit_body.h"
#include "pagedoptim/optim/table_runner.h"
#include "pagedoptim/thread_start.h"

namespace pagedoptim::kernels::emulation {

// The 32 lanes of one emulated warp meet here for each reduction.
class WarpExchange {
 public:
  WarpExchange() : barrier_(kGroupSize) {}

  uint32_t max(int lane, uint32_t value) {
    slots_[lane] = value;
    barrier_.arrive_and_wait();  // every lane has published its value
    uint32_t largest = 0;
    for (uint32_t slot : slots_) largest = slot > largest ? slot : largest;
    barrier_.arrive_and_wait();  // every lane has read them before any publishes again
    return largest;
  }

  // The maximum over the aligned run of `width` lanes that holds `lane`.
  uint32_t group_max(int lane, uint32_t value, int width) {
    slots_[lane] = value;
    barrier_.arrive_and_wait();
    uint32_t largest = 0;
    const int first = lane / width * width;
    for (int l = first; l < first + width; ++l) largest = slots_[l] > largest ? slots_[l] : largest;
    barrier_.arrive_and_wait();
    return largest;
  }

  // Every lane's value, as 32 __shfl_sync would give them.
  void gather(int lane, uint32_t value, uint32_t* all) {
    slots_[lane] = value;
    barrier_.arrive_and_wait();
    for (int src = 0; src < kGroupSize; ++src) all[src] = slots_[src];
    barrier_.arrive_and_wait();
  }

 private:
  std::barrier<> barrier_;
  uint32_t slots_[kGroupSize] = {};
};

struct HostLane {
  int lane_index;
  int64_t warp;
  int64_t warps;
  WarpExchange* exchange;

  int lane() const { return lane_index; }
  int64_t first_warp() const { return warp; }
  int64_t warp_stride() const { return warps; }
  uint32_t warp_max(uint32_t value) const { return exchange->max(lane_index, value); }
  uint32_t group_max(uint32_t value, int width) const {
    return exchange->group_max(lane_index, value, width);
  }
  void gather(float value, float* all) const {
    uint32_t bits[kGroupSize];
    exchange->gather(lane_index, codec::float_to_bits(value), bits);
    for (int src = 0; src < kGroupSize; ++src) all[src] = codec::bits_to_float(bits[src]);
  }
};

// Runs body(lane) for every lane of a grid of `warps` warps, each lane on its own thread.
// The lanes of a warp wait for each other (WarpExchange), so none runs its body before every
// lane has started: if a thread cannot start (EAGAIN under load), the started ones are
// released without running, joined, and the error rethrown, instead of leaving a warp
// waiting forever for its missing lane, or a joinable thread to std::terminate.
template <class Body>
void emulate_grid(int warps, const Body& body) {
  std::vector<WarpExchange> exchanges(static_cast<size_t>(warps));
  std::mutex mutex;
  std::condition_variable started_cv;
  bool released = false;
  bool abandoned = false;
  auto release = [&](bool abandon) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      released = true;
      abandoned = abandon;
    }
    started_cv.notify_all();
  };
  std::vector<std::thread> lanes;
  lanes.reserve(static_cast<size_t>(warps) * kGroupSize);
  try {
    for (int w = 0; w < warps; ++w) {
      for (int l = 0; l < kGroupSize; ++l) {
        lanes.push_back(start_thread([&, w, l] {
          {
            std::unique_lock<std::mutex> lock(mutex);
            started_cv.wait(lock, [&] { return released; });
            if (abandoned) return;
          }
          body(HostLane{l, w, warps, &exchanges[size_t(w)]});
        }));
      }
    }
  } catch (...) {
    release(/*abandon=*/true);
    for (std::thread& lane : lanes) lane.join();
    throw;
  }
  release(/*abandon=*/false);
  for (std::thread& lane : lanes) lane.join();
}

// Runs one table as a grid of `warps` warps, every lane on its own thread.
inline void emulate_launch(const StepTable& table, int warps) {
  bool known = false;
  table::visit_step_body(table.variant, [&]<class Body>() {
    known = true;
    emulate_grid(warps, [&](const HostLane& lane) { Body::run(table, lane); });
  });
  if (!known) throw std::invalid_argument("no kernel body for this variant");
}

// A TableRunner whose "device" is this host: step counters are host floats, tables run
// through emulate_launch.
class HostTableRunner final : public optim::TableRunner {
 public:
  explicit HostTableRunner(int warps = 2, const float* found_inf = nullptr,
                           const float* grad_scale = nullptr)
      : warps_(warps), found_inf_(found_inf), grad_scale_(grad_scale) {}

  // The preparations are kept until the first kernel (TableRunner's contract), as the CUDA
  // runner keeps its launch.
  void prepare_adamw(const std::vector<ScalarJob>& jobs,
                     const std::vector<optim::AdamWGroup>& groups) override {
    defer(jobs, groups, adamw_, &table::prepare_adamw_scalars);
  }
  void prepare_sgd(const std::vector<ScalarJob>& jobs,
                   const std::vector<optim::SGDGroup>& groups) override {
    defer(jobs, groups, sgd_, &table::prepare_sgd_scalars);
  }
  void prepare_lion(const std::vector<ScalarJob>& jobs,
                    const std::vector<optim::LionGroup>& groups) override {
    defer(jobs, groups, lion_, &table::prepare_lion_scalars);
  }
  void prepare_skewadam(const std::vector<ScalarJob>& jobs,
                        const std::vector<optim::SkewAdamGroup>& groups) override {
    defer(jobs, groups, skewadam_, &table::prepare_skewadam_scalars);
  }
  bool counters_advanced() const override { return prepared_; }

  void* scratch(int64_t bytes) override {
    scratch_.push_back(std::make_unique<std::byte[]>(size_t(bytes)));
    return scratch_.back().get();
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    std::memcpy(dst, src, size_t(bytes));
  }
  void run_statistics(const std::vector<FactorMatrix>& matrices) override {
    flush_prepare();
    table::FactorTable factors;
    factors.matrices = matrices.data();
    factors.num_matrices = int32_t(matrices.size());
    factors.total_rows = matrices.back().first_row + matrices.back().rows;
    factors.total_cols = matrices.back().first_col + matrices.back().cols;
    factors.scalars = skewadam_.data();
    table::visit_statistics_bodies([&]<class Body>() {
      emulate_grid(warps_, [&](const HostLane& lane) { Body::run(factors, lane); });
      ++launches_;
    });
  }

  void run(const optim::TableBatch& batch) override {
    flush_prepare();
    ++batches_;
    for (size_t t = 0; t < batch.variants.size(); ++t) {
      const std::vector<StepRow>& rows = batch.rows[t];
      StepTable table;
      table.variant = batch.variants[t];
      table.rows = rows.data();
      table.num_rows = int32_t(rows.size());
      table.num_units = rows.back().first_unit + units_of(rows.back().count);
      table.scalars = scalars_;
      table.found_inf = found_inf_;
      table.grad_scale = grad_scale_;
      emulate_launch(table, warps_);
      ++launches_;
      rows_ += int64_t(rows.size());
    }
  }

  int launches() const { return launches_; }
  int batches() const { return batches_; }
  int64_t rows() const { return rows_; }

 private:
  bool skipped() const { return found_inf_ != nullptr && *found_inf_ != 0.0f; }

  // Sizes the scalars now (rows index them) and keeps their computation for flush_prepare.
  // A step skipped by found_inf leaves them unset and the counters alone, as the kernel does.
  template <class Group, class Scalars, class Prepare>
  void defer(const std::vector<ScalarJob>& jobs, const std::vector<Group>& groups,
             std::vector<Scalars>& scalars, Prepare prepare) {
    scalars.resize(jobs.size());
    scalars_ = scalars.data();
    pending_prepare_ = [this, jobs, groups, &scalars, prepare] {
      if (skipped()) return;
      for (size_t i = 0; i < jobs.size(); ++i) {
        prepare(jobs[i], groups[size_t(jobs[i].group)], scalars[i]);
      }
    };
  }
  void flush_prepare() {
    if (!pending_prepare_) return;
    auto prepare = std::move(pending_prepare_);
    pending_prepare_ = nullptr;
    prepared_ = true;
    prepare();
  }

  int warps_;
  const float* found_inf_;
  const float* grad_scale_;
  const void* scalars_ = nullptr;
  std::function<void()> pending_prepare_;
  bool prepared_ = false;
  std::vector<codec::AdamWScalars> adamw_;
  std::vector<codec::SGDScalars> sgd_;
  std::vector<codec::LionScalars> lion_;
  std::vector<codec::SkewAdamScalars> skewadam_;
  std::vector<std::unique_ptr<std::byte[]>> scratch_;
  int launches_ = 0;
  int batches_ = 0;
  int64_t rows_ = 0;
};

}  // namespace pagedoptim::kernels::emulation
