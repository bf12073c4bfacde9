// Page I/O on one page file: the torch-free interface the pager talks to.
//
// An IoEngine owns one open file and moves whole pages between it and caller-owned memory.
// Two backends implement it: io_uring (liburing; batched submission, registered buffers) and
// POSIX (pread/pwrite on a small thread pool). make_io_engine() probes io_uring at run time
// and falls back to POSIX when the kernel or a sandbox refuses it, recording why.
//
// Error model. Nothing in this layer throws and nothing aborts on bad input: every function
// that can fail returns a negative errno (like liburing; print it with strerror(-ret)) and
// every completion carries either the number of bytes moved or a negative errno. The binding
// layer turns these into Python exceptions that name the path and the errno, once.
//
// Thread safety. All members of an engine may be called concurrently from any number of
// threads, with these exceptions:
//   * open(), close(), register_buffers(), unregister_buffers() and the destructor must not
//     run concurrently with any other call on the same engine. The first four return -EBUSY
//     while requests are in flight; the destructor waits for in-flight requests to finish,
//     because the kernel may still be writing into the caller's buffers.
//   * A completion is delivered exactly once, to whichever thread reaps it (poll or wait).
//     With more than one reaping thread, route completions by tag.
// read_page() and write_page() run on the calling thread, directly on the file descriptor;
// they do not use the submission queue, so they can never reap (steal) a completion that
// another thread is waiting for.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace pagedoptim::io {

// O_DIRECT transfers must have buffer address, file offset and length aligned to the
// device's logical block size. 4096 covers 512-byte and 4Kn devices alike and equals the
// page alignment of the pager, so one rule serves every device. Engines check it at submit
// time (-EINVAL) instead of letting the kernel fail the request later.
constexpr int64_t kDirectAlignment = 4096;

// Largest queue depth an engine accepts (io_uring's own limit for a submission queue).
constexpr uint32_t kMaxQueueDepth = 4096;

// wait() timeout that never expires.
constexpr std::chrono::milliseconds kWaitForever{-1};

enum class Backend : int {
  kAuto = 0,     // io_uring when the run-time probe accepts it, POSIX otherwise
  kIoUring = 1,  // io_uring or nothing (make_io_engine fails when it is refused)
  kPosix = 2,    // pread/pwrite on a thread pool
};
const char* backend_name(Backend backend) noexcept;

enum class OpKind : int { kRead = 0, kWrite = 1 };

// Whether open() asks for O_DIRECT (bypassing the page cache, so that cold pages do not
// evict the RAM the host cache needs and the disk bandwidth measured is the disk's).
enum class DirectMode : int {
  kAuto = 0,     // O_DIRECT when the file system allows it, buffered I/O otherwise
  kOff = 1,      // always buffered
  kRequire = 2,  // O_DIRECT or fail with -EINVAL
};

// What open() ended up with.
enum class DirectStatus : int {
  kClosed = 0,
  kDirect = 1,            // O_DIRECT is in use
  kBufferedRefused = 2,   // asked for O_DIRECT, the file system refused it (tmpfs on older
                          // kernels, some FUSE and network file systems): buffered I/O
  kBufferedByOption = 3,  // DirectMode::kOff
};
const char* direct_status_name(DirectStatus status) noexcept;

struct OpenOptions {
  bool create = true;     // O_CREAT, mode 0600 (page files hold private training state)
  bool truncate = false;  // O_TRUNC
  DirectMode direct = DirectMode::kAuto;
};

struct FileInfo {
  std::string path;
  int fd = -1;
  DirectStatus direct = DirectStatus::kClosed;
  int direct_errno = 0;       // errno with which O_DIRECT was refused, 0 otherwise
  std::string direct_reason;  // one sentence for a user-facing warning; empty when direct

  bool is_open() const noexcept { return fd >= 0; }
  bool is_direct() const noexcept { return direct == DirectStatus::kDirect; }
};

struct EngineOptions {
  Backend backend = Backend::kAuto;
  // Requests handed to the kernel at once (io_uring) or transfers running at once (POSIX,
  // bounded further by posix_threads). More requests may be submitted: the excess waits in
  // a software queue inside the engine and is issued as earlier requests complete.
  uint32_t queue_depth = 32;
  uint32_t posix_threads = 4;
};

// One read or write of `length` bytes at file offset `offset`.
//
// buf_index >= 0 names a buffer registered with register_buffers(); `buf` must then lie,
// with its length, inside that buffer, or be nullptr to mean the buffer's start. io_uring
// skips pinning and mapping the pages of a registered buffer on every request.
struct IoRequest {
  OpKind op = OpKind::kRead;
  int64_t offset = 0;
  void* buf = nullptr;
  uint32_t length = 0;
  int32_t buf_index = -1;
  uint64_t tag = 0;  // returned untouched in the completion; the engine never interprets it

  static IoRequest read(void* buf, uint32_t length, int64_t offset, uint64_t tag) noexcept {
    return {OpKind::kRead, offset, buf, length, -1, tag};
  }
  static IoRequest write(const void* buf, uint32_t length, int64_t offset, uint64_t tag) noexcept {
    return {OpKind::kWrite, offset, const_cast<void*>(buf), length, -1, tag};
  }
  static IoRequest read_fixed(int32_t buf_index, uint32_t length, int64_t offset, uint64_t tag,
                              void* buf = nullptr) noexcept {
    return {OpKind::kRead, offset, buf, length, buf_index, tag};
  }
  static IoRequest write_fixed(int32_t buf_index, uint32_t length, int64_t offset, uint64_t tag,
                               const void* buf = nullptr) noexcept {
    return {OpKind::kWrite, offset, const_cast<void*>(buf), length, buf_index, tag};
  }
};

// result: bytes moved, or a negative errno. The engines retry short transfers themselves
// (EINTR, EAGAIN, partial pread/pwrite), so a non-negative result below the request's
// length means end of file on a read and never happens on a write. A caller that needs the
// whole page checks result == length; anything else means the page was not moved.
struct IoCompletion {
  uint64_t tag = 0;
  int64_t result = 0;
};

class IoEngine {
 public:
  virtual ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  virtual Backend backend() const noexcept = 0;
  virtual uint32_t queue_depth() const noexcept = 0;

  // Why make_io_engine() did not give the backend the caller asked for (kAuto counts as
  // asking for io_uring); empty when it did. The Python layer shows it as a warning.
  const std::string& fallback_reason() const noexcept { return fallback_reason_; }
  void set_fallback_reason(std::string reason) { fallback_reason_ = std::move(reason); }

  // Opens (and with OpenOptions::create creates, mode 0600) the page file. With
  // DirectMode::kAuto it tries O_DIRECT first and falls back to buffered I/O when the file
  // system refuses it; file().direct says which is in use. 0 or -errno; -EBUSY when a file
  // is open already.
  virtual int open(const std::string& path, const OpenOptions& options = {}) = 0;
  // 0 or -errno; -EBUSY while requests are in flight. Unregisters nothing: registered
  // buffers belong to the engine, not the file.
  virtual int close() = 0;
  virtual const FileInfo& file() const noexcept = 0;

  // Reserves `bytes` of disk for the file (posix_fallocate), so that a full disk shows up
  // here, once, rather than as ENOSPC in the middle of a write-back. 0 or -errno.
  virtual int reserve(int64_t bytes) = 0;
  // fdatasync: written pages survive a crash once this returns 0.
  virtual int sync() = 0;

  // Registers the caller's buffers (the host page slots) for index-based I/O. The memory
  // stays owned by the caller and must outlive the registration. On io_uring the buffers
  // are also registered with the kernel when it allows (it may refuse for RLIMIT_MEMLOCK);
  // when it does not, index-based requests still work as plain requests and
  // fixed_buffers_in_kernel() says so. 0 or -errno (-EINVAL for a null or empty buffer).
  virtual int register_buffers(std::span<const iovec> buffers) = 0;
  virtual int unregister_buffers() = 0;
  virtual bool fixed_buffers_in_kernel() const noexcept = 0;

  // Queues every request of the batch, or none: a batch with an invalid request (no open
  // file, zero length, bad buffer index, misaligned for O_DIRECT, ...) returns -EINVAL (or
  // -EBADF when no file is open) and nothing is queued. Returns requests.size() otherwise.
  // Never blocks on the device: requests beyond the queue depth wait inside the engine.
  virtual int submit(std::span<const IoRequest> requests) = 0;
  // Completions available now, at most out.size(); never blocks. Count or -errno.
  virtual int poll(std::span<IoCompletion> out) = 0;
  // Blocks until at least one completion is available (returns how many were written to
  // out), until `timeout` passes (-ETIME), or returns 0 at once when nothing is in flight.
  virtual int wait(std::span<IoCompletion> out,
                   std::chrono::milliseconds timeout = kWaitForever) = 0;
  // Requests submitted whose completion has not been reaped yet.
  virtual int64_t in_flight() const noexcept = 0;

  // Blocking single-page transfers on the calling thread: bytes moved (== length unless a
  // read hits end of file) or -errno. Same alignment rules as submit().
  virtual int64_t read_page(void* buf, size_t length, int64_t offset) = 0;
  virtual int64_t write_page(const void* buf, size_t length, int64_t offset) = 0;

 protected:
  IoEngine() = default;

 private:
  std::string fallback_reason_;
};

// --- construction -----------------------------------------------------------------------

struct IoUringSupport {
  bool available = false;
  int error = 0;       // negative errno of the step that failed, 0 when available
  std::string reason;  // one sentence; empty when available
};

// Run-time capability probe, computed once per process: creates a small ring, checks the
// opcodes the engine uses and completes one tiny read through it within a deadline. A
// sandbox may refuse io_uring_setup (-ENOSYS, -EPERM) or let it succeed and break later;
// any failure counts as refused.
const IoUringSupport& probe_io_uring();

// Returns an engine with no file open, or nullptr with *error set (-EINVAL for options out
// of range, the probe's error when Backend::kIoUring was asked for and is refused). With
// Backend::kAuto it never fails for lack of io_uring: it returns a POSIX engine whose
// fallback_reason() says why.
std::unique_ptr<IoEngine> make_io_engine(const EngineOptions& options, int* error = nullptr);

// --- fault injection (for tests of the layers above) -----------------------------------

enum class FaultKind : int {
  kEnospc = 1,    // the write fails with -ENOSPC; nothing reaches the file
  kEio = 2,       // the request fails with -EIO; a failed read fills its buffer with 0xA5
                  // so that data used in spite of the error is visibly wrong
  kShort = 3,     // only short_bytes are transferred and reported (a torn write really
                  // leaves the file half written)
  kFlipByte = 4,  // the request succeeds but one byte is XORed with flip_mask: in the
                  // caller's buffer after a read, in the data that reaches the file on a
                  // write (the caller's buffer is left intact)
};

// Which requests a rule applies to (bit mask).
constexpr int kFaultReads = 1;
constexpr int kFaultWrites = 2;

// One rule, all plain integers so that it maps one-to-one onto a Python dataclass.
// A rule counts the requests it matches (op mask and offset range), numbered from 0 in the
// order they are submitted. It fires on request n when
//   n >= from_op  and  (every_nth == 0 or (n + 1) % every_nth == 0)
// until it has fired max_fires times. Examples: every request: defaults; every 3rd:
// every_nth = 3; from the 10th on: from_op = 9; only the 5th: from_op = 4, max_fires = 1.
// Rules are checked in order and the first that fires decides; all matching rules count
// the request. Both submit() and the blocking read_page()/write_page() count.
struct FaultRule {
  int kind = static_cast<int>(FaultKind::kEio);  // a FaultKind
  int ops = kFaultReads | kFaultWrites;
  int64_t every_nth = 0;
  int64_t from_op = 0;
  int64_t max_fires = -1;     // -1: no limit
  int64_t offset_begin = 0;   // the request must overlap [offset_begin, offset_end)
  int64_t offset_end = -1;    // -1: no end
  int64_t short_bytes = -1;   // kShort: bytes moved; -1 means half the request. Rounded
                              // down to kDirectAlignment on an O_DIRECT file.
  int64_t flip_at = 0;        // kFlipByte: byte index in the request, modulo its length
  int flip_mask = 0x01;       // kFlipByte: XOR mask, non-zero
};

// A decorator that forwards to another engine and injects the faults its rules describe.
// Same thread-safety contract as IoEngine. Its wait() returns injected failures within a
// few milliseconds even while another thread is blocked in the inner engine's wait.
class FaultInjectingEngine : public IoEngine {
 public:
  // Replaces the rules and resets their counters. -EINVAL (rules unchanged) for an unknown
  // kind, an empty op mask, negative every_nth or a zero flip_mask.
  virtual int set_rules(std::vector<FaultRule> rules) = 0;
  // How often each rule fired, in rule order.
  virtual std::vector<int64_t> fire_counts() const = 0;
  virtual IoEngine& inner() noexcept = 0;
};

// nullptr when inner is null or the rules are invalid.
std::unique_ptr<FaultInjectingEngine> make_fault_injecting_engine(
    std::unique_ptr<IoEngine> inner, std::vector<FaultRule> rules = {});

// --- sequential bandwidth (for benchmarks: the disk's limit as our own engine sees it) ---

struct BandwidthOptions {
  std::string dir;                 // a scratch file is created here and removed afterwards
  int64_t file_bytes = 256 << 20;  // rounded down to a multiple of block_bytes; at least two
                                   // blocks, so the mixed pass has one to read, one to write
  uint32_t block_bytes = 1 << 20;  // one request; a multiple of kDirectAlignment
  uint32_t queue_depth = 16;
  Backend backend = Backend::kAuto;
  DirectMode direct = DirectMode::kAuto;
};

struct BandwidthResult {
  int error = 0;  // 0 or the first negative errno; the figures are 0 when it is set
  Backend backend = Backend::kAuto;
  std::string fallback_reason;
  DirectStatus direct = DirectStatus::kClosed;
  std::string direct_reason;
  int64_t bytes = 0;
  int64_t mixed_bytes = 0;     // read + written in the mixed pass: bytes, rounded down to
                               // an even number of blocks
  double write_seconds = 0.0;  // includes the final fdatasync
  double read_seconds = 0.0;
  double mixed_seconds = 0.0;  // includes the final fdatasync
  double write_gb_per_s = 0.0;  // 1e9 bytes per second
  double read_gb_per_s = 0.0;
  double mixed_gb_per_s = 0.0;  // reads and writes together: mixed_bytes / mixed_seconds
};

// Three passes over one scratch file, each keeping queue_depth requests of block_bytes in
// flight into registered buffers:
//   write: the whole file sequentially, then fdatasync;
//   read:  the whole file sequentially;
//   mixed: the first half read while the second half is overwritten, requests alternating
//          read, write, read, ... on the same queue (then fdatasync), which is what the pager
//          does when it prefetches pages while writing evicted ones back.
// Before each read, buffered I/O drops the file from the page cache so that the disk, not
// memory, is measured; on tmpfs there is no disk behind it and the reads measure memory, by
// nature. The file's name is removed as soon as it is open, so no path leaves it behind.
BandwidthResult measure_sequential_bandwidth(const BandwidthOptions& options);

}  // namespace pagedoptim::io
