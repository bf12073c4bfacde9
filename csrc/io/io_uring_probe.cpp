// probe_io_uring(): can this process use io_uring at all?
#include <cerrno>
#include <cstring>
#include <string>

#include "pagedoptim/io/io_engine.h"

#if PAGEDOPTIM_HAVE_IO_URING
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>
#endif

namespace pagedoptim::io {
namespace {

IoUringSupport refused(int err, std::string why) {
  IoUringSupport s;
  s.available = false;
  s.error = err;
  s.reason = std::move(why);
  return s;
}

#if PAGEDOPTIM_HAVE_IO_URING

std::string describe(const char* step, int err) {
  return std::string("io_uring is unavailable (") + step + ": " + std::strerror(-err) + ")";
}

// One read through a real ring, from a pipe that already holds a byte, so the kernel
// completes it at once. Some sandboxes allow io_uring_setup and then fail or stall the
// requests themselves; this catches both, within a deadline.
IoUringSupport probe_read(io_uring& ring) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return refused(-errno, describe("pipe for the probe read", -errno));
  }
  const char sent = 'p';
  char got = 0;
  IoUringSupport result;
  if (::write(fds[1], &sent, 1) != 1) {
    result = refused(-EIO, describe("write to the probe pipe", -EIO));
  } else if (io_uring_sqe* sqe = io_uring_get_sqe(&ring); sqe == nullptr) {
    result = refused(-EBUSY, describe("io_uring_get_sqe", -EBUSY));
  } else {
    io_uring_prep_read(sqe, fds[0], &got, 1, 0);
    const int submitted = io_uring_submit(&ring);
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec deadline{};
    deadline.tv_sec = 2;
    const int waited = submitted == 1 ? io_uring_wait_cqe_timeout(&ring, &cqe, &deadline)
                                      : (submitted < 0 ? submitted : -EIO);
    if (waited < 0) {
      result = refused(waited, describe("probe read", waited));
    } else if (cqe->res != 1 || got != sent) {
      const int err = cqe->res < 0 ? cqe->res : -EIO;
      result = refused(err, describe("probe read result", err));
    } else {
      result.available = true;
    }
    if (cqe != nullptr) {
      io_uring_cqe_seen(&ring, cqe);
    }
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return result;
}

IoUringSupport run_probe() {
  io_uring ring;
  const int err = io_uring_queue_init(4, &ring, 0);
  if (err < 0) {
    return refused(err, describe("io_uring_queue_init", err));
  }
  IoUringSupport result;
  io_uring_probe* ops = io_uring_get_probe_ring(&ring);
  if (ops == nullptr) {
    result = refused(-ENOSYS, "io_uring is unavailable (the kernel cannot report its opcodes; "
                              "it predates Linux 5.6)");
  } else {
    const bool complete = io_uring_opcode_supported(ops, IORING_OP_READ) &&
                          io_uring_opcode_supported(ops, IORING_OP_WRITE) &&
                          io_uring_opcode_supported(ops, IORING_OP_READ_FIXED) &&
                          io_uring_opcode_supported(ops, IORING_OP_WRITE_FIXED);
    io_uring_free_probe(ops);
    result = complete ? probe_read(ring)
                      : refused(-ENOSYS, "io_uring is unavailable (the kernel lacks "
                                         "IORING_OP_READ/WRITE; Linux 5.6 or newer is needed)");
  }
  io_uring_queue_exit(&ring);
  return result;
}

#else

IoUringSupport run_probe() {
  return refused(-ENOSYS,
                 "io_uring is unavailable (this build has no io_uring backend: "
                 "PAGEDOPTIM_WITH_IO_URING=OFF or liburing was not found)");
}

#endif

}  // namespace

const IoUringSupport& probe_io_uring() {
  static const IoUringSupport support = run_probe();
  return support;
}

}  // namespace pagedoptim::io
