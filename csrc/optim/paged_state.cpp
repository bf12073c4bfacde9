#include "pagedoptim/optim/paged_state.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "optim/param_chunks.h"
#include "pagedoptim/common.h"

namespace pagedoptim::optim {
namespace {

// Elements a parallel work item covers: large enough to amortize the scheduling, small
// enough that two cores balance on a few-MiB parameter. A multiple of kGroupSize so that
// chunks of quantized streams start on group boundaries.
constexpr int64_t kChunkElements = 32 * 1024;
static_assert(kChunkElements % kGroupSize == 0);


struct WorkItem {
  int32_t param;    // index into the call's params
  int32_t page;
  const paging::Segment* segment;
  int64_t begin;    // element offset inside the segment
  int64_t count;
};

}  // namespace

namespace {

std::vector<paging::PageGeometry> make_geometries(
    std::vector<std::vector<paging::StreamSpec>> kinds, int64_t page_bytes) {
  if (kinds.empty()) kinds.emplace_back();
  std::vector<paging::PageGeometry> geometries;
  for (auto& streams : kinds) geometries.emplace_back(std::move(streams), page_bytes);
  return geometries;
}

KindStreams resolve_streams(const paging::PageGeometry& geometry, OptimizerKind kind) {
  auto moment = [&](const std::string& name) {
    KindStreams::Moment m;
    m.values = geometry.find_stream(name);
    if (m.values < 0) {
      m.values = geometry.find_stream(name + "_codes");
      m.scales = geometry.find_stream(name + "_scales");
      if ((m.values < 0) != (m.scales < 0)) {
        throw std::invalid_argument("stream " + name + "_codes needs " + name +
                                    "_scales and the reverse");
      }
    }
    return m;
  };
  KindStreams k;
  if (kind == OptimizerKind::kAdamW) {
    k.m = moment("exp_avg");
    k.v = moment("exp_avg_sq");
    k.v_max = moment("max_exp_avg_sq");
    if (geometry.num_streams() > 0 && (k.m.values < 0 || k.v.values < 0)) {
      throw std::invalid_argument("AdamW state needs exp_avg and exp_avg_sq streams");
    }
    if ((k.m.scales < 0) != (k.v.scales < 0) ||
        (k.v_max.values >= 0 && (k.v_max.scales < 0) != (k.m.scales < 0))) {
      throw std::invalid_argument("AdamW moments must all be fp32 or all be companded");
    }
  } else if (kind == OptimizerKind::kSkewAdam) {
    // Any subset: a kind per tier and rank, see SkewAdamParamStep.
    k.m = moment("exp_avg");
    k.v.values = geometry.find_stream("exp_avg_sq");
    k.factors = geometry.find_stream("exp_avg_sq_factors");
  } else {
    k.m = moment(kind == OptimizerKind::kSGD ? "momentum_buffer" : "exp_avg");
    if (kind == OptimizerKind::kLion && geometry.num_streams() > 0 && k.m.values < 0) {
      throw std::invalid_argument("Lion state needs an exp_avg stream");
    }
  }
  k.residual = geometry.find_stream("master_residual");
  if (k.residual >= 0) {
    const int64_t bytes_per_group = geometry.streams()[size_t(k.residual)].bytes_per_group;
    if (bytes_per_group != kGroupSize && bytes_per_group != 2 * kGroupSize) {
      throw std::invalid_argument("master_residual must be int8 or int16");
    }
    k.residual_bits = int(bytes_per_group / kGroupSize) * 8;
  }
  return k;
}

}  // namespace

PagedState::PagedState(OptimizerKind kind, std::vector<std::vector<paging::StreamSpec>> kinds,
                       std::unique_ptr<paging::PageStore> store)
    : kind_(kind),
      stateless_(std::all_of(kinds.begin(), kinds.end(),
                             [](const auto& streams) { return streams.empty(); })),
      table_(make_geometries(std::move(kinds), store->page_bytes())),
      store_(std::move(store)) {
  for (int k = 0; k < table_.num_kinds(); ++k) {
    kind_streams_.push_back(resolve_streams(table_.geometry(k), kind_));
  }
}

int32_t PagedState::register_param(int64_t numel, int kind, int64_t row_length) {
  if (stateless_) {
    throw std::logic_error("this optimizer keeps no state; nothing to register");
  }
  // The store may fail to provide the new pages (a full device, a full disk): the table
  // then forgets the parameter again, so a retry lays it out afresh instead of leaving
  // pages behind that no parameter uses.
  paging::PageTable before = table_;
  const int32_t slot = table_.add_param(numel, kind, row_length);
  try {
    store_->grow(table_.num_pages());
  } catch (...) {
    table_ = std::move(before);
    throw;
  }
  return slot;
}

int64_t PagedState::stream_offset(int kind, int stream, const paging::Segment& segment,
                                  int64_t begin) const {
  const paging::PageGeometry& geometry = table_.geometry(kind);
  return geometry.stream_offset(stream) +
         geometry.streams()[size_t(stream)].offset_of(segment.page_offset + begin);
}

void* PagedState::stream_ptr(int kind, int stream, std::byte* page,
                             const paging::Segment& segment, int64_t begin) const {
  if (stream < 0) return nullptr;
  return page + stream_offset(kind, stream, segment, begin);
}

kernels::MomentStream PagedState::moment_ptr(int kind, const KindStreams::Moment& moment,
                                             std::byte* page, const paging::Segment& segment,
                                             int64_t begin) const {
  return kernels::MomentStream{
      stream_ptr(kind, moment.values, page, segment, begin),
      static_cast<uint16_t*>(stream_ptr(kind, moment.scales, page, segment, begin))};
}

kernels::MasterResidual PagedState::residual_ptr(int kind, std::byte* page,
                                                 const paging::Segment& segment,
                                                 int64_t begin) const {
  const KindStreams& k = kind_streams_[size_t(kind)];
  return kernels::MasterResidual{stream_ptr(kind, k.residual, page, segment, begin),
                                 k.residual_bits};
}

void PagedState::check_param(const ParamStep& param, size_t num_groups) const {
  if (param.group < 0 || size_t(param.group) >= num_groups) {
    throw std::out_of_range("group index " + std::to_string(param.group) + " out of range");
  }
  if (param.step == nullptr) throw std::invalid_argument("step counter must not be null");
  // Only SGD has stateless parameters (momentum 0, no master residual); they have no slot.
  if (stateless_ || (kind_ == OptimizerKind::kSGD && param.slot < 0)) return;
  if (param.slot < 0 || param.slot >= table_.num_params()) {
    throw std::out_of_range("parameter slot " + std::to_string(param.slot) + " is not registered");
  }
  const paging::ParamLayout& layout = table_.param(param.slot);
  if (layout.numel != param.span.count) {
    throw std::invalid_argument("parameter in slot " + std::to_string(param.slot) + " has " +
                                std::to_string(param.span.count) + " elements, its state has " +
                                std::to_string(layout.numel));
  }
  const KindStreams& k = kind_streams_[size_t(layout.kind)];
  if (k.residual >= 0 && param.span.type == kernels::ElementType::kFloat32) {
    throw std::invalid_argument("parameter in slot " + std::to_string(param.slot) +
                                " is float32 but its state kind carries a master residual");
  }
}

std::vector<int32_t> PagedState::plan_pages(const std::vector<ParamStep>& params,
                                            bool resuming) {
  if (resuming) {
    // The interrupted step's own plan, direction included; the store learns only the pages
    // still to apply, so it neither prefetches nor keeps the applied ones for this step.
    const std::vector<int32_t>& plan = journal_->plan;
    store_->plan(std::vector<int32_t>(plan.begin() + std::ptrdiff_t(journal_->pages_done),
                                      plan.end()));
    return plan;
  }
  // The plan: every page that holds a segment of a parameter stepped now, in page order
  // (registration order, so consecutive parameters share pages and cache lines). Every
  // other step walks it backwards: the pages used last in one step are the first ones
  // needed in the next, so a store that cannot hold everything finds them still resident.
  std::vector<int32_t> plan;
  for (const ParamStep& param : params) {
    if (param.slot < 0) continue;  // stateless SGD: no pages
    for (const paging::PagePiece& piece : table_.param(param.slot).pieces) {
      plan.push_back(piece.page);
    }
  }
  std::sort(plan.begin(), plan.end());
  plan.erase(std::unique(plan.begin(), plan.end()), plan.end());
  if (steps_taken_++ % 2 == 1) std::reverse(plan.begin(), plan.end());
  journal_->plan = plan;
  journal_->planned = true;
  store_->plan(plan);
  return plan;
}

std::optional<InterruptedStep> PagedState::interrupted_step() const {
  if (!journal_) return std::nullopt;
  return InterruptedStep{int64_t(journal_->pages_done), int64_t(journal_->plan.size()),
                         journal_->resumable, journal_->complete};
}

bool PagedState::begin_step(StepCall call, const std::vector<ParamStep>& params) {
  const bool resume = std::exchange(resume_requested_, false);
  deferred_error_ = nullptr;
  std::vector<std::array<int64_t, 3>> signature;
  signature.reserve(params.size());
  for (const ParamStep& p : params) signature.push_back({p.slot, p.group, p.span.count});
  if (!resume) {
    if (journal_ && !journal_->complete) {
      throw std::logic_error(
          "the last step was interrupted after " + std::to_string(journal_->pages_done) +
          " of " + std::to_string(journal_->plan.size()) + " pages: resume it "
          "(resume_next_step) or discard it (discard_interrupted_step) before a new step");
    }
    journal_ = StepJournal{call, std::move(signature), {}};
    return false;
  }
  if (!journal_) throw std::logic_error("resume_next_step: no interrupted step to resume");
  if (!journal_->resumable) {
    throw std::logic_error("the interrupted step cannot be resumed: a batch failed half run "
                           "(a device error); discard it or load a checkpoint");
  }
  if (journal_->call != call || journal_->signature != signature) {
    throw std::invalid_argument("resume_next_step: this step's parameters, slots or groups "
                                "differ from the interrupted step's");
  }
  return true;
}

void PagedState::finish_step() {
  if (deferred_error_) {
    journal_->complete = true;
    std::rethrow_exception(std::exchange(deferred_error_, nullptr));
  }
  journal_.reset();
}

void PagedState::unpin_written(const std::vector<int32_t>& plan, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    try {
      store_->unpin(plan[i], /*dirty=*/true);
    } catch (...) {
      if (!deferred_error_) deferred_error_ = std::current_exception();
    }
  }
}

void PagedState::at_batch_boundary(size_t batch) {
  if (!batch_hook_) return;
  try {
    batch_hook_(batch);
  } catch (...) {
    // Nothing is pinned; the rest of the plan is not coming in this call.
    store_->plan({});
    throw;
  }
}

void PagedState::check_adamw_params(const std::vector<ParamStep>& params,
                                    const std::vector<AdamWGroup>& groups) const {
  for (const ParamStep& param : params) {
    check_param(param, groups.size());
    const KindStreams& k = kind_streams_[size_t(table_.param(param.slot).kind)];
    if (groups[size_t(param.group)].amsgrad && k.v_max.values < 0) {
      throw std::invalid_argument(
          "amsgrad was turned on after the first step; the state has no max_exp_avg_sq");
    }
  }
}

void PagedState::check_sgd_params(const std::vector<ParamStep>& params,
                                  const std::vector<SGDGroup>& groups) const {
  for (const ParamStep& param : params) {
    check_param(param, groups.size());
    if (groups[size_t(param.group)].momentum != 0.0 &&
        (param.slot < 0 || kind_streams_[size_t(table_.param(param.slot).kind)].m.values < 0)) {
      throw std::invalid_argument(
          "momentum was turned on after the first step; the state has no momentum_buffer");
    }
  }
}

void PagedState::pin_batch(const std::vector<int32_t>& plan, size_t begin, size_t end,
                           std::vector<std::byte*>& pages) {
  size_t pinned = begin;
  try {
    for (; pinned < end; ++pinned) pages[size_t(plan[pinned])] = store_->pin(plan[pinned]);
  } catch (...) {
    for (size_t i = begin; i < pinned; ++i) store_->unpin(plan[i], /*dirty=*/false);
    throw;
  }
}

template <class Apply>
void PagedState::for_each_chunk(const std::vector<ParamStep>& params,
                                const ParallelFor& parallel_for, const Apply& apply) {
  const std::vector<int32_t> plan = plan_pages(params, journal_->planned);
  const size_t first_page = first_page_to_apply();
  std::vector<int32_t> position(size_t(table_.num_pages()), -1);
  for (size_t i = 0; i < plan.size(); ++i) position[size_t(plan[i])] = int32_t(i);

  std::vector<WorkItem> items;
  for (size_t p = 0; p < params.size(); ++p) {
    for (const paging::PagePiece& piece : table_.param(params[p].slot).pieces) {
      if (size_t(position[size_t(piece.page)]) < first_page) continue;  // applied already
      const paging::Segment& segment = table_.segment(piece);
      for (int64_t begin = 0; begin < segment.count; begin += kChunkElements) {
        items.push_back(WorkItem{int32_t(p), piece.page, &segment, begin,
                                 std::min(kChunkElements, segment.count - begin)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return position[size_t(a.page)] < position[size_t(b.page)];
  });

  // Batches of as many pages as the store lets us pin at once (all of them for a store
  // that holds everything): pin the batch, run its chunks in parallel, unpin it as written.
  // A failed pin unpins the batch's pages unchanged, so the store never sees a page marked
  // written that was not; batches before it stay applied, and the journal says how many
  // pages that is, so a resumed step starts at the first page not applied.
  const size_t batch_pages = size_t(std::max<int32_t>(1, store_->pin_limit()));
  std::vector<std::byte*> page_bytes(size_t(table_.num_pages()), nullptr);
  size_t next_item = 0;
  size_t batch = 0;
  for (size_t batch_begin = first_page; batch_begin < plan.size();
       batch_begin += batch_pages, ++batch) {
    if (batch > 0) at_batch_boundary(batch);
    const size_t batch_end = std::min(plan.size(), batch_begin + batch_pages);
    pin_batch(plan, batch_begin, batch_end, page_bytes);
    size_t items_end = next_item;
    while (items_end < items.size() &&
           size_t(position[size_t(items[items_end].page)]) < batch_end) {
      ++items_end;
    }
    const size_t first_item = next_item;
    parallel_for(int64_t(items_end - first_item), [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const WorkItem& item = items[first_item + size_t(i)];
        apply(size_t(item.param), *item.segment, page_bytes[size_t(item.page)], item.begin,
              item.count);
      }
    });
    next_item = items_end;
    journal_->pages_done = batch_end;
    unpin_written(plan, batch_begin, batch_end);
  }
}

void PagedState::for_each_chunk_of(const std::vector<ParamStep>& params,
                                   const ParallelFor& parallel_for, const ChunkFn& apply) {
  for_each_chunk(params, parallel_for, apply);
}


void PagedState::step_adamw(const std::vector<ParamStep>& params,
                            const std::vector<AdamWGroup>& groups,
                            const ParallelFor& parallel_for) {
  check_adamw_params(params, groups);
  // A resumed step finds its counters advanced already.
  const bool resuming = begin_step(StepCall::kAdamW, params);
  std::vector<codec::AdamWScalars> scalars;
  scalars.reserve(params.size());
  for (const ParamStep& param : params) {
    const AdamWGroup& g = groups[size_t(param.group)];
    if (!resuming) *param.step += 1.0f;
    scalars.push_back(codec::make_adamw_scalars(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
                                                (long long)(*param.step), g.maximize));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  for_each_chunk(params, parallel_for,
                 [&](size_t p, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   const int kind = table_.param(params[p].slot).kind;
                   const KindStreams& k = kind_streams_[size_t(kind)];
                   kernels::AdamWStreams streams;
                   streams.m = moment_ptr(kind, k.m, page, segment, begin);
                   streams.v = moment_ptr(kind, k.v, page, segment, begin);
                   if (groups[size_t(params[p].group)].amsgrad) {
                     streams.v_max = moment_ptr(kind, k.v_max, page, segment, begin);
                   }
                   streams.residual = residual_ptr(kind, page, segment, begin);
                   kernel.adamw(chunk_span(params[p].span, segment, begin, count), streams,
                                scalars[p]);
                 });
  finish_step();
}

void PagedState::step_sgd(const std::vector<ParamStep>& params,
                          const std::vector<SGDGroup>& groups,
                          const ParallelFor& parallel_for) {
  check_sgd_params(params, groups);
  const bool resuming = begin_step(StepCall::kSGD, params);
  std::vector<codec::SGDScalars> scalars;
  scalars.reserve(params.size());
  for (const ParamStep& param : params) {
    const SGDGroup& g = groups[size_t(param.group)];
    // A resumed step finds its counter advanced already.
    const bool first_step = *param.step == (resuming ? 1.0f : 0.0f);
    if (!resuming) *param.step += 1.0f;
    scalars.push_back(codec::make_sgd_scalars(g.lr, g.momentum, g.dampening, g.weight_decay,
                                              g.nesterov, g.maximize, first_step));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  // Parameters without state (momentum 0 and no master residual) have no slot and no
  // pages: their chunks are cut from the parameters directly.
  std::vector<ParamStep> paged;
  std::vector<size_t> paged_index;
  std::vector<std::pair<size_t, int64_t>> items;
  for (size_t p = 0; p < params.size(); ++p) {
    if (params[p].slot >= 0) {
      paged.push_back(params[p]);
      paged_index.push_back(p);
      continue;
    }
    for (int64_t begin = 0; begin < params[p].span.count; begin += kChunkElements) {
      items.emplace_back(p, begin);
    }
  }
  if (!items.empty() && !journal_->unpaged_done) {
    parallel_for(int64_t(items.size()), [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const auto [p, begin] = items[size_t(i)];
        const paging::Segment whole{params[p].slot, 0, params[p].span.count, 0};
        kernel.sgd(chunk_span(params[p].span, whole, begin,
                              std::min(kChunkElements, params[p].span.count - begin)),
                   kernels::MomentumStreams{}, scalars[p]);
      }
    });
  }
  journal_->unpaged_done = true;
  if (paged.empty()) {
    finish_step();
    return;
  }
  for_each_chunk(paged, parallel_for,
                 [&](size_t q, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   const size_t p = paged_index[q];
                   const int kind = table_.param(params[p].slot).kind;
                   kernels::MomentumStreams streams;
                   if (groups[size_t(params[p].group)].momentum != 0.0) {
                     streams.m = moment_ptr(kind, kind_streams_[size_t(kind)].m, page, segment,
                                            begin);
                   }
                   streams.residual = residual_ptr(kind, page, segment, begin);
                   kernel.sgd(chunk_span(params[p].span, segment, begin, count), streams,
                              scalars[p]);
                 });
  finish_step();
}

void PagedState::step_lion(const std::vector<ParamStep>& params,
                           const std::vector<LionGroup>& groups,
                           const ParallelFor& parallel_for) {
  for (const ParamStep& param : params) check_param(param, groups.size());
  const bool resuming = begin_step(StepCall::kLion, params);
  std::vector<codec::LionScalars> scalars;
  scalars.reserve(params.size());
  for (const ParamStep& param : params) {
    const LionGroup& g = groups[size_t(param.group)];
    if (!resuming) *param.step += 1.0f;
    scalars.push_back(
        codec::make_lion_scalars(g.lr, g.beta1, g.beta2, g.weight_decay, g.maximize));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  for_each_chunk(params, parallel_for,
                 [&](size_t p, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   const int kind = table_.param(params[p].slot).kind;
                   kernels::MomentumStreams streams;
                   streams.m = moment_ptr(kind, kind_streams_[size_t(kind)].m, page, segment,
                                          begin);
                   streams.residual = residual_ptr(kind, page, segment, begin);
                   kernel.lion(chunk_span(params[p].span, segment, begin, count), streams,
                               scalars[p]);
                 });
  finish_step();
}

int PagedState::find_stream_of(int32_t slot, const std::string& stream) const {
  if (slot < 0 || slot >= table_.num_params()) {
    throw std::out_of_range("parameter slot " + std::to_string(slot) + " is not registered");
  }
  const int index = table_.geometry(table_.param(slot).kind).find_stream(stream);
  if (index < 0) {
    throw std::out_of_range("parameter slot " + std::to_string(slot) + " has no stream '" +
                            stream + "'");
  }
  return index;
}

int64_t PagedState::stream_bytes(int32_t slot, const std::string& stream) const {
  const int index = find_stream_of(slot, stream);
  const paging::ParamLayout& layout = table_.param(slot);
  const paging::StreamSpec& spec = table_.geometry(layout.kind).streams()[size_t(index)];
  int64_t bytes = 0;
  for (const paging::PagePiece& piece : layout.pieces) {
    bytes += spec.bytes_for(table_.segment(piece).count);
  }
  return bytes;
}

void PagedState::for_each_piece_of_range(int32_t slot, const std::string& stream,
                                         int64_t offset, int64_t bytes,
                                         const PieceCopy& copy) const {
  const int index = find_stream_of(slot, stream);
  const int64_t total = stream_bytes(slot, stream);
  if (offset < 0 || bytes < 0 || offset > total || bytes > total - offset) {
    throw std::out_of_range("bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset) + " + " + std::to_string(bytes) +
                            ") are not inside stream '" + stream + "' of parameter slot " +
                            std::to_string(slot) + " (" + std::to_string(total) + " bytes)");
  }
  const int kind = table_.param(slot).kind;
  const paging::StreamSpec& spec = table_.geometry(kind).streams()[size_t(index)];
  // The stream's bytes in element order are its pieces' bytes one after the other.
  int64_t piece_begin = 0;
  for (const paging::PagePiece& piece : table_.param(slot).pieces) {
    if (piece_begin >= offset + bytes) break;
    const paging::Segment& segment = table_.segment(piece);
    const int64_t piece_end = piece_begin + spec.bytes_for(segment.count);
    const int64_t first = std::max(offset, piece_begin);
    const int64_t last = std::min(offset + bytes, piece_end);
    if (first < last) {
      copy(piece.page, stream_offset(kind, index, segment, 0) + (first - piece_begin),
           first - offset, last - first);
    }
    piece_begin = piece_end;
  }
}

void PagedState::read_stream_range(int32_t slot, const std::string& stream, int64_t offset,
                                   int64_t bytes, void* out) {
  char* base = static_cast<char*>(out);
  for_each_piece_of_range(slot, stream, offset, bytes,
                          [&](int32_t page, int64_t page_offset, int64_t at, int64_t n) {
                            store_->read_bytes(page, page_offset, base + at, n);
                          });
}

void PagedState::write_stream_range(int32_t slot, const std::string& stream, int64_t offset,
                                    int64_t bytes, const void* in) {
  const char* base = static_cast<const char*>(in);
  for_each_piece_of_range(slot, stream, offset, bytes,
                          [&](int32_t page, int64_t page_offset, int64_t at, int64_t n) {
                            store_->write_bytes(page, page_offset, base + at, n);
                          });
}

void PagedState::plan_stream_ranges(const std::vector<StreamRange>& ranges) {
  // read/write_stream_range pin once per piece (PageStore::read_bytes and write_bytes), so
  // the pieces' pages are the order of their pins. A pin of the page just pinned does not
  // move the plan on (PlanTracker::advance_if_next), so such repeats are left out: they
  // would only narrow the prefetch window, which counts plan positions.
  std::vector<int32_t> pins;
  for (const StreamRange& range : ranges) {
    for_each_piece_of_range(range.slot, range.stream, range.offset, range.bytes,
                            [&](int32_t page, int64_t, int64_t, int64_t) {
                              if (pins.empty() || pins.back() != page) pins.push_back(page);
                            });
  }
  store_->plan_copies(pins);
}

void PagedState::read_stream(int32_t slot, const std::string& stream, void* out) {
  read_stream_range(slot, stream, 0, stream_bytes(slot, stream), out);
}

void PagedState::write_stream(int32_t slot, const std::string& stream, const void* in) {
  write_stream_range(slot, stream, 0, stream_bytes(slot, stream), in);
}

MemoryUsage PagedState::memory_usage() const {
  MemoryUsage usage{};
  usage.num_pages = table_.num_pages();
  usage.num_params = table_.num_params();
  usage.state_bytes = int64_t(store_->num_pages()) * store_->page_bytes();
  usage.resident_bytes = store_->resident_bytes();
  for (int32_t slot = 0; slot < table_.num_params(); ++slot) {
    for (const paging::StreamSpec& spec : table_.geometry(table_.param(slot).kind).streams()) {
      usage.payload_bytes += stream_bytes(slot, spec.name);
    }
  }
  return usage;
}

}  // namespace pagedoptim::optim
