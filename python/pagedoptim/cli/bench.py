"""Measure this machine for `python -m pagedoptim plan`: host memory bandwidth; disk write,
read and mixed bandwidth through pagedoptim's io engine in --dir; pinned host <-> GPU
bandwidth when a CUDA GPU is present; and the optimizer step throughput of each pagedoptim
mode against torch.optim.AdamW, timed in the same rounds.

Prints a table (or, with --json, the record), and writes the record where plan looks for it
($PAGEDOPTIM_BENCH_FILE, else ~/.cache/pagedoptim/bench.json; --output overrides).

    python -m pagedoptim bench                       # about 15 s on 2 cores
    python -m pagedoptim bench --dir /mnt/nvme --png bench.png
    python -m pagedoptim bench --quick               # tiny sizes, a few seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import stat
import sys
import warnings
from typing import Any, Optional

import torch

from pagedoptim.cli import link_bandwidth, machine_profile, step_modes
from pagedoptim.cli.bench_plot import draw_png, matplotlib_missing
from pagedoptim.cli.memory_bandwidth import measure_memory_bandwidth
from pagedoptim.cli.progress import PhaseProgress
from pagedoptim.paging.setting_text import parse_byte_size

MIB = 1 << 20

# (normal, --quick) for each size the user may leave unset. The normal ones make the whole
# run take about 15 s on a 2-core machine (13 s measured on 2026-12-06): host buffers well
# past any last-level cache, a disk file large enough that its bandwidth is the disk's, 16M
# params per mode.
SIZES = {
    "params": (16 << 20, 1 << 16),
    "disk_bytes": (256 * MIB, 8 * MIB),
    "memory_bytes": (512 * MIB, 16 * MIB),
    "pcie_bytes": (256 * MIB, 8 * MIB),
    "repeats": (5, 3),
}
WARMUP = {False: 2, True: 1}  # untimed rounds before the timed ones, normal and --quick


# --- arguments -----------------------------------------------------------------------------


def _count(text: str) -> int:
    """A positive count: 16777216, or with a binary suffix: 64K, 16M, 1G."""
    suffixes = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    cleaned = text.strip().lower()
    multiplier = suffixes.get(cleaned[-1:], 1)
    digits = cleaned[:-1] if multiplier != 1 else cleaned
    try:
        value = int(digits) * multiplier
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number such as 16M or "
                                         f"1000000, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _disk_bytes(text: str) -> int:
    try:
        value = parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}, got {text!r}") from None
    if value < link_bandwidth.MIN_DISK_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at least {link_bandwidth.MIN_DISK_BYTES} bytes (2MiB: the probe reads one "
            f"1 MiB block while it writes another), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=os.environ.get("TMPDIR") or "/tmp",
                        help="directory for the disk test file and the paged mode's page file: "
                             "the disk your nvme_dir would be on (default: $TMPDIR or /tmp, "
                             "here %(default)s)")
    parser.add_argument("--disk-bytes", type=_disk_bytes, default=None,
                        help="size of the disk test file, e.g. 256MiB or 1GiB (default: 256MiB; "
                             "8MiB with --quick)")
    parser.add_argument("--params", type=_count, default=None,
                        help="params per optimizer in the step benchmark, e.g. 16M (default: 16M; "
                             "64K with --quick)")
    parser.add_argument("--repeats", type=_count, default=None,
                        help="timed rounds per measurement; steps report the median "
                             "(default: 5; 3 with --quick)")
    parser.add_argument("--output", type=pathlib.Path, default=None,
                        help="where to write the JSON record (default: where plan reads it, "
                             f"${machine_profile.BENCH_FILE_ENV} or "
                             "~/.cache/pagedoptim/bench.json)")
    parser.add_argument("--png", type=pathlib.Path, default=None,
                        help="also draw the bandwidths and step throughput ratios into this PNG "
                             "(needs matplotlib)")
    parser.add_argument("--json", action="store_true",
                        help="print the record as JSON on stdout instead of the table")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, for a smoke test: the numbers mean little")


def _resolve_sizes(args: argparse.Namespace) -> None:
    """Fills the sizes left unset from SIZES (normal or --quick)."""
    for name, (normal, quick) in SIZES.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else normal)


# --- checks before anything is written -------------------------------------------------------


def _bytes_text(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count:,} bytes ({count / size:.1f} {unit})"
    return f"{count:,} bytes"


def scratch_dir_problem(directory: str, needed_bytes: int) -> Optional[str]:
    """Why bench cannot write `needed_bytes` into `directory`, or None when it can."""
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        return f"--dir {directory} does not exist"
    except NotADirectoryError:
        return f"--dir {directory} is not a directory (a part of its path is a file)"
    except OSError as error:
        return f"--dir {directory} cannot be used: {error.strerror}"
    if not stat.S_ISDIR(mode):
        return f"--dir {directory} is not a directory"
    file_system = os.statvfs(directory)
    if file_system.f_flag & os.ST_RDONLY:
        return f"--dir {directory} is on a read-only file system"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"--dir {directory} is not writable"
    free = file_system.f_bavail * file_system.f_frsize
    if free < needed_bytes:
        return (f"--dir {directory} has {_bytes_text(free)} free, but bench writes up to "
                f"{_bytes_text(needed_bytes)} there (the --disk-bytes test file, then the paged "
                f"mode's page file); {_bytes_text(needed_bytes - free)} missing. Lower "
                "--disk-bytes or --params, or name another --dir.")
    return None


def output_problem(path: pathlib.Path, flag: str) -> Optional[str]:
    """Why the file `flag` names cannot be written to `path`, or None; checked before the
    minute of measuring rather than after it."""
    if path.is_dir():
        return f"{flag} {path} is a directory; name a file"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{flag} {path}: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{flag} {path}: {ancestor} is not writable"
    return None


# --- measuring ---------------------------------------------------------------------------------


def _measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    record: dict[str, Any] = {
        "schema": machine_profile.SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }
    progress = PhaseProgress(4)
    with progress.phase("host memory bandwidth"):
        memory = measure_memory_bandwidth(args.memory_bytes, args.repeats)
    record["memory"] = {"bytes_per_s": memory.roofline_gbps * 1e9,
                        "copy_bytes_per_s": memory.copy_gbps * 1e9,
                        "buffer_bytes": memory.buffer_bytes}

    with progress.phase(f"disk bandwidth in {args.dir}"):
        record["disk"] = link_bandwidth.measure_disk(args.dir, args.disk_bytes)

    if device.type == "cuda":
        with progress.phase(f"pcie and device memory bandwidth ({device})"):
            record["pcie"] = link_bandwidth.measure_pcie(device, args.pcie_bytes, args.repeats)
            record["device_memory"] = link_bandwidth.measure_device_memory(
                device, args.memory_bytes, args.repeats)
    else:
        progress.skip("pcie bandwidth", "no CUDA GPU")

    warmup = WARMUP[args.quick]
    # The paged mode warns when its page file falls back to POSIX or buffered I/O. Caught
    # here, the warning becomes one line after the progress and a note in the record, not
    # a two-line warning in the middle of a bar.
    with warnings.catch_warnings(record=True) as caught, \
            progress.phase(f"step throughput, {args.params:,} params on {device.type}",
                           steps=warmup + args.repeats) as advance:
        warnings.simplefilter("always")
        results = step_modes.measure_steps(args.params, device, args.dir, warmup=warmup,
                                           repeats=args.repeats, on_round=advance)
    notes = list(dict.fromkeys(str(warning.message) for warning in caught))
    for note in notes:
        print(f"bench: {note}", file=sys.stderr)
    torch_rate = next(r.params_per_s for r in results if r.mode == step_modes.TORCH_MODE)
    record["steps"] = [
        {"mode": r.mode, "device": device.type, "params_per_s": r.params_per_s,
         "ratio_to_torch": r.params_per_s / torch_rate, "median_s": r.median_s,
         "params": args.params, "what": r.what}
        for r in results
    ]
    record["bench"] = {"params": args.params, "repeats": args.repeats, "quick": args.quick,
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "warnings": notes}
    return record


# --- reporting ---------------------------------------------------------------------------------


def _disk_note(disk: dict[str, Any]) -> str:
    note = f"{disk['backend']}, {'O_DIRECT' if disk['direct'] == 'direct' else disk['direct']}"
    if disk["fallback_reason"]:
        note += f" ({disk['fallback_reason']})"
    return note


def format_table(record: dict[str, Any]) -> str:
    lines = [f"{'link':<28} {'GB/s':>9}  measured with"]

    def link(label: str, bytes_per_s: float, note: str) -> None:
        lines.append(f"{label:<28} {bytes_per_s / 1e9:>9.3f}  {note}")

    memory, disk = record["memory"], record["disk"]
    link("host memory", memory["bytes_per_s"],
         f"in-place add over 2 x {_bytes_text(memory['buffer_bytes'])}")
    note = f"{_bytes_text(disk['file_bytes'])} in {disk['dir']}, {_disk_note(disk)}"
    link("disk write", disk["write_bytes_per_s"], note)
    link("disk read", disk["read_bytes_per_s"], note)
    link("disk mixed (read + write)", disk["mixed_bytes_per_s"], "half read while half written")
    if "pcie" in record:
        pcie = record["pcie"]
        link("pinned host -> device", pcie["host_to_device_bytes_per_s"], pcie["device"])
        link("device -> pinned host", pcie["device_to_host_bytes_per_s"], pcie["device"])
        link("device memory", record["device_memory"]["bytes_per_s"], pcie["device"])
    else:
        lines.append(f"{'pinned host <-> device':<28} {'-':>9}  skipped: no CUDA GPU")

    steps = record["steps"]
    lines += ["", f"step throughput: {steps[0]['params']:,} params on {steps[0]['device']}, "
                  f"median of {record['bench']['repeats']} interleaved rounds",
              f"{'mode':<16} {'Mparams/s':>10} {'x torch':>8}  optimizer"]
    for entry in steps:
        lines.append(f"{entry['mode']:<16} {entry['params_per_s'] / 1e6:>10.2f} "
                     f"{entry['ratio_to_torch']:>8.2f}  {entry['what']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    _resolve_sizes(args)
    output = args.output if args.output is not None else machine_profile.default_path()
    needed = max(args.disk_bytes, step_modes.nvme_page_file_bytes(args.params))
    problem = (scratch_dir_problem(args.dir, needed) or output_problem(output, "--output")
               or (matplotlib_missing() if args.png is not None else None)
               or (output_problem(args.png, "--png") if args.png is not None else None))
    if problem is not None:
        print(f"bench: {problem}", file=sys.stderr)
        return 1

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        record = _measure(args, device)
    except OSError as error:  # the disk refused the probe or the page file: say so, no trace
        print(f"bench: {error}", file=sys.stderr)
        return 1
    path = machine_profile.save_profile(record, output)
    if args.png is not None:
        draw_png(record, args.png)
    if args.json:
        print(json.dumps(record, indent=1, sort_keys=True))
    else:
        print(format_table(record))
    print(f"bench: results written to {path}" + (f", plot to {args.png}" if args.png else ""),
          file=sys.stderr)
    return 0
