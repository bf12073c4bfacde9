"""The PNG of `python -m pagedoptim bench --png`: link bandwidths and step throughput ratios.

matplotlib is optional; `matplotlib_missing()` lets the command say so before it measures.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Mapping, Optional


def matplotlib_missing() -> Optional[str]:
    """Why no PNG can be drawn, or None when it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--png needs matplotlib, which is not installed (pip install matplotlib)"
    return None


def _bandwidths(record: Mapping[str, Any]) -> dict[str, float]:
    """Label -> GB/s of every link the record measured."""
    fields = [("host memory", "memory", "bytes_per_s"),
              ("disk write", "disk", "write_bytes_per_s"),
              ("disk read", "disk", "read_bytes_per_s"),
              ("disk mixed", "disk", "mixed_bytes_per_s"),
              ("host -> device", "pcie", "host_to_device_bytes_per_s"),
              ("device -> host", "pcie", "device_to_host_bytes_per_s"),
              ("device memory", "device_memory", "bytes_per_s")]
    return {label: record[section][key] / 1e9 for label, section, key in fields
            if key in record.get(section, {})}


def draw_png(record: Mapping[str, Any], path: os.PathLike | str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    bandwidths = _bandwidths(record)
    steps = record.get("steps", [])
    figure, (links_axis, steps_axis) = plt.subplots(1, 2, figsize=(12, 4.5))

    links_axis.barh(list(bandwidths), list(bandwidths.values()), color="tab:blue")
    links_axis.invert_yaxis()
    links_axis.set_xscale("log")  # DRAM and a disk differ by an order of magnitude or more
    links_axis.set_xlabel("GB/s (1e9 bytes/s, log scale)")
    links_axis.set_title("link bandwidth")
    for index, value in enumerate(bandwidths.values()):
        links_axis.annotate(f" {value:.3g}", (value, index), va="center")

    modes = [entry["mode"] for entry in steps]
    ratios = [entry["ratio_to_torch"] for entry in steps]
    steps_axis.barh(modes, ratios, color="tab:orange")
    steps_axis.invert_yaxis()
    steps_axis.axvline(1.0, color="black", linewidth=0.8)
    steps_axis.set_xlabel("step throughput / torch.optim.AdamW's")
    device = steps[0]["device"] if steps else "?"
    params = record.get("bench", {}).get("params", "?")
    steps_axis.set_title(f"optimizer step, {params:,} params on {device}"
                         if isinstance(params, int) else "optimizer step")
    for index, value in enumerate(ratios):
        steps_axis.annotate(f" {value:.2f}x", (value, index), va="center")

    figure.suptitle(f"pagedoptim bench on {record.get('host', '?')}, {record.get('created', '')}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
