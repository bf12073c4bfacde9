// Where the work tables of a device step run.
//
// The step driver (csrc/optim/table_step.cpp) decides what to step: it pins pages, turns
// them into rows (pagedoptim/kernels/step_table.h) and groups the rows by kernel variant.
// A TableRunner decides where and how: the CUDA runner (csrc/bindings/backends/cuda_backend.cpp)
// uploads the rows and launches one kernel per table on the current stream, with no host
// synchronization; the CPU tests' runner emulates the same kernel bodies on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedoptim/kernels/step_table.h"
#include "pagedoptim/optim/groups.h"

namespace pagedoptim::optim {

// The rows of one batch of pinned pages, one table per variant (rows in host memory;
// first_unit already numbered within each table).
struct TableBatch {
  std::vector<kernels::StepVariant> variants;
  std::vector<std::vector<kernels::StepRow>> rows;  // rows[t] belong to variants[t]
};

class TableRunner {
 public:
  virtual ~TableRunner() = default;

  // Once per step, before any batch: the per-parameter scalars (jobs[i] for the call's
  // parameter i, whose step counter lives where the runner's kernels run). Row i's
  // StepRow::scalars indexes them. The preparation advances the step counters, so a runner
  // runs it with the step's first kernel (run_statistics or run), never here: a step that
  // fails before that (an out-of-memory in an upload, a page fault pinning the first batch)
  // leaves every counter as it was.
  virtual void prepare_adamw(const std::vector<kernels::ScalarJob>& jobs,
                             const std::vector<AdamWGroup>& groups) = 0;
  virtual void prepare_sgd(const std::vector<kernels::ScalarJob>& jobs,
                           const std::vector<SGDGroup>& groups) = 0;
  virtual void prepare_lion(const std::vector<kernels::ScalarJob>& jobs,
                            const std::vector<LionGroup>& groups) = 0;

  virtual void prepare_skewadam(const std::vector<kernels::ScalarJob>& jobs,
                                const std::vector<SkewAdamGroup>& groups) = 0;

  // SkewAdam's first phase. Memory of `bytes` bytes where the kernels run, alive until the
  // runner is destroyed (the end of the step); zero-filled is not promised.
  virtual void* scratch(int64_t bytes) = 0;
  // Copies between page bytes and scratch, in order with the kernels.
  virtual void copy(void* dst, const void* src, int64_t bytes) = 0;
  // Runs the statistics of every factored matrix of the step (pointers into scratch and the
  // gradients; first_row/first_col numbered); needs the prepared SkewAdam scalars.
  virtual void run_statistics(const std::vector<kernels::FactorMatrix>& matrices) = 0;

  // Runs every table of a batch. The pages behind the rows stay pinned until it returns;
  // a runner that only enqueues work must make the store wait for it before the pages
  // move (the store and the runner share the stream).
  virtual void run(const TableBatch& batch) = 0;

  // Whether the scalar preparation has run or is queued ahead of a kernel: the step
  // counters then hold this step's count, and a retry of the step must not advance them
  // again (PagedState's journal keeps this across the retry).
  virtual bool counters_advanced() const = 0;
};

}  // namespace pagedoptim::optim
