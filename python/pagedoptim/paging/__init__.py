"""Paging: from the optimizer's paging keywords to the native page store, and back.

`store_options()` turns PagingOptions into the dict `PagedState(..., store=...)` takes
(None: every page stays in memory). What a keyword implies when `offload` is not given:

* `nvme_dir=...` alone means `offload="nvme"`: it says where the page file goes.
* `cache_bytes=...` alone is an error naming `offload`: it says how much stays resident,
  not where the rest goes (once it meant the page file for CPU params, silently, under
  $TMPDIR).
* `offload` without `cache_bytes` keeps DEFAULT_CACHE_BYTES of pages resident.
* `prefetch` and `policy` only act on paged state; setting them without paging is an error.

The page file lives in a private directory under `nvme_dir` (default: $TMPDIR or /tmp) and
is unlinked as soon as it is open, so it disappears with the optimizer, or with the process
however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import warnings
from typing import Any, Iterator, Optional

import torch

from pagedoptim._native import native
from pagedoptim.paging.options import PAGE_ALIGNMENT, PagingOptions
from pagedoptim.state.format import GROUP_SIZE

DEFAULT_CACHE_BYTES = 1 << 30
# Pages are at most this large when page_bytes is not given, and smaller when the state is:
# unpaged state then costs its payload plus at most one partly filled page per kind.
DEFAULT_PAGE_BYTES = 2 << 20
# kStreamAlignment (include/pagedoptim/common.h): each stream of a page starts on a cache
# line. test_torch_contract checks that pages chosen with it hold the whole state.
_STREAM_ALIGNMENT = 64
# A paged cache holds at least this many pages of a chosen size: a batch being stepped and
# the next ones coming in.
MIN_CACHE_PAGES = 8
# What choose_page_bytes counts a page as costing besides its bytes (its I/O request, its
# kernel table row, its cache entry): many small pages must save more than this each.
PAGE_OVERHEAD_CHARGE = 4096

_overrides: dict[str, Any] = {}


def _native_exception(name: str, base: type[BaseException]) -> type[BaseException]:
    try:
        return getattr(native, name)
    except (AttributeError, RuntimeError):  # no native library: a stand-in of the same kind
        return type(name, (base,), {"__module__": "pagedoptim"})


PageIOError = _native_exception("PageIOError", OSError)
PageCorruptionError = _native_exception("PageCorruptionError", RuntimeError)


def resolve_offload(options: PagingOptions) -> Optional[str]:
    """The tier cold pages go to, after the implications described in the module doc (the
    same on every device)."""
    if options.offload is not None:
        return options.offload
    if options.nvme_dir is not None:
        return "nvme"
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


def resident_on_simulated_device() -> dict[str, Any]:
    """Optimizer keyword arguments that keep CPU params' whole state on the simulated device
    (tests): it holds device state only under a page cache, and one of 1 TiB stands for
    CUDA's device-resident state (slots are allocated as pages are first used, so the size
    costs nothing)."""
    return {"offload": "host", "cache_bytes": 1 << 40}


def engine_device(store: Optional[dict], device: Optional[torch.device]) -> str:
    """The native engine's device string: "cuda:N" for CUDA params, "simulated" for paged
    CPU params inside `simulated_device()`, else "cpu"."""
    if device is not None and device.type == "cuda":
        return f"cuda:{device.index or 0}"
    if _simulated and store is not None:
        return "simulated"
    return "cpu"


def store_options(options: PagingOptions) -> Optional[dict]:
    offload = resolve_offload(options)
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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _page_layout_bytes(streams: list[Any], groups: int) -> int:
    """Bytes a page needs for `groups` groups of every stream (PageGeometry's layout)."""
    size = 0
    for stream in streams:
        size = _round_up(size, _STREAM_ALIGNMENT) + stream.bytes_per_group * groups
    return size


def choose_page_bytes(options: PagingOptions, store: Optional[dict], kinds: list[list[Any]],
                      planned: list[tuple[int, int, int]]) -> int:
    """The page size: page_bytes when given; otherwise the 4 KiB multiple, at most
    DEFAULT_PAGE_BYTES and for paged state at most 1/MIN_CACHE_PAGES of the cache, that lays
    the state out in the fewest bytes, each page charged PAGE_OVERHEAD_CHARGE besides its
    size. The candidates are the sizes that hold one kind's whole state: one kind (AdamW)
    gets one page of its size, so a LoRA adapter's 3,584 params take one 8 KiB page, not
    2 MiB; several kinds of unequal size (SkewAdam's tiers) share a page size that fits the
    small ones, instead of each small kind filling a page sized for the largest.

    kinds: the stream specs of each page kind; planned: (kind, elements, row length) per
    param."""
    if options.page_bytes is not None:
        return options.page_bytes
    groups = [0] * len(kinds)
    for kind, numel, row in planned:
        # The page slots a param takes: one per group, every row's last possibly partial
        # where the kind has per-group streams (page_table.h), else in flat order.
        rows_matter = any(spec.per_group for spec in kinds[kind])
        groups[kind] += (int(native.count_groups(numel, row)) if rows_matter
                         else -(-numel // GROUP_SIZE))
    largest = DEFAULT_PAGE_BYTES
    if store is not None:
        per_page = store["cache_bytes"] // MIN_CACHE_PAGES
        largest = min(largest, max(PAGE_ALIGNMENT, per_page // PAGE_ALIGNMENT * PAGE_ALIGNMENT))
    candidates = {min(largest, _round_up(max(_page_layout_bytes(kinds[k], groups[k]), 1),
                                         PAGE_ALIGNMENT))
                  for k in range(len(kinds)) if kinds[k] and groups[k]}
    if len(candidates) <= 1:
        return candidates.pop() if candidates else PAGE_ALIGNMENT
    native_kinds = [[spec.as_native() for spec in kind] for kind in kinds]
    params = [(numel, kind, row) for kind, numel, row in planned]

    def cost(page: int) -> tuple[int, int]:
        pages = int(native.count_pages(native_kinds, page, params))
        return pages * (page + PAGE_OVERHEAD_CHARGE), -page  # ties: the larger page
    return min(candidates, key=cost)


def _check_cache_holds_a_page(options: PagingOptions) -> None:
    if options.cache_bytes is None:
        return
    smallest = options.page_bytes if options.page_bytes is not None else PAGE_ALIGNMENT
    if options.cache_bytes < smallest:
        what = (f"one page (page_bytes={options.page_bytes})" if options.page_bytes is not None
                else f"one page ({PAGE_ALIGNMENT} bytes, the smallest page)")
        raise ValueError(f"cache_bytes={options.cache_bytes} must hold at least {what}: the "
                         "pages being stepped stay resident")


def _page_file_dir(options: PagingOptions) -> tuple[str, str]:
    """Where the page file goes (the native file tier's rule), and how errors name it."""
    if options.nvme_dir is not None:
        return os.fspath(options.nvme_dir), "nvme_dir"
    return os.environ.get("TMPDIR") or "/tmp", "the default nvme_dir ($TMPDIR)"


def check_page_file_fits(options: PagingOptions, page_file_bytes: int) -> None:
    """Raises when the page file the state plan needs is larger than the free space of its
    directory. The native tier then reserves the space (posix_fallocate) as the file grows
    at the first step, so a full disk is reported here or there, never mid-step."""
    directory, label = _page_file_dir(options)
    free = shutil.disk_usage(directory).free
    if page_file_bytes > free:
        raise OSError(errno.ENOSPC,
                      f"{label} {directory!r} has {free} bytes free, but the page file of this "
                      f"optimizer's state needs {page_file_bytes} bytes: "
                      f"{page_file_bytes - free} bytes are missing. Free space there, or point "
                      "nvme_dir at a larger file system")


def check_before_first_step(options: PagingOptions, device: Optional[torch.device]) -> None:
    """The paging settings that can be checked at construction: a cache that holds at least
    one page, the page file's directory (it must exist and be writable), and on a GPU a
    cache that fits in the device's free memory."""
    _check_cache_holds_a_page(options)
    offload = resolve_offload(options)
    if offload == "nvme":
        directory, label = _page_file_dir(options)
        if not os.path.isdir(directory):
            raise ValueError(f"{label} {directory!r} does not exist or is not a directory: the "
                             "page file goes there")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{label} {directory!r} is not writable: the page file goes "
                                  "there")
    if offload is None or device is None or device.type != "cuda":
        return
    cache_bytes = options.cache_bytes if options.cache_bytes is not None else DEFAULT_CACHE_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    if cache_bytes > free:
        raise ValueError(f"cache_bytes={cache_bytes} is more than the {free} bytes free on "
                         f"{device}: lower cache_bytes (the state's pages beyond it stay in "
                         f"{'pinned host memory' if offload == 'host' else 'the page file'})")


def stats_before_first_step(options: PagingOptions) -> dict[str, Any]:
    """paging_stats() of an optimizer whose state does not exist yet: every key the engine
    reports, the settings where they are known already, every count zero. page_bytes and
    the page counts are chosen with the state (None until then)."""
    store = store_options(options)
    paged = store is not None
    return {
        "policy": options.policy if paged else None,
        "prefetch": options.prefetch if paged else 0,
        "page_bytes": options.page_bytes, "num_pages": 0, "budget_pages": None,
        "cache_bytes": store["cache_bytes"] if paged else None,
        "resident_bytes": 0, "resident_pages": 0, "peak_resident_pages": 0,
        "over_budget_pages": 0, "pin_limit": None,
        "hits": 0, "misses": 0, "hit_rate": 0.0, "prefetch_hits": 0, "evictions": 0,
        "pending_error": None, "offload": resolve_offload(options), "zero_fills": 0,
        "reads": 0, "writes": 0, "bytes_read": {}, "bytes_written": {}, "stall_seconds": 0.0,
        "read_retries": 0, "read_errors": 0, "checksum_errors": 0, "write_errors": 0,
        "io_backend": None, "io_fallback_reason": "", "direct_io": None,
        "direct_io_reason": "", "page_file": None,
    }


def _frames_to_the_caller() -> int:
    """warnings.warn's stacklevel that names the first frame outside pagedoptim and torch
    (the step() call of the user's loop, or Trainer's), for a warning issued from wherever
    the state happens to be built (step, state_dict, load_state_dict)."""
    # This file is pagedoptim/paging/__init__.py: the package is two levels up.
    packages = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(packages):
        frame, level = frame.f_back, level + 1
    return level


def warn_about_fallbacks(engine: Any) -> None:
    """A warning for each way the page file runs below its best: POSIX instead of io_uring,
    buffered instead of O_DIRECT."""
    stats = engine.paging_stats()
    level = _frames_to_the_caller()
    if stats["io_fallback_reason"]:
        warnings.warn(f"pagedoptim: the page file uses the POSIX pread/pwrite backend because "
                      f"{stats['io_fallback_reason']}", RuntimeWarning, stacklevel=level)
    if stats["direct_io_reason"]:
        warnings.warn(f"pagedoptim: the page file uses buffered I/O because "
                      f"{stats['direct_io_reason']}", RuntimeWarning, stacklevel=level)


def warn_about_host_offload_on_cpu(store: Optional[dict], engine_device_name: str) -> None:
    """offload="host" for CPU params pages host memory to host memory: the page cache is in
    the params' own memory and the host tier below it holds every page again, so the state
    takes its size twice (memory_report()'s 'host' and 'host_tier') and saves nothing. It
    still works (tests use it to run the host tier on the CPU), so this warns once per
    optimizer rather than refusing."""
    if store is None or store["offload"] != "host" or engine_device_name != "cpu":
        return
    warnings.warn("pagedoptim: offload='host' with params on the CPU keeps every page twice, "
                  "in the page cache (host memory, where CPU params live) and in the host "
                  "tier below it, so it saves no memory. Leave offload unset to keep the "
                  "state in memory once, or use offload='nvme' to page it to disk",
                  RuntimeWarning, stacklevel=_frames_to_the_caller())


def set_fault_rules(optimizer: Any, rules: list[dict[str, Any]]) -> None:
    """Replaces the faults injected into an optimizer's page file (tests). The optimizer's
    state must have been created inside `store_overrides(faults=[...])`."""
    native.set_fault_rules(optimizer.state_store.ensure_engine(), rules)


def fault_counts(optimizer: Any) -> list[int]:
    return list(native.fault_counts(optimizer.state_store.ensure_engine()))


def sigint_before_batch(optimizer: Any, batch: int) -> None:
    """Tests: the optimizer's next native step raises SIGINT in this process right before
    its batch `batch` (>= 1) of pinned pages, as a Ctrl-C arriving there would (once)."""
    optimizer.state_store.ensure_engine().set_sigint_before_batch(batch)


def drain(optimizer: Any) -> None:
    """Waits until the pager of the optimizer has no I/O in flight."""
    engine = optimizer.state_store.engine
    if engine is not None and engine.paging_stats()["offload"]:
        native.drain_paging(engine)
