#include "pagedoptim/thread_start.h"

#include <atomic>
#include <cerrno>
#include <system_error>

namespace pagedoptim {
namespace {
// Starts left before the armed failure; 0: none armed.
std::atomic<int> starts_before_failure{0};
}  // namespace

std::thread start_thread(std::function<void()> body) {
  int left = starts_before_failure.load(std::memory_order_relaxed);
  while (left > 0 &&
         !starts_before_failure.compare_exchange_weak(left, left - 1,
                                                      std::memory_order_relaxed)) {
  }
  if (left == 1) {
    throw std::system_error(EAGAIN, std::generic_category(),
                            "thread start failed (injected by a test)");
  }
  return std::thread(std::move(body));
}

namespace testing {
void fail_thread_start(int nth) {
  starts_before_failure.store(nth > 0 ? nth : 0, std::memory_order_relaxed);
}
}  // namespace testing

}  // namespace pagedoptim
