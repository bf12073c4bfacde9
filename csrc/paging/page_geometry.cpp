#include "pagedoptim/paging/page_geometry.h"

#include <stdexcept>

#include "pagedoptim/common.h"

namespace pagedoptim::paging {
namespace {

int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

int64_t StreamSpec::bytes_for(int64_t elements) const {
  if (per_group) return (elements + kGroupSize - 1) / kGroupSize * bytes_per_group;
  return elements * bytes_per_group / kGroupSize;
}

int64_t StreamSpec::offset_of(int64_t element) const {
  if (per_group) return element / kGroupSize * bytes_per_group;
  return element * bytes_per_group / kGroupSize;
}

PageGeometry::PageGeometry(std::vector<StreamSpec> streams, int64_t page_bytes)
    : streams_(std::move(streams)), page_bytes_(page_bytes) {
  if (page_bytes <= 0 || page_bytes % kPageAlignment != 0) {
    throw std::invalid_argument("page_bytes must be a positive multiple of " +
                                std::to_string(kPageAlignment) + ", got " +
                                std::to_string(page_bytes));
  }
  for (const StreamSpec& stream : streams_) {
    if (stream.bytes_per_group <= 0 ||
        (!stream.per_group && stream.bytes_per_group % kGroupSize != 0)) {
      throw std::invalid_argument("stream '" + stream.name +
                                  "' must have a positive size, whole bytes per element");
    }
  }
  if (streams_.empty()) return;  // stateless optimizer (plain SGD): no pages at all
  // The layout is monotonic in the group count, so a binary search finds the largest page
  // content that still fits once every stream is padded to its alignment.
  int64_t low = 0;
  int64_t high = page_bytes;  // no stream is smaller than one byte per group
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (layout_bytes(mid, nullptr) <= page_bytes) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  if (low == 0) {
    throw std::invalid_argument("page_bytes=" + std::to_string(page_bytes) +
                                " cannot hold one group of every state stream");
  }
  capacity_groups_ = low;
  layout_bytes(capacity_groups_, &stream_offsets_);
}

int64_t PageGeometry::layout_bytes(int64_t groups, std::vector<int64_t>* offsets) const {
  int64_t bytes = 0;
  if (offsets) offsets->clear();
  for (const StreamSpec& stream : streams_) {
    bytes = align_up(bytes, kStreamAlignment);
    if (offsets) offsets->push_back(bytes);
    bytes += stream.bytes_per_group * groups;
  }
  return bytes;
}

int64_t PageGeometry::capacity_elements() const { return capacity_groups_ * kGroupSize; }

double PageGeometry::bytes_per_element() const {
  int64_t per_group = 0;
  for (const StreamSpec& stream : streams_) per_group += stream.bytes_per_group;
  return double(per_group) / kGroupSize;
}

int PageGeometry::find_stream(const std::string& name) const {
  for (size_t s = 0; s < streams_.size(); ++s) {
    if (streams_[s].name == name) return int(s);
  }
  return -1;
}

}  // namespace pagedoptim::paging
