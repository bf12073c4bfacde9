"""What `python -m pagedoptim bench` measured on this machine, and the stated defaults
`python -m pagedoptim plan` uses for whatever it has not measured.

bench writes one JSON file (`default_path()`: $PAGEDOPTIM_BENCH_FILE, else
$XDG_CACHE_HOME/pagedoptim/bench.json, else ~/.cache/pagedoptim/bench.json); plan reads it
with `load_profile()`. Every link keeps where its number came from, so a plan can say
"measured by bench on <date>" or "default: <why this number>" next to each estimate.

The file (schema 1; every section optional, each missing one falls back to its default):

    {"schema": 1, "created": "<ISO 8601>", "host": "<hostname>",
     "memory": {"bytes_per_s": float},                      # host DRAM, streaming read+write
     "disk": {"dir": str, "read_bytes_per_s": float, "write_bytes_per_s": float,
              "mixed_bytes_per_s": float, ...},              # through pagedoptim's io engine
     "pcie": {"host_to_device_bytes_per_s": float,           # pinned host <-> GPU
              "device_to_host_bytes_per_s": float, ...},
     "device_memory": {"bytes_per_s": float, ...},           # GPU memory, streaming
     "steps": [{"mode": str, "device": str, "params_per_s": float, ...}, ...]}
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import tempfile
from typing import Any, Mapping, Optional

BENCH_FILE_ENV = "PAGEDOPTIM_BENCH_FILE"
SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Link:
    """A bandwidth and where the number came from."""

    bytes_per_s: float
    source: str

    @property
    def measured(self) -> bool:
        return not self.source.startswith("default")


# Conservative numbers for the hardware our users train on, used where bench has not run.
DEFAULT_LINKS = {
    "memory": Link(10e9, "default: a share of one server socket's DRAM bandwidth"),
    "disk_read": Link(2.0e9, "default: a PCIe 3.0 x4 NVMe drive, sequential read"),
    "disk_write": Link(1.5e9, "default: a PCIe 3.0 x4 NVMe drive, sequential write"),
    "disk_mixed": Link(1.5e9, "default: a PCIe 3.0 x4 NVMe drive, reads and writes at once"),
    "host_to_device": Link(20e9, "default: pinned copies over PCIe 4.0 x16"),
    "device_to_host": Link(20e9, "default: pinned copies over PCIe 4.0 x16"),
    "device_memory": Link(1.0e12, "default: a 24 GB consumer GPU's memory bandwidth"),
}

# (section, key) in the bench file for each link.
_LINK_FIELDS = {
    "memory": ("memory", "bytes_per_s"),
    "disk_read": ("disk", "read_bytes_per_s"),
    "disk_write": ("disk", "write_bytes_per_s"),
    "disk_mixed": ("disk", "mixed_bytes_per_s"),
    "host_to_device": ("pcie", "host_to_device_bytes_per_s"),
    "device_to_host": ("pcie", "device_to_host_bytes_per_s"),
    "device_memory": ("device_memory", "bytes_per_s"),
}


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    links: dict[str, Link]
    # (mode, device) -> measured optimizer step throughput in params per second.
    step_params_per_s: dict[tuple[str, str], float]
    path: Optional[pathlib.Path]  # the bench file read, None when nothing was

    def link(self, name: str) -> Link:
        return self.links[name]


def default_path() -> pathlib.Path:
    explicit = os.environ.get(BENCH_FILE_ENV)
    if explicit:
        return pathlib.Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "pagedoptim" / "bench.json"


def _positive_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def parse_profile(record: Mapping[str, Any], path: Optional[pathlib.Path] = None) -> MachineProfile:
    """A profile from a bench record; raises ValueError naming the bad field."""
    where = str(path) if path is not None else "bench record"
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    schema = record.get("schema")
    if schema != SCHEMA_VERSION:
        raise ValueError(f"{where}: 'schema' must be {SCHEMA_VERSION}, got {schema!r}")
    measured_on = f"measured by bench on {record.get('created', 'an unknown date')} ({where})"
    links = dict(DEFAULT_LINKS)
    for name, (section, key) in _LINK_FIELDS.items():
        values = record.get(section)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}: '{section}' must be an object, got {values!r}")
        if key in values:
            links[name] = Link(_positive_number(values[key], f"{where}: {section}.{key}"),
                               measured_on)
    steps: dict[tuple[str, str], float] = {}
    entries = record.get("steps", [])
    if not isinstance(entries, list):
        raise ValueError(f"{where}: 'steps' must be a list, got {entries!r}")
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("mode"), str) \
                or not isinstance(entry.get("device"), str):
            raise ValueError(f"{where}: steps[{index}] needs a 'mode' and a 'device' string")
        steps[(entry["mode"], entry["device"])] = _positive_number(
            entry.get("params_per_s"), f"{where}: steps[{index}].params_per_s")
    return MachineProfile(links, steps, path)


def load_profile(path: Optional[os.PathLike | str] = None) -> MachineProfile:
    """The profile in `path` (default: `default_path()`); the defaults when the default file
    does not exist. An explicitly named file that is missing, or any unreadable one, raises."""
    explicit = path is not None
    resolved = pathlib.Path(path) if explicit else default_path()
    if not resolved.exists():
        if explicit:
            raise FileNotFoundError(f"no bench results at {resolved}: run "
                                    "`python -m pagedoptim bench` first")
        return MachineProfile(dict(DEFAULT_LINKS), {}, None)
    try:
        record = json.loads(resolved.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read bench results {resolved}: {error}") from error
    return parse_profile(record, resolved)


def save_profile(record: Mapping[str, Any], path: Optional[os.PathLike | str] = None) -> pathlib.Path:
    """Writes a bench record atomically (temporary file, fsync, rename) after checking that
    it parses; returns the path written."""
    resolved = pathlib.Path(path) if path is not None else default_path()
    parse_profile(record, resolved)
    resolved.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=resolved.parent, prefix=".bench-",
                                             suffix=".json")
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, resolved)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return resolved

