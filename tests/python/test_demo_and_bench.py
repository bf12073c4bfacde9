"""Smoke tests of the command-line demo and the step-throughput benchmark.

Both run as subprocesses, the way users run them. They check that the programs finish and that
their output has the promised shape; they never check timings, which depend on the machine.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY_DEMO_ARGS = [
    "--steps", "5", "--batch", "2", "--seq-len", "16", "--d-model", "32", "--layers", "1",
    "--heads", "2", "--corpus-bytes", "4096", "--seed", "3",
]  # fmt: skip

THROUGHPUT_KEYS = {
    "size",
    "optimizer",
    "params_per_s",
    "ratio_vs_torch_fused",
    "ratio_vs_foreach",
    "achieved_gbps",
    "roofline_gbps",
    "roofline_fraction",
}
BANDWIDTH_KEYS = {"copy_gbps", "inplace_add_gbps", "buffer_bytes"}


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )


def test_cli_without_command_prints_usage():
    result = run(["-m", "pagedoptim"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "demo" in result.stdout


def test_demo_prints_finite_losses_and_memory_for_both_optimizers():
    result = run(["-m", "pagedoptim", "demo", *TINY_DEMO_ARGS], timeout=300)
    assert result.returncode == 0, result.stderr

    # Loss rows: "  step | loss pagedoptim | loss torch | abs diff".
    loss_rows = re.findall(r"^\s*(\d+) \|\s*(\S+) \|\s*(\S+) \|\s*(\S+)\s*$", result.stdout, re.MULTILINE)
    steps = [int(row[0]) for row in loss_rows]
    assert steps and steps[0] == 1 and steps[-1] == 5, result.stdout
    for _, paged_loss, torch_loss, _ in loss_rows:
        assert math.isfinite(float(paged_loss)) and math.isfinite(float(torch_loss)), result.stdout

    for metric in ("optimizer-state bytes", "optimizer-state bytes/param", "wall time (s)"):
        row = re.search(rf"^{re.escape(metric)}\s*\|\s*([\d.,]+)\s*\|\s*([\d.,]+)\s*$", result.stdout, re.MULTILINE)
        assert row is not None, f"no '{metric}' row in:\n{result.stdout}"
        paged_value, torch_value = (float(value.replace(",", "")) for value in row.groups())
        if metric.startswith("optimizer-state"):
            assert paged_value > 0 and torch_value > 0, row.group(0)


def test_step_throughput_quick_prints_one_json_object_per_line():
    result = run([str(REPO_ROOT / "benchmarks" / "step_throughput.py"), "--quick"], timeout=600)
    assert result.returncode == 0, result.stderr

    records = [json.loads(line) for line in result.stdout.splitlines()]
    bandwidth = [r for r in records if r.get("benchmark") == "memory_bandwidth"]
    throughput = [r for r in records if r.get("benchmark") == "adamw_step_throughput"]
    assert len(bandwidth) == 1 and BANDWIDTH_KEYS <= bandwidth[0].keys(), bandwidth
    assert len(bandwidth) + len(throughput) == len(records), "lines of an unknown benchmark"

    assert throughput, result.stdout
    for record in throughput:
        assert THROUGHPUT_KEYS <= record.keys(), record
        assert record["params_per_s"] > 0 and record["roofline_fraction"] > 0, record
    assert {r["optimizer"] for r in throughput} == {"pagedoptim", "torch_fused", "torch_foreach"}
    assert {r["size"] for r in throughput} >= {"1M"}


def test_gpu_paging_harness_runs_on_the_cpu():
    """benchmarks/gpu_paging.py first runs for real on a lent GPU; its harness (model from a
    config, activation checkpointing, gradient release, paged against resident state, the
    memory plan) is checked here so that the GPU run does not fail on a typo."""
    result = run([str(REPO_ROOT / "benchmarks" / "gpu_paging.py"), "--quick", "--device", "cpu",
                  "--parts", "train,headline"], timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    train = [r for r in records if r.get("part") == "train"]
    assert [r["paged"] for r in train] == [False, True], records
    # Paging never changes results: the same seeds give the same loss, paged or not.
    assert train[0]["loss"] == train[1]["loss"], train
    assert all(r["tokens_per_s"] > 0 for r in train)
    headline = next(r for r in records if r.get("part") == "headline")
    plan = headline["memory_plan"]
    assert plan["torch_adamw_gib"] > plan["pagedoptim_8bit_resident_gib"] > \
        plan["pagedoptim_8bit_resident_release_gib"] > 0
    assert records[-1]["bench"] == "gpu_paging_targets"
