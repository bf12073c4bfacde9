// Host launchers of the CUDA step kernels: the same arguments as the CPU kernels
// (pagedoptim/kernels/step_args.h, device pointers here) and the same element math, so the
// two backends agree. No torch header: plain nvcc builds this next to a CPU-only torch.
#pragma once

#include <cuda_runtime.h>

#include "pagedoptim/codec/update_rules.h"
#include "pagedoptim/kernels/step_args.h"

namespace pagedoptim::kernels::cuda {

// Each launcher runs one kernel over one page segment's span on `stream` and returns the
// launch error, if any. Spans start on a group boundary (the driver guarantees it).
cudaError_t launch_adamw(const ParamSpan& span, const AdamWStreams& streams,
                         const codec::AdamWScalars& scalars, cudaStream_t stream);
cudaError_t launch_sgd(const ParamSpan& span, const MomentumStreams& streams,
                       const codec::SGDScalars& scalars, cudaStream_t stream);
cudaError_t launch_lion(const ParamSpan& span, const MomentumStreams& streams,
                        const codec::LionScalars& scalars, cudaStream_t stream);

}  // namespace pagedoptim::kernels::cuda
