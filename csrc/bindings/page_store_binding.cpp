// Python side of the pager: building a TieredPageStore from an options dict, its
// statistics, its errors as Python exceptions, and the fault-injection hooks of the tests.
#include "bindings/page_store_binding.h"

#include <set>
#include <string>
#include <vector>

#include "pagedoptim/device/device.h"
#include "pagedoptim/optim/paged_state.h"
#include "pagedoptim/paging/backing_tier.h"
#include "pagedoptim/paging/device_cache_store.h"
#include "pagedoptim/paging/page_errors.h"
#include "pagedoptim/paging/pinned_host_store.h"
#include "pagedoptim/paging/tiered_page_store.h"

namespace pagedoptim::bindings {
namespace {

namespace py = pybind11;

// Owned by the module for the life of the interpreter.
PyObject* page_io_error = nullptr;
PyObject* page_corruption_error = nullptr;

const std::set<std::string> kStoreKeys = {"offload", "cache_bytes", "prefetch", "policy",
                                          "nvme_dir", "io_backend", "queue_depth", "direct",
                                          "faults"};
const std::set<std::string> kFaultKeys = {"kind", "ops", "every_nth", "from_op", "max_fires",
                                          "offset_begin", "offset_end", "short_bytes",
                                          "flip_at", "flip_mask"};

template <class T>
T get_or(const py::dict& d, const char* key, T fallback) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  try {
    return d[key].cast<T>();
  } catch (const py::cast_error&) {
    TORCH_CHECK_VALUE(false, "paging option '", key, "' has the wrong type: ",
                      std::string(py::str(d[key].get_type())));
  }
}

io::FaultRule to_fault_rule(const py::handle& item, size_t index) {
  TORCH_CHECK_VALUE(py::isinstance<py::dict>(item), "faults[", index, "] must be a dict");
  const py::dict d = py::reinterpret_borrow<py::dict>(item);
  for (const auto& [key, value] : d) {
    const std::string name = py::str(key);
    TORCH_CHECK_VALUE(kFaultKeys.count(name) != 0, "faults[", index, "] has an unknown key '",
                      name, "'");
  }
  io::FaultRule rule;
  const std::string kind = get_or<std::string>(d, "kind", "eio");
  if (kind == "enospc") rule.kind = int(io::FaultKind::kEnospc);
  else if (kind == "eio") rule.kind = int(io::FaultKind::kEio);
  else if (kind == "short") rule.kind = int(io::FaultKind::kShort);
  else if (kind == "flip") rule.kind = int(io::FaultKind::kFlipByte);
  else TORCH_CHECK_VALUE(false, "faults[", index, "]['kind'] must be 'enospc', 'eio', 'short' "
                         "or 'flip', got '", kind, "'");
  const std::string ops = get_or<std::string>(d, "ops", "both");
  if (ops == "read") rule.ops = io::kFaultReads;
  else if (ops == "write") rule.ops = io::kFaultWrites;
  else if (ops == "both") rule.ops = io::kFaultReads | io::kFaultWrites;
  else TORCH_CHECK_VALUE(false, "faults[", index, "]['ops'] must be 'read', 'write' or 'both', "
                         "got '", ops, "'");
  rule.every_nth = get_or<int64_t>(d, "every_nth", rule.every_nth);
  rule.from_op = get_or<int64_t>(d, "from_op", rule.from_op);
  rule.max_fires = get_or<int64_t>(d, "max_fires", rule.max_fires);
  rule.offset_begin = get_or<int64_t>(d, "offset_begin", rule.offset_begin);
  rule.offset_end = get_or<int64_t>(d, "offset_end", rule.offset_end);
  rule.short_bytes = get_or<int64_t>(d, "short_bytes", rule.short_bytes);
  rule.flip_at = get_or<int64_t>(d, "flip_at", rule.flip_at);
  rule.flip_mask = get_or<int>(d, "flip_mask", rule.flip_mask);
  return rule;
}

std::vector<io::FaultRule> to_fault_rules(const py::handle& rules) {
  std::vector<io::FaultRule> out;
  if (rules.is_none()) return out;
  TORCH_CHECK_VALUE(py::isinstance<py::list>(rules) || py::isinstance<py::tuple>(rules),
                    "faults must be a list of dicts");
  size_t index = 0;
  for (const py::handle& item : rules) out.push_back(to_fault_rule(item, index++));
  return out;
}

// The tiered store of a paged state: the store itself on the CPU, the device cache's home
// (offload='nvme') on a GPU; nullptr otherwise.
paging::TieredPageStore* find_tiered_store(paging::PageStore& store) {
  if (auto* device = dynamic_cast<paging::DeviceCacheStore*>(&store)) {
    return dynamic_cast<paging::TieredPageStore*>(&device->home());
  }
  return dynamic_cast<paging::TieredPageStore*>(&store);
}

paging::TieredPageStore& tiered_store(optim::PagedState& state) {
  paging::TieredPageStore* store = find_tiered_store(state.store());
  TORCH_CHECK_VALUE(store != nullptr, "this optimizer's state has no page file or host tier "
                    "(offload=None, or offload='host' on a GPU)");
  return *store;
}

// What the options dict of pagedoptim.paging.store_options() says, checked.
struct StoreConfig {
  std::string offload;  // "host" or "nvme"
  paging::TieredStoreOptions store;
  paging::FileTierOptions file;  // offload == "nvme"
};

StoreConfig parse_store_options(const py::object& options, int64_t page_bytes) {
  TORCH_CHECK_VALUE(py::isinstance<py::dict>(options), "store must be None or a dict, got ",
                    std::string(py::str(options.get_type())));
  const py::dict d = py::reinterpret_borrow<py::dict>(options);
  for (const auto& [key, value] : d) {
    const std::string name = py::str(key);
    TORCH_CHECK_VALUE(kStoreKeys.count(name) != 0, "unknown paging option '", name, "'");
  }
  StoreConfig config;
  config.offload = get_or<std::string>(d, "offload", "");
  TORCH_CHECK_VALUE(config.offload == "host" || config.offload == "nvme",
                    "paging option 'offload' must be 'host' or 'nvme', got '", config.offload,
                    "'");

  paging::TieredStoreOptions& store = config.store;
  store.page_bytes = page_bytes;
  store.cache_bytes = get_or<int64_t>(d, "cache_bytes", store.cache_bytes);
  TORCH_CHECK_VALUE(store.cache_bytes >= 0, "paging option 'cache_bytes' must be >= 0, got ",
                    store.cache_bytes);
  store.prefetch = get_or<int32_t>(d, "prefetch", store.prefetch);
  TORCH_CHECK_VALUE(store.prefetch >= 0, "paging option 'prefetch' must be >= 0, got ",
                    store.prefetch);
  try {
    store.policy = paging::parse_eviction_policy(get_or<std::string>(d, "policy", "auto"));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "paging option ", e.what());
  }

  if (config.offload == "host") {
    TORCH_CHECK_VALUE(!d.contains("nvme_dir") || d["nvme_dir"].is_none(),
                      "paging option 'nvme_dir' applies only to offload='nvme'");
    TORCH_CHECK_VALUE(!d.contains("faults") || d["faults"].is_none(),
                      "fault injection applies only to offload='nvme'");
    return config;
  }
  paging::FileTierOptions& file = config.file;
  file.page_bytes = page_bytes;
  file.dir = get_or<std::string>(d, "nvme_dir", "");
  const std::string backend = get_or<std::string>(d, "io_backend", "auto");
  if (backend == "auto") file.engine.backend = io::Backend::kAuto;
  else if (backend == "io_uring") file.engine.backend = io::Backend::kIoUring;
  else if (backend == "posix") file.engine.backend = io::Backend::kPosix;
  else TORCH_CHECK_VALUE(false, "paging option 'io_backend' must be 'auto', 'io_uring' or "
                         "'posix', got '", backend, "'");
  const int64_t depth = get_or<int64_t>(d, "queue_depth", file.engine.queue_depth);
  TORCH_CHECK_VALUE(depth >= 1 && depth <= io::kMaxQueueDepth,
                    "paging option 'queue_depth' must be in [1, ", io::kMaxQueueDepth,
                    "], got ", depth);
  file.engine.queue_depth = uint32_t(depth);
  const std::string direct = get_or<std::string>(d, "direct", "auto");
  if (direct == "auto") file.direct = io::DirectMode::kAuto;
  else if (direct == "off") file.direct = io::DirectMode::kOff;
  else if (direct == "require") file.direct = io::DirectMode::kRequire;
  else TORCH_CHECK_VALUE(false, "paging option 'direct' must be 'auto', 'off' or 'require', "
                         "got '", direct, "'");
  if (d.contains("faults") && !d["faults"].is_none()) {
    file.inject_faults = true;
    file.faults = to_fault_rules(d["faults"]);
  }
  return config;
}

// Pinned bounce buffers between a device cache and the page file. Each copy in flight holds
// one until it retires, and the step's thread may enqueue a whole batch (half the device
// budget) ahead of the GPU, plus the prefetch window each way: fewer would push the file's
// cache past its budget (pinning and unpinning memory, which synchronizes the device).
int64_t bounce_pages(int64_t device_budget_pages, int32_t prefetch) {
  return std::max<int64_t>(16, device_budget_pages / 2 + 2 * int64_t(prefetch) + 4);
}

io::FaultInjectingEngine& fault_injector(optim::PagedState& state) {
  io::FaultInjectingEngine* injector = tiered_store(state).tier().fault_injector();
  TORCH_CHECK_VALUE(injector != nullptr,
                    "fault injection needs offload='nvme' and a 'faults' entry (an empty list "
                    "will do) in the store options");
  return *injector;
}

}  // namespace

std::unique_ptr<paging::PageStore> make_page_store(const py::object& options,
                                                   int64_t page_bytes) {
  if (options.is_none()) return std::make_unique<paging::HostPageStore>(page_bytes);
  StoreConfig config = parse_store_options(options, page_bytes);
  std::unique_ptr<paging::BackingTier> tier = config.offload == "host"
                                                  ? paging::make_host_tier(page_bytes)
                                                  : paging::make_file_tier(config.file);
  return std::make_unique<paging::TieredPageStore>(config.store, std::move(tier));
}

std::unique_ptr<paging::PageStore> make_device_page_store(const py::object& options,
                                                          int64_t page_bytes,
                                                          device::Device& device) {
  StoreConfig config = parse_store_options(options, page_bytes);
  paging::DeviceCacheOptions cache;
  cache.page_bytes = page_bytes;
  cache.cache_bytes = config.store.cache_bytes;
  cache.prefetch = config.store.prefetch;
  cache.policy = config.store.policy;
  TORCH_CHECK_VALUE(cache.cache_bytes >= page_bytes, "cache_bytes (", cache.cache_bytes,
                    ") must hold at least one page of page_bytes=", page_bytes, " on ",
                    device.name());
  std::unique_ptr<paging::PageStore> home;
  if (config.offload == "host") {
    home = std::make_unique<paging::PinnedHostStore>(device, page_bytes);
  } else {
    paging::TieredStoreOptions bounce = config.store;
    bounce.cache_bytes = bounce_pages(cache.cache_bytes / page_bytes, bounce.prefetch) * page_bytes;
    bounce.slots.allocate = [&device](int64_t bytes) { return device.allocate_host(bytes); };
    bounce.slots.release = [&device](void* memory) { device.release_host(memory); };
    home = std::make_unique<paging::TieredPageStore>(bounce, paging::make_file_tier(config.file));
  }
  return std::make_unique<paging::DeviceCacheStore>(device, std::move(home), cache);
}

namespace {

// The keys every paging_stats() has, from the counters every cache keeps.
void put_cache_stats(py::dict& d, const paging::CacheStats& s, const paging::PageStore& store) {
  d["policy"] = s.policy;
  d["prefetch"] = s.prefetch;
  d["page_bytes"] = store.page_bytes();
  d["num_pages"] = store.num_pages();
  d["budget_pages"] = s.budget_pages;
  d["cache_bytes"] = int64_t(s.budget_pages) * store.page_bytes();
  d["resident_bytes"] = store.resident_bytes();
  d["resident_pages"] = s.resident_pages;
  d["peak_resident_pages"] = s.peak_resident_pages;
  d["over_budget_pages"] = s.over_budget_pages;
  d["pin_limit"] = s.pin_limit;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["hit_rate"] = s.hits + s.misses > 0 ? double(s.hits) / double(s.hits + s.misses) : 0.0;
  d["prefetch_hits"] = s.prefetch_hits;
  d["evictions"] = s.evictions;
  d["pending_error"] =
      s.pending_error.empty() ? py::object(py::none()) : py::object(py::str(s.pending_error));
}

// The io backend of the tier below the cache, and why it runs below its best; None where
// there is no tier (`paged`) or no page file (`file`).
void put_tier_info(py::dict& d, const paging::TierInfo& tier, bool paged, bool file) {
  const auto or_none = [](bool present, const std::string& value) {
    return present ? py::object(py::str(value)) : py::object(py::none());
  };
  d["io_backend"] = or_none(paged, tier.backend);
  d["io_fallback_reason"] = tier.fallback_reason;
  d["direct_io"] = or_none(paged, tier.direct);
  d["direct_io_reason"] = tier.direct_reason;
  d["page_file"] = or_none(file, tier.location);
}

py::dict link(int64_t bytes, double seconds) {
  py::dict d;
  d["bytes"] = bytes;
  d["seconds"] = seconds;
  d["gb_per_s"] = seconds > 0 ? double(bytes) / seconds / 1e9 : 0.0;
  return d;
}

// The device cache's statistics under the keys of the CPU pager's, plus the links: bytes,
// busy seconds and GB/s of each copy direction (and of the page file), and the time the
// compute stream waited for a page.
py::dict device_paging_stats(paging::DeviceCacheStore& store) {
  const paging::DeviceCacheStats s = store.stats();
  auto* file = dynamic_cast<paging::TieredPageStore*>(&store.home());
  const paging::PagingStats f = file != nullptr ? file->stats() : paging::PagingStats{};
  py::dict d;
  paging::DeviceCacheStats shown = s;
  if (shown.pending_error.empty()) shown.pending_error = f.pending_error;
  put_cache_stats(d, shown, store);
  d["offload"] = file != nullptr ? "nvme" : "host";
  d["device"] = store.device().name();
  d["zero_fills"] = f.zero_fills;
  d["reads"] = s.loads;
  d["writes"] = s.write_backs;
  py::dict bytes_read, bytes_written;
  bytes_read["host"] = s.bytes_to_device;
  bytes_written["host"] = s.bytes_to_host;
  if (file != nullptr) {
    bytes_read["nvme"] = f.bytes_read;
    bytes_written["nvme"] = f.bytes_written;
  }
  d["bytes_read"] = bytes_read;
  d["bytes_written"] = bytes_written;
  py::dict links;
  links["host_to_device"] = link(s.bytes_to_device, s.seconds_to_device);
  links["device_to_host"] = link(s.bytes_to_host, s.seconds_to_host);
  d["links"] = links;
  d["stall_seconds"] = s.compute_wait_seconds;
  d["compute_wait_seconds"] = s.compute_wait_seconds;
  d["host_stall_seconds"] = f.stall_seconds;  // the step's thread waiting for the page file
  d["learned_order_pages"] = s.learned_order_pages;
  d["read_retries"] = f.read_retries;
  d["read_errors"] = f.read_errors;
  d["checksum_errors"] = f.checksum_errors;
  d["write_errors"] = f.write_errors;
  put_tier_info(d, f.tier, file != nullptr, file != nullptr);
  return d;
}

}  // namespace

py::dict state_placement(paging::PageStore& store, bool on_device) {
  py::dict d;
  const int64_t all = int64_t(store.num_pages()) * store.page_bytes();
  if (auto* cache = dynamic_cast<paging::DeviceCacheStore*>(&store)) {
    d["device"] = cache->resident_bytes();
    if (auto* file = dynamic_cast<paging::TieredPageStore*>(&cache->home())) {
      d["pinned_host"] = file->resident_bytes();  // the bounce buffers
      d["nvme"] = all;
    } else {
      d["pinned_host"] = all;
    }
  } else if (auto* tiered = dynamic_cast<paging::TieredPageStore*>(&store)) {
    d["host"] = tiered->resident_bytes();  // the cache; the tier below holds every page
    d[py::str(tiered->stats().tier.name == "nvme" ? "nvme" : "host_tier")] = all;
  } else {
    d[on_device ? "device" : "host"] = all;
  }
  return d;
}

py::dict paging_stats(paging::PageStore& store) {
  if (auto* device = dynamic_cast<paging::DeviceCacheStore*>(&store)) {
    return device_paging_stats(*device);
  }
  py::dict d;
  auto* tiered = dynamic_cast<paging::TieredPageStore*>(&store);
  paging::PagingStats s = tiered != nullptr ? tiered->stats() : paging::PagingStats{};
  if (tiered == nullptr) {
    // Not paged: every page is resident, as if in a cache as large as the state.
    s.budget_pages = s.resident_pages = s.peak_resident_pages = store.num_pages();
    s.pin_limit = store.pin_limit();
  }
  const std::string tier = tiered != nullptr ? s.tier.name : "";
  put_cache_stats(d, s, store);
  d["offload"] = tiered != nullptr ? py::object(py::str(tier)) : py::object(py::none());
  if (tiered == nullptr) d["policy"] = py::none();
  d["zero_fills"] = s.zero_fills;
  d["reads"] = s.reads;
  d["writes"] = s.writes;
  py::dict bytes_read, bytes_written;
  if (tiered != nullptr) {
    bytes_read[py::str(tier)] = s.bytes_read;
    bytes_written[py::str(tier)] = s.bytes_written;
  }
  d["bytes_read"] = bytes_read;
  d["bytes_written"] = bytes_written;
  d["stall_seconds"] = s.stall_seconds;
  d["read_retries"] = s.read_retries;
  d["read_errors"] = s.read_errors;
  d["checksum_errors"] = s.checksum_errors;
  d["write_errors"] = s.write_errors;
  put_tier_info(d, s.tier, tiered != nullptr, tier == "nvme");
  return d;
}

void bind_page_store(py::module_& m) {
  page_io_error = PyErr_NewExceptionWithDoc(
      "pagedoptim._C.PageIOError",
      "The page file failed (a full disk, EIO, a short transfer): an OSError whose errno and "
      "filename say which. A failed write-back loses no state; state_dict() still works.",
      PyExc_OSError, nullptr);
  page_corruption_error = PyErr_NewExceptionWithDoc(
      "pagedoptim._C.PageCorruptionError",
      "A page read back from the page file failed its crc32c; its bytes were not used.",
      PyExc_RuntimeError, nullptr);
  if (page_io_error == nullptr || page_corruption_error == nullptr) throw py::error_already_set();
  m.add_object("PageIOError", py::handle(page_io_error));
  m.add_object("PageCorruptionError", py::handle(page_corruption_error));
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const paging::PageIoError& e) {
      // OSError(errno, strerror, filename): sets .errno, .strerror and .filename.
      const py::tuple args = py::make_tuple(e.error_number(), std::string(e.what()), e.path());
      PyErr_SetObject(page_io_error, args.ptr());
    } catch (const paging::PageCorruptionError& e) {
      PyErr_SetString(page_corruption_error, e.what());
    } catch (const device::MemoryRefused& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const device::DeviceError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("set_fault_rules",
        [](optim::PagedState& state, const py::object& rules) {
          const int err = fault_injector(state).set_rules(to_fault_rules(rules));
          TORCH_CHECK_VALUE(err == 0, "invalid fault rules");
        },
        py::arg("state"), py::arg("rules"),
        "Replaces the injected faults of a paged state's page file (tests only).");
  m.def("fault_counts",
        [](optim::PagedState& state) { return fault_injector(state).fire_counts(); },
        py::arg("state"), "How often each injected fault rule fired.");
  m.def("measure_disk_bandwidth",
        [](const std::string& dir, int64_t file_bytes, int64_t block_bytes, int64_t queue_depth,
           const std::string& backend) {
          io::BandwidthOptions options;
          options.dir = dir;
          options.file_bytes = file_bytes;
          TORCH_CHECK_VALUE(block_bytes > 0 && block_bytes % io::kDirectAlignment == 0 &&
                                block_bytes <= (int64_t(1) << 30),
                            "block_bytes must be a multiple of 4096 up to 1 GiB, got ",
                            block_bytes);
          options.block_bytes = uint32_t(block_bytes);
          TORCH_CHECK_VALUE(queue_depth >= 1 && queue_depth <= io::kMaxQueueDepth,
                            "queue_depth out of range: ", queue_depth);
          options.queue_depth = uint32_t(queue_depth);
          if (backend == "posix") options.backend = io::Backend::kPosix;
          else if (backend == "io_uring") options.backend = io::Backend::kIoUring;
          else TORCH_CHECK_VALUE(backend == "auto", "backend must be 'auto', 'io_uring' or "
                                 "'posix', got '", backend, "'");
          io::BandwidthResult r;
          {
            py::gil_scoped_release no_gil;
            r = io::measure_sequential_bandwidth(options);
          }
          if (r.error < 0) {
            throw paging::PageIoError(-r.error, dir, -1, "bandwidth probe in " + dir);
          }
          py::dict d;
          d["backend"] = io::backend_name(r.backend);
          d["fallback_reason"] = r.fallback_reason;
          d["direct"] = io::direct_status_name(r.direct);
          d["bytes"] = r.bytes;
          d["write_gb_per_s"] = r.write_gb_per_s;
          d["read_gb_per_s"] = r.read_gb_per_s;
          d["mixed_bytes"] = r.mixed_bytes;
          d["mixed_gb_per_s"] = r.mixed_gb_per_s;
          return d;
        },
        py::arg("dir"), py::arg("file_bytes") = int64_t(256) << 20,
        py::arg("block_bytes") = int64_t(1) << 20, py::arg("queue_depth") = 16,
        py::arg("backend") = "auto",
        "Sequential write, sequential read, then mixed bandwidth (first half read while the "
        "second is written, on one queue; mixed_gb_per_s counts both) of a scratch file of at "
        "least two blocks in `dir`, through the same io engines the page file uses "
        "(GB/s = 1e9 B/s).");
  m.def("drain_paging",
        [](optim::PagedState& state) {
          auto* device = dynamic_cast<paging::DeviceCacheStore*>(&state.store());
          paging::TieredPageStore* file = find_tiered_store(state.store());
          TORCH_CHECK_VALUE(device != nullptr || file != nullptr,
                            "this optimizer's state is not paged (offload=None)");
          py::gil_scoped_release no_gil;
          if (device != nullptr) device->drain();  // the copies first: they pin file pages
          if (file != nullptr) {
            file->drain();
            if (device != nullptr) file->raise_pending_error();
          }
        },
        py::arg("state"), "Waits until the pager has no I/O in flight.");
}

}  // namespace pagedoptim::bindings
