"""Leak check of the GPU path, for scripts/gpu_check.sh's `leaks` part (a CUDA machine only).

Creates, steps and closes CUDA-param optimizers CYCLES times in each configuration (state
resident on the device; paged through the device cache over pinned host memory; over the
page file), after a warm-up, and checks that the process holds what it held before:

- torch.cuda.memory_allocated() ("device_delta"): exactly the same bytes (the page cache's
  slabs come from torch's caching allocator, so a slab never given back shows here);
- the process's resident memory: within 32 MiB. The pinned host tier and the bounce buffers
  are cudaHostAlloc'd (outside torch's counters) and resident once touched; one cycle holds
  at least 1 MiB of them, so a leak of one per cycle would add 200 MiB;
- its open descriptors: exactly the same (page files, io_uring rings).

The simulated device's counterpart (exact counts of device and pinned bytes, allocations,
streams and events) runs on every machine: tests/python/test_lifecycle.py,
test_device_cached_optimizers_give_back_every_device_resource. `--simulated` runs this
script itself there (CPU params, the simulated device's own counters in place of
torch.cuda's), which is how CI checks that the script works before a GPU runs it.

    python scripts/gpu_leak_check.py                       # on the GPU: 200 cycles each
    python scripts/gpu_leak_check.py --simulated --cycles 20

Prints one JSON line per configuration; exit status 1 when one leaked, 3 when there is no
CUDA device (without --simulated).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile

import torch

import pagedoptim as po
from pagedoptim import paging

CYCLES = 200
PAGE = 64 << 10
RSS_SLACK = 32 << 20


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _device_bytes(simulated: bool) -> dict[str, int]:
    """What the device holds now: torch.cuda's allocated bytes, or the simulated device's
    bytes, allocations, streams and events."""
    if simulated:
        from pagedoptim._native import native

        return dict(native.simulated_device_usage())
    return {"allocated": torch.cuda.memory_allocated()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=CYCLES,
                        help=f"create/step/close cycles per configuration (default {CYCLES})")
    parser.add_argument("--simulated", action="store_true",
                        help="CPU params on the simulated device: the script's own check")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error(f"--cycles must be at least 1, got {args.cycles}")
    if not args.simulated and not torch.cuda.is_available():
        print(json.dumps({"check": "gpu_leaks", "skipped": "no CUDA device"}))
        return 3
    device = "cpu" if args.simulated else "cuda"
    nvme_dir = tempfile.mkdtemp(prefix="pagedoptim-leaks-")
    resident = paging.resident_on_simulated_device() if args.simulated else {}
    configs = {
        "device": resident,
        "offload_host": dict(offload="host", cache_bytes=4 * PAGE, page_bytes=PAGE),
        "offload_nvme": dict(offload="nvme", cache_bytes=4 * PAGE, page_bytes=PAGE,
                             nvme_dir=nvme_dir),
    }
    # 4 MiB, ~34 pages of 8-bit state; on the simulated device, whose emulated kernels step
    # about a million elements a second, 512 KiB: still more pages than the cache holds.
    p = torch.nn.Parameter(torch.randn(1 << (17 if args.simulated else 20), device=device))
    p.grad = torch.randn_like(p)
    failed = False
    with paging.simulated_device() if args.simulated else contextlib.nullcontext():
        for name, kw in configs.items():
            def cycle() -> None:
                with po.AdamW([p], lr=1e-3, **kw) as opt:
                    opt.step()
                    opt.step()
                if not args.simulated:
                    torch.cuda.synchronize()

            for _ in range(5):
                cycle()
            gc.collect()
            held, rss, fds = _device_bytes(args.simulated), _rss(), _fds()
            for _ in range(args.cycles):
                cycle()
            gc.collect()
            now = _device_bytes(args.simulated)
            result = {"check": "gpu_leaks", "device": "simulated" if args.simulated else "cuda",
                      "config": name, "cycles": args.cycles,
                      "device_delta": {k: now[k] - held[k] for k in held},
                      "rss_delta_bytes": _rss() - rss, "fd_delta": _fds() - fds}
            result["ok"] = (all(v == 0 for v in result["device_delta"].values())
                            and result["fd_delta"] == 0 and result["rss_delta_bytes"] < RSS_SLACK)
            failed |= not result["ok"]
            print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
