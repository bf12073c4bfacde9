#include "pagedoptim/paging/page_table.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {
namespace {

int64_t groups_for(int64_t elements) { return (elements + kGroupSize - 1) / kGroupSize; }

}  // namespace

PageTable::PageTable(std::vector<PageGeometry> kinds)
    : kinds_(std::move(kinds)), open_pages_(kinds_.size()) {
  if (kinds_.empty()) throw std::invalid_argument("a page table needs at least one kind");
  for (const PageGeometry& kind : kinds_) {
    if (kind.page_bytes() != kinds_.front().page_bytes()) {
      throw std::invalid_argument("every page kind must have the same page size");
    }
  }
}

int32_t PageTable::add_param(int64_t numel, int kind) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (kind < 0 || kind >= num_kinds()) {
    throw std::out_of_range("page kind " + std::to_string(kind) + " does not exist");
  }
  const PageGeometry& geometry = kinds_[size_t(kind)];
  if (geometry.num_streams() == 0) {
    throw std::logic_error("a kind without state streams has no pages to lay out");
  }
  const int32_t slot = int32_t(params_.size());
  params_.push_back(ParamLayout{numel, kind, {}});
  const int64_t capacity = geometry.capacity_elements();

  // Whole pages first: a page that a single parameter fills is never shared.
  int64_t offset = 0;
  while (numel - offset >= capacity) {
    place(slot, offset, capacity, open_new_page(kind));
    offset += capacity;
  }
  const int64_t rest = numel - offset;
  if (rest == 0 && numel > 0) return slot;

  // The remainder (or a small parameter) goes into the open page when it fits; a 0-element
  // parameter still gets an (empty) segment so that it owns state like any other.
  const int64_t rest_groups = groups_for(rest);
  // First fit among the kind's pages that still have room: a large parameter's remainder
  // (often half a page) would otherwise close the page that small ones were filling.
  std::vector<int32_t>& open = open_pages_[size_t(kind)];
  int32_t target = -1;
  for (int32_t page : open) {
    if (pages_[size_t(page)].used_groups + rest_groups <= geometry.capacity_groups()) {
      target = page;
      break;
    }
  }
  if (target < 0) {
    target = open_new_page(kind);
    open.push_back(target);
  }
  place(slot, offset, rest, target);
  if (pages_[size_t(target)].used_groups == geometry.capacity_groups()) {
    open.erase(std::find(open.begin(), open.end(), target));
  }
  return slot;
}

int32_t PageTable::open_new_page(int kind) {
  pages_.emplace_back();
  pages_.back().kind = kind;
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
