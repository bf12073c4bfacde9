// Where the core starts its threads, so that a test can make a start fail.
//
// Creating a thread fails when the system is out of them (std::system_error, EAGAIN), which
// happens under load: two training ranks and their torch threads on a small machine. An
// object that owns threads must then stop the ones it had started and throw. Destroying a
// joinable std::thread instead calls std::terminate ("terminate called without an active
// exception"), taking the training process with it. Every thread of the core (the pager's,
// the io engines', the simulated device's) starts here; tests arm a failure with
// testing::fail_thread_start and check that nothing is left running.
#pragma once

#include <functional>
#include <thread>

namespace pagedoptim {

std::thread start_thread(std::function<void()> body);

namespace testing {
// The `nth` start from now (1: the next) throws std::system_error(EAGAIN), as the system
// would; 0 or a negative value disarms. For tests only.
void fail_thread_start(int nth);
}  // namespace testing

}  // namespace pagedoptim
