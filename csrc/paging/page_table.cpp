#include "pagedoptim/paging/page_table.h"

#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {
namespace {

int64_t groups_for(int64_t elements) { return (elements + kGroupSize - 1) / kGroupSize; }

}  // namespace

PageTable::PageTable(PageGeometry geometry) : geometry_(std::move(geometry)) {}

int32_t PageTable::add_param(int64_t numel) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (geometry_.num_streams() == 0) {
    throw std::logic_error("an optimizer without state streams has no pages to lay out");
  }
  const int32_t slot = int32_t(params_.size());
  params_.push_back(ParamLayout{numel, {}});
  const int64_t capacity = geometry_.capacity_elements();

  // Whole pages first: a page that a single parameter fills is never shared.
  int64_t offset = 0;
  while (numel - offset >= capacity) {
    place(slot, offset, capacity, open_new_page_unshared());
    offset += capacity;
  }
  const int64_t rest = numel - offset;
  if (rest == 0 && numel > 0) return slot;

  // The remainder (or a small parameter) goes into the open page when it fits; a 0-element
  // parameter still gets an (empty) segment so that it owns state like any other.
  const int64_t rest_groups = groups_for(rest);
  if (open_page_ < 0 ||
      pages_[size_t(open_page_)].used_groups + rest_groups > geometry_.capacity_groups()) {
    open_page_ = open_new_page_unshared();
  }
  place(slot, offset, rest, open_page_);
  return slot;
}

int32_t PageTable::open_new_page_unshared() {
  pages_.emplace_back();
  return int32_t(pages_.size() - 1);
}

void PageTable::place(int32_t slot, int64_t param_offset, int64_t count, int32_t page_id) {
  Page& page = pages_[size_t(page_id)];
  page.segments.push_back(Segment{slot, param_offset, count, page.used_groups * kGroupSize});
  page.used_groups += groups_for(count);
  params_[size_t(slot)].pieces.push_back(
      PagePiece{page_id, int32_t(page.segments.size() - 1)});
}

}  // namespace pagedoptim::paging
