"""The scripts a lent GPU machine runs (scripts/gpu_check.sh and what it calls), run here first.

A GPU is lent for one call of about 8 minutes: a script that fails on a typo there wastes the
lease. Each script has a mode that needs no GPU (the simulated device, the CPU harness, or
stand-ins for nvidia-smi, nvcc and compute-sanitizer), and these tests run it.
(benchmarks/gpu_step.py's and gpu_paging.py's CPU harness runs are in test_demo_and_bench.py;
the GPU test modules themselves run on the simulated device as part of the suite.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, **kw)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_sanitizer_cases_pass_on_the_simulated_device():
    """Every case compares the device's params with a CPU run bit for bit: run on the simulated
    device, the cases themselves (SkewAdam's and the offload path's included) are checked."""
    result = run_script(["scripts/gpu_sanitize_cases.py", "--quick", "--simulated"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = json_lines(result.stdout)
    summary = records[-1]
    assert summary["failed"] == [] and summary["cases"] == len(records) - 1
    names = {r["case"] for r in records[:-1]}
    assert all(r["ok"] for r in records[:-1])
    assert {"offload-host", "offload-nvme", "state-dict", "amp-adamw", "release-lion"} <= names
    assert any(name.startswith("skewadam-") for name in names)
    listed = run_script(["scripts/gpu_sanitize_cases.py", "--quick", "--list"])
    assert listed.stdout.split() == [r["case"] for r in records[:-1]]


def test_leak_check_runs_on_the_simulated_device():
    result = run_script(["scripts/gpu_leak_check.py", "--simulated", "--cycles", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    records = json_lines(result.stdout)
    assert [r["config"] for r in records] == ["device", "offload_host", "offload_nvme"]
    for record in records:
        assert record["ok"] and record["device"] == "simulated", record
        assert set(record["device_delta"]) >= {"device_bytes", "pinned_host_bytes", "streams",
                                               "events"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_leak_check_without_a_gpu_says_so():
    result = run_script(["scripts/gpu_leak_check.py"])
    assert result.returncode == 3
    assert json_lines(result.stdout) == [{"check": "gpu_leaks", "skipped": "no CUDA device"}]
