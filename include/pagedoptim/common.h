// Macros shared by the CPU and CUDA builds of the element math.
//
// Everything under include/pagedoptim/codec/ is written once and compiled by both g++ and
// nvcc, so the two backends compute the same thing. Those headers include no torch header.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PO_HOST_DEVICE __host__ __device__ __forceinline__
#define PO_RESTRICT __restrict__
#else
#define PO_HOST_DEVICE inline __attribute__((always_inline))
#define PO_RESTRICT __restrict__
#endif

namespace pagedoptim {

// Elements that share one quantization scale. Page segments start on a group boundary so a
// group never straddles two parameters or two pages.
constexpr int kGroupSize = 32;

// Every page, and every stream inside a page, starts on this boundary (O_DIRECT needs 4 KiB
// for whole pages; 64 B keeps streams on cache lines and lets vector loads stay aligned).
constexpr long kPageAlignment = 4096;
constexpr long kStreamAlignment = 64;

}  // namespace pagedoptim
