// The optimizer engine: a page table, a page store, and the step driver that runs the
// fused kernels over the pages of every parameter that has a gradient.
//
// One step is one call: the Python optimizer hands over every (parameter, gradient, step
// counter, group) with a gradient at once; the driver builds the step plan (the pages to
// touch, in order), pins them in the store, cuts their segments into chunks, runs the
// kernel on the chunks in parallel, and unpins the pages as written.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/step_kernels.h"
#include "pagedoptim/codec/skewadam_rules.h"
#include "pagedoptim/optim/groups.h"
#include "pagedoptim/optim/table_runner.h"
#include "pagedoptim/paging/page_store.h"
#include "pagedoptim/paging/page_table.h"

namespace pagedoptim::optim {

// Runs body(begin, end) over [0, n) on the caller's thread pool. The bindings pass
// at::parallel_for (torch's intra-op pool, so torch.set_num_threads applies); C++ tests
// pass a serial loop or std::threads. Chunks handed out are disjoint.
using ParallelFor =
    std::function<void(int64_t n, const std::function<void(int64_t begin, int64_t end)>&)>;

enum class OptimizerKind { kAdamW, kSGD, kLion, kSkewAdam };

struct ParamStep {
  int32_t slot;             // from PagedState::register_param
  kernels::ParamSpan span;  // the whole parameter and its gradient
  int32_t group;            // index into the group hyperparameters of the call
  float* step;              // the parameter's step counter, incremented by the step
};

// A SkewAdam parameter (codec/skewadam_rules.h). `step.slot` is -1 for a parameter without
// per-element state (an fp32 experts-tier matrix keeps only its factors). A factored
// parameter has its row and column running means, [experts * rows] then [experts * cols]
// fp32, in the "exp_avg_sq_factors" stream of `factor_slot`; an exact one has factor_slot -1
// and its second moment in the "exp_avg_sq" stream of `step.slot`.
struct SkewAdamParamStep {
  ParamStep step;
  int32_t factor_slot = -1;
  int64_t experts = 1, rows = 0, cols = 0;  // the factored shape; experts * rows * cols = numel
  bool momentum = false;                    // keeps "exp_avg" (8-bit or fp32)
};

struct MemoryUsage {
  int64_t state_bytes;     // page bytes allocated (what the state costs)
  int64_t resident_bytes;  // of which resident in memory now
  int64_t payload_bytes;   // bytes the streams use for the registered elements
  int32_t num_pages;
  int32_t num_params;
};

// Where the driver finds each logical stream inside a page of one kind (-1: absent). A
// moment named X is either one fp32 stream "X" or, companded, "X_codes" + "X_scales".
struct KindStreams {
  struct Moment {
    int values = -1;  // "X" (fp32) or "X_codes" (8-bit)
    int scales = -1;  // "X_scales"; -1 for fp32 state
  };
  Moment m, v, v_max;  // AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq; SGD/Lion use m only
  int residual = -1;   // "master_residual"
  int residual_bits = 0;
  int factors = -1;    // SkewAdam's "exp_avg_sq_factors"
};

// A step that raised before it finished (docs/reliability.md, "Steps that fail").
struct InterruptedStep {
  int64_t pages_done;  // pages of the step's plan already applied
  int64_t pages;       // pages in the step's plan
  bool resumable;      // false when a batch failed half run (a device error): retry is refused
  bool complete;       // every page applied; only an error that surfaced afterwards is left
};

// Called by the step drivers between two batches of pinned pages (no page pinned), with
// the index of the batch about to be pinned in this call. It may throw to interrupt the
// step there (the binding turns a pending Ctrl-C into an exception); the step then stays
// journaled and resumable.
using BatchBoundaryHook = std::function<void(size_t next_batch)>;

class PagedState {
 public:
  // One stream set per parameter kind, fixed for the life of the state. Moment names:
  // AdamW exp_avg, exp_avg_sq [, max_exp_avg_sq]; SGD momentum_buffer (or no stream at all
  // when momentum is 0); Lion exp_avg. Each as "X" (fp32) or "X_codes" (int8, or uint8 for
  // second moments) plus "X_scales" (fp16 per group); optionally "master_residual" (int8 or
  // int16) for bf16/fp16 parameters.
  PagedState(OptimizerKind kind, std::vector<std::vector<paging::StreamSpec>> kinds,
             std::unique_ptr<paging::PageStore> store);

  // Lays out zero-initialized state for a parameter of `numel` elements of kind `kind`;
  // returns its slot. `row_length`: the length of its last dimension (0: one row); 8-bit
  // groups never cross one of its rows (paging/page_table.h).
  int32_t register_param(int64_t numel, int kind = 0, int64_t row_length = 0);

  void step_adamw(const std::vector<ParamStep>& params, const std::vector<AdamWGroup>& groups,
                  const ParallelFor& parallel_for);
  void step_sgd(const std::vector<ParamStep>& params, const std::vector<SGDGroup>& groups,
                const ParallelFor& parallel_for);
  void step_lion(const std::vector<ParamStep>& params, const std::vector<LionGroup>& groups,
                 const ParallelFor& parallel_for);
  // The same steps through work tables, for state on a compute device: the runner
  // prepares the scalars next to the step counters (ParamStep::step points into the
  // runner's memory then) and runs one kernel per variant and batch of pinned pages.
  // Defined in table_step.cpp.
  void step_adamw(const std::vector<ParamStep>& params, const std::vector<AdamWGroup>& groups,
                  TableRunner& runner);
  void step_sgd(const std::vector<ParamStep>& params, const std::vector<SGDGroup>& groups,
                TableRunner& runner);
  void step_lion(const std::vector<ParamStep>& params, const std::vector<LionGroup>& groups,
                 TableRunner& runner);
  // Two phases in one call: the row and column statistics of every factored parameter
  // (they need its whole gradient), then the elementwise pass over the pages. Defined in
  // skewadam_step.cpp.
  void step_skewadam(const std::vector<SkewAdamParamStep>& params,
                     const std::vector<SkewAdamGroup>& groups, const ParallelFor& parallel_for);

  // SkewAdam through the table kernels: the statistics kernels on contiguous copies of the
  // factor streams, then the elementwise tables. Defined in table_step.cpp.
  void step_skewadam(const std::vector<SkewAdamParamStep>& params,
                     const std::vector<SkewAdamGroup>& groups, TableRunner& runner);

  // Copies the stream named `stream` of one parameter out of / into its pages, as the raw
  // bytes of the stream (stream_bytes() of them), in element order. Used by state_dict().
  void read_stream(int32_t slot, const std::string& stream, void* out);
  void write_stream(int32_t slot, const std::string& stream, const void* in);
  int64_t stream_bytes(int32_t slot, const std::string& stream) const;
  // The same for `bytes` bytes from byte `offset` of the stream (checkpoints stream state
  // larger than memory through these): only the pages holding that range are pinned, one
  // at a time, so a call holds no more than the caller's buffer. Throws std::out_of_range
  // when the range is not inside the stream.
  void read_stream_range(int32_t slot, const std::string& stream, int64_t offset,
                         int64_t bytes, void* out);
  void write_stream_range(int32_t slot, const std::string& stream, int64_t offset,
                          int64_t bytes, const void* in);
  // Tells the store which pages a run of read/write_stream_range calls will pin, in that
  // order, so that a paged store reads ahead of them and writes back behind them, as in a
  // step (a checkpoint's records otherwise read each page only when the copy reaches it).
  // The plan is the pages of those calls' pins in order, a page pinned again later named
  // again: a page that several records use stays wanted until its last use, where a plan
  // naming it once would have it evicted as done and read again. An empty list ends the
  // plan. Throws std::out_of_range, naming the range, before the store is told anything.
  struct StreamRange {
    int32_t slot;
    std::string stream;
    int64_t offset;
    int64_t bytes;
  };
  void plan_stream_ranges(const std::vector<StreamRange>& ranges);

  // Steps that fail. A step that raises (a failed read, an interrupt at a batch boundary)
  // leaves a journal: its plan, how many of its pages are applied, and which parameters
  // it stepped. The next step call must then either resume it (resume_next_step() first:
  // same parameters, slots and groups; the counters are not advanced again, the scan does
  // not flip, and only the pages not yet applied are stepped) or follow
  // discard_interrupted_step(). A fresh step over an unfinished journal throws.
  std::optional<InterruptedStep> interrupted_step() const;
  void discard_interrupted_step() {
    journal_.reset();
    resume_requested_ = false;  // a resume asked for by a call that failed before it began
  }
  // The next step call finishes the interrupted step instead of starting a new one.
  void resume_next_step() { resume_requested_ = true; }
  void set_batch_boundary_hook(BatchBoundaryHook hook) { batch_hook_ = std::move(hook); }

  // Whether the table steps may use the vector bodies for rows aligned for them (default
  // on; off runs every row one element per lane, for comparisons).
  void set_vector_loads(bool on) { vector_loads_ = on; }

  OptimizerKind kind() const { return kind_; }
  const paging::PageTable& table() const { return table_; }
  paging::PageStore& store() { return *store_; }
  MemoryUsage memory_usage() const;
  bool stateless() const { return stateless_; }

 private:
  // What an interrupted step did (see interrupted_step()); which driver ran it, so that a
  // resume through another one is refused.
  enum class StepCall { kAdamW, kSGD, kLion, kSkewAdam, kTableAdamW, kTableSGD, kTableLion,
                        kTableSkewAdam };
  struct StepJournal {
    StepCall call;
    std::vector<std::array<int64_t, 3>> signature;  // per parameter: slot, group, numel
    bool planned = false;                           // plan_pages ran: `plan` is the plan
    std::vector<int32_t> plan;                      // the step's pages, in pin order
    size_t pages_done = 0;         // plan[0, pages_done) are applied
    bool unpaged_done = false;     // parameters without pages (plain SGD, SkewAdam's fp32
                                   // experts in the table step) are applied; the CPU
                                   // SkewAdam step applies its own with phase 1's factors
    size_t factors_written = 0;    // SkewAdam: factored parameters, in call order, whose new
                                   // running means are in their pages
    // SkewAdam on the CPU: phase 1's new running means and coefficients per parameter
    // (empty until it ran), so a resumed step reuses them.
    std::vector<std::vector<float>> factors, coefficients;
    // Table steps: the runner's scalar preparation has run (it goes with the first kernel),
    // so the step counters hold this step's count. A step that failed before any kernel (an
    // upload out of memory, a page fault pinning the first batch) left them alone, and its
    // retry advances them; one that failed later must not advance them twice.
    bool counters_advanced = false;
    bool resumable = true;
    bool complete = false;
  };
  // Starts a step through driver `call`: a fresh one (journal opened), or the interrupted
  // one again after resume_next_step(). Returns whether it resumes. Throws when a fresh
  // step meets an unfinished journal, or a resume does not match it.
  bool begin_step(StepCall call, const std::vector<ParamStep>& params);
  // Ends a step whose work is all done: rethrows an error that surfaced on the way (a
  // failed write-back, reported by the last unpin) with the journal marked complete, else
  // closes the journal.
  void finish_step();
  // The pages of the plan still to apply: all of a fresh step's, the rest of a resumed one.
  size_t first_page_to_apply() const { return journal_ ? journal_->pages_done : 0; }
  // Unpins plan[begin, end) as written. An unpin that throws (the store's pending error,
  // raised by the last unpin of a plan) is kept for finish_step: the work is done.
  void unpin_written(const std::vector<int32_t>& plan, size_t begin, size_t end);
  // Before batch `batch` (> 0) of this call: the hook, which may interrupt the step; then
  // the store stops prefetching the rest of the plan.
  void at_batch_boundary(size_t batch);

  // The pages of a step's parameters in the order they will be pinned (see
  // for_each_chunk), handed to the store as its plan; a resumed step's rest of its plan.
  std::vector<int32_t> plan_pages(const std::vector<ParamStep>& params, bool resuming);
  // Pins plan[begin, end) into pages[page id]; on a failed pin unpins what it pinned,
  // unchanged, and rethrows, so the store never sees a page marked written that was not.
  void pin_batch(const std::vector<int32_t>& plan, size_t begin, size_t end,
                 std::vector<std::byte*>& pages);
  // Table steps: records in the journal whether `runner` has advanced the counters; after
  // each of its kernel calls, whether it returned or threw.
  void note_counters(const TableRunner& runner);
  // Row builder of the table step: the variant and row of segment `segment` of parameter
  // `param`, whose page is resident at `page`.
  using RowFn = std::function<void(size_t param, const paging::Segment& segment,
                                   std::byte* page, kernels::StepVariant& variant,
                                   kernels::StepRow& row)>;
  // Pins the plan in batches, builds every row of each batch with `make_row`, runs the
  // batch's tables on `runner`, unpins. `extra` rows (parameters without pages) run in the
  // first batch.
  void run_tables(const std::vector<ParamStep>& params, TableRunner& runner,
                  const RowFn& make_row, std::vector<std::pair<kernels::StepVariant,
                                                               kernels::StepRow>> extra);
  // Calls apply(param_index, segment, page_bytes, chunk_begin, chunk_count) for every chunk
  // of every segment of the parameters in `params`, pages pinned around it.
  template <class Apply>
  void for_each_chunk(const std::vector<ParamStep>& params, const ParallelFor& parallel_for,
                      const Apply& apply);
  // for_each_chunk behind a type-erased callback, for drivers in other translation units.
  using ChunkFn = std::function<void(size_t param, const paging::Segment& segment,
                                     std::byte* page, int64_t begin, int64_t count)>;
  void for_each_chunk_of(const std::vector<ParamStep>& params, const ParallelFor& parallel_for,
                         const ChunkFn& apply);
  void check_param(const ParamStep& param, size_t num_groups) const;
  void check_adamw_params(const std::vector<ParamStep>& params,
                          const std::vector<AdamWGroup>& groups) const;
  void check_sgd_params(const std::vector<ParamStep>& params,
                        const std::vector<SGDGroup>& groups) const;
  void check_skewadam_params(const std::vector<SkewAdamParamStep>& params,
                             const std::vector<SkewAdamGroup>& groups) const;
  // Copies stream `stream` of `slot` between its pages and `buffer` (contiguous, in element
  // order, in the runner's memory) with the runner's copy, so no host code touches page bytes.
  void copy_stream_with(TableRunner& runner, int32_t slot, const std::string& stream,
                        void* buffer, bool into_pages);
  // Calls copy(page, offset in the page, offset in the range, bytes) for each piece of the
  // byte range [offset, offset + bytes) of stream `stream` of `slot`, in element order.
  using PieceCopy = std::function<void(int32_t page, int64_t page_offset, int64_t range_offset,
                                       int64_t bytes)>;
  void for_each_piece_of_range(int32_t slot, const std::string& stream, int64_t offset,
                               int64_t bytes, const PieceCopy& copy) const;

  // Stream `stream` (an index into the kind's streams, -1 for none) of element `begin` of
  // `segment`, inside the resident `page` of kind `kind`; nullptr for stream -1.
  void* stream_ptr(int kind, int stream, std::byte* page, const paging::Segment& segment,
                   int64_t begin) const;
  // The byte offset of that element inside its page (stream >= 0).
  int64_t stream_offset(int kind, int stream, const paging::Segment& segment,
                        int64_t begin) const;
  kernels::MomentStream moment_ptr(int kind, const KindStreams::Moment& moment,
                                   std::byte* page, const paging::Segment& segment,
                                   int64_t begin) const;
  kernels::MasterResidual residual_ptr(int kind, std::byte* page,
                                       const paging::Segment& segment, int64_t begin) const;
  int find_stream_of(int32_t slot, const std::string& stream) const;

  OptimizerKind kind_;
  bool stateless_;  // plain SGD: no streams in any kind, no pages at all
  paging::PageTable table_;
  std::vector<KindStreams> kind_streams_;
  std::unique_ptr<paging::PageStore> store_;
  int64_t steps_taken_ = 0;  // the parity picks the plan's scan direction
  bool vector_loads_ = true;
  std::optional<StepJournal> journal_;
  bool resume_requested_ = false;
  BatchBoundaryHook batch_hook_;
  std::exception_ptr deferred_error_;  // see unpin_written
};

}  // namespace pagedoptim::optim
