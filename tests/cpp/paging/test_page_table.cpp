// Page geometry and page table layout: alignment, capacity, packing of small parameters,
// splitting of large ones, and the segment bookkeeping the driver relies on.
#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>

#include "pagedoptim/common.h"
#include "pagedoptim/paging/page_store.h"
#include "pagedoptim/paging/page_table.h"

namespace pagedoptim::paging {
namespace {

PageGeometry adamw_geometry(int64_t page_bytes) {
  return PageGeometry({{"exp_avg", 128}, {"exp_avg_sq", 128}}, page_bytes);
}

std::vector<PageGeometry> one_kind(int64_t page_bytes) { return {adamw_geometry(page_bytes)}; }

TEST(PageGeometry, StreamsAreAlignedAndFitThePage) {
  const PageGeometry g({{"codes", 32}, {"scales", 2, true}, {"v", 32}}, 8192);
  ASSERT_EQ(g.num_streams(), 3);
  for (int s = 0; s < g.num_streams(); ++s) EXPECT_EQ(g.stream_offset(s) % kStreamAlignment, 0);
  const int64_t end = g.stream_offset(2) + 32 * g.capacity_groups();
  EXPECT_LE(end, 8192);
  // One more group would not fit: the capacity is the largest that does.
  const int64_t scales_end = g.stream_offset(1) + 2 * (g.capacity_groups() + 1);
  const int64_t v_start = (scales_end + kStreamAlignment - 1) / kStreamAlignment * kStreamAlignment;
  EXPECT_GT(v_start + 32 * (g.capacity_groups() + 1), 8192);
}

TEST(PageGeometry, RejectsBadPageSizes) {
  EXPECT_THROW(adamw_geometry(0), std::invalid_argument);
  EXPECT_THROW(adamw_geometry(4096 + 1), std::invalid_argument);
  EXPECT_THROW(PageGeometry({{"huge", 128 * 4096}}, 4096), std::invalid_argument);
  EXPECT_THROW(PageGeometry({{"odd", 33}}, 4096), std::invalid_argument);
}

TEST(PageGeometry, StreamByteCounts) {
  const StreamSpec fp32{"m", 128};
  const StreamSpec scale{"s", 2, true};
  EXPECT_EQ(fp32.bytes_for(33), 33 * 4);
  EXPECT_EQ(scale.bytes_for(33), 2 * 2);
  EXPECT_EQ(fp32.offset_of(64), 256);
  EXPECT_EQ(scale.offset_of(64), 4);
}

TEST(PageTable, PacksSmallParamsIntoSharedPages) {
  PageTable table(one_kind(4096));  // 2 fp32 streams: 16 groups = 512 elements a page
  ASSERT_EQ(table.geometry().capacity_elements(), 512);
  const int32_t a = table.add_param(100);  // 4 groups
  const int32_t b = table.add_param(33);   // 2 groups
  const int32_t c = table.add_param(1);    // 1 group
  EXPECT_EQ(table.num_pages(), 1);
  EXPECT_EQ(table.segment(table.param(a).pieces[0]).page_offset, 0);
  EXPECT_EQ(table.segment(table.param(b).pieces[0]).page_offset, 128);
  EXPECT_EQ(table.segment(table.param(c).pieces[0]).page_offset, 192);
  EXPECT_EQ(table.page(0).used_groups, 7);
}

TEST(PageTable, SplitsLargeParamsAndPacksTheirRemainder) {
  PageTable table(one_kind(4096));
  table.add_param(10);                       // opens page 0
  const int32_t big = table.add_param(1100);  // 2 full pages + 76 elements packed into page 0
  const ParamLayout& layout = table.param(big);
  ASSERT_EQ(layout.pieces.size(), 3u);
  int64_t covered = 0;
  for (const PagePiece& piece : layout.pieces) {
    const Segment& s = table.segment(piece);
    EXPECT_EQ(s.param_offset, covered);  // element order
    EXPECT_EQ(s.page_offset % kGroupSize, 0);
    covered += s.count;
  }
  EXPECT_EQ(covered, 1100);
  EXPECT_EQ(layout.pieces[2].page, 0);
  EXPECT_EQ(table.num_pages(), 3);
}

TEST(PageTable, RemaindersFillFreeTailsAndSmallParamsStayWhole) {
  PageTable table(one_kind(4096));  // 16 groups a page
  table.add_param(300);  // 10 groups: page 0 keeps 6 free
  // 25 groups: a full page 1, then the 9-group rest fits no open page whole, so it fills
  // page 0's 6 free groups and opens page 2 for the last 3.
  const int32_t big = table.add_param(800);
  ASSERT_EQ(table.param(big).pieces.size(), 3u);
  EXPECT_EQ(table.param(big).pieces[0].page, 1);
  EXPECT_EQ(table.param(big).pieces[1].page, 0);
  EXPECT_EQ(table.param(big).pieces[2].page, 2);
  EXPECT_EQ(table.segment(table.param(big).pieces[1]).count, 6 * 32);
  EXPECT_EQ(table.page(0).used_groups, 16);
  // A small parameter that fits whole somewhere is never split.
  const int32_t small = table.add_param(100);
  ASSERT_EQ(table.param(small).pieces.size(), 1u);
  EXPECT_EQ(table.param(small).pieces[0].page, 2);
  EXPECT_EQ(table.num_pages(), 3);
  const int32_t empty = table.add_param(0);
  ASSERT_EQ(table.param(empty).pieces.size(), 1u);
  EXPECT_EQ(table.segment(table.param(empty).pieces[0]).count, 0);
}

TEST(PageTable, NoSegmentOverlapsAnother) {
  PageTable table(one_kind(8192));
  const int64_t sizes[] = {1, 31, 32, 33, 1000, 1024, 5000, 0, 7, 64, 2049};
  for (int64_t n : sizes) table.add_param(n);
  for (int32_t p = 0; p < table.num_pages(); ++p) {
    int64_t next_free = 0;
    for (const Segment& s : table.page(p).segments) {
      EXPECT_GE(s.page_offset, next_free);
      next_free = s.page_offset + (s.count + kGroupSize - 1) / kGroupSize * kGroupSize;
      EXPECT_LE(next_free, table.geometry().capacity_elements());
    }
  }
}

TEST(PageTable, KindsNeverSharePages) {
  PageTable table({adamw_geometry(4096),
                   PageGeometry({{"exp_avg", 128}, {"exp_avg_sq", 128}, {"master_residual", 32}},
                                4096)});
  const int32_t plain = table.add_param(10, 0);
  const int32_t with_residual = table.add_param(10, 1);
  const int32_t plain_again = table.add_param(10, 0);
  EXPECT_NE(table.param(plain).pieces[0].page, table.param(with_residual).pieces[0].page);
  EXPECT_EQ(table.param(plain).pieces[0].page, table.param(plain_again).pieces[0].page);
  EXPECT_EQ(table.page(table.param(with_residual).pieces[0].page).kind, 1);
  EXPECT_THROW(table.add_param(10, 2), std::out_of_range);
}

PageGeometry companded_geometry(int64_t page_bytes) {
  return PageGeometry({{"exp_avg_codes", 32}, {"exp_avg_scales", 2, true}}, page_bytes);
}

// The elements each segment of `slot` holds, in element order: [param_offset, count).
std::vector<std::pair<int64_t, int64_t>> segments_of(const PageTable& table, int32_t slot) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const PagePiece& piece : table.param(slot).pieces) {
    out.emplace_back(table.segment(piece).param_offset, table.segment(piece).count);
  }
  return out;
}

TEST(PageTable, RowsThatEndInPartialGroupsAreSegmentsOfTheirOwn) {
  PageTable table({companded_geometry(4096)});
  // A (3, 40) param: each row is one full group and a partial one of 8.
  const int32_t slot = table.add_param(120, 0, 40);
  EXPECT_EQ(table.param(slot).row_length, 40);
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 40}, {40, 40}, {80, 40}};
  EXPECT_EQ(segments_of(table, slot), expected);
  // Each row starts a group: page offsets 0, 64, 128 (two group slots a row).
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(table.segment(table.param(slot).pieces[size_t(i)]).page_offset, 64 * i);
  }
  EXPECT_EQ(table.page(0).used_groups, 6);
  EXPECT_EQ(PageTable::groups_of(120, 40), 6);
  EXPECT_EQ(PageTable::groups_of(120, 0), 4);  // flat: ceil(120 / 32)
  const StreamSpec& scales = table.geometry().streams()[1];
  int64_t scale_bytes = 0;
  for (const PagePiece& piece : table.param(slot).pieces) {
    scale_bytes += scales.bytes_for(table.segment(piece).count);
  }
  EXPECT_EQ(scale_bytes, 6 * 2);  // one fp16 scale per group, rows x ceil(40 / 32)
}

TEST(PageTable, RowsOfWholeGroupsAndFlatStateAreNotCut) {
  PageTable table({companded_geometry(4096), adamw_geometry(4096)});
  EXPECT_EQ(table.add_param(128, 0, 64), 0);  // rows end on group boundaries
  EXPECT_EQ(table.param(0).pieces.size(), 1u);
  EXPECT_EQ(table.param(0).row_length, 0);
  EXPECT_EQ(table.add_param(120, 1, 40), 1);  // fp32 state: no groups to keep whole
  EXPECT_EQ(table.param(1).pieces.size(), 1u);
  EXPECT_EQ(table.add_param(40, 0, 40), 2);   // one row
  EXPECT_EQ(table.param(2).pieces.size(), 1u);
  EXPECT_THROW(table.add_param(120, 0, 50), std::invalid_argument);
  EXPECT_THROW(table.add_param(120, 0, -1), std::invalid_argument);
}

TEST(PageTable, RowsLongerThanAPageAreCutAtGroupsAndStartTheNextRowAfresh) {
  PageTable table({companded_geometry(4096)});
  const int64_t capacity = table.geometry().capacity_groups();
  const int64_t row = (capacity + 2) * kGroupSize - 7;  // capacity + 2 groups, the last partial
  const int32_t slot = table.add_param(2 * row, 0, row);
  int64_t groups = 0, elements = 0;
  for (const PagePiece& piece : table.param(slot).pieces) {
    const Segment& segment = table.segment(piece);
    // No segment crosses a row; each starts on a group of its row.
    EXPECT_EQ(segment.param_offset / row, (segment.param_offset + segment.count - 1) / row);
    EXPECT_EQ(segment.param_offset % row % kGroupSize, 0);
    EXPECT_EQ(segment.page_offset % kGroupSize, 0);
    EXPECT_EQ(segment.param_offset, elements);
    elements += segment.count;
    groups += (segment.count + kGroupSize - 1) / kGroupSize;
  }
  EXPECT_EQ(elements, 2 * row);
  EXPECT_EQ(groups, 2 * (capacity + 2));
  EXPECT_EQ(groups, PageTable::groups_of(2 * row, row));
  int64_t used = 0;
  for (int32_t p = 0; p < table.num_pages(); ++p) used += table.page(p).used_groups;
  EXPECT_EQ(used, groups);
}

TEST(HostPageStore, PagesAreAlignedZeroedAndPinCounted) {
  HostPageStore store(8192);
  store.grow(3);
  for (int32_t p = 0; p < 3; ++p) {
    std::byte* bytes = store.pin(p);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes) % kPageAlignment, 0u);
    for (int i = 0; i < 8192; ++i) ASSERT_EQ(bytes[i], std::byte{0});
    store.unpin(p, false);
  }
  EXPECT_THROW(store.unpin(0, false), std::logic_error);
  EXPECT_THROW(store.pin(3), std::out_of_range);
  EXPECT_EQ(store.resident_bytes(), 3 * 8192);
}

}  // namespace
}  // namespace pagedoptim::paging
