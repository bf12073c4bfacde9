// Tests that run the CPU kernels of one ISA: skip, with the reason, where they cannot run.
//
// A loop over the ISAs that stepped past one this CPU lacks would report its kernels as
// compared when nothing ran (an AVX2 machine never runs the AVX-512 kernels; qemu cannot
// emulate AVX-512). gtest's SKIPPED line says so, and ctest counts the test as skipped.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kernels/cpu/step_kernels.h"

namespace pagedoptim::test {

// Empty when this binary has `isa`'s kernels and this CPU runs them, else why not.
inline std::string isa_unavailable_reason(const char* isa) {
  if (kernels::cpu_kernels_for_isa(isa) == nullptr) {
    return std::string("no ") + isa + " kernels are built for this architecture";
  }
  if (!kernels::cpu_runs_isa(isa)) {
    return std::string("this CPU cannot run ") + isa + ", so its kernels were not compared "
           "here (tests/python/test_emulated_cpus.py runs AVX2 and baseline on emulated "
           "CPUs; AVX-512 is compared only on a CPU that has it)";
  }
  return {};
}

// The gtest name of an ISA parameter: Isa/Suite.Test/avx2.
inline std::string isa_param_name(const ::testing::TestParamInfo<const char*>& info) {
  return info.param;
}

}  // namespace pagedoptim::test

// In a test body or SetUp: skip the test unless `isa`'s kernels run here.
#define PO_SKIP_UNLESS_ISA_RUNS(isa)                                              \
  do {                                                                            \
    const std::string po_isa_reason = ::pagedoptim::test::isa_unavailable_reason(isa); \
    if (!po_isa_reason.empty()) GTEST_SKIP() << po_isa_reason;                    \
  } while (0)
