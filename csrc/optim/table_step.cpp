// The table step: PagedState's steps for state on a compute device.
//
// Same plan as the CPU driver (pages in plan order, pinned in batches the store can hold),
// but instead of running a kernel per chunk on this thread pool, every segment of a batch
// becomes one row of a work table, rows are grouped by kernel variant, and the runner
// launches one kernel per variant and batch. Nothing here reads or writes page bytes: page
// pointers are only offset into, so they may be device addresses.
#include <algorithm>
#include <map>
#include <string>
#include <stdexcept>
#include <utility>

#include "kernels/table/param_io.h"
#include "optim/param_chunks.h"
#include "pagedoptim/optim/paged_state.h"

namespace pagedoptim::optim {
namespace {

using kernels::StateFormat;
using kernels::StepAlgorithm;
using kernels::StepRow;
using kernels::StepVariant;

// Collects rows into one table per variant, in the order variants first appear.
class BatchBuilder {
 public:
  void add(const StepVariant& variant, const StepRow& row) {
    const auto [it, inserted] = table_of_.emplace(variant.key(), batch_.variants.size());
    if (inserted) {
      batch_.variants.push_back(variant);
      batch_.rows.emplace_back();
    }
    batch_.rows[it->second].push_back(row);
  }

  bool empty() const { return batch_.variants.empty(); }

  // Numbers the units of each table and hands the batch over.
  TableBatch finish() {
    for (std::vector<StepRow>& rows : batch_.rows) {
      int64_t units = 0;
      for (StepRow& row : rows) {
        row.first_unit = units;
        units += kernels::units_of(row.count);
      }
    }
    TableBatch out = std::move(batch_);
    batch_ = TableBatch{};
    table_of_.clear();
    return out;
  }

 private:
  TableBatch batch_;
  std::map<int, size_t> table_of_;
};

// `advanced`: a resumed step whose first attempt advanced the counters already.
std::vector<kernels::ScalarJob> scalar_jobs(const std::vector<ParamStep>& params,
                                            bool advanced) {
  std::vector<kernels::ScalarJob> jobs;
  jobs.reserve(params.size());
  for (const ParamStep& param : params) {
    jobs.push_back(kernels::ScalarJob{param.step, param.group, advanced ? 1 : 0});
  }
  return jobs;
}

// The variant of a parameter whose state kind has streams `k`, before its state format.
StepVariant variant_of(StepAlgorithm algorithm, const ParamStep& param, const KindStreams& k) {
  StepVariant variant;
  variant.algorithm = algorithm;
  variant.type = param.span.type;
  variant.residual_bits = uint8_t(k.residual >= 0 ? k.residual_bits : 0);
  variant.state = k.m.scales >= 0 ? StateFormat::kCompanded8 : StateFormat::kFloat32;
  return variant;
}

// Whether the vector bodies may run `row`: 8-bit state, and every pointer aligned for four
// elements per access (a param that is a view at an odd offset is not; its rows take the
// one-element-per-lane bodies).
bool vector_ready(const StepVariant& variant, const StepRow& row) {
  using kernels::table::vector_aligned;
  if (variant.state != StateFormat::kCompanded8) return false;
  const int64_t element_bytes = variant.type == kernels::ElementType::kFloat32 ? 4 : 2;
  bool aligned = vector_aligned(row.param, element_bytes) &&
                 vector_aligned(row.grad, element_bytes) &&
                 (row.residual == nullptr || vector_aligned(row.residual, variant.residual_bits / 8));
  for (const void* moment : row.moments) aligned = aligned && vector_aligned(moment, 1);
  return aligned;
}

// The row of the parameter's elements in `segment`, without state streams.
StepRow param_row(const ParamStep& param, size_t index, const paging::Segment& segment) {
  const kernels::ParamSpan span = chunk_span(param.span, segment, 0, segment.count);
  StepRow row;
  row.param = span.param;
  row.grad = span.grad;
  row.count = segment.count;
  row.scalars = int32_t(index);
  return row;
}

}  // namespace

void PagedState::note_counters(const TableRunner& runner) {
  journal_->counters_advanced = journal_->counters_advanced || runner.counters_advanced();
}

void PagedState::run_tables(const std::vector<ParamStep>& params, TableRunner& runner,
                            const RowFn& make_row,
                            std::vector<std::pair<StepVariant, StepRow>> extra) {
  const std::vector<int32_t> plan = plan_pages(params, journal_->planned);
  const size_t first_page = first_page_to_apply();
  std::vector<int32_t> position(size_t(table_.num_pages()), -1);
  for (size_t i = 0; i < plan.size(); ++i) position[size_t(plan[i])] = int32_t(i);
  if (journal_->unpaged_done) extra.clear();

  struct Piece {
    size_t param;
    paging::PagePiece piece;
  };
  std::vector<Piece> pieces;
  for (size_t p = 0; p < params.size(); ++p) {
    if (params[p].slot < 0) continue;
    for (const paging::PagePiece& piece : table_.param(params[p].slot).pieces) {
      if (size_t(position[size_t(piece.page)]) >= first_page) pieces.push_back(Piece{p, piece});
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [&](const Piece& a, const Piece& b) {
    return position[size_t(a.piece.page)] < position[size_t(b.piece.page)];
  });

  const size_t batch_pages = size_t(std::max<int32_t>(1, store_->pin_limit()));
  std::vector<std::byte*> page_bytes(size_t(table_.num_pages()), nullptr);
  size_t next_piece = 0;
  size_t batch_begin = first_page;
  size_t batch = 0;
  // One pass even without pages: parameters without state (plain SGD) still need a launch.
  do {
    if (batch++ > 0) at_batch_boundary(batch - 1);
    const size_t batch_end = std::min(plan.size(), batch_begin + batch_pages);
    pin_batch(plan, batch_begin, batch_end, page_bytes);
    BatchBuilder builder;
    for (const auto& [variant, row] : extra) builder.add(variant, row);
    extra.clear();
    for (; next_piece < pieces.size() &&
           size_t(position[size_t(pieces[next_piece].piece.page)]) < batch_end;
         ++next_piece) {
      const Piece& piece = pieces[next_piece];
      StepVariant variant;
      StepRow row;
      make_row(piece.param, table_.segment(piece.piece), page_bytes[size_t(piece.piece.page)],
               variant, row);
      variant.vector = vector_loads_ && vector_ready(variant, row);
      builder.add(variant, row);
    }
    // Unpinned as written whether or not the runner succeeds: a table that ran before a
    // failing one has changed its pages, and a page marked written is never lost. Such a
    // batch is neither applied nor untouched, so its step cannot be resumed.
    try {
      if (!builder.empty()) runner.run(builder.finish());
    } catch (...) {
      note_counters(runner);
      journal_->resumable = false;
      // The runner's error is the one to report: an unpin here may throw a store's pending
      // error (a write-back that failed earlier, counted in paging_stats()["write_errors"];
      // its page stayed in memory), which must not replace it.
      for (size_t i = batch_begin; i < batch_end; ++i) {
        try {
          store_->unpin(plan[i], /*dirty=*/true);
        } catch (...) {
        }
      }
      throw;
    }
    note_counters(runner);
    journal_->unpaged_done = true;
    journal_->pages_done = batch_end;
    unpin_written(plan, batch_begin, batch_end);
    batch_begin = batch_end;
  } while (batch_begin < plan.size());
}

void PagedState::step_adamw(const std::vector<ParamStep>& params,
                            const std::vector<AdamWGroup>& groups, TableRunner& runner) {
  check_adamw_params(params, groups);
  if (params.empty()) return;
  begin_step(StepCall::kTableAdamW, params);
  runner.prepare_adamw(scalar_jobs(params, journal_->counters_advanced), groups);
  run_tables(params, runner,
             [&](size_t p, const paging::Segment& segment, std::byte* page, StepVariant& variant,
                 StepRow& row) {
               const int kind = table_.param(params[p].slot).kind;
               const KindStreams& k = kind_streams_[size_t(kind)];
               const bool amsgrad = groups[size_t(params[p].group)].amsgrad;
               variant = variant_of(StepAlgorithm::kAdamW, params[p], k);
               variant.amsgrad = amsgrad;
               row = param_row(params[p], p, segment);
               const KindStreams::Moment* moments[3] = {&k.m, &k.v, amsgrad ? &k.v_max : nullptr};
               for (int j = 0; j < 3; ++j) {
                 if (moments[j] == nullptr) continue;
                 const kernels::MomentStream stream = moment_ptr(kind, *moments[j], page, segment, 0);
                 row.moments[j] = stream.values;
                 row.scales[j] = stream.scales;
               }
               row.residual = residual_ptr(kind, page, segment, 0).values;
             },
             {});
  finish_step();
}

void PagedState::step_sgd(const std::vector<ParamStep>& params,
                          const std::vector<SGDGroup>& groups, TableRunner& runner) {
  check_sgd_params(params, groups);
  if (params.empty()) return;
  begin_step(StepCall::kTableSGD, params);
  runner.prepare_sgd(scalar_jobs(params, journal_->counters_advanced), groups);
  // Parameters without state (momentum 0 and no master residual) have no pages: one row
  // each, over the whole parameter.
  std::vector<std::pair<StepVariant, StepRow>> stateless;
  for (size_t p = 0; p < params.size(); ++p) {
    if (params[p].slot >= 0) continue;
    StepVariant variant;
    variant.algorithm = StepAlgorithm::kSGD;
    variant.type = params[p].span.type;
    variant.state = StateFormat::kNone;
    const paging::Segment whole{-1, 0, params[p].span.count, 0};
    stateless.emplace_back(variant, param_row(params[p], p, whole));
  }
  run_tables(params, runner,
             [&](size_t p, const paging::Segment& segment, std::byte* page, StepVariant& variant,
                 StepRow& row) {
               const int kind = table_.param(params[p].slot).kind;
               const KindStreams& k = kind_streams_[size_t(kind)];
               const bool momentum = groups[size_t(params[p].group)].momentum != 0.0;
               variant = variant_of(StepAlgorithm::kSGD, params[p], k);
               if (!momentum) variant.state = StateFormat::kNone;
               row = param_row(params[p], p, segment);
               if (momentum) {
                 const kernels::MomentStream stream = moment_ptr(kind, k.m, page, segment, 0);
                 row.moments[0] = stream.values;
                 row.scales[0] = stream.scales;
               }
               row.residual = residual_ptr(kind, page, segment, 0).values;
             },
             std::move(stateless));
  finish_step();
}

void PagedState::step_lion(const std::vector<ParamStep>& params,
                           const std::vector<LionGroup>& groups, TableRunner& runner) {
  for (const ParamStep& param : params) check_param(param, groups.size());
  if (params.empty()) return;
  begin_step(StepCall::kTableLion, params);
  runner.prepare_lion(scalar_jobs(params, journal_->counters_advanced), groups);
  run_tables(params, runner,
             [&](size_t p, const paging::Segment& segment, std::byte* page, StepVariant& variant,
                 StepRow& row) {
               const int kind = table_.param(params[p].slot).kind;
               const KindStreams& k = kind_streams_[size_t(kind)];
               variant = variant_of(StepAlgorithm::kLion, params[p], k);
               row = param_row(params[p], p, segment);
               const kernels::MomentStream stream = moment_ptr(kind, k.m, page, segment, 0);
               row.moments[0] = stream.values;
               row.scales[0] = stream.scales;
               row.residual = residual_ptr(kind, page, segment, 0).values;
             },
             {});
  finish_step();
}

void PagedState::copy_stream_with(TableRunner& runner, int32_t slot, const std::string& stream,
                                  void* buffer, bool into_pages) {
  const int index = find_stream_of(slot, stream);
  const int kind = table_.param(slot).kind;
  const paging::StreamSpec& spec = table_.geometry(kind).streams()[size_t(index)];
  auto* cursor = static_cast<std::byte*>(buffer);
  for (const paging::PagePiece& piece : table_.param(slot).pieces) {
    const paging::Segment& segment = table_.segment(piece);
    const int64_t bytes = spec.bytes_for(segment.count);
    std::byte* page = store_->pin(piece.page);
    std::byte* in_page = page + stream_offset(kind, index, segment, 0);
    try {
      into_pages ? runner.copy(in_page, cursor, bytes) : runner.copy(cursor, in_page, bytes);
    } catch (...) {
      store_->unpin(piece.page, /*dirty=*/into_pages);
      throw;
    }
    store_->unpin(piece.page, /*dirty=*/into_pages);
    cursor += bytes;
  }
}

void PagedState::step_skewadam(const std::vector<SkewAdamParamStep>& params,
                               const std::vector<SkewAdamGroup>& groups, TableRunner& runner) {
  static const std::string kFactorStream = "exp_avg_sq_factors";
  check_skewadam_params(params, groups);
  if (params.empty()) return;
  std::vector<ParamStep> steps;
  steps.reserve(params.size());
  for (const SkewAdamParamStep& p : params) steps.push_back(p.step);
  begin_step(StepCall::kTableSkewAdam, steps);
  runner.prepare_skewadam(scalar_jobs(steps, journal_->counters_advanced), groups);

  // Phase 1: each factored parameter's running means, copied out of their pages into
  // scratch next to its coefficients, through the statistics kernels. The scratch lives
  // as long as this call, so a resumed step computes them again; that gives the same bits
  // because the new means go back into the pages only after phase 2 (the pages still hold
  // the old ones), and only those of parameters not yet written back.
  size_t factored = 0;
  std::vector<bool> rewrite(params.size(), false);
  std::vector<const float*> coefficients(params.size(), nullptr);
  std::vector<float*> factors(params.size(), nullptr);
  std::vector<kernels::FactorMatrix> matrices;
  int64_t first_row = 0;
  int64_t first_col = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const SkewAdamParamStep& p = params[i];
    if (p.factor_slot < 0 || factored++ < journal_->factors_written) continue;
    rewrite[i] = true;
    const int64_t lines = p.experts * (p.rows + p.cols);
    factors[i] = static_cast<float*>(runner.scratch(lines * int64_t(sizeof(float))));
    auto* coef = static_cast<float*>(runner.scratch(lines * int64_t(sizeof(float))));
    auto* terms = static_cast<double*>(runner.scratch(p.experts * p.cols * int64_t(sizeof(double))));
    auto* norms = static_cast<float*>(runner.scratch(p.experts * 2 * int64_t(sizeof(float))));
    coefficients[i] = coef;
    copy_stream_with(runner, p.factor_slot, kFactorStream, factors[i], /*into_pages=*/false);
    const int64_t all_rows = p.experts * p.rows;
    const int64_t matrix_bytes = p.rows * p.cols * element_size(p.step.span.type);
    for (int64_t e = 0; e < p.experts; ++e) {
      kernels::FactorMatrix m;
      m.grad = static_cast<const char*>(p.step.span.grad) + e * matrix_bytes;
      m.type = p.step.span.type;
      m.rows = p.rows;
      m.cols = p.cols;
      m.row_means = factors[i] + e * p.rows;
      m.col_means = factors[i] + all_rows + e * p.cols;
      m.row_coef = coef + e * p.rows;
      m.col_coef = coef + all_rows + e * p.cols;
      m.col_terms = terms + e * p.cols;
      m.norm_and_clip = norms + 2 * e;
      m.first_row = first_row;
      m.first_col = first_col;
      m.scalars = int32_t(i);
      first_row += p.rows;
      first_col += p.cols;
      matrices.push_back(m);
    }
  }
  if (!matrices.empty()) {
    try {
      runner.run_statistics(matrices);
    } catch (...) {
      note_counters(runner);
      throw;
    }
    note_counters(runner);
  }

  // Phase 2: the elementwise tables. Factored parameters without per-element state (the
  // experts tier in fp32) have no pages: one row each over the whole parameter.
  auto factored_row = [&](size_t i, StepRow& row, int64_t first_element) {
    const SkewAdamParamStep& p = params[i];
    row.row_coef = coefficients[i];
    row.col_coef = coefficients[i] + p.experts * p.rows;
    row.rows = p.rows;
    row.cols = p.cols;
    row.first_element = first_element;
  };
  std::vector<std::pair<StepVariant, StepRow>> unpaged;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].step.slot >= 0) continue;
    StepVariant variant;
    variant.algorithm = StepAlgorithm::kSkewAdamFactored;
    variant.type = params[i].step.span.type;
    variant.state = StateFormat::kNone;
    const paging::Segment whole{-1, 0, params[i].step.span.count, 0};
    StepRow row = param_row(params[i].step, i, whole);
    factored_row(i, row, 0);
    unpaged.emplace_back(variant, row);
  }
  run_tables(steps, runner,
             [&](size_t i, const paging::Segment& segment, std::byte* page, StepVariant& variant,
                 StepRow& row) {
               const SkewAdamParamStep& p = params[i];
               const int kind = table_.param(p.step.slot).kind;
               const KindStreams& k = kind_streams_[size_t(kind)];
               const bool factored = p.factor_slot >= 0;
               variant = variant_of(factored ? StepAlgorithm::kSkewAdamFactored
                                             : StepAlgorithm::kSkewAdamExact,
                                    p.step, k);
               if (!p.momentum) variant.state = StateFormat::kNone;
               row = param_row(p.step, i, segment);
               if (p.momentum) {
                 const kernels::MomentStream m = moment_ptr(kind, k.m, page, segment, 0);
                 row.moments[0] = m.values;
                 row.scales[0] = m.scales;
               }
               if (factored) {
                 factored_row(i, row, segment.param_offset);
               } else {
                 row.moments[1] = stream_ptr(kind, k.v.values, page, segment, 0);
               }
               row.residual = residual_ptr(kind, page, segment, 0).values;
             },
             std::move(unpaged));

  // The new running means. A write that raised after the first page of a parameter
  // whose means span several pages left them half new: not resumable.
  for (size_t i = 0; i < params.size(); ++i) {
    if (!rewrite[i]) continue;
    try {
      copy_stream_with(runner, params[i].factor_slot, kFactorStream, factors[i],
                       /*into_pages=*/true);
    } catch (...) {
      if (table_.param(params[i].factor_slot).pieces.size() > 1) journal_->resumable = false;
      throw;
    }
    ++journal_->factors_written;
  }
  finish_step();
}

}  // namespace pagedoptim::optim
