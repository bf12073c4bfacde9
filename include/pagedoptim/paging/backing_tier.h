// Where pages live while they are not in the cache: a second pool of host memory (pinned
// host memory on a CUDA machine) or a page file on NVMe, behind one asynchronous interface.
//
// A tier moves whole pages between itself and cache slots the caller owns. Page p of the
// file tier lives at byte offset p * page_bytes. Like the io layer below it, submit() and
// wait() return negative errnos instead of throwing; only construction and grow() throw
// (PageIoError), because a store cannot work at all when they fail.
//
// Thread safety: submit() and wait() may run concurrently on two threads (the pager's
// submitter and reaper); grow() and the accessors need no I/O in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::paging {

struct TierRequest {
  io::OpKind op = io::OpKind::kRead;
  int32_t page = 0;
  std::byte* slot = nullptr;  // page_bytes of cache memory, 4 KiB aligned
  uint64_t tag = 0;
};

// result: bytes moved (page_bytes on success) or a negative errno.
struct TierCompletion {
  uint64_t tag = 0;
  int64_t result = 0;
};

// What a tier reports about itself for paging_stats() and the Python warnings.
struct TierInfo {
  std::string name;      // "host" or "nvme"
  std::string location;  // the page file's path, or "host memory"
  std::string backend;   // "memcpy", "io_uring" or "posix"
  std::string fallback_reason;  // why io_uring is not in use; empty when it is
  std::string direct;           // O_DIRECT status (io::direct_status_name)
  std::string direct_reason;    // why O_DIRECT was refused; empty otherwise
};

class BackingTier {
 public:
  virtual ~BackingTier() = default;

  virtual const TierInfo& info() const noexcept = 0;
  virtual int64_t page_bytes() const noexcept = 0;

  // Makes room for pages [0, num_pages). The file tier reserves the disk space up front
  // (fallocate), so that a disk too small for the state fails here, before a step, rather
  // than as ENOSPC in the middle of one. Throws PageIoError.
  virtual void grow(int32_t num_pages) = 0;

  // Queues every request (count) or none (-errno). Never waits for the device.
  virtual int submit(std::span<const TierRequest> requests) = 0;
  // Completions of earlier submits: blocks until at least one is available or a short
  // timeout passes (-ETIME); 0 at once when nothing is in flight; other -errno: the tier
  // failed as a whole and the requests in flight will not complete.
  virtual int wait(std::span<TierCompletion> out) = 0;

  // The fault-injecting engine under the file tier when it was built with one (tests).
  virtual io::FaultInjectingEngine* fault_injector() noexcept { return nullptr; }
};

// Pages in host memory, one 4 KiB aligned buffer per page, allocated on the page's first
// write-back. submit() copies on the calling thread. Plain memory: the cache is host memory
// too in this CPU build; a CUDA cache would want these buffers pinned for its copy engine.
std::unique_ptr<BackingTier> make_host_tier(int64_t page_bytes);

struct FileTierOptions {
  // Directory of the page file; empty: $TMPDIR, else /tmp.
  std::string dir;
  int64_t page_bytes = 2 << 20;
  io::EngineOptions engine;
  io::DirectMode direct = io::DirectMode::kAuto;
  // Faults to inject (tests); the engine is wrapped in a FaultInjectingEngine when set, or
  // when inject_faults is true (so that rules can be set later).
  std::vector<io::FaultRule> faults;
  bool inject_faults = false;
};

// Opens a page file in a private mkdtemp directory under options.dir, mode 0600, and
// removes both names at once: the open descriptor keeps the file alive, and the kernel
// frees it when the tier closes it, even if the process is killed. Throws PageIoError.
std::unique_ptr<BackingTier> make_file_tier(const FileTierOptions& options);

}  // namespace pagedoptim::paging
