"""Paging: from the optimizer's paging keywords to the native page store, and back.

`store_options()` turns PagingOptions into the dict `PagedState(..., store=...)` takes
(None: every page stays in memory). What a keyword implies when `offload` is not given:

* `nvme_dir=...` alone means `offload="nvme"`: it says where the page file goes.
* `cache_bytes=...` alone means "keep at most this much state on the compute device and the
  rest on the next tier down": `offload="host"` for parameters on a GPU, `offload="nvme"`
  for parameters on the CPU (there the cache already is host memory).
* `offload` without `cache_bytes` keeps DEFAULT_CACHE_BYTES of pages resident.
* `prefetch` and `policy` only act on paged state; setting them without paging is an error.

The page file lives in a private directory under `nvme_dir` (default: $TMPDIR or /tmp) and
is unlinked as soon as it is open, so it disappears with the optimizer, or with the process
however it ends.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Optional

import torch

from pagedoptim._native import native
from pagedoptim.options import PagingOptions

DEFAULT_CACHE_BYTES = 1 << 30

_overrides: dict[str, Any] = {}


def _native_exception(name: str, base: type[BaseException]) -> type[BaseException]:
    try:
        return getattr(native, name)
    except (AttributeError, RuntimeError):  # no native library: a stand-in of the same kind
        return type(name, (base,), {"__module__": "pagedoptim"})


PageIOError = _native_exception("PageIOError", OSError)
PageCorruptionError = _native_exception("PageCorruptionError", RuntimeError)


def resolve_offload(options: PagingOptions, device: Optional[torch.device]) -> Optional[str]:
    """The tier cold pages go to, after the implications described in the module doc."""
    if options.offload is not None:
        return options.offload
    if options.nvme_dir is not None:
        return "nvme"
    if options.cache_bytes is not None:
        return "host" if device is not None and device.type == "cuda" else "nvme"
    return None


@contextlib.contextmanager
def store_overrides(**extra: Any) -> Iterator[None]:
    """Adds native store options (io_backend, queue_depth, direct, faults) to every paged
    optimizer whose state is created inside the block. For tests and benchmarks."""
    saved = dict(_overrides)
    _overrides.update(extra)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


_simulated = False


@contextlib.contextmanager
def simulated_device() -> Iterator[None]:
    """Paged CPU state created inside the block lives on the simulated device instead of the
    CPU pager: a device page cache (docs/gpu_paging.md) over host memory or the page file,
    with streams that complete in random order, stepped by the host emulation of the CUDA
    table kernels. For tests: the GPU paging orchestration on a machine without a GPU. It
    must give exactly the bits of the CPU path."""
    global _simulated
    saved = _simulated
    _simulated = True
    try:
        yield
    finally:
        _simulated = saved


def engine_device(store: Optional[dict], device: Optional[torch.device]) -> str:
    """The native engine's device string: "cuda:N" for CUDA params, "simulated" for paged
    CPU params inside `simulated_device()`, else "cpu"."""
    if device is not None and device.type == "cuda":
        return f"cuda:{device.index or 0}"
    if _simulated and store is not None:
        return "simulated"
    return "cpu"


def store_options(options: PagingOptions, device: Optional[torch.device]) -> Optional[dict]:
    offload = resolve_offload(options, device)
    if offload is None:
        return None
    store: dict[str, Any] = {
        "offload": offload,
        "cache_bytes": int(options.cache_bytes if options.cache_bytes is not None
                           else DEFAULT_CACHE_BYTES),
        "prefetch": options.prefetch,
        "policy": options.policy,
    }
    if offload == "nvme":
        if options.nvme_dir is not None:
            store["nvme_dir"] = os.fspath(options.nvme_dir)
        backend = os.environ.get("PAGEDOPTIM_IO_BACKEND")
        if backend:
            store["io_backend"] = backend
    store.update(_overrides)
    return store


def check_before_first_step(options: PagingOptions, device: Optional[torch.device]) -> None:
    """The paging settings that can be checked at construction: the page file's directory
    (it must exist and be writable), and on a GPU a cache that holds at least one page and
    fits in the device's free memory."""
    offload = resolve_offload(options, device)
    if offload == "nvme":
        directory = os.fspath(options.nvme_dir) if options.nvme_dir is not None else \
            (os.environ.get("TMPDIR") or "/tmp")
        label = "nvme_dir" if options.nvme_dir is not None else "the default nvme_dir ($TMPDIR)"
        if not os.path.isdir(directory):
            raise ValueError(f"{label} {directory!r} does not exist or is not a directory: the "
                             "page file goes there")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{label} {directory!r} is not writable: the page file goes "
                                  "there")
    if offload is None or device is None or device.type != "cuda":
        return
    cache_bytes = options.cache_bytes if options.cache_bytes is not None else DEFAULT_CACHE_BYTES
    if cache_bytes < options.page_bytes:
        raise ValueError(f"cache_bytes={cache_bytes} must hold at least one page of "
                         f"page_bytes={options.page_bytes} on {device}")
    free, _ = torch.cuda.mem_get_info(device)
    if cache_bytes > free:
        raise ValueError(f"cache_bytes={cache_bytes} is more than the {free} bytes free on "
                         f"{device}: lower cache_bytes (the state's pages beyond it stay in "
                         f"{'pinned host memory' if offload == 'host' else 'the page file'})")


def warn_about_fallbacks(engine: Any) -> None:
    """A warning for each way the page file runs below its best: POSIX instead of io_uring,
    buffered instead of O_DIRECT."""
    stats = engine.paging_stats()
    if stats["io_fallback_reason"]:
        warnings.warn(f"pagedoptim: the page file uses the POSIX pread/pwrite backend because "
                      f"{stats['io_fallback_reason']}", RuntimeWarning, stacklevel=3)
    if stats["direct_io_reason"]:
        warnings.warn(f"pagedoptim: the page file uses buffered I/O because "
                      f"{stats['direct_io_reason']}", RuntimeWarning, stacklevel=3)


def set_fault_rules(optimizer: Any, rules: list[dict[str, Any]]) -> None:
    """Replaces the faults injected into an optimizer's page file (tests). The optimizer's
    state must have been created inside `store_overrides(faults=[...])`."""
    native.set_fault_rules(optimizer._ensure_engine(), rules)


def fault_counts(optimizer: Any) -> list[int]:
    return list(native.fault_counts(optimizer._ensure_engine()))


def drain(optimizer: Any) -> None:
    """Waits until the pager of the optimizer has no I/O in flight."""
    if optimizer._engine is not None and optimizer._engine.paging_stats()["offload"]:
        native.drain_paging(optimizer._engine)
