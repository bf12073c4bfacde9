// The pieces of the public interface that belong to no backend: names, the base class
// and the factory.
#include "pagedoptim/io/io_engine.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "io/posix_engine.h"
#if PAGEDOPTIM_HAVE_IO_URING
#include "io/io_uring_engine.h"
#endif

namespace pagedoptim::io {

IoEngine::~IoEngine() = default;

const char* backend_name(Backend backend) noexcept {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kIoUring:
      return "io_uring";
    case Backend::kPosix:
      return "posix";
  }
  return "unknown";
}

const char* direct_status_name(DirectStatus status) noexcept {
  switch (status) {
    case DirectStatus::kClosed:
      return "closed";
    case DirectStatus::kDirect:
      return "direct";
    case DirectStatus::kBufferedRefused:
      return "buffered (O_DIRECT refused)";
    case DirectStatus::kBufferedByOption:
      return "buffered (by option)";
  }
  return "unknown";
}

namespace {

#if PAGEDOPTIM_HAVE_IO_URING
std::unique_ptr<IoEngine> make_io_uring(const EngineOptions& options, int* error,
                                        std::string* why) {
  const IoUringSupport& support = probe_io_uring();
  if (!support.available) {
    *error = support.error;
    *why = support.reason;
    return nullptr;
  }
  auto engine = IoUringEngine::create(options.queue_depth, error);
  if (engine == nullptr) {
    *why = std::string("io_uring ring of depth ") + std::to_string(options.queue_depth) +
           " could not be set up (" + std::strerror(-*error) + ")";
  }
  return engine;
}
#else
std::unique_ptr<IoEngine> make_io_uring(const EngineOptions&, int* error, std::string* why) {
  const IoUringSupport& support = probe_io_uring();
  *error = support.error;
  *why = support.reason;
  return nullptr;
}
#endif

}  // namespace

std::unique_ptr<IoEngine> make_io_engine(const EngineOptions& options, int* error) {
  int local_error = 0;
  int& err = error != nullptr ? *error : local_error;
  err = 0;
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth ||
      options.posix_threads == 0) {
    err = -EINVAL;
    return nullptr;
  }
  std::string why;
  if (options.backend == Backend::kAuto || options.backend == Backend::kIoUring) {
    auto engine = make_io_uring(options, &err, &why);
    if (engine != nullptr || options.backend == Backend::kIoUring) {
      return engine;
    }
  } else if (options.backend != Backend::kPosix) {
    err = -EINVAL;
    return nullptr;
  }
  auto engine = PosixEngine::create(options.queue_depth, options.posix_threads, &err);
  if (engine != nullptr) {
    engine->set_fallback_reason(why.empty() ? why : why + "; using the POSIX pread/pwrite backend");
  }
  return engine;
}

}  // namespace pagedoptim::io
