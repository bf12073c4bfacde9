"""Measurement helpers shared by the benchmark scripts.

Every benchmark here compares against a baseline measured in the same process and relates its
result to a physical limit measured in the same process, because absolute times on shared
machines drift by tens of percent between runs. The helpers below are the pieces for that:
interleaved timing, a memory-bandwidth probe and a one-JSON-line-per-result printer.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import torch


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the timed (post-warmup) repetitions of one callable."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for queued device work so a timer brackets the work, not its launch."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    warmup: int,
    repeats: int,
    device: torch.device | str = "cpu",
) -> dict[str, Timing]:
    """Time each callable `repeats` times, taking turns, after `warmup` untimed calls each.

    Taking turns (one call of each candidate per round) exposes all candidates to the same
    drift in clock speed and memory traffic from neighbours; timing one candidate to completion
    before the next would turn that drift into a fake speed difference. The order rotates each
    round so no candidate always runs right after the same other one (caches, page faults).
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    synchronize(device)

    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(values)) for name, values in samples.items()}


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


def measure_memory_bandwidth(buffer_bytes: int = 512 << 20, repeats: int = 10) -> MemoryBandwidth:
    """Measure streaming bandwidth with fp32 buffers of `buffer_bytes` each (>= 512 MiB so
    that the last-level cache holds a negligible share of them).

    Uses the best repetition: the roofline is what the machine can do, and the interleaved
    optimizer timings it is compared with already carry the noise.
    """
    elements = buffer_bytes // 4
    source = torch.ones(elements, dtype=torch.float32)
    destination = torch.ones(elements, dtype=torch.float32)  # ones, not empty: fault pages in now

    def best_gbps(kernel: Callable[[], Any], bytes_moved: int) -> float:
        timing = time_interleaved({"kernel": kernel}, warmup=2, repeats=repeats)["kernel"]
        return bytes_moved / timing.min / 1e9

    copy_gbps = best_gbps(lambda: destination.copy_(source), 2 * buffer_bytes)
    inplace_add_gbps = best_gbps(lambda: destination.add_(source), 3 * buffer_bytes)
    return MemoryBandwidth(copy_gbps, inplace_add_gbps, elements * 4)


def significant(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits so JSON lines stay readable."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def emit(record: Mapping[str, Any], stream: TextIO = sys.stdout) -> None:
    """Print one result as one JSON line and flush, so partial runs still leave results."""
    stream.write(json.dumps(dict(record)) + "\n")
    stream.flush()
