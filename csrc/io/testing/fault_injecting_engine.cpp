#include "io/testing/fault_injecting_engine.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "io/request_check.h"

namespace pagedoptim::io {
namespace {

// Injected failures are queued here, not in the inner engine, so a thread blocked in the
// inner wait() would not see them; waits are cut into slices of this length to notice.
constexpr std::chrono::milliseconds kWaitSlice{5};

// A failed read leaves its buffer like this, so that a caller that uses the data anyway is
// caught by its checksum instead of carrying on with the slot's stale contents.
constexpr int kPoison = 0xA5;

bool valid_rule(const FaultRule& r) {
  return r.kind >= static_cast<int>(FaultKind::kEnospc) &&
         r.kind <= static_cast<int>(FaultKind::kFlipByte) && r.ops > 0 &&
         (r.ops & ~(kFaultReads | kFaultWrites)) == 0 && r.every_nth >= 0 && r.from_op >= 0 &&
         r.max_fires >= -1 && r.offset_begin >= 0 &&
         (r.offset_end == -1 || r.offset_end > r.offset_begin) && r.short_bytes >= -1 &&
         r.flip_at >= 0 && (r.flip_mask & 0xFF) != 0 && (r.flip_mask & ~0xFF) == 0;
}

int error_of(int kind) {
  return kind == static_cast<int>(FaultKind::kEnospc) ? -ENOSPC : -EIO;
}

bool fails(int kind) {
  return kind == static_cast<int>(FaultKind::kEnospc) || kind == static_cast<int>(FaultKind::kEio);
}

}  // namespace

FaultInjector::FaultInjector(std::unique_ptr<IoEngine> inner) : inner_(std::move(inner)) {
  set_fallback_reason(inner_->fallback_reason());
}

// The inner engine's destructor waits for its in-flight requests; tracked copies must
// outlive them, so the inner engine goes first.
FaultInjector::~FaultInjector() {
  inner_.reset();
}

int FaultInjector::set_rules(std::vector<FaultRule> rules) {
  if (!std::all_of(rules.begin(), rules.end(), valid_rule)) {
    return -EINVAL;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  rules_ = std::move(rules);
  seen_.assign(rules_.size(), 0);
  fired_.assign(rules_.size(), 0);
  return 0;
}

std::vector<int64_t> FaultInjector::fire_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fired_;
}

int FaultInjector::open(const std::string& path, const OpenOptions& options) {
  return inner_->open(path, options);
}

int FaultInjector::close() {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  return inner_->close();
}

int FaultInjector::register_buffers(std::span<const iovec> buffers) {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  const int err = inner_->register_buffers(buffers);
  if (err == 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    buffers_.assign(buffers.begin(), buffers.end());
  }
  return err;
}

int FaultInjector::unregister_buffers() {
  if (in_flight() > 0) {
    return -EBUSY;
  }
  const int err = inner_->unregister_buffers();
  if (err == 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    buffers_.clear();
  }
  return err;
}

FaultInjector::Decision FaultInjector::decide_locked(OpKind op, int64_t offset, uint64_t length) {
  Decision d;
  const int op_bit = op == OpKind::kRead ? kFaultReads : kFaultWrites;
  const uint64_t end = static_cast<uint64_t>(offset) + length;
  for (size_t i = 0; i < rules_.size(); ++i) {
    const FaultRule& r = rules_[i];
    const bool overlaps = end > static_cast<uint64_t>(r.offset_begin) &&
                          (r.offset_end < 0 || offset < r.offset_end);
    if ((r.ops & op_bit) == 0 || !overlaps) {
      continue;
    }
    const int64_t n = seen_[i]++;
    const bool fires = d.kind == 0 && n >= r.from_op &&
                       (r.every_nth == 0 || (n + 1) % r.every_nth == 0) &&
                       (r.max_fires < 0 || fired_[i] < r.max_fires);
    if (!fires) {
      continue;
    }
    ++fired_[i];
    d.kind = r.kind;
    if (r.kind == static_cast<int>(FaultKind::kShort)) {
      const auto len = static_cast<int64_t>(length);
      int64_t bytes = r.short_bytes < 0 ? len / 2 : std::min(r.short_bytes, len - 1);
      if (inner_->file().is_direct()) {
        bytes -= bytes % kDirectAlignment;
      }
      d.bytes = bytes;
    } else if (r.kind == static_cast<int>(FaultKind::kFlipByte)) {
      d.flip_at = r.flip_at % static_cast<int64_t>(length);
      d.flip_mask = static_cast<uint8_t>(r.flip_mask);
    }
  }
  return d;
}

FaultInjector::AlignedCopy FaultInjector::flipped_copy(const void* buf, size_t length,
                                                       const Decision& d) {
  // Aligned like the caller's buffer had to be, so an O_DIRECT file accepts the copy.
  const size_t rounded = (length + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  AlignedCopy copy(static_cast<char*>(std::aligned_alloc(kDirectAlignment, rounded)));
  if (copy != nullptr) {
    std::memcpy(copy.get(), buf, length);
    copy.get()[d.flip_at] = static_cast<char>(copy.get()[d.flip_at] ^ d.flip_mask);
  }
  return copy;
}

int FaultInjector::submit(std::span<const IoRequest> requests) {
  if (requests.empty()) {
    return 0;
  }
  std::vector<IoRequest> checked(requests.begin(), requests.end());
  std::lock_guard<std::mutex> lock(mutex_);
  for (IoRequest& r : checked) {
    const int err = normalize_request(r, inner_->file(), buffers_);
    if (err < 0) {
      return err;
    }
  }
  // Counters and tracking are committed only when the inner engine accepts the batch, so a
  // rejected batch leaves the rules exactly where they were.
  const std::vector<int64_t> seen_before = seen_;
  const std::vector<int64_t> fired_before = fired_;
  const uint64_t first_tag = next_tag_;
  auto rollback = [&] {
    for (uint64_t tag = first_tag; tag != next_tag_; ++tag) {
      tracked_.erase(tag);
    }
    next_tag_ = first_tag;
    seen_ = seen_before;
    fired_ = fired_before;
  };
  std::vector<IoRequest> forward;
  std::vector<IoCompletion> injected;
  std::vector<IoRequest> poison;
  forward.reserve(checked.size());
  for (const IoRequest& r : checked) {
    const Decision d = decide_locked(r.op, r.offset, r.length);
    if (fails(d.kind)) {
      injected.push_back({r.tag, error_of(d.kind)});
      if (r.op == OpKind::kRead) {
        poison.push_back(r);
      }
      continue;
    }
    if (d.kind == static_cast<int>(FaultKind::kShort) && d.bytes == 0) {
      injected.push_back({r.tag, 0});
      continue;
    }
    IoRequest inner_request = r;
    inner_request.tag = next_tag_++;
    Tracked t{r.tag, r.op, static_cast<char*>(r.buf), r.length, d, nullptr};
    if (d.kind == static_cast<int>(FaultKind::kShort)) {
      inner_request.length = static_cast<uint32_t>(d.bytes);
    } else if (d.kind == static_cast<int>(FaultKind::kFlipByte) && r.op == OpKind::kWrite) {
      t.copy = flipped_copy(r.buf, r.length, d);
      if (t.copy == nullptr) {
        rollback();
        return -ENOMEM;
      }
      inner_request.buf = t.copy.get();
      inner_request.buf_index = -1;
    }
    tracked_.emplace(inner_request.tag, std::move(t));
    forward.push_back(inner_request);
  }
  if (!forward.empty()) {
    const int err = inner_->submit(forward);
    if (err < 0) {
      rollback();
      return err;
    }
  }
  for (const IoRequest& r : poison) {
    std::memset(r.buf, kPoison, r.length);
  }
  ready_.insert(ready_.end(), injected.begin(), injected.end());
  ready_count_.fetch_add(static_cast<int64_t>(injected.size()), std::memory_order_acq_rel);
  return static_cast<int>(checked.size());
}

int FaultInjector::take_ready_locked(std::span<IoCompletion> out) {
  const size_t n = std::min(out.size(), ready_.size());
  std::copy_n(ready_.begin(), n, out.begin());
  ready_.erase(ready_.begin(), ready_.begin() + static_cast<std::ptrdiff_t>(n));
  ready_count_.fetch_sub(static_cast<int64_t>(n), std::memory_order_acq_rel);
  return static_cast<int>(n);
}

void FaultInjector::finish_inner(std::span<IoCompletion> out) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (IoCompletion& c : out) {
    auto it = tracked_.find(c.tag);
    if (it == tracked_.end()) {
      continue;
    }
    Tracked& t = it->second;
    c.tag = t.user_tag;
    if (t.decision.kind == static_cast<int>(FaultKind::kFlipByte) && t.op == OpKind::kRead &&
        c.result == static_cast<int64_t>(t.length)) {
      char& byte = t.buf[t.decision.flip_at];
      byte = static_cast<char>(byte ^ t.decision.flip_mask);
    }
    tracked_.erase(it);
  }
}

int FaultInjector::poll(std::span<IoCompletion> out) {
  int n;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    n = take_ready_locked(out);
  }
  if (static_cast<size_t>(n) == out.size()) {
    return n;
  }
  const int m = inner_->poll(out.subspan(static_cast<size_t>(n)));
  if (m < 0) {
    return n > 0 ? n : m;
  }
  finish_inner(out.subspan(static_cast<size_t>(n), static_cast<size_t>(m)));
  return n + m;
}

int FaultInjector::wait(std::span<IoCompletion> out, std::chrono::milliseconds timeout) {
  if (out.empty()) {
    return -EINVAL;
  }
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout < std::chrono::milliseconds::zero();
  const Clock::time_point start = Clock::now();
  for (;;) {
    const int n = poll(out);
    if (n != 0) {
      return n;
    }
    if (in_flight() == 0) {
      return 0;
    }
    std::chrono::milliseconds slice = kWaitSlice;
    if (!forever) {
      const auto left =
          timeout - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      if (left <= std::chrono::milliseconds::zero()) {
        return -ETIME;
      }
      slice = std::min(slice, left);
    }
    const int m = inner_->wait(out, slice);
    if (m > 0) {
      finish_inner(out.first(static_cast<size_t>(m)));
      return m;
    }
    if (m < 0 && m != -ETIME) {
      return m;
    }
  }
}

int64_t FaultInjector::in_flight() const noexcept {
  return ready_count_.load(std::memory_order_acquire) + inner_->in_flight();
}

int64_t FaultInjector::read_page(void* buf, size_t length, int64_t offset) {
  const int err = check_transfer(inner_->file(), buf, length, offset);
  if (err < 0) {
    return err;
  }
  Decision d;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    d = decide_locked(OpKind::kRead, offset, length);
  }
  if (fails(d.kind)) {
    std::memset(buf, kPoison, length);
    return error_of(d.kind);
  }
  if (d.kind == static_cast<int>(FaultKind::kShort)) {
    return d.bytes == 0 ? 0 : inner_->read_page(buf, static_cast<size_t>(d.bytes), offset);
  }
  const int64_t r = inner_->read_page(buf, length, offset);
  if (d.kind == static_cast<int>(FaultKind::kFlipByte) && r == static_cast<int64_t>(length)) {
    auto* bytes = static_cast<char*>(buf);
    bytes[d.flip_at] = static_cast<char>(bytes[d.flip_at] ^ d.flip_mask);
  }
  return r;
}

int64_t FaultInjector::write_page(const void* buf, size_t length, int64_t offset) {
  const int err = check_transfer(inner_->file(), buf, length, offset);
  if (err < 0) {
    return err;
  }
  Decision d;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    d = decide_locked(OpKind::kWrite, offset, length);
  }
  if (fails(d.kind)) {
    return error_of(d.kind);
  }
  if (d.kind == static_cast<int>(FaultKind::kShort)) {
    return d.bytes == 0 ? 0 : inner_->write_page(buf, static_cast<size_t>(d.bytes), offset);
  }
  if (d.kind == static_cast<int>(FaultKind::kFlipByte)) {
    const AlignedCopy copy = flipped_copy(buf, length, d);
    if (copy == nullptr) {
      return -ENOMEM;
    }
    return inner_->write_page(copy.get(), length, offset);
  }
  return inner_->write_page(buf, length, offset);
}

std::unique_ptr<FaultInjectingEngine> make_fault_injecting_engine(std::unique_ptr<IoEngine> inner,
                                                                  std::vector<FaultRule> rules) {
  if (inner == nullptr) {
    return nullptr;
  }
  auto engine = std::make_unique<FaultInjector>(std::move(inner));
  if (engine->set_rules(std::move(rules)) < 0) {
    return nullptr;
  }
  return engine;
}

}  // namespace pagedoptim::io
