#include "pagedoptim/optim/paged_state.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"

namespace pagedoptim::optim {
namespace {

// Elements a parallel work item covers: large enough to amortize the scheduling, small
// enough that two cores balance on a few-MiB parameter. A multiple of kGroupSize so that
// chunks of quantized streams start on group boundaries.
constexpr int64_t kChunkElements = 32 * 1024;
static_assert(kChunkElements % kGroupSize == 0);

int64_t element_size(kernels::ElementType type) {
  return type == kernels::ElementType::kFloat32 ? 4 : 2;
}

struct WorkItem {
  int32_t param;    // index into the call's params
  int32_t page;
  const paging::Segment* segment;
  int64_t begin;    // element offset inside the segment
  int64_t count;
};

}  // namespace

PagedState::PagedState(OptimizerKind kind, std::vector<paging::StreamSpec> streams,
                       std::unique_ptr<paging::PageStore> store)
    : kind_(kind),
      table_(paging::PageGeometry(std::move(streams), store->page_bytes())),
      store_(std::move(store)) {}

int32_t PagedState::register_param(int64_t numel) {
  if (table_.geometry().num_streams() == 0) {
    // Stateless (plain SGD): slots exist so callers need no special case, pages do not.
    throw std::logic_error("this optimizer keeps no state; nothing to register");
  }
  const int32_t slot = table_.add_param(numel);
  store_->grow(table_.num_pages());
  return slot;
}

void PagedState::check_param(const ParamStep& param, size_t num_groups) const {
  if (param.group < 0 || size_t(param.group) >= num_groups) {
    throw std::out_of_range("group index " + std::to_string(param.group) + " out of range");
  }
  if (param.step == nullptr) throw std::invalid_argument("step counter must not be null");
  if (table_.geometry().num_streams() == 0) return;
  if (param.slot < 0 || param.slot >= table_.num_params()) {
    throw std::out_of_range("parameter slot " + std::to_string(param.slot) + " is not registered");
  }
  if (table_.param(param.slot).numel != param.span.count) {
    throw std::invalid_argument("parameter in slot " + std::to_string(param.slot) + " has " +
                                std::to_string(param.span.count) + " elements, its state has " +
                                std::to_string(table_.param(param.slot).numel));
  }
}

template <class Apply>
void PagedState::for_each_chunk(const std::vector<ParamStep>& params,
                                const ParallelFor& parallel_for, const Apply& apply) {
  // The plan: every page that holds a segment of a parameter stepped now, in page order
  // (which is registration order, so consecutive parameters share pages and cache lines).
  std::vector<int32_t> plan;
  for (const ParamStep& param : params) {
    for (const paging::PagePiece& piece : table_.param(param.slot).pieces) {
      plan.push_back(piece.page);
    }
  }
  std::sort(plan.begin(), plan.end());
  plan.erase(std::unique(plan.begin(), plan.end()), plan.end());
  store_->plan(plan);

  std::vector<WorkItem> items;
  for (size_t p = 0; p < params.size(); ++p) {
    for (const paging::PagePiece& piece : table_.param(params[p].slot).pieces) {
      const paging::Segment& segment = table_.segment(piece);
      for (int64_t begin = 0; begin < segment.count; begin += kChunkElements) {
        items.push_back(WorkItem{int32_t(p), piece.page, &segment, begin,
                                 std::min(kChunkElements, segment.count - begin)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.page < b.page; });

  // Pin the whole plan for the duration of the kernels; on failure unpin what was pinned,
  // unchanged, so the store never sees a page marked written that was not.
  std::vector<std::byte*> page_bytes(size_t(table_.num_pages()), nullptr);
  size_t pinned = 0;
  try {
    for (; pinned < plan.size(); ++pinned) {
      page_bytes[size_t(plan[pinned])] = store_->pin(plan[pinned]);
    }
  } catch (...) {
    for (size_t i = 0; i < pinned; ++i) store_->unpin(plan[i], /*dirty=*/false);
    throw;
  }
  parallel_for(int64_t(items.size()), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const WorkItem& item = items[size_t(i)];
      apply(size_t(item.param), *item.segment, page_bytes[size_t(item.page)], item.begin,
            item.count);
    }
  });
  for (int32_t page : plan) store_->unpin(page, /*dirty=*/true);
}

namespace {

// The parameter/gradient elements of a chunk of a segment.
kernels::ParamSpan chunk_span(const kernels::ParamSpan& whole, const paging::Segment& segment,
                              int64_t begin, int64_t count) {
  const int64_t offset = (segment.param_offset + begin) * element_size(whole.type);
  return kernels::ParamSpan{static_cast<char*>(whole.param) + offset,
                            static_cast<const char*>(whole.grad) + offset, count, whole.type};
}

}  // namespace

void PagedState::step_adamw(const std::vector<ParamStep>& params,
                            const std::vector<AdamWGroup>& groups,
                            const ParallelFor& parallel_for) {
  const bool has_max_stream = table_.geometry().num_streams() >= 3;
  std::vector<codec::AdamWScalars> scalars;
  scalars.reserve(params.size());
  for (const ParamStep& param : params) {
    check_param(param, groups.size());
    const AdamWGroup& g = groups[size_t(param.group)];
    if (g.amsgrad && !has_max_stream) {
      throw std::invalid_argument(
          "amsgrad was turned on after the first step; the state has no max_exp_avg_sq");
    }
  }
  for (const ParamStep& param : params) {
    const AdamWGroup& g = groups[size_t(param.group)];
    *param.step += 1.0f;
    scalars.push_back(codec::make_adamw_scalars(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay,
                                                long(*param.step), g.maximize));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  for_each_chunk(params, parallel_for,
                 [&](size_t p, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   const bool amsgrad = groups[size_t(params[p].group)].amsgrad;
                   kernel.adamw_fp32_state(
                       chunk_span(params[p].span, segment, begin, count),
                       stream_ptr<float>(0, page, segment, begin),
                       stream_ptr<float>(1, page, segment, begin),
                       amsgrad ? stream_ptr<float>(2, page, segment, begin) : nullptr,
                       scalars[p]);
                 });
}

void PagedState::step_sgd(const std::vector<ParamStep>& params,
                          const std::vector<SGDGroup>& groups,
                          const ParallelFor& parallel_for) {
  std::vector<codec::SGDScalars> scalars;
  scalars.reserve(params.size());
  const bool has_buffer = table_.geometry().num_streams() >= 1;
  for (const ParamStep& param : params) {
    check_param(param, groups.size());
    if (groups[size_t(param.group)].momentum != 0.0 && !has_buffer) {
      throw std::invalid_argument(
          "momentum was turned on after the first step; the state has no momentum_buffer");
    }
  }
  for (const ParamStep& param : params) {
    const SGDGroup& g = groups[size_t(param.group)];
    const bool first_step = *param.step == 0.0f;
    *param.step += 1.0f;
    scalars.push_back(codec::make_sgd_scalars(g.lr, g.momentum, g.dampening, g.weight_decay,
                                              g.nesterov, g.maximize, first_step));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  if (!has_buffer) {
    // Stateless: no pages, so the chunks are cut from the parameters directly.
    std::vector<std::pair<size_t, int64_t>> items;
    for (size_t p = 0; p < params.size(); ++p) {
      for (int64_t begin = 0; begin < params[p].span.count; begin += kChunkElements) {
        items.emplace_back(p, begin);
      }
    }
    parallel_for(int64_t(items.size()), [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const auto [p, begin] = items[size_t(i)];
        const paging::Segment whole{params[p].slot, 0, params[p].span.count, 0};
        kernel.sgd_fp32_state(
            chunk_span(params[p].span, whole, begin,
                       std::min(kChunkElements, params[p].span.count - begin)),
            nullptr, scalars[p]);
      }
    });
    return;
  }
  for_each_chunk(params, parallel_for,
                 [&](size_t p, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   const bool momentum = groups[size_t(params[p].group)].momentum != 0.0;
                   kernel.sgd_fp32_state(
                       chunk_span(params[p].span, segment, begin, count),
                       momentum ? stream_ptr<float>(0, page, segment, begin) : nullptr,
                       scalars[p]);
                 });
}

void PagedState::step_lion(const std::vector<ParamStep>& params,
                           const std::vector<LionGroup>& groups,
                           const ParallelFor& parallel_for) {
  std::vector<codec::LionScalars> scalars;
  scalars.reserve(params.size());
  for (const ParamStep& param : params) check_param(param, groups.size());
  for (const ParamStep& param : params) {
    const LionGroup& g = groups[size_t(param.group)];
    *param.step += 1.0f;
    scalars.push_back(
        codec::make_lion_scalars(g.lr, g.beta1, g.beta2, g.weight_decay, g.maximize));
  }
  const kernels::CpuKernelTable& kernel = kernels::cpu_kernels();
  for_each_chunk(params, parallel_for,
                 [&](size_t p, const paging::Segment& segment, std::byte* page, int64_t begin,
                     int64_t count) {
                   kernel.lion_fp32_state(chunk_span(params[p].span, segment, begin, count),
                                          stream_ptr<float>(0, page, segment, begin),
                                          scalars[p]);
                 });
}

int64_t PagedState::stream_bytes(int32_t slot, int stream) const {
  if (slot < 0 || slot >= table_.num_params()) {
    throw std::out_of_range("parameter slot " + std::to_string(slot) + " is not registered");
  }
  if (stream < 0 || stream >= table_.geometry().num_streams()) {
    throw std::out_of_range("stream " + std::to_string(stream) + " does not exist");
  }
  const paging::StreamSpec& spec = table_.geometry().streams()[size_t(stream)];
  int64_t bytes = 0;
  for (const paging::PagePiece& piece : table_.param(slot).pieces) {
    bytes += spec.bytes_for(table_.segment(piece).count);
  }
  return bytes;
}

void PagedState::read_stream(int32_t slot, int stream, void* out) {
  stream_bytes(slot, stream);  // validates
  const paging::StreamSpec& spec = table_.geometry().streams()[size_t(stream)];
  char* cursor = static_cast<char*>(out);
  for (const paging::PagePiece& piece : table_.param(slot).pieces) {
    const paging::Segment& segment = table_.segment(piece);
    const std::byte* page = store_->pin(piece.page);
    const int64_t bytes = spec.bytes_for(segment.count);
    std::memcpy(cursor,
                page + table_.geometry().stream_offset(stream) + spec.offset_of(segment.page_offset),
                size_t(bytes));
    store_->unpin(piece.page, /*dirty=*/false);
    cursor += bytes;
  }
}

void PagedState::write_stream(int32_t slot, int stream, const void* in) {
  stream_bytes(slot, stream);  // validates
  const paging::StreamSpec& spec = table_.geometry().streams()[size_t(stream)];
  const char* cursor = static_cast<const char*>(in);
  for (const paging::PagePiece& piece : table_.param(slot).pieces) {
    const paging::Segment& segment = table_.segment(piece);
    std::byte* page = store_->pin(piece.page);
    const int64_t bytes = spec.bytes_for(segment.count);
    std::memcpy(page + table_.geometry().stream_offset(stream) + spec.offset_of(segment.page_offset),
                cursor, size_t(bytes));
    store_->unpin(piece.page, /*dirty=*/true);
    cursor += bytes;
  }
}

MemoryUsage PagedState::memory_usage() const {
  MemoryUsage usage{};
  usage.num_pages = table_.num_pages();
  usage.num_params = table_.num_params();
  usage.state_bytes = int64_t(store_->num_pages()) * store_->page_bytes();
  usage.resident_bytes = store_->resident_bytes();
  for (int32_t slot = 0; slot < table_.num_params(); ++slot) {
    for (int s = 0; s < table_.geometry().num_streams(); ++s) {
      usage.payload_bytes += stream_bytes(slot, s);
    }
  }
  return usage;
}

}  // namespace pagedoptim::optim
