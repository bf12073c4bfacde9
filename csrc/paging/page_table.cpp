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

  // The remainder (or a small parameter) goes into the first page with room for all of it
  // (first fit), so small parameters stay whole. A remainder that fits no open page whole is
  // split at group boundaries over the open pages' free tails before a new page is opened:
  // two remainders just over half a page each (a Linear(2048, 4096) with 2 MiB pages) would
  // otherwise waste half a page apiece. A 0-element parameter still gets an (empty) segment
  // so that it owns state like any other.
  std::vector<int32_t>& open = open_pages_[size_t(kind)];
  const int64_t capacity_groups = geometry.capacity_groups();
  auto free_groups = [&](int32_t page) { return capacity_groups - pages_[size_t(page)].used_groups; };
  auto fill = [&](int32_t page, int64_t count) {
    place(slot, offset, count, page);
    offset += count;
    if (free_groups(page) == 0) open.erase(std::find(open.begin(), open.end(), page));
  };
  const auto whole = std::find_if(open.begin(), open.end(), [&](int32_t page) {
    return free_groups(page) >= groups_for(numel - offset);
  });
  if (whole != open.end()) {
    fill(*whole, numel - offset);
    return slot;
  }
  while (!open.empty() && numel - offset > 0) {
    const int32_t page = open.front();
    fill(page, std::min(numel - offset, free_groups(page) * kGroupSize));
  }
  if (numel - offset > 0 || numel == 0) {
    const int32_t page = open_new_page(kind);
    open.push_back(page);
    fill(page, numel - offset);
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
