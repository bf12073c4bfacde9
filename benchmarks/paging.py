"""Paged optimizer state on the NVMe tier: step time against offload=None, disk traffic per
step as a fraction of the disk's own sequential bandwidth (measured by our io engine in the
same run), and the hit rate of the eviction policies. One JSON line per result.

    python benchmarks/paging.py                       # step + bandwidth + hit-rate table
    python benchmarks/paging.py --state-mib 2048      # a bigger state (4x the cache)
    python benchmarks/paging.py --large --large-params 2e9   # 8-bit AdamW, 4 GiB cache
    python benchmarks/paging.py --large --checkpoint          # + a streaming checkpoint of it
    python benchmarks/paging.py --overlap                     # the NVMe overlap targets,
                                                              # per prefetch depth

`--dir` is where the page file and the bandwidth probe's scratch file go (default: $TMPDIR
or /tmp); it should be the disk under test. The large mode needs about 3.1 B/param on disk
(8-bit moments + 24-bit master residual) and 4 B/param of RAM for bf16 params and grads on
top of the cache: check `df -h` and `free -g` first.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagedoptim as po  # noqa: E402
from pagedoptim._native import native  # noqa: E402
from pagedoptim.cli.process_memory import peak_rss_bytes, rss_bytes  # noqa: E402
from utils import emit, run_child, significant, time_interleaved  # noqa: E402

MIB = 1 << 20


def disk_bandwidth(directory: str, file_bytes: int) -> dict:
    """Sequential write, read and mixed (half read while half written) bandwidth of our own
    engine (io_uring, O_DIRECT, QD16, 1 MiB blocks)."""
    result = native.measure_disk_bandwidth(directory, file_bytes, 1 << 20, 16, "auto")
    emit({"bench": "disk_bandwidth", "tool": "pagedoptim_io", "dir": directory,
          "backend": result["backend"], "direct": result["direct"],
          "bytes": result["bytes"], "write_gb_per_s": significant(result["write_gb_per_s"]),
          "read_gb_per_s": significant(result["read_gb_per_s"]),
          "mixed_gb_per_s": significant(result["mixed_gb_per_s"])})
    return result


def traffic(opt) -> tuple[int, int]:
    stats = opt.paging_stats()
    return sum(stats["bytes_read"].values()), sum(stats["bytes_written"].values())


def step_benchmark(args) -> dict:
    """AdamW (fp32 state: the most bytes per param) over `state_mib` of state with a cache of
    a quarter of it, against the same optimizer without paging. Returns the record; main()
    adds the disk limit once the disk was probed before and after."""
    state_bytes = args.state_mib * MIB
    numel = state_bytes // 8  # fp32 exp_avg + exp_avg_sq
    sizes = [numel // args.params] * args.params
    g = torch.Generator().manual_seed(0)
    params = {name: [torch.randn(n, generator=g).requires_grad_() for n in sizes]
              for name in ("none", "nvme")}
    for name in params:
        for p in params[name]:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
    common = dict(lr=1e-4, state_bits=32, master_bits=None, page_bytes=args.page_bytes)
    opts = {
        "none": po.AdamW(params["none"], **common),
        "nvme": po.AdamW(params["nvme"], offload="nvme", nvme_dir=args.dir,
                         cache_bytes=state_bytes // args.state_over_cache,
                         prefetch=args.prefetch, **common),
    }
    before = {}

    def mark():
        before["traffic"] = traffic(opts["nvme"])
        before["stats"] = opts["nvme"].paging_stats()

    opts["nvme"].step()  # zero-fills every page once and writes most of them
    opts["none"].step()
    mark()
    timings = time_interleaved({name: opt.step for name, opt in opts.items()},
                               warmup=1, repeats=args.repeats)
    steps = 1 + args.repeats
    read, written = (a - b for a, b in zip(traffic(opts["nvme"]), before["traffic"]))
    stats = opts["nvme"].paging_stats()
    read_per_step, written_per_step = read / steps, written / steps
    t_nvme, t_none = timings["nvme"].median, timings["none"].median
    hits = stats["hits"] - before["stats"]["hits"]
    misses = stats["misses"] - before["stats"]["misses"]
    record = {"bench": "paging_step", "optimizer": "AdamW fp32 state", "state_bytes": state_bytes,
          "cache_bytes": stats["cache_bytes"], "page_bytes": args.page_bytes,
          "prefetch": args.prefetch, "io_backend": stats["io_backend"],
          "direct_io": stats["direct_io"],
          "step_s_offload_none": significant(t_none), "step_s_nvme": significant(t_nvme),
          "slowdown": significant(t_nvme / t_none),
          "bytes_read_per_step": int(read_per_step),
          "bytes_written_per_step": int(written_per_step),
          "disk_gb_per_s": significant((read_per_step + written_per_step) / t_nvme / 1e9),
          "hit_rate": significant(hits / max(1, hits + misses)),
          "stall_s_per_step": significant((stats["stall_seconds"]
                                           - before["stats"]["stall_seconds"]) / steps)}
    del opts, params
    gc.collect()
    return record


def add_disk_limit(record: dict, probes: list[dict]) -> dict:
    """The time the disk needs for the step's traffic at the best sequential rates the probes
    saw, two ways: reads and writes one after the other (serial), or at once on a device
    that does both in parallel (overlapped, the tighter bound on a full-duplex device)."""
    read_bw = max(p["read_gb_per_s"] for p in probes) * 1e9
    write_bw = max(p["write_gb_per_s"] for p in probes) * 1e9
    t_read = record["bytes_read_per_step"] / read_bw
    t_write = record["bytes_written_per_step"] / write_bw
    step_s = record["step_s_nvme"]
    return {**record,
            "disk_limit_s_serial": significant(t_read + t_write),
            "disk_limit_s_overlapped": significant(max(t_read, t_write)),
            "fraction_of_disk_limit_serial": significant((t_read + t_write) / step_s),
            "fraction_of_disk_limit_overlapped": significant(max(t_read, t_write) / step_s)}


def hit_rate_table(args) -> None:
    """Steady-state hit rate of lru and plan for budgets of 10/25/50/75% of the state, with
    the driver's alternating scan and with a scan in one direction (LRU's worst case). The
    second is run on the store directly: the driver always alternates."""
    page = 8192
    pages = 200
    for fraction in (0.10, 0.25, 0.50, 0.75):
        for policy in ("lru", "plan"):
            p = torch.randn(pages * 1024, requires_grad=True)  # fp32 AdamW: 1024 per 8 KiB page
            opt = po.AdamW([p], state_bits=32, master_bits=None, page_bytes=page,
                           offload="host", cache_bytes=int(fraction * pages) * page,
                           policy=policy)
            hits = pins = 0
            for step in range(6):
                p.grad = torch.randn_like(p)
                before = opt.paging_stats()
                opt.step()
                after = opt.paging_stats()
                if step >= 2:
                    hits += after["hits"] - before["hits"]
                    pins += (after["hits"] + after["misses"]
                             - before["hits"] - before["misses"])
            emit({"bench": "hit_rate", "scan": "alternating (driver)", "policy": policy,
                  "budget_fraction": fraction, "hit_rate": significant(hits / pins),
                  "optimum": significant(int(fraction * pages) / opt.paging_stats()["num_pages"])})


class PeakRss:
    """The highest RSS a sampling thread sees while the block runs (every ~1 ms)."""

    def __enter__(self) -> "PeakRss":
        gc.collect()
        self.before = self.peak = rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def checkpoint_benchmark(opt, args, disk: dict) -> None:
    """save_checkpoint of the large run's state, then load_checkpoint of it back into the
    same optimizer (staged into a second engine, so the disk holds the page file twice for
    a while): seconds, GB/s, the disk's own rates from the probe, and the RSS they add."""
    path = Path(args.dir) / "paging-large.ckpt"
    state_bytes = opt.memory_report()["state_bytes"]
    read_bw, write_bw = disk["read_gb_per_s"] * 1e9, disk["write_gb_per_s"] * 1e9
    try:
        with PeakRss() as rss:
            start = time.perf_counter()
            opt.save_checkpoint(path)
            seconds = time.perf_counter() - start
        size = path.stat().st_size
        # The state comes from the page file and goes to the checkpoint, on one disk.
        limit_s = state_bytes / read_bw + size / write_bw
        emit({"bench": "checkpoint_save", "state_bytes": state_bytes, "checkpoint_bytes": size,
              "seconds": significant(seconds), "gb_per_s": significant(size / seconds / 1e9),
              "disk_read_gb_per_s": significant(read_bw / 1e9),
              "disk_write_gb_per_s": significant(write_bw / 1e9),
              "disk_limit_s_serial": significant(limit_s),
              "fraction_of_disk_limit_serial": significant(limit_s / seconds),
              "rss_before_bytes": rss.before, "peak_rss_bytes": rss.peak,
              "rss_rise_bytes": rss.peak - rss.before})
        with PeakRss() as rss:
            start = time.perf_counter()
            opt.load_checkpoint(path)
            seconds = time.perf_counter() - start
        emit({"bench": "checkpoint_load", "state_bytes": state_bytes, "checkpoint_bytes": size,
              "seconds": significant(seconds), "gb_per_s": significant(size / seconds / 1e9),
              "rss_before_bytes": rss.before, "peak_rss_bytes": rss.peak,
              "rss_rise_bytes": rss.peak - rss.before,
              "cache_bytes": opt.paging_stats()["cache_bytes"]})
    finally:
        path.unlink(missing_ok=True)


def chunked(numel: int, chunk: int = 1 << 27) -> list[int]:
    """Sizes of tensors of `chunk` elements (134M: a few transformer layers each) that hold
    `numel` in all."""
    return [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])


def large_run(args) -> None:
    """8-bit AdamW with the split master weight over --large-params bf16 params, 4 GiB cache;
    with --checkpoint, then a streaming checkpoint of its state."""
    numel = int(float(args.large_params))
    # One row each: 2-D, as a model's weights (1-D params keep fp32 moments).
    params = [torch.zeros(1, n, dtype=torch.bfloat16).requires_grad_() for n in chunked(numel)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = po.AdamW(params, lr=1e-4, offload="nvme", nvme_dir=args.dir,
                   cache_bytes=int(args.large_cache_gib * (1 << 30)), page_bytes=args.page_bytes,
                   prefetch=args.large_prefetch)
    for step in range(args.large_steps):
        before = traffic(opt)
        start = time.perf_counter()
        opt.step()
        seconds = time.perf_counter() - start
        read, written = (a - b for a, b in zip(traffic(opt), before))
        stats = opt.paging_stats()
        emit({"bench": "paging_large", "step": step, "params": numel,
              "prefetch": args.large_prefetch,
              "state_bytes": stats["num_pages"] * stats["page_bytes"],
              "cache_bytes": stats["cache_bytes"], "step_s": significant(seconds),
              "bytes_read": read, "bytes_written": written,
              "disk_gb_per_s": significant((read + written) / seconds / 1e9),
              "stall_s": significant(stats["stall_seconds"]),
              "peak_rss_bytes": peak_rss_bytes()})
    if args.checkpoint:
        for p in params:  # a checkpoint is taken after the step, without gradients
            p.grad = None
        checkpoint_benchmark(opt, args, disk_bandwidth(args.dir, args.probe_mib * MIB))


def overlap_params(args) -> list[torch.Tensor]:
    """--overlap-params bf16 params with bf16 grads, the same in every process (seeded)."""
    g = torch.Generator().manual_seed(0)
    params = [(torch.randn(1, n, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
              for n in chunked(int(float(args.overlap_params)))]  # 2-D: 8-bit moments
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(torch.bfloat16)
    return params


def overlap_child(args) -> None:
    """One paged optimizer at --prefetch over the overlap params: two steps to allocate,
    write every page once and read pages back, then the median of --repeats steps."""
    opt = po.AdamW(overlap_params(args), lr=1e-4, offload="nvme", nvme_dir=args.dir,
                   cache_bytes=args.overlap_cache_bytes, page_bytes=args.page_bytes,
                   prefetch=args.prefetch)
    opt.step()
    opt.step()
    runs = []
    for _ in range(args.repeats):
        before, stall = sum(traffic(opt)), opt.paging_stats()["stall_seconds"]
        start = time.perf_counter()
        opt.step()
        seconds = time.perf_counter() - start
        runs.append((seconds, sum(traffic(opt)) - before,
                     opt.paging_stats()["stall_seconds"] - stall))
    stats = opt.paging_stats()
    emit({"step_s": statistics.median(r[0] for r in runs),
          "moved": statistics.median(r[1] for r in runs),
          "stall_s": statistics.median(r[2] for r in runs),
          "cache_bytes": stats["cache_bytes"], "io_backend": stats["io_backend"]})


def run_overlap_child(args, depth: int, cache_bytes: int) -> dict:
    return run_child(__file__, ["--overlap-child", "--dir", args.dir,
                                "--overlap-params", str(args.overlap_params),
                                "--page-bytes", str(args.page_bytes), "--prefetch", str(depth),
                                "--repeats", str(args.repeats),
                                "--overlap-cache-bytes", str(cache_bytes)])


def overlap_run(args) -> None:
    """The NVMe overlap run: --overlap-params bf16 params (8-bit AdamW, the 24-bit master
    split: the defaults), a cache of 1/8 of the state, at each prefetch depth of
    --overlap-prefetch. Times the kernel-only step (the same params under an unpaged
    optimizer), then --overlap-rounds rounds of one process per depth, in turn (the order
    reversed every other round), each timing the median of --repeats paged steps, with a
    probe of the disk's mixed read/write bandwidth by our engine before the first round and
    after every round. One optimizer per process, as users run it: optimizers sharing a
    process and a disk were measured to slow each other unevenly (docs/paging.md). The
    shared disk's rate moves by 2x within a minute, so depths are compared with each other
    round by round, and each with the disk limit twice: the best probe of the run (the
    strict bound, the targets) and the median probe. Targets: bytes moved per second of step
    at least 0.8x the mixed bandwidth, the step at most 1.15x max(kernel-only step, bytes /
    mixed bandwidth)."""
    numel = int(float(args.overlap_params))
    depths = [int(d) for d in args.overlap_prefetch.split(",")]
    params = overlap_params(args)
    resident = po.AdamW(params, lr=1e-4)
    resident.step()  # allocates
    kernel_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        resident.step()
        kernel_times.append(time.perf_counter() - start)
    kernel_s = statistics.median(kernel_times)
    state_bytes = resident.memory_report()["state_bytes"]
    del resident, params
    gc.collect()

    probes = [disk_bandwidth(args.dir, args.probe_mib * MIB)]
    steps: list[list[dict]] = [[] for _ in depths]
    for round_index in range(args.overlap_rounds):
        order = range(len(depths)) if round_index % 2 == 0 else reversed(range(len(depths)))
        for i in order:
            steps[i].append(run_overlap_child(args, depths[i], state_bytes // 8))
        probes.append(disk_bandwidth(args.dir, args.probe_mib * MIB))

    mixed_rates = [p["mixed_gb_per_s"] * 1e9 for p in probes]
    best_mixed, median_mixed = max(mixed_rates), statistics.median(mixed_rates)
    for depth, runs in zip(depths, steps):
        step_s = statistics.median(r["step_s"] for r in runs)
        moved = statistics.median(r["moved"] for r in runs)
        emit({"bench": "paging_overlap", "params": numel, "param_dtype": "bfloat16",
              "state_bytes": state_bytes, "cache_bytes": runs[0]["cache_bytes"],
              "page_bytes": args.page_bytes, "prefetch": depth,
              "io_backend": runs[0]["io_backend"], "rounds": len(runs),
              "kernel_only_step_s": significant(kernel_s),
              "paged_step_s": significant(step_s),
              "paged_step_s_range": [significant(min(r["step_s"] for r in runs)),
                                     significant(max(r["step_s"] for r in runs))],
              "bytes_moved_per_step": int(moved),
              "step_gb_per_s": significant(moved / step_s / 1e9),
              "stall_s_per_step": significant(statistics.median(r["stall_s"] for r in runs)),
              "mixed_gb_per_s_best": significant(best_mixed / 1e9),
              "mixed_gb_per_s_median": significant(median_mixed / 1e9),
              "over_median_probe": {
                  "disk_rate_over_mixed_bandwidth": significant(moved / step_s / median_mixed),
                  "step_over_max_kernel_io":
                      significant(step_s / max(kernel_s, moved / median_mixed))}})
        rate_fraction = moved / step_s / best_mixed
        step_over_bound = step_s / max(kernel_s, moved / best_mixed)
        emit({"bench": "paging_overlap_targets", "prefetch": depth,
              "load_average_1m": os.getloadavg()[0], "targets": {
                  "disk_rate_over_mixed_bandwidth": {"value": significant(rate_fraction),
                                                     "target": 0.8,
                                                     "met": rate_fraction >= 0.8},
                  "step_over_max_kernel_io": {"value": significant(step_over_bound),
                                              "target": 1.15, "met": step_over_bound <= 1.15}}})
    for depth, runs in zip(depths[1:], steps[1:]):
        # Paired within rounds: the same disk moment for both depths.
        ratios = [r["step_s"] / b["step_s"] for r, b in zip(runs, steps[0])]
        emit({"bench": "paging_overlap_prefetch", "prefetch": depth, "baseline_prefetch": depths[0],
              "step_time_ratio_median": significant(statistics.median(ratios)),
              "rounds_faster": sum(x < 1 for x in ratios), "rounds": len(ratios)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.environ.get("TMPDIR", tempfile.gettempdir()))
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--state-over-cache", type=int, default=4)
    parser.add_argument("--params", type=int, default=8)
    parser.add_argument("--page-bytes", type=int, default=2 * MIB)
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hit-rate", action="store_true")
    parser.add_argument("--large", action="store_true")
    parser.add_argument("--large-params", default="2e9")
    parser.add_argument("--large-cache-gib", type=float, default=4.0)
    parser.add_argument("--large-steps", type=int, default=2)
    parser.add_argument("--large-prefetch", type=int, default=4,
                        help="prefetch of the large run (4: the optimizers' default)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="with --large: save_checkpoint / load_checkpoint of its state")
    parser.add_argument("--overlap", action="store_true",
                        help="the NVMe overlap targets (cache = state / 8)")
    parser.add_argument("--overlap-params", default="1e9")
    parser.add_argument("--overlap-prefetch", default="4,32",
                        help="prefetch depths compared by --overlap, the first the baseline "
                             "(4: the optimizers' default)")
    parser.add_argument("--overlap-rounds", type=int, default=3)
    parser.add_argument("--overlap-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlap-cache-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe-mib", type=int, default=1024,
                        help="size of the disk probe's scratch file")
    args = parser.parse_args()

    if args.overlap_child:
        overlap_child(args)
        return
    if args.overlap:
        overlap_run(args)
        return

    before = disk_bandwidth(args.dir, args.probe_mib * MIB)
    if args.large:
        large_run(args)
        disk_bandwidth(args.dir, args.probe_mib * MIB)
        return
    record = step_benchmark(args)
    after = disk_bandwidth(args.dir, args.probe_mib * MIB)  # again: the disk drifts on this shared machine
    emit(add_disk_limit(record, [before, after]))
    if not args.skip_hit_rate:
        hit_rate_table(args)


if __name__ == "__main__":
    main()
