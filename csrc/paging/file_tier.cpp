// The NVMe tier: one page file driven by an io engine (io_uring, or POSIX as the fallback).
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "pagedoptim/paging/backing_tier.h"
#include "pagedoptim/paging/page_errors.h"

namespace pagedoptim::paging {
namespace {

// How long the reaper sleeps in the engine before it looks at its own state again.
constexpr std::chrono::milliseconds kWaitSlice{100};

std::string default_dir() {
  const char* dir = std::getenv("TMPDIR");
  return dir != nullptr && *dir != '\0' ? dir : "/tmp";
}

class FileTier final : public BackingTier {
 public:
  explicit FileTier(const FileTierOptions& options) : page_bytes_(options.page_bytes) {
    if (page_bytes_ <= 0 || page_bytes_ % io::kDirectAlignment != 0 || page_bytes_ > (1 << 30)) {
      throw std::invalid_argument("page_bytes of the nvme tier must be a multiple of 4096 "
                                  "between 4096 and 1 GiB, got " + std::to_string(page_bytes_));
    }
    const std::string base = options.dir.empty() ? default_dir() : options.dir;
    std::string dir = base + "/pagedoptim-XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) {
      const int err = errno;
      throw PageIoError(err, base, -1,
                        "cannot create a private directory for the page file in " + base);
    }
    path_ = dir + "/pages";
    int err = 0;
    std::unique_ptr<io::IoEngine> engine = io::make_io_engine(options.engine, &err);
    if (engine == nullptr) {
      ::rmdir(dir.c_str());
      throw PageIoError(-err, path_, -1,
                        std::string("no io engine for the page file (backend ") +
                            io::backend_name(options.engine.backend) + ")");
    }
    info_.fallback_reason = engine->fallback_reason();
    info_.backend = io::backend_name(engine->backend());
    if (options.inject_faults || !options.faults.empty()) {
      injector_ = io::make_fault_injecting_engine(std::move(engine), options.faults).release();
      if (injector_ == nullptr) {
        ::rmdir(dir.c_str());
        throw std::invalid_argument("invalid fault injection rules");
      }
      engine_.reset(injector_);
    } else {
      engine_ = std::move(engine);
    }
    io::OpenOptions open_options;
    open_options.create = true;
    open_options.truncate = true;
    open_options.direct = options.direct;
    err = engine_->open(path_, open_options);
    // Both names go now, whatever happened: the descriptor keeps the file, and nothing is
    // left behind on disk when the process dies without running destructors.
    ::unlink(path_.c_str());
    ::rmdir(dir.c_str());
    if (err < 0) throw PageIoError(-err, path_, -1, "cannot open the page file " + path_);
    const io::FileInfo& file = engine_->file();
    info_.name = "nvme";
    info_.location = path_;
    info_.direct = io::direct_status_name(file.direct);
    info_.direct_reason = file.direct_reason;
  }

  ~FileTier() override {
    // The engine's destructor waits for requests the kernel still holds; close() then
    // releases the descriptor and with it the (already unlinked) file's blocks.
    engine_->close();
  }

  const TierInfo& info() const noexcept override { return info_; }
  int64_t page_bytes() const noexcept override { return page_bytes_; }

  void grow(int32_t num_pages) override {
    const int err = engine_->reserve(int64_t(num_pages) * page_bytes_);
    // File systems without fallocate (and without glibc's emulation) get no reservation;
    // a full disk then surfaces at a write-back, which keeps the page in memory.
    if (err < 0 && err != -EOPNOTSUPP && err != -ENOSYS && err != -EINVAL) {
      throw PageIoError(-err, path_, -1,
                        "cannot reserve " + std::to_string(int64_t(num_pages) * page_bytes_) +
                            " bytes for " + std::to_string(num_pages) +
                            " pages of optimizer state in " + path_);
    }
  }

  int submit(std::span<const TierRequest> requests) override {
    std::vector<io::IoRequest> batch;
    batch.reserve(requests.size());
    for (const TierRequest& r : requests) {
      const int64_t offset = int64_t(r.page) * page_bytes_;
      batch.push_back(r.op == io::OpKind::kRead
                          ? io::IoRequest::read(r.slot, uint32_t(page_bytes_), offset, r.tag)
                          : io::IoRequest::write(r.slot, uint32_t(page_bytes_), offset, r.tag));
    }
    return engine_->submit(batch);
  }

  int wait(std::span<TierCompletion> out) override {
    std::vector<io::IoCompletion> done(out.size());
    const int n = engine_->wait(done, kWaitSlice);
    for (int i = 0; i < n; ++i) {
      out[size_t(i)] = TierCompletion{done[size_t(i)].tag, done[size_t(i)].result};
    }
    return n;
  }

  io::FaultInjectingEngine* fault_injector() noexcept override { return injector_; }

 private:
  const int64_t page_bytes_;
  std::string path_;
  TierInfo info_;
  std::unique_ptr<io::IoEngine> engine_;
  io::FaultInjectingEngine* injector_ = nullptr;  // engine_ when faults are injected
};

}  // namespace

std::unique_ptr<BackingTier> make_file_tier(const FileTierOptions& options) {
  return std::make_unique<FileTier>(options);
}

}  // namespace pagedoptim::paging
