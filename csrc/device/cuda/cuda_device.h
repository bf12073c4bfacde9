// The device seam (pagedoptim/device/device.h) on a CUDA GPU: a thin layer over the CUDA
// runtime, with device memory from torch's caching allocator (so cache slots show in
// torch.cuda.memory_allocated() and the allocator's statistics) and pinned host memory from
// cudaHostAlloc (one allocation per slab, not rounded up to a power of two as torch's pinned
// allocator does). Compiled only when PAGEDOPTIM_WITH_CUDA is defined.
#pragma once

#include "pagedoptim/device/device.h"

namespace pagedoptim::device {

// One device object per GPU, alive for the whole process (page stores of any optimizer may
// refer to it until interpreter exit). Throws c10::Error for an index that does not exist.
device::Device& cuda_device(int index);

// The GPU index of a device from cuda_device(); -1 for any other device.
int cuda_index_of(const device::Device& device);

}  // namespace pagedoptim::device
