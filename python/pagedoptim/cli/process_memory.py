"""The process's memory as the kernel counts it: resident set now, its high-water mark, and
glibc set up so that both move with live tensors. One copy for the library's measurements,
benchmarks/ and the tests.

For RSS to move with live tensors, glibc must hand large blocks back when they are freed and
must not serve a new tensor from memory an earlier one left in its heap. `pin_malloc_to_mmap`
fixes the mmap threshold at 64 KiB (setting it also stops glibc raising it on its own), so
every allocation above that is mapped when made and unmapped when freed; torch's CPU allocator
calls malloc/free directly, with no cache of its own. The peak comes from the kernel's
high-water mark (VmHWM), reset by writing 5 to /proc/self/clear_refs: an exact peak, not a
sampled one.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD_BYTES = 64 << 10
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def pin_malloc_to_mmap() -> bool:
    """Map every allocation above MMAP_THRESHOLD_BYTES on its own; False where glibc refuses."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Start a new high-water mark at the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")
