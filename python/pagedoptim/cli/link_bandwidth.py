"""The links optimizer state moves over, measured the way the pager uses them: the disk
through pagedoptim's own io engine, and pinned host memory to and from a CUDA GPU.

Each returns a section of the bench record (machine_profile's schema: bytes per second,
plus what the number was measured with).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedoptim._native import native
from pagedoptim.cli.memory_bandwidth import measure_memory_bandwidth
from pagedoptim.cli.timing import time_interleaved

# One request per MiB, 16 in flight: the pager's page size and default prefetch are of the
# same order, and a deeper queue does not raise a single NVMe drive's sequential bandwidth.
DISK_BLOCK_BYTES = 1 << 20
DISK_QUEUE_DEPTH = 16
# The probe reads one half of its file while it writes the other, so it needs two blocks.
MIN_DISK_BYTES = 2 * DISK_BLOCK_BYTES


def measure_disk(directory: str, file_bytes: int) -> dict[str, Any]:
    """Write, read and mixed (reads and writes in flight together) bandwidth of a scratch
    file of `file_bytes` in `directory`, removed however the probe ends. Raises OSError
    (pagedoptim's PageIOError) naming the directory and the errno when the disk refuses."""
    backend = os.environ.get("PAGEDOPTIM_IO_BACKEND") or "auto"  # as the page file does
    result = native.measure_disk_bandwidth(directory, file_bytes, DISK_BLOCK_BYTES,
                                           DISK_QUEUE_DEPTH, backend)
    return {
        "dir": directory,
        "write_bytes_per_s": result["write_gb_per_s"] * 1e9,
        "read_bytes_per_s": result["read_gb_per_s"] * 1e9,
        "mixed_bytes_per_s": result["mixed_gb_per_s"] * 1e9,
        "file_bytes": result["bytes"],
        "block_bytes": DISK_BLOCK_BYTES,
        "queue_depth": DISK_QUEUE_DEPTH,
        "backend": result["backend"],
        "direct": result["direct"],
        "fallback_reason": result["fallback_reason"],
    }


def measure_pcie(device: torch.device, buffer_bytes: int, repeats: int) -> dict[str, Any]:
    """Pinned host -> device and device -> host copy bandwidth, best of `repeats`: the
    pager's copies come from pinned slots on a side stream, which this is the limit of."""
    host = torch.ones(buffer_bytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.ones(buffer_bytes, dtype=torch.uint8, device=device)
    timings = time_interleaved(
        {"host_to_device": lambda: on_device.copy_(host, non_blocking=True),
         "device_to_host": lambda: host.copy_(on_device, non_blocking=True)},
        warmup=2, repeats=repeats, device=device)
    return {
        "host_to_device_bytes_per_s": buffer_bytes / timings["host_to_device"].min,
        "device_to_host_bytes_per_s": buffer_bytes / timings["device_to_host"].min,
        "buffer_bytes": buffer_bytes,
        "device": torch.cuda.get_device_name(device),
    }


def measure_device_memory(device: torch.device, buffer_bytes: int, repeats: int) -> dict[str, Any]:
    """The GPU's own streaming bandwidth (the in-place add of the host probe, on device)."""
    bandwidth = measure_memory_bandwidth(buffer_bytes, repeats, device=device)
    return {
        "bytes_per_s": bandwidth.roofline_gbps * 1e9,
        "copy_bytes_per_s": bandwidth.copy_gbps * 1e9,
        "buffer_bytes": bandwidth.buffer_bytes,
        "device": torch.cuda.get_device_name(device),
    }
