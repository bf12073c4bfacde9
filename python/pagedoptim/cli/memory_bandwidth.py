"""Host memory bandwidth as a streaming kernel sees it: the roofline of an optimizer step.

An optimizer step reads and writes every state byte once, so the fastest it can go on a CPU
is the bandwidth of a streaming in-place kernel over buffers far larger than the caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedoptim.cli.timing import time_interleaved


@dataclass(frozen=True)
class MemoryBandwidth:
    """Best observed DRAM bandwidth of two streaming kernels, counting read + write bytes.

    `inplace_add_gbps` (a += b: read a, read b, write a) is the roofline for optimizer steps:
    like an optimizer it writes only lines it has just read, so the CPU does not fetch the
    destination before overwriting it. `copy_gbps` (b = a) pays that extra fetch on most CPUs and
    reads lower; it is reported so the gap is visible, not used as the roofline.
    """

    copy_gbps: float
    inplace_add_gbps: float
    buffer_bytes: int

    @property
    def roofline_gbps(self) -> float:
        return self.inplace_add_gbps


class StreamingProbe:
    """The roofline kernel as a callable: one in-place add over two fp32 buffers (>= 512 MiB
    each, so the last-level cache holds a negligible share of them).

    Passing it to `time_interleaved` next to the kernels under test measures the bandwidth the
    machine delivered in the same rounds, under the same neighbours, which a single measurement
    at the start cannot: on a shared machine it drifts by 20% and more within minutes.
    """

    def __init__(self, buffer_bytes: int = 512 << 20):
        elements = buffer_bytes // 4
        self._source = torch.ones(elements, dtype=torch.float32)
        self._destination = torch.ones(elements, dtype=torch.float32)  # ones: fault pages in now
        self.bytes_moved = 3 * elements * 4  # read both, write the destination

    def __call__(self) -> None:
        self._destination.add_(self._source)

    def gbps(self, seconds: float) -> float:
        return self.bytes_moved / seconds / 1e9


def measure_memory_bandwidth(buffer_bytes: int = 512 << 20, repeats: int = 10,
                             device: torch.device | str = "cpu") -> MemoryBandwidth:
    """Measure streaming bandwidth with fp32 buffers of `buffer_bytes` each (>= 512 MiB so
    that the last-level cache holds a negligible share of them) on `device` (host memory
    for "cpu", the GPU's own memory for a CUDA device).

    Uses the best repetition: the roofline is what the machine can do, and the interleaved
    optimizer timings it is compared with already carry the noise.
    """
    elements = buffer_bytes // 4
    source = torch.ones(elements, dtype=torch.float32, device=device)
    # ones, not empty: fault the pages in now rather than inside the first timed call
    destination = torch.ones(elements, dtype=torch.float32, device=device)

    def best_gbps(kernel: Callable[[], Any], bytes_moved: int) -> float:
        timing = time_interleaved({"kernel": kernel}, warmup=2, repeats=repeats,
                                  device=device)["kernel"]
        return bytes_moved / timing.min / 1e9

    copy_gbps = best_gbps(lambda: destination.copy_(source), 2 * elements * 4)
    inplace_add_gbps = best_gbps(lambda: destination.add_(source), 3 * elements * 4)
    return MemoryBandwidth(copy_gbps, inplace_add_gbps, elements * 4)
