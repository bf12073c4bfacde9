// The optimizer engine: a page table, a page store, and the step driver that runs the
// fused kernels over the pages of every parameter that has a gradient.
//
// One step is one call: the Python optimizer hands over every (parameter, gradient, step
// counter, group) with a gradient at once; the driver builds the step plan (the pages to
// touch, in order), pins them in the store, cuts their segments into chunks, runs the
// kernel on the chunks in parallel, and unpins the pages as written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/paging/page_store.h"
#include "pagedoptim/paging/page_table.h"

namespace pagedoptim::optim {

// Runs body(begin, end) over [0, n) on the caller's thread pool. The bindings pass
// at::parallel_for (torch's intra-op pool, so torch.set_num_threads applies); C++ tests
// pass a serial loop or std::threads. Chunks handed out are disjoint.
using ParallelFor =
    std::function<void(int64_t n, const std::function<void(int64_t begin, int64_t end)>&)>;

enum class OptimizerKind { kAdamW, kSGD, kLion };

struct ParamStep {
  int32_t slot;             // from PagedState::register_param
  kernels::ParamSpan span;  // the whole parameter and its gradient
  int32_t group;            // index into the group hyperparameters of the call
  float* step;              // the parameter's step counter, incremented by the step
};

struct AdamWGroup {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

struct SGDGroup {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
};

struct LionGroup {
  double lr, beta1, beta2, weight_decay;
  bool maximize;
};

struct MemoryUsage {
  int64_t state_bytes;     // page bytes allocated (what the state costs)
  int64_t resident_bytes;  // of which resident in memory now
  int64_t payload_bytes;   // bytes the streams use for the registered elements
  int32_t num_pages;
  int32_t num_params;
};

class PagedState {
 public:
  // The stream set is fixed for the life of the state: AdamW {exp_avg, exp_avg_sq
  // [, max_exp_avg_sq]}, SGD {momentum_buffer} or none, Lion {exp_avg}.
  PagedState(OptimizerKind kind, std::vector<paging::StreamSpec> streams,
             std::unique_ptr<paging::PageStore> store);

  // Lays out zero-initialized state for a parameter of `numel` elements; returns its slot.
  int32_t register_param(int64_t numel);

  void step_adamw(const std::vector<ParamStep>& params, const std::vector<AdamWGroup>& groups,
                  const ParallelFor& parallel_for);
  void step_sgd(const std::vector<ParamStep>& params, const std::vector<SGDGroup>& groups,
                const ParallelFor& parallel_for);
  void step_lion(const std::vector<ParamStep>& params, const std::vector<LionGroup>& groups,
                 const ParallelFor& parallel_for);

  // Copies one stream of one parameter out of / into its pages, as the raw bytes of the
  // stream (stream.bytes_for(numel) of them), in element order. Used by state_dict().
  void read_stream(int32_t slot, int stream, void* out);
  void write_stream(int32_t slot, int stream, const void* in);

  OptimizerKind kind() const { return kind_; }
  const paging::PageTable& table() const { return table_; }
  paging::PageStore& store() { return *store_; }
  MemoryUsage memory_usage() const;
  int64_t stream_bytes(int32_t slot, int stream) const;

 private:
  // Calls apply(param_index, segment, page_bytes, chunk_begin, chunk_count) for every chunk
  // of every segment of the parameters in `params`, pages pinned around it.
  template <class Apply>
  void for_each_chunk(const std::vector<ParamStep>& params, const ParallelFor& parallel_for,
                      const Apply& apply);
  void check_param(const ParamStep& param, size_t num_groups) const;

  // Stream `stream` of element `begin` of `segment`, inside the resident `page`.
  template <class T>
  T* stream_ptr(int stream, std::byte* page, const paging::Segment& segment,
                int64_t begin) const {
    const paging::PageGeometry& geometry = table_.geometry();
    return reinterpret_cast<T*>(page + geometry.stream_offset(stream) +
                                geometry.streams()[size_t(stream)].offset_of(
                                    segment.page_offset + begin));
  }

  OptimizerKind kind_;
  paging::PageTable table_;
  std::unique_ptr<paging::PageStore> store_;
};

}  // namespace pagedoptim::optim
