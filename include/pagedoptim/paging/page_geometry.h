// Where each state stream sits inside a page, and how many elements a page holds.
//
// A page holds every state stream of one element range back to back (so a page moves with
// one I/O): [stream 0 for `capacity` elements][stream 1 ...]..., each stream starting on a
// kStreamAlignment boundary. Streams are described in bytes per group of kGroupSize
// elements, which covers fp32 moments (128 B/group), int8 codes (32 B/group), int16
// residuals (64 B/group) and one fp16 scale per group (2 B/group) alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagedoptim::paging {

struct StreamSpec {
  std::string name;         // e.g. "exp_avg"; used in error messages and by the bindings
  int64_t bytes_per_group;  // storage for kGroupSize elements of this stream
  bool per_group = false;   // one value per group (a scale) rather than one per element

  // Bytes this stream holds for `elements` elements of one segment (the partial last group
  // of a per-element stream is padding and is not counted).
  int64_t bytes_for(int64_t elements) const;
  // Byte offset inside the stream of element `element` (a multiple of kGroupSize for
  // per-group streams).
  int64_t offset_of(int64_t element) const;
};

class PageGeometry {
 public:
  // Throws std::invalid_argument when page_bytes is not a positive multiple of
  // kPageAlignment or cannot hold a single group of every stream.
  PageGeometry(std::vector<StreamSpec> streams, int64_t page_bytes);

  const std::vector<StreamSpec>& streams() const { return streams_; }
  int num_streams() const { return int(streams_.size()); }
  int64_t page_bytes() const { return page_bytes_; }
  int64_t capacity_groups() const { return capacity_groups_; }
  int64_t capacity_elements() const;
  // Byte offset of stream `s` from the start of a page.
  int64_t stream_offset(int s) const { return stream_offsets_[size_t(s)]; }
  // Bytes of state per element, summed over streams (without alignment padding).
  double bytes_per_element() const;
  int find_stream(const std::string& name) const;  // -1 when absent

 private:
  int64_t layout_bytes(int64_t groups, std::vector<int64_t>* offsets) const;

  std::vector<StreamSpec> streams_;
  int64_t page_bytes_;
  int64_t capacity_groups_ = 0;
  std::vector<int64_t> stream_offsets_;
};

}  // namespace pagedoptim::paging
