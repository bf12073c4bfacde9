// Run-time choice of the kernel table: the widest ISA both compiled in and supported by
// the CPU we run on (a wheel built on one machine must run on an older one).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/step_kernels.h"

namespace pagedoptim::kernels {

namespace baseline { extern const CpuKernelTable kTable; }
#if defined(__x86_64__)
namespace avx2 { extern const CpuKernelTable kTable; }
namespace avx512 { extern const CpuKernelTable kTable; }
#endif

bool cpu_runs_isa(const char* isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (std::strcmp(isa, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return std::strcmp(isa, "baseline") == 0;
}

namespace {

const CpuKernelTable& choose() {
  const char* cap = std::getenv("PAGEDOPTIM_CPU_ISA");
  const char* order[] = {"avx512", "avx2", "baseline"};
  bool allowed = cap == nullptr;
  for (const char* isa : order) {
    if (!allowed && std::strcmp(isa, cap) == 0) allowed = true;
    if (!allowed) continue;
    const CpuKernelTable* table = cpu_kernels_for_isa(isa);
    if (table != nullptr && cpu_runs_isa(isa)) return *table;
  }
  if (!allowed) {
    throw std::invalid_argument(std::string("PAGEDOPTIM_CPU_ISA must be one of avx512, avx2, "
                                            "baseline; got '") + cap + "'");
  }
  return baseline::kTable;
}

}  // namespace

const CpuKernelTable* cpu_kernels_for_isa(const char* isa) {
  if (std::strcmp(isa, "baseline") == 0) return &baseline::kTable;
#if defined(__x86_64__)
  if (std::strcmp(isa, "avx2") == 0) return &avx2::kTable;
  if (std::strcmp(isa, "avx512") == 0) return &avx512::kTable;
#endif
  return nullptr;
}

const CpuKernelTable& cpu_kernels() {
  static const CpuKernelTable& table = choose();
  return table;
}

}  // namespace pagedoptim::kernels
