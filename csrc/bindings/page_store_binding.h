// The page store an optimizer's PagedState pages through, built from the Python options
// dict (pagedoptim.paging.store_options), and its statistics as a Python dict.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>

#include "pagedoptim/device/device.h"
#include "pagedoptim/paging/page_store.h"

namespace pagedoptim::bindings {

// None: every page resident in host memory (HostPageStore). A dict: a TieredPageStore with
// the keys offload ("host" | "nvme"), cache_bytes, prefetch, policy, nvme_dir, io_backend,
// queue_depth, direct, faults; a bad value raises ValueError naming its key.
std::unique_ptr<paging::PageStore> make_page_store(const pybind11::object& options,
                                                   int64_t page_bytes);

// With CUDA params and offload: a DeviceCacheStore on `device` (a device cache of
// cache_bytes over pinned host memory or the page file behind pinned bounce buffers). The
// device must outlive the store.
std::unique_ptr<paging::PageStore> make_device_page_store(const pybind11::object& options,
                                                          int64_t page_bytes,
                                                          device::Device& device);

// Bytes of page memory per place: "device", "pinned_host", "host" (the CPU cache),
// "host_tier", "nvme" (only the places the store uses). `on_device`: an unpaged store's
// pages are on the GPU.
pybind11::dict state_placement(paging::PageStore& store, bool on_device);

// hits, misses, bytes read/written per tier, stall seconds, io backend, ... (zeros and
// offload=None for a store that does not page).
pybind11::dict paging_stats(paging::PageStore& store);

// Registers pagedoptim._C.PageIOError / PageCorruptionError, their translation from the
// pager's C++ exceptions, and the fault-injection hooks the tests use.
void bind_page_store(pybind11::module_& m);

}  // namespace pagedoptim::bindings
