// The part of an engine that is about the file, not the queue: open with the O_DIRECT
// probe, close, reserve, sync and the blocking single-page transfers. Both backends derive
// from it; only submission and completion differ between them.
#pragma once

#include <string>

#include "pagedoptim/io/io_engine.h"

namespace pagedoptim::io {

class FileEngine : public IoEngine {
 public:
  int open(const std::string& path, const OpenOptions& options) final;
  int close() final;
  const FileInfo& file() const noexcept final { return file_; }
  int reserve(int64_t bytes) final;
  int sync() final;
  int64_t read_page(void* buf, size_t length, int64_t offset) final;
  int64_t write_page(const void* buf, size_t length, int64_t offset) final;

 protected:
  // Called with the file open (0 or -errno; on error the file is closed again) and just
  // before it is closed: io_uring registers the descriptor with the ring.
  virtual int after_open() { return 0; }
  virtual void before_close() {}

  // Written only by open() and close(), which the contract keeps away from every other
  // call; workers read it after taking the lock that published their request.
  FileInfo file_;
};

}  // namespace pagedoptim::io
