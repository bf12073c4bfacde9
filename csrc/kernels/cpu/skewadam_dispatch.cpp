// Run-time choice of SkewAdam's kernel table: the one of the ISA that cpu_kernels() chose,
// so PAGEDOPTIM_CPU_ISA caps both and the optimizers never run different ISAs side by side.
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/skewadam_kernels.h"

namespace pagedoptim::kernels {

namespace baseline { extern const SkewAdamKernelTable kSkewAdamTable; }
#if defined(__x86_64__)
namespace avx2 { extern const SkewAdamKernelTable kSkewAdamTable; }
namespace avx512 { extern const SkewAdamKernelTable kSkewAdamTable; }
#endif

const SkewAdamKernelTable* skewadam_kernels_for_isa(const char* isa) {
  if (std::strcmp(isa, "baseline") == 0) return &baseline::kSkewAdamTable;
#if defined(__x86_64__)
  if (std::strcmp(isa, "avx2") == 0) return &avx2::kSkewAdamTable;
  if (std::strcmp(isa, "avx512") == 0) return &avx512::kSkewAdamTable;
#endif
  return nullptr;
}

const SkewAdamKernelTable& skewadam_cpu_kernels() {
  static const SkewAdamKernelTable& table = [] () -> const SkewAdamKernelTable& {
    const SkewAdamKernelTable* chosen = skewadam_kernels_for_isa(cpu_kernels().isa);
    if (chosen == nullptr) {
      throw std::logic_error(std::string("no SkewAdam kernels for ISA ") + cpu_kernels().isa);
    }
    return *chosen;
  }();
  return table;
}

}  // namespace pagedoptim::kernels
