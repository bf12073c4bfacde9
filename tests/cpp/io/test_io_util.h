// Shared helpers of the io tests: scratch directories, aligned buffers, page patterns.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

// Readable parameter names in test output ("io_uring" instead of a byte dump).
inline void PrintTo(Backend backend, std::ostream* os) {
  *os << backend_name(backend);
}

}  // namespace pagedoptim::io

namespace pagedoptim::io::test {

inline std::string tmp_base() {
  const char* dir = std::getenv("TMPDIR");
  return dir != nullptr && *dir != '\0' ? dir : "/tmp";
}

inline bool has_dev_shm() {
  struct stat st {};
  return ::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0;
}

// A mkdtemp directory, removed with the (flat) files inside it.
class TempDir {
 public:
  explicit TempDir(const std::string& base = tmp_base()) {
    std::string templ = base + "/pagedoptim-io-test-XXXXXX";
    if (::mkdtemp(templ.data()) != nullptr) {
      path_ = templ;
    }
  }
  ~TempDir() {
    if (path_.empty()) {
      return;
    }
    if (DIR* d = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          ::unlink((path_ + "/" + e->d_name).c_str());
        }
      }
      ::closedir(d);
    }
    ::rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Page-aligned memory, as O_DIRECT needs and as the pager's host slots are.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size)
      : size_(size),
        data_(static_cast<char*>(std::aligned_alloc(kDirectAlignment, round_up(size)))) {
    std::memset(data_.get(), 0, size_);
  }
  static size_t round_up(size_t n) {
    return (n + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  }
  char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  char* page(size_t index, size_t page_bytes) const { return data_.get() + index * page_bytes; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  size_t size_;
  std::unique_ptr<char, Free> data_;
};

// Deterministic contents for (page, generation), so that a read can be checked without
// keeping a copy of what was written.
inline void fill_page(void* dst, size_t bytes, uint64_t page, uint64_t generation) {
  uint64_t x = page * 0x9E3779B97F4A7C15ull + generation * 0xD1B54A32D192ED03ull + 1;
  auto* p = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < bytes; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, std::min<size_t>(8, bytes - i));
  }
}

inline bool page_matches(const void* src, size_t bytes, uint64_t page, uint64_t generation) {
  std::vector<unsigned char> expected(bytes);
  fill_page(expected.data(), bytes, page, generation);
  return std::memcmp(src, expected.data(), bytes) == 0;
}

inline bool backend_available(Backend backend) {
  return backend != Backend::kIoUring || probe_io_uring().available;
}

// Skips (by the capability probe, never by error text) when io_uring is refused here.
#define PO_SKIP_IF_REFUSED(backend)                                                      \
  do {                                                                                    \
    if (!::pagedoptim::io::test::backend_available(backend)) {                            \
      GTEST_SKIP() << "io_uring refused: " << ::pagedoptim::io::probe_io_uring().reason;  \
    }                                                                                     \
  } while (0)

inline std::unique_ptr<IoEngine> make_engine(Backend backend, uint32_t queue_depth,
                                             uint32_t posix_threads = 4) {
  EngineOptions options;
  options.backend = backend;
  options.queue_depth = queue_depth;
  options.posix_threads = posix_threads;
  int err = 0;
  auto engine = make_io_engine(options, &err);
  EXPECT_NE(engine, nullptr) << "make_io_engine(" << backend_name(backend) << "): " << err;
  return engine;
}

// Reaps exactly `count` completions; a wait that times out fails the test instead of
// hanging it.
inline std::vector<IoCompletion> reap(IoEngine& engine, size_t count) {
  std::vector<IoCompletion> all;
  std::vector<IoCompletion> batch(16);
  while (all.size() < count) {
    const int n = engine.wait(batch, std::chrono::seconds(30));
    if (n <= 0) {
      ADD_FAILURE() << "wait returned " << n << " with " << all.size() << " of " << count
                    << " completions reaped";
      break;
    }
    all.insert(all.end(), batch.begin(), batch.begin() + n);
  }
  return all;
}

inline const char* short_name(Backend backend) {
  return backend == Backend::kIoUring ? "IoUring" : "Posix";
}

inline std::string backend_param_name(const ::testing::TestParamInfo<Backend>& info) {
  return short_name(info.param);
}

}  // namespace pagedoptim::io::test
