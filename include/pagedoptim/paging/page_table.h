// The page table: which element ranges of which parameters each page holds.
//
// Parameters are registered once, on their first step, and laid out in registration order.
// A parameter larger than a page is cut into full pages; what is left of it, and every
// parameter smaller than a page, is packed into the first page with room (first fit), so a
// LoRA adapter's many small tensors share pages instead of each wasting most of one.
// Segments start on a group boundary so quantization groups never straddle parameters.
//
// Groups of 32 never cross a row of a parameter's last dimension either (a row whose length
// is not a multiple of 32 ends in a partial group with its own scale), so that a shard of
// the parameter along any dimension but the last holds whole groups (docs/compression.md,
// "Groups"). The table makes that true by cutting such a parameter into one segment per row
// (or per piece of a row that spans pages): inside a segment, groups run in flat order from
// its first element, which is all the kernels assume. A row length that is a multiple of 32
// needs no cut (its rows already end on group boundaries), nor does a kind without per-group
// streams (fp32 state has no groups to keep whole).
//
// Parameters of different kinds (say bf16 weights that carry a master residual and fp32
// norms that do not) hold different stream sets, so each kind has its own geometry and its
// own open page; a page holds parameters of one kind only.
//
// Residency (which tier holds a page, dirty bits, pins) is the page store's business, not
// this table's: the table is pure layout and never changes once a page is written.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedoptim/paging/page_geometry.h"

namespace pagedoptim::paging {

struct Segment {
  int32_t param;         // parameter slot
  int64_t param_offset;  // first element of the parameter held here
  int64_t count;         // elements
  int64_t page_offset;   // element index inside the page (a multiple of kGroupSize)
};

struct Page {
  int kind = 0;  // index into PageTable::geometry(kind)
  std::vector<Segment> segments;
  int64_t used_groups = 0;
};

struct PagePiece {
  int32_t page;
  int32_t segment;  // index into Page::segments
};

struct ParamLayout {
  int64_t numel = 0;
  int kind = 0;
  int64_t row_length = 0;  // elements per row of the last dimension; 0: one row (flat groups)
  std::vector<PagePiece> pieces;  // in element order
};

class PageTable {
 public:
  // One geometry per parameter kind; all of the same page size.
  explicit PageTable(std::vector<PageGeometry> kinds);

  // Lays out a new parameter of `numel` elements and kind `kind` and returns its slot. Pages
  // it opens are appended; the caller (the store) must then provide memory for pages
  // [old num_pages(), num_pages()). `row_length`: the length of the parameter's last
  // dimension (0 for a 1-D parameter: one row); groups never cross one of its rows. Throws
  // std::invalid_argument when it does not divide `numel`.
  int32_t add_param(int64_t numel, int kind = 0, int64_t row_length = 0);

  // The groups of kGroupSize elements a parameter of `numel` elements in rows of
  // `row_length` has (every row's last group possibly partial): what its per-group streams
  // hold. The plan (python/pagedoptim/paging/state_plan.py) counts the same.
  static int64_t groups_of(int64_t numel, int64_t row_length);

  int num_kinds() const { return int(kinds_.size()); }
  const PageGeometry& geometry(int kind = 0) const { return kinds_[size_t(kind)]; }
  int64_t page_bytes() const { return kinds_.front().page_bytes(); }
  int32_t num_pages() const { return int32_t(pages_.size()); }
  int32_t num_params() const { return int32_t(params_.size()); }
  const Page& page(int32_t id) const { return pages_[size_t(id)]; }
  const ParamLayout& param(int32_t slot) const { return params_[size_t(slot)]; }
  const Segment& segment(const PagePiece& piece) const {
    return pages_[size_t(piece.page)].segments[size_t(piece.segment)];
  }

 private:
  // Places groups [first_group, first_group + groups) of parameter `slot` at the end of
  // page `page_id`: one segment, or one per row where rows end in partial groups.
  void place(int32_t slot, int64_t first_group, int64_t groups, int32_t page_id);
  int32_t open_new_page(int kind);

  std::vector<PageGeometry> kinds_;
  std::vector<Page> pages_;
  std::vector<ParamLayout> params_;
  // Per kind, the pages that still have room, oldest first (small parameters and the
  // remainders of large ones are packed into the first that fits).
  std::vector<std::vector<int32_t>> open_pages_;
};

}  // namespace pagedoptim::paging
