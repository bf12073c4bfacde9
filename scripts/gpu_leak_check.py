"""Leak check of the GPU path, for scripts/gpu_check.sh's `leaks` part (a CUDA machine only).

Creates, steps and closes CUDA-param optimizers CYCLES times in each configuration (state
resident on the device; paged through the device cache over pinned host memory; over the
page file), after a warm-up, and checks that the process holds what it held before:

- torch.cuda.memory_allocated(): exactly the same bytes (the page cache's slabs come from
  torch's caching allocator, so a slab never given back shows here);
- the process's resident memory: within 32 MiB. The pinned host tier and the bounce buffers
  are cudaHostAlloc'd (outside torch's counters) and resident once touched; one cycle holds
  at least 1 MiB of them, so a leak of one per cycle would add 200 MiB;
- its open descriptors: exactly the same (page files, io_uring rings).

The simulated device's counterpart (exact counts of device and pinned bytes, allocations,
streams and events) runs on every machine: tests/python/test_lifecycle.py,
test_device_cached_optimizers_give_back_every_device_resource.

Prints one JSON line per configuration; exit status 1 when one leaked.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import torch

import pagedoptim as po

CYCLES = 200
PAGE = 64 << 10
RSS_SLACK = 32 << 20


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu_leaks", "skipped": "no CUDA device"}))
        return 3
    nvme_dir = tempfile.mkdtemp(prefix="pagedoptim-leaks-")
    configs = {
        "device": {},
        "offload_host": dict(offload="host", cache_bytes=4 * PAGE, page_bytes=PAGE),
        "offload_nvme": dict(offload="nvme", cache_bytes=4 * PAGE, page_bytes=PAGE,
                             nvme_dir=nvme_dir),
    }
    p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))  # 4 MiB; ~64 pages of state
    p.grad = torch.randn_like(p)
    failed = False
    for name, kw in configs.items():
        def cycle() -> None:
            with po.AdamW([p], lr=1e-3, **kw) as opt:
                opt.step()
                opt.step()
            torch.cuda.synchronize()

        for _ in range(5):
            cycle()
        gc.collect()
        allocated, rss, fds = torch.cuda.memory_allocated(), _rss(), _fds()
        for _ in range(CYCLES):
            cycle()
        gc.collect()
        result = {"check": "gpu_leaks", "config": name, "cycles": CYCLES,
                  "allocated_delta_bytes": torch.cuda.memory_allocated() - allocated,
                  "rss_delta_bytes": _rss() - rss, "fd_delta": _fds() - fds}
        result["ok"] = (result["allocated_delta_bytes"] == 0 and result["fd_delta"] == 0
                        and result["rss_delta_bytes"] < RSS_SLACK)
        failed |= not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
