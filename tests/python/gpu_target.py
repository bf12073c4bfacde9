"""Where the GPU test modules (test_cuda_step.py, test_cuda_paging.py) run.

On a machine with a CUDA device and a pagedoptim built with its CUDA kernels: the GPU. Elsewhere
(CI): the simulated device (docs/gpu_paging.md), whose page cache, streams and events follow
CUDA's rules, null default stream included, and whose kernels are the host emulation of the
CUDA table bodies. Params are CPU tensors there, so each module's own CPU reference still runs
on the CPU kernels, and the comparison is the one the GPU makes: the table bodies against the
CPU kernels, bit for bit.

What has a meaning on the simulated device runs there: bit identity, AMP's unscale and skip
in the kernels, the paging protocol, state_dict, release, errors. What needs real CUDA memory,
streams, timing or the profiler carries `needs_cuda`, and is skipped with the reason.

PAGEDOPTIM_GPU_TARGET=simulated picks the simulated device on a GPU machine too (to see the
test files themselves work there before spending device time).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

import pytest
import torch

from support import cuda_skip_reason
from pagedoptim import paging

@dataclass(frozen=True)
class GpuTarget:
    device: torch.device
    simulated: bool
    # Why the GPU itself is not used (None on the GPU).
    reason: Optional[str] = None
    # What an optimizer over device params adds to its arguments: on the simulated device,
    # paging.resident_on_simulated_device().
    state_kwargs: dict = field(default_factory=dict)

    @property
    def engine_device(self) -> str:
        """What the optimizer's engine reports as its device."""
        return "simulated" if self.simulated else f"cuda:{self.device.index or 0}"

    def synchronize(self) -> None:
        if not self.simulated:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Paged state created inside runs on the target: the simulated device, or the GPU."""
        with paging.simulated_device() if self.simulated else contextlib.nullcontext():
            yield


def _pick() -> GpuTarget:
    forced = os.environ.get("PAGEDOPTIM_GPU_TARGET", "")
    if forced not in ("", "cuda", "simulated"):
        raise ValueError(f"PAGEDOPTIM_GPU_TARGET must be 'cuda' or 'simulated', got {forced!r}")
    reason = cuda_skip_reason()
    if forced == "cuda" and reason is not None:
        raise RuntimeError(f"PAGEDOPTIM_GPU_TARGET=cuda, but {reason}")
    if reason is None and forced != "simulated":
        return GpuTarget(torch.device("cuda", 0), simulated=False)
    return GpuTarget(torch.device("cpu"), simulated=True,
                     reason=reason or "PAGEDOPTIM_GPU_TARGET=simulated",
                     state_kwargs=paging.resident_on_simulated_device())


TARGET = _pick()


def needs_cuda(what: str) -> pytest.MarkDecorator:
    """Skips a test on the simulated device, saying what of real CUDA it needs."""
    return pytest.mark.skipif(TARGET.simulated,
                              reason=f"needs {what}; on the simulated device ({TARGET.reason})")
