// Shared helpers of the pager tests: scratch directories, tiers, page patterns, and a step
// loop that pins a plan the way the step driver does.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pagedoptim/io/io_engine.h"
#include "pagedoptim/paging/backing_tier.h"
#include "pagedoptim/paging/tiered_page_store.h"

namespace pagedoptim::paging::test {

// A mkdtemp directory under $TMPDIR (or /tmp), removed (with flat contents) at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base != nullptr && *base ? base : "/tmp") +
                        "/pagedoptim-paging-test-XXXXXX";
    if (::mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    for (const std::string& name : entries()) ::unlink((path_ + "/" + name).c_str());
    ::rmdir(path_.c_str());
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          names.emplace_back(e->d_name);
        }
      }
      ::closedir(d);
    }
    return names;
  }

 private:
  std::string path_;
};

// "host", "posix" (nvme tier over pread/pwrite) or "io_uring" (nvme tier over io_uring).
inline std::unique_ptr<BackingTier> make_test_tier(const std::string& kind, int64_t page_bytes,
                                                   const std::string& dir,
                                                   bool inject_faults = false) {
  if (kind == "host") return make_host_tier(page_bytes);
  FileTierOptions options;
  options.dir = dir;
  options.page_bytes = page_bytes;
  options.engine.backend = kind == "io_uring" ? io::Backend::kIoUring : io::Backend::kPosix;
  options.engine.queue_depth = 8;
  options.inject_faults = inject_faults;
  return make_file_tier(options);
}

inline bool io_uring_usable() { return io::probe_io_uring().available; }

// Page contents that tell every (page, version) apart in every 8-byte word.
inline uint64_t pattern_word(int32_t page, int64_t version, size_t i) {
  uint64_t x = (uint64_t(uint32_t(page)) << 40) ^ (uint64_t(version) << 20) ^ uint64_t(i);
  x *= 0x9E3779B97F4A7C15ull;
  return x ^ (x >> 29);
}

inline void fill_page(std::byte* bytes, int64_t page_bytes, int32_t page, int64_t version) {
  auto* words = reinterpret_cast<uint64_t*>(bytes);
  for (size_t i = 0; i < size_t(page_bytes / 8); ++i) words[i] = pattern_word(page, version, i);
}

// Version 0 is the zero page every new page starts as.
inline bool page_matches(const std::byte* bytes, int64_t page_bytes, int32_t page,
                         int64_t version) {
  const auto* words = reinterpret_cast<const uint64_t*>(bytes);
  for (size_t i = 0; i < size_t(page_bytes / 8); ++i) {
    const uint64_t expected = version == 0 ? 0 : pattern_word(page, version, i);
    if (words[i] != expected) return false;
  }
  return true;
}

// Pins `plan` in batches of pin_limit() like the step driver, calls body on each page of a
// batch once the batch is pinned, and unpins the batch as written. A failed pin unpins the
// batch's pinned pages unchanged and rethrows; an unpin may throw the step's write error.
inline void run_step(PageStore& store, const std::vector<int32_t>& plan,
                     const std::function<void(int32_t, std::byte*)>& body) {
  store.plan(plan);
  const size_t batch = size_t(std::max(1, store.pin_limit()));
  std::vector<std::byte*> bytes(plan.size());
  for (size_t begin = 0; begin < plan.size(); begin += batch) {
    const size_t end = std::min(plan.size(), begin + batch);
    size_t pinned = begin;
    try {
      for (; pinned < end; ++pinned) bytes[pinned] = store.pin(plan[pinned]);
    } catch (...) {
      for (size_t i = begin; i < pinned; ++i) store.unpin(plan[i], false);
      throw;
    }
    for (size_t i = begin; i < end; ++i) body(plan[i], bytes[i]);
    for (size_t i = begin; i < end; ++i) store.unpin(plan[i], true);
  }
}

}  // namespace pagedoptim::paging::test
