#include "pagedoptim/paging/page_table.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {
namespace {

int64_t groups_for(int64_t elements) { return (elements + kGroupSize - 1) / kGroupSize; }

// Whether a parameter in rows of `row_length` needs cutting at rows: only where a row ends
// inside a group.
bool rows_end_in_partial_groups(int64_t numel, int64_t row_length) {
  return row_length > 0 && row_length < numel && row_length % kGroupSize != 0;
}

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

int64_t PageTable::groups_of(int64_t numel, int64_t row_length) {
  if (!rows_end_in_partial_groups(numel, row_length)) return groups_for(numel);
  return numel / row_length * groups_for(row_length);
}

int32_t PageTable::add_param(int64_t numel, int kind, int64_t row_length) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (kind < 0 || kind >= num_kinds()) {
    throw std::out_of_range("page kind " + std::to_string(kind) + " does not exist");
  }
  if (row_length < 0 || (row_length > 0 && numel % row_length != 0)) {
    throw std::invalid_argument("row_length must be >= 0 and divide numel (" +
                                std::to_string(numel) + "), got " + std::to_string(row_length));
  }
  const PageGeometry& geometry = kinds_[size_t(kind)];
  if (geometry.num_streams() == 0) {
    throw std::logic_error("a kind without state streams has no pages to lay out");
  }
  const bool has_groups = std::any_of(geometry.streams().begin(), geometry.streams().end(),
                                      [](const StreamSpec& s) { return s.per_group; });
  if (!has_groups || !rows_end_in_partial_groups(numel, row_length)) row_length = 0;
  const int32_t slot = int32_t(params_.size());
  params_.push_back(ParamLayout{numel, kind, row_length, {}});
  // Pages are filled in groups: a group is a page slot of kGroupSize elements of every
  // stream (a partial group at a row's end takes a whole slot).
  const int64_t total = groups_of(numel, row_length);
  const int64_t capacity = geometry.capacity_groups();

  // Whole pages first: a page that a single parameter fills is never shared.
  int64_t placed = 0;
  while (total - placed >= capacity) {
    place(slot, placed, capacity, open_new_page(kind));
    placed += capacity;
  }
  if (placed == total && numel > 0) return slot;

  // The remainder (or a small parameter) goes into the first page with room for all of it
  // (first fit), so small parameters stay whole. A remainder that fits no open page whole is
  // split at group boundaries over the open pages' free tails before a new page is opened:
  // two remainders just over half a page each (a Linear(2048, 4096) with 2 MiB pages) would
  // otherwise waste half a page apiece. A 0-element parameter still gets an (empty) segment
  // so that it owns state like any other.
  std::vector<int32_t>& open = open_pages_[size_t(kind)];
  auto free_groups = [&](int32_t page) { return capacity - pages_[size_t(page)].used_groups; };
  auto fill = [&](int32_t page, int64_t groups) {
    place(slot, placed, groups, page);
    placed += groups;
    if (free_groups(page) == 0) open.erase(std::find(open.begin(), open.end(), page));
  };
  const auto whole = std::find_if(open.begin(), open.end(), [&](int32_t page) {
    return free_groups(page) >= total - placed;
  });
  if (whole != open.end()) {
    fill(*whole, total - placed);
    return slot;
  }
  while (!open.empty() && total - placed > 0) {
    const int32_t page = open.front();
    fill(page, std::min(total - placed, free_groups(page)));
  }
  if (total - placed > 0 || numel == 0) {
    const int32_t page = open_new_page(kind);
    open.push_back(page);
    fill(page, total - placed);
  }
  return slot;
}

int32_t PageTable::open_new_page(int kind) {
  pages_.emplace_back();
  pages_.back().kind = kind;
  return int32_t(pages_.size() - 1);
}

void PageTable::place(int32_t slot, int64_t first_group, int64_t groups, int32_t page_id) {
  Page& page = pages_[size_t(page_id)];
  ParamLayout& param = params_[size_t(slot)];
  auto add_segment = [&](int64_t param_offset, int64_t count, int64_t segment_groups) {
    page.segments.push_back(Segment{slot, param_offset, count, page.used_groups * kGroupSize});
    page.used_groups += segment_groups;
    param.pieces.push_back(PagePiece{page_id, int32_t(page.segments.size() - 1)});
  };
  if (param.row_length == 0) {  // flat groups: one segment
    const int64_t begin = first_group * kGroupSize;
    add_segment(begin, std::min(param.numel, (first_group + groups) * kGroupSize) - begin,
                groups);
    return;
  }
  // One segment per row (or piece of a row) of the groups: each starts a new group.
  const int64_t per_row = groups_for(param.row_length);
  for (int64_t group = first_group; group < first_group + groups;) {
    const int64_t row = group / per_row, column_group = group % per_row;
    const int64_t n = std::min(first_group + groups - group, per_row - column_group);
    const int64_t begin = column_group * kGroupSize;
    const int64_t end = std::min(param.row_length, (column_group + n) * kGroupSize);
    add_segment(row * param.row_length + begin, end - begin, n);
    group += n;
  }
}

}  // namespace pagedoptim::paging
