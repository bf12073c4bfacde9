// measure_sequential_bandwidth(): the disk's sequential and mixed read/write limits as seen
// through our engine.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {
namespace {

// A healthy disk finishes one block in far less; a wait this long means the device hangs.
constexpr std::chrono::milliseconds kBlockTimeout{60'000};

struct FreeDeleter {
  void operator()(char* p) const noexcept { std::free(p); }
};

enum class PassKind { kWrite, kRead, kMixed };

// The n-th request of a pass. A mixed pass alternates: even n read block n/2 of the first
// half, odd n overwrite block n/2 of the second half (which starts at block half_blocks),
// so from its first two requests on it has reads and writes in flight together.
IoRequest request_for(PassKind kind, int64_t n, int64_t half_blocks, uint32_t block_bytes,
                      uint32_t slot) {
  OpKind op = kind == PassKind::kRead ? OpKind::kRead : OpKind::kWrite;
  int64_t block = n;
  if (kind == PassKind::kMixed) {
    op = n % 2 == 0 ? OpKind::kRead : OpKind::kWrite;
    block = n / 2 + (op == OpKind::kWrite ? half_blocks : 0);
  }
  const int64_t offset = block * static_cast<int64_t>(block_bytes);
  const auto index = static_cast<int32_t>(slot);
  return op == OpKind::kRead ? IoRequest::read_fixed(index, block_bytes, offset, slot)
                             : IoRequest::write_fixed(index, block_bytes, offset, slot);
}

// Keeps every buffer slot busy: whenever a request completes, the next block goes into
// the slot it freed. `requests` counts the requests of the pass (for kMixed, reads and
// writes together). Returns seconds, or sets *error.
double run_pass(IoEngine& engine, PassKind kind, uint32_t slots, uint32_t block_bytes,
                int64_t requests, int64_t half_blocks, int* error) {
  std::vector<uint32_t> free_slots(slots);
  for (uint32_t i = 0; i < slots; ++i) {
    free_slots[i] = slots - 1 - i;
  }
  std::vector<IoRequest> batch;
  std::vector<IoCompletion> done(slots);
  batch.reserve(slots);
  int64_t next = 0;
  int64_t finished = 0;
  const auto start = std::chrono::steady_clock::now();
  while (finished < requests) {
    batch.clear();
    while (!free_slots.empty() && next < requests) {
      const uint32_t slot = free_slots.back();
      free_slots.pop_back();
      batch.push_back(request_for(kind, next, half_blocks, block_bytes, slot));
      ++next;
    }
    if (!batch.empty()) {
      const int err = engine.submit(batch);
      if (err < 0) {
        *error = err;
        return 0.0;
      }
    }
    const int n = engine.wait(done, kBlockTimeout);
    if (n < 0) {
      *error = n;
      return 0.0;
    }
    for (int i = 0; i < n; ++i) {
      if (done[i].result != static_cast<int64_t>(block_bytes)) {
        *error = done[i].result < 0 ? static_cast<int>(done[i].result) : -EIO;
      }
      free_slots.push_back(static_cast<uint32_t>(done[i].tag));
    }
    finished += n;
    if (*error < 0) {
      // Let what is in flight land before the buffers go away.
      while (engine.in_flight() > 0 && engine.wait(done, kBlockTimeout) > 0) {
      }
      return 0.0;
    }
  }
  if (kind != PassKind::kRead) {
    const int err = engine.sync();
    if (err < 0) {
      *error = err;
      return 0.0;
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

BandwidthResult measure_sequential_bandwidth(const BandwidthOptions& options) {
  BandwidthResult result;
  if (options.dir.empty() || options.block_bytes == 0 ||
      options.block_bytes % kDirectAlignment != 0 || options.queue_depth == 0 ||
      options.queue_depth > kMaxQueueDepth ||
      options.file_bytes / std::max<int64_t>(options.block_bytes, 1) < 2) {
    result.error = -EINVAL;
    return result;
  }
  const int64_t blocks = options.file_bytes / options.block_bytes;

  EngineOptions engine_options;
  engine_options.backend = options.backend;
  engine_options.queue_depth = options.queue_depth;
  // For POSIX, transfers in flight are threads; give it the same depth as io_uring, within
  // reason.
  engine_options.posix_threads = std::min<uint32_t>(options.queue_depth, 64);
  int err = 0;
  std::unique_ptr<IoEngine> engine = make_io_engine(engine_options, &err);
  if (engine == nullptr) {
    result.error = err;
    return result;
  }
  result.backend = engine->backend();
  result.fallback_reason = engine->fallback_reason();

  std::string path = options.dir + "/pagedoptim-bandwidth-XXXXXX";
  const int tmp = ::mkstemp(path.data());
  if (tmp < 0) {
    result.error = -errno;
    return result;
  }
  ::close(tmp);
  OpenOptions open_options;
  open_options.truncate = true;
  open_options.direct = options.direct;
  err = engine->open(path, open_options);
  // The open descriptor keeps the data alive; the name goes now so that nothing is left
  // behind, whatever happens next.
  ::unlink(path.c_str());
  if (err < 0) {
    result.error = err;
    return result;
  }
  result.direct = engine->file().direct;
  result.direct_reason = engine->file().direct_reason;

  const size_t total = static_cast<size_t>(options.queue_depth) * options.block_bytes;
  std::unique_ptr<char, FreeDeleter> memory(
      static_cast<char*>(std::aligned_alloc(kDirectAlignment, total)));
  if (memory == nullptr) {
    result.error = -ENOMEM;
    return result;
  }
  // Incompressible data, so that no layer below can make the disk look faster.
  std::mt19937_64 rng(0x5eed);
  for (size_t i = 0; i + sizeof(uint64_t) <= total; i += sizeof(uint64_t)) {
    const uint64_t v = rng();
    std::memcpy(memory.get() + i, &v, sizeof(v));
  }
  std::vector<iovec> slots(options.queue_depth);
  for (uint32_t i = 0; i < options.queue_depth; ++i) {
    slots[i] = iovec{memory.get() + static_cast<size_t>(i) * options.block_bytes,
                     options.block_bytes};
  }
  err = engine->register_buffers(slots);
  if (err < 0) {
    result.error = err;
    return result;
  }

  err = 0;
  const uint32_t depth = options.queue_depth;
  const uint32_t block = options.block_bytes;
  const int64_t half_blocks = blocks / 2;
  // Written back by the fdatasync that ends every writing pass, the pages are clean and can
  // be dropped, so a read reads the disk rather than the page cache.
  const auto drop_cached_pages = [&engine] {
    if (!engine->file().is_direct()) {
      ::posix_fadvise(engine->file().fd, 0, 0, POSIX_FADV_DONTNEED);
    }
  };
  const double write_seconds =
      run_pass(*engine, PassKind::kWrite, depth, block, blocks, half_blocks, &err);
  if (err == 0) {
    drop_cached_pages();
  }
  const double read_seconds =
      err == 0 ? run_pass(*engine, PassKind::kRead, depth, block, blocks, half_blocks, &err)
               : 0.0;
  if (err == 0) {
    drop_cached_pages();
  }
  const double mixed_seconds =
      err == 0
          ? run_pass(*engine, PassKind::kMixed, depth, block, 2 * half_blocks, half_blocks, &err)
          : 0.0;
  engine->unregister_buffers();
  engine->close();
  if (err < 0) {
    result.error = err;
    return result;
  }
  result.bytes = blocks * static_cast<int64_t>(options.block_bytes);
  result.write_seconds = write_seconds;
  result.read_seconds = read_seconds;
  const auto gb = static_cast<double>(result.bytes) / 1e9;
  result.write_gb_per_s = write_seconds > 0 ? gb / write_seconds : 0.0;
  result.read_gb_per_s = read_seconds > 0 ? gb / read_seconds : 0.0;
  result.mixed_bytes = 2 * half_blocks * static_cast<int64_t>(options.block_bytes);
  result.mixed_seconds = mixed_seconds;
  result.mixed_gb_per_s =
      mixed_seconds > 0 ? static_cast<double>(result.mixed_bytes) / 1e9 / mixed_seconds : 0.0;
  return result;
}

}  // namespace pagedoptim::io
